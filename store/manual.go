package store

import (
	"context"
	"errors"
	"fmt"
	"time"

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
	// FailureSettlesAfter, for a FAILED_TERMINAL, is how long after the operation's
	// last send ended (by the database's clock) a failure may be recorded: before that
	// the send may still take effect, or its effect not be visible at the target yet.
	FailureSettlesAfter time.Duration
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

// ErrSendMayStillLand means a resolution as FAILED_TERMINAL came too soon after the
// operation's last send; ResolveManually returns it as a *SendMayStillLandError.
var ErrSendMayStillLand = errors.New("the operation's last send may still take effect")

// SendMayStillLandError is ErrSendMayStillLand with how long until a failure may be
// recorded.
type SendMayStillLandError struct{ Wait time.Duration }

func (e *SendMayStillLandError) Error() string { return ErrSendMayStillLand.Error() }
func (e *SendMayStillLandError) Unwrap() error { return ErrSendMayStillLand }

// ErrTargetConfirmed means a resolution as FAILED_TERMINAL of an operation whose target
// confirmed an effect: it answered one of its sends with a verified success (kept as a
// stale outcome: it came after the send's lease), or an event of its saying the
// operation succeeded was matched to it; ResolveManually returns it as a
// *TargetConfirmedError.
var ErrTargetConfirmed = errors.New("the target confirmed an effect of the operation")

// TargetConfirmedError is ErrTargetConfirmed with the target's reference of the effect
// ("" when its event carried none), and the id of the event that confirmed it ("" for
// a send's answer).
type TargetConfirmedError struct{ RemoteRef, EventID string }

func (e *TargetConfirmedError) Error() string { return ErrTargetConfirmed.Error() }
func (e *TargetConfirmedError) Unwrap() error { return ErrTargetConfirmed }

// ResolveManually records an operator's resolution: the operation moves to p.State with
// fence + 1, so a reconciler that held it earlier can no longer record, and an event
// whose actor is the operator and whose observation holds the reason and evidence. It is
// refused, recording nothing, when the operation is not UNKNOWN or ESCALATED
// (*StateError), changed since p.Revision (*RevisionChangedError), or is held by a
// reconciler's live lease (ErrBeingReconciled), or is a FAILED_TERMINAL sooner than
// p.FailureSettlesAfter after the last send ended (*SendMayStillLandError), or a
// FAILED_TERMINAL while the target's confirmation of an effect is on record, a verified
// success of one of its sends or its event saying it succeeded (*TargetConfirmedError:
// the effect exists, whatever a later look at the target showed; resolve it SUCCEEDED
// with that reference). The
// resolved operation keeps its Escalation when it was ESCALATED, and has none when it
// was UNKNOWN.
func (q Scope) ResolveManually(ctx context.Context, p ManualResolution) (Operation, error) {
	return q.resolveManually(ctx, p, manualStep{})
}

// ProposeResolution records a resolution that waits for a second operator, for a target
// that asks for one: the operation stays UNKNOWN or ESCALATED, its revision goes up by
// one with an event (reason RESOLUTION_PROPOSED) whose actor is the proposer, and its
// last observation holds the proposal, approvable for window by the database's clock
// (ApproveResolution). It is refused as ResolveManually is.
func (q Scope) ProposeResolution(ctx context.Context, p ManualResolution, window time.Duration) (Operation, error) {
	return q.resolveManually(ctx, p, manualStep{propose: window})
}

// ErrNoProposal means no resolution waits for approval on the operation.
var ErrNoProposal = errors.New("no resolution is waiting for approval")

// ErrSameOperator means the operator approving a resolution proposed it.
var ErrSameOperator = errors.New("a resolution must be approved by another operator than its proposer")

// ErrProposalExpired means the resolution waiting for approval expired.
var ErrProposalExpired = errors.New("the proposed resolution expired")

// ApproveResolution applies the resolution proposed on the operation at revision (the
// proposal's), as ResolveManually would, its event's actor the approver and its
// observation naming the proposer. It is refused with ErrNoProposal, ErrSameOperator or
// ErrProposalExpired (by the database's clock), or as ResolveManually is, a failure only
// failureSettlesAfter(the operation) after its last send.
func (q Scope) ApproveResolution(ctx context.Context, tenantID string, id uuid.UUID, revision int64, approver string,
	failureSettlesAfter func(Operation) time.Duration) (Operation, error) {
	op, err := q.Get(ctx, tenantID, id)
	if err != nil {
		return Operation{}, err
	}
	if op.Revision != revision {
		return Operation{}, &RevisionChangedError{Current: op.Revision}
	}
	obs := op.LastObservation
	if obs == nil || obs.Proposal == nil {
		return Operation{}, ErrNoProposal
	}
	if obs.Proposal.ProposedBy == approver {
		return Operation{}, ErrSameOperator
	}
	return q.resolveManually(ctx, ManualResolution{TenantID: tenantID, ID: id, Revision: revision,
		State: obs.Proposal.State, RemoteRef: obs.Proposal.RemoteRef, Reason: obs.Summary, Evidence: obs.Evidence,
		EvidenceURL: obs.EvidenceURL, Actor: approver, FailureSettlesAfter: failureSettlesAfter(op)}, manualStep{approve: obs.Proposal})
}

// manualStep says what resolveManually records: the resolution itself (the zero
// value), a proposal of it valid for propose, or the approval of approve.
type manualStep struct {
	propose time.Duration
	approve *Proposal
}

// manualResolution is the statement of resolveManually: $1, $2 the operation, $3 the
// revision read, $4 the state resolved to, $5 the target's reference, $6 the
// observation, whose outcome is the event's reason, $7 the operator. With a window $8 it
// only proposes: the state, the fence and the reference stay, and the observation's
// proposal expires after the window. With $9 it is an approval, applied only before $9.
// A FAILED_TERMINAL is recorded or proposed only $10 or longer after the last send
// ended, and never while the target's confirmation of an effect is on record
// (noFailureAfterSuccess, under lockedForFailure).
var manualResolution = `
	WITH cur AS (
		SELECT tenant_id, operation_id, state AS from_state FROM operations
		WHERE tenant_id = $1 AND operation_id = $2
		FOR UPDATE
	), upd AS (
		UPDATE operations o SET
			state = CASE WHEN $8::interval IS NULL THEN $4::operation_state ELSE o.state END,
			revision = o.revision + 1,
			fence_token = CASE WHEN $8::interval IS NULL THEN o.fence_token + 1 ELSE o.fence_token END,
			remote_ref = coalesce($5, o.remote_ref),
			last_observation = CASE WHEN $8::interval IS NULL
				THEN jsonb_set($6::jsonb, '{observed_at}', to_jsonb(now()))
				ELSE jsonb_set(jsonb_set($6::jsonb, '{observed_at}', to_jsonb(now())),
					'{proposal,expires_at}', to_jsonb(now() + $8::interval)) END,
			next_check_at = CASE WHEN $8::interval IS NULL THEN NULL ELSE o.next_check_at END,
			lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
		FROM cur
		WHERE o.tenant_id = cur.tenant_id AND o.operation_id = cur.operation_id AND o.revision = $3
			AND o.state IN ('UNKNOWN', 'ESCALATED') AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())
			AND ($9::timestamptz IS NULL OR now() < $9)
			AND ($4::operation_state <> 'FAILED_TERMINAL' OR coalesce(now() - ` + lastSendEnded("o") + ` >= $10::interval, true))
			AND ` + noFailureAfterSuccess("$4", "o.tenant_id", "o.operation_id") + `
		RETURNING o.*, cur.from_state
	), ev AS (` + eventsFrom("upd", "from_state", "$7", "$6::jsonb->>'outcome'", "last_observation") + `)
	SELECT ` + operationColumns + ` FROM upd`

func (q Scope) resolveManually(ctx context.Context, p ManualResolution, step manualStep) (Operation, error) {
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
	var window *time.Duration // set for a proposal
	var expires *time.Time    // set for an approval
	switch {
	case step.propose > 0:
		obs.Outcome = "RESOLUTION_PROPOSED"
		obs.Proposal = &Proposal{State: p.State, RemoteRef: p.RemoteRef, ProposedBy: p.Actor}
		window, ref = &step.propose, nil
	case step.approve != nil:
		obs.ProposedBy, expires = step.approve.ProposedBy, &step.approve.ExpiresAt
	}
	rows := q.query(lockedForFailure(ctx, p.State, OperationKey{TenantID: p.TenantID, ID: p.ID}), manualResolution, p.TenantID, p.ID, p.Revision, p.State, ref, obs, p.Actor, window, expires,
		p.FailureSettlesAfter)
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
	if p.State == StateFailedTerminal {
		switch confirmed, ok, err := q.StaleSuccess(ctx, p.TenantID, p.ID); {
		case err != nil:
			return Operation{}, err
		case ok:
			return Operation{}, &TargetConfirmedError{RemoteRef: confirmed}
		}
		switch ref, eventID, ok, err := q.reportedSuccess(ctx, p.TenantID, p.ID); {
		case err != nil:
			return Operation{}, err
		case ok:
			return Operation{}, &TargetConfirmedError{RemoteRef: ref, EventID: eventID}
		}
	}
	// The rest of the statement's conditions, by the database's clock.
	var expired, leased bool
	var wait *int64 // until a failure may be recorded
	if err := q.queryRow(ctx, `SELECT coalesce(now() >= $4::timestamptz, false), coalesce(lease_expires_at >= now(), false),
			`+micros(`$3::interval - (now() - `+lastSendEnded("o")+`)`)+`
		FROM operations o WHERE tenant_id = $1 AND operation_id = $2`,
		p.TenantID, p.ID, p.FailureSettlesAfter, expires).Scan(&expired, &leased, &wait); err != nil {
		return Operation{}, fmt.Errorf("store: resolve manually: %w", translate(err))
	}
	switch {
	case expired:
		return Operation{}, ErrProposalExpired
	case !leased && p.State == StateFailedTerminal && wait != nil && *wait > 0:
		return Operation{}, &SendMayStillLandError{Wait: duration(*wait)}
	}
	return Operation{}, ErrBeingReconciled
}
