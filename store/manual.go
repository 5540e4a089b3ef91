package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
)

// ManualResolution is an operator's resolution of an UNKNOWN or ESCALATED operation,
// after checking the target by hand.
type ManualResolution struct {
	TenantID string
	ID       uuid.UUID
	// Revision is the revision the operator looked at: if the operation changed since,
	// nothing is recorded (ErrRevisionChanged).
	Revision int64
	// State is SUCCEEDED (RemoteRef required: the target's reference of the effect) or
	// FAILED_TERMINAL.
	State     State
	RemoteRef string
	// Reason says why, Evidence what was checked and EvidenceURL where, in the
	// operator's words; the event keeps them with the operator's name (Actor).
	Reason      string
	Evidence    string
	EvidenceURL string
	Actor       string
}

// ErrRevisionChanged means the operation changed after the revision the caller read;
// ResolveManually returns it as a *RevisionChangedError, with the revision now.
var ErrRevisionChanged = errors.New("the operation changed since that revision")

// RevisionChangedError is ErrRevisionChanged with the operation's current revision.
type RevisionChangedError struct{ Current int64 }

func (e *RevisionChangedError) Error() string { return ErrRevisionChanged.Error() }
func (e *RevisionChangedError) Unwrap() error { return ErrRevisionChanged }

// ErrBeingReconciled means a reconciler holds the operation at this moment.
var ErrBeingReconciled = errors.New("a reconciler is working on the operation")

// ResolveManually records an operator's resolution: the operation moves to p.State with
// fence + 1, so a reconciler that held it earlier can no longer record, and an event
// whose actor is the operator and whose observation holds the reason and evidence. It is
// refused, recording nothing, when the operation is not UNKNOWN or ESCALATED
// (*StateError), changed since p.Revision (*RevisionChangedError), or is held by a
// reconciler's live lease (ErrBeingReconciled). The resolved operation keeps its
// Escalation when it was ESCALATED, and has none when it was UNKNOWN.
func (q Scope) ResolveManually(ctx context.Context, p ManualResolution) (Operation, error) {
	switch {
	case p.State != StateSucceeded && p.State != StateFailedTerminal:
		return Operation{}, fmt.Errorf("store: resolve manually: %s is not a resolution", p.State)
	case p.State == StateSucceeded && p.RemoteRef == "":
		return Operation{}, errors.New("store: resolve manually: SUCCEEDED needs the target's reference")
	case p.Reason == "" || p.Actor == "":
		return Operation{}, errors.New("store: resolve manually: a resolution needs its reason and its operator")
	}
	var ref *string
	if p.RemoteRef != "" {
		ref = &p.RemoteRef
	}
	obs := Observation{Source: "OPERATOR", Outcome: "MANUAL_RESOLUTION", Summary: p.Reason,
		Evidence: p.Evidence, EvidenceURL: p.EvidenceURL}
	rows := q.query(ctx, `
		WITH cur AS (
			SELECT tenant_id, operation_id, state AS from_state FROM operations
			WHERE tenant_id = $1 AND operation_id = $2
			FOR UPDATE
		), upd AS (
			UPDATE operations o SET state = $4, revision = o.revision + 1, fence_token = o.fence_token + 1,
				remote_ref = coalesce($5, o.remote_ref), last_observation = jsonb_set($6::jsonb, '{observed_at}', to_jsonb(now())),
				next_check_at = NULL, lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
			FROM cur
			WHERE o.tenant_id = cur.tenant_id AND o.operation_id = cur.operation_id AND o.revision = $3
				AND o.state IN ('UNKNOWN', 'ESCALATED') AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())
			RETURNING o.*, cur.from_state
		), ev AS (`+eventsFrom("upd", "from_state", "$7", "'MANUAL_RESOLUTION'", "last_observation")+`)
		SELECT `+operationColumns+` FROM upd`,
		p.TenantID, p.ID, p.Revision, p.State, ref, obs, p.Actor)
	op, err := q.collectFenced(rows, "resolve manually")
	if !errors.Is(err, ErrFenceLost) {
		return op, err
	}
	// Nothing moved: say why.
	current, err := q.Get(ctx, p.TenantID, p.ID)
	switch {
	case err != nil:
		return Operation{}, err
	case current.State != StateUnknown && current.State != StateEscalated:
		return Operation{}, &StateError{Operation: current, Want: StateEscalated}
	case current.Revision != p.Revision:
		return Operation{}, &RevisionChangedError{Current: current.Revision}
	}
	return Operation{}, ErrBeingReconciled
}
