package evidence

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/opbroker/opbroker/store"
)

// Review errors. A review that fails with one of them recorded nothing.
var (
	// ErrNotQuarantined: the event is not (or no longer) quarantined.
	ErrNotQuarantined = errors.New("the event is not quarantined")
	// ErrUnknownTarget: no loaded contract reads the events of the event's target.
	ErrUnknownTarget = errors.New("no loaded target reads this event's target's events")
	// ErrOtherTarget: the operation named is not one of the event's target.
	ErrOtherTarget = errors.New("the operation is not of the event's target")
	// ErrBodyPurged: the event's body is gone, and its contract checks fields in it.
	ErrBodyPurged = errors.New("the event's body was purged after its retention: it cannot be checked against the operation")
)

// MismatchError is an attached event that still disagrees with the operation named: it
// stays quarantined.
type MismatchError struct {
	Reason string
	Detail string
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("the event does not match the operation (%s): %s", e.Reason, e.Detail)
}

// Attach applies a quarantined event to the operation an operator names, through the
// same checks and fencing as a matched event (decide), with the operator as the
// actor: the event becomes ATTACHED, with the reviewer and note, in the same statement
// as its change to the operation. An event that still disagrees is a *MismatchError;
// store.ErrEvidenceChanged means the event or the operation moved meanwhile.
func (m *Matcher) Attach(ctx context.Context, k store.EvidenceKey, tenantID string, id uuid.UUID, reviewer, note string) (store.InboundEvidence, error) {
	scope := m.cfg.Store.AllTenants()
	e, err := scope.Evidence(ctx, k)
	if err != nil {
		return store.InboundEvidence{}, err
	}
	if e.Disposition != store.EvidenceQuarantined {
		return store.InboundEvidence{}, ErrNotQuarantined
	}
	contract, ok := m.cfg.Targets.ByName(k.Target)
	if !ok || contract.Evidence == nil {
		return store.InboundEvidence{}, ErrUnknownTarget
	}
	if e.Body == nil && (contract.Evidence.Tenant != nil || len(contract.Evidence.Match) > 0) {
		return store.InboundEvidence{}, ErrBodyPurged
	}
	c, err := scope.Candidate(ctx, tenantID, id)
	if err != nil {
		return store.InboundEvidence{}, err
	}
	if !contract.Serves(c.OperationType) {
		return store.InboundEvidence{}, ErrOtherTarget
	}
	v := decide(contract, e, []store.Candidate{c}, reviewer)
	if v.disposition == store.EvidenceQuarantined {
		return store.InboundEvidence{}, &MismatchError{Reason: v.reason, Detail: v.detail}
	}
	if v.change != nil {
		v.change.Observation.Summary += "; attached by " + reviewer + ": " + note
	}
	err = scope.SettleEvidence(ctx, store.EvidenceSettlement{EvidenceKey: k,
		From: store.EvidenceQuarantined, To: store.EvidenceAttached, TenantID: tenantID, ID: id,
		Change: v.change, Revision: c.Revision, Reviewer: reviewer, Note: note})
	if err != nil {
		return store.InboundEvidence{}, err
	}
	m.log.Warn("quarantined evidence attached", "target", k.Target, "event_id", k.EventID, "reporter", k.Reporter,
		"reviewer", reviewer, "tenant", tenantID, "operation", id)
	m.metrics.Decided(ctx, k.Target, store.EvidenceAttached, "")
	return scope.Evidence(ctx, k)
}

// Dismiss closes a quarantined event without changing any operation, with the reviewer
// and note.
func (m *Matcher) Dismiss(ctx context.Context, k store.EvidenceKey, reviewer, note string) (store.InboundEvidence, error) {
	scope := m.cfg.Store.AllTenants()
	err := scope.SettleEvidence(ctx, store.EvidenceSettlement{EvidenceKey: k,
		From: store.EvidenceQuarantined, To: store.EvidenceDismissed, Reviewer: reviewer, Note: note})
	if errors.Is(err, store.ErrEvidenceChanged) {
		if _, err := scope.Evidence(ctx, k); err != nil {
			return store.InboundEvidence{}, err
		}
		return store.InboundEvidence{}, ErrNotQuarantined
	}
	if err != nil {
		return store.InboundEvidence{}, err
	}
	m.log.Warn("quarantined evidence dismissed", "target", k.Target, "event_id", k.EventID, "reporter", k.Reporter, "reviewer", reviewer)
	m.metrics.Decided(ctx, k.Target, store.EvidenceDismissed, "")
	return scope.Evidence(ctx, k)
}
