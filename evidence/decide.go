package evidence

import (
	"fmt"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// Why an event is quarantined (store.InboundEvidence.Reason). Each is a metric
// attribute value and a word an operator reviewing the quarantine reads.
const (
	// ReasonUnmatched: its reference named no operation of the target within the
	// event's match window.
	ReasonUnmatched = "UNMATCHED"
	// ReasonAmbiguous: its reference named more than one operation.
	ReasonAmbiguous = "AMBIGUOUS"
	// ReasonTenantConflict: the event names another tenant than its operation's (or none
	// where the contract reads one), or was reported for another tenant.
	ReasonTenantConflict = "TENANT_CONFLICT"
	// ReasonPayloadMismatch: the event's object disagrees with the approved payload.
	ReasonPayloadMismatch = "PAYLOAD_MISMATCH"
	// ReasonContradictsTerminal: it says the opposite of a terminal state (a success for
	// an operation that failed or was cancelled, a failure for one that succeeded).
	ReasonContradictsTerminal = "CONTRADICTS_TERMINAL"
	// ReasonContradictsLedger: it contradicts what the ledger knows of the sends: an
	// effect of an operation never sent (or whose every send the target documented as
	// not executed), or another target reference than the one recorded.
	ReasonContradictsLedger = "CONTRADICTS_LEDGER"
	// ReasonIncomplete: a success that does not carry the target's reference, which a
	// SUCCEEDED operation must have.
	ReasonIncomplete = "INCOMPLETE"
)

// Reasons lists every reason, for metrics and the API.
var Reasons = []string{ReasonUnmatched, ReasonAmbiguous, ReasonTenantConflict, ReasonPayloadMismatch,
	ReasonContradictsTerminal, ReasonContradictsLedger, ReasonIncomplete}

// The reasons of the operation events that evidence records.
const (
	eventSucceeded = "EVIDENCE_SUCCEEDED"
	eventFailed    = "EVIDENCE_FAILED"
	eventPending   = "EVIDENCE_PENDING"
)

// verdict is what decide concludes about an event and the operations its reference
// found.
type verdict struct {
	// later: nothing found yet; match again until the window closes.
	later bool
	// disposition is APPLIED (Change set), OBSERVED or QUARANTINED (reason, detail).
	disposition string
	reason      string
	detail      string
	candidate   *store.Candidate // the operation, when one was found
	change      *store.EvidenceChange
}

// decide judges an event against the operations its reference found. It is pure: the
// caller records the verdict under the operation's revision, and decides again if the
// operation moved meanwhile.
//
//   - An event is evidence for exactly one operation: none found is matched again later,
//     more than one is ambiguous.
//   - The tenant is the operation's, never the event's: an event reported for another
//     tenant, or naming another tenant (or none) where the contract reads one, is a
//     tenant conflict, quarantined as no tenant's.
//   - Its object must agree with the approved payload on the contract's match fields,
//     and name the target reference the ledger recorded, if any.
//   - Success resolves an UNKNOWN or IN_FLIGHT operation to SUCCEEDED; a documented final
//     failure, to FAILED_TERMINAL; pending marks an UNKNOWN one as accepted and
//     unfinished (no replay follows). An ESCALATED operation only records it, for its
//     owner. What agrees with a terminal state is observed; what contradicts it, or the
//     ledger's sends (a failure of one whose send the target answered with a verified
//     success, kept as a stale outcome, too), is quarantined.
func decide(contract *target.Contract, e store.InboundEvidence, found []store.Candidate, actor string) verdict {
	switch len(found) {
	case 0:
		return verdict{later: true, reason: ReasonUnmatched,
			detail: fmt.Sprintf("no operation of target %s has the %s %q", contract.Name, e.ReferenceKind, e.Reference)}
	case 1:
	default:
		return verdict{disposition: store.EvidenceQuarantined, reason: ReasonAmbiguous,
			detail: fmt.Sprintf("more than one operation of target %s has the %s %q", contract.Name, e.ReferenceKind, e.Reference)}
	}
	c := &found[0]
	op := c.Operation
	quarantine := func(reason, format string, args ...any) verdict {
		return verdict{disposition: store.EvidenceQuarantined, reason: reason, detail: fmt.Sprintf(format, args...), candidate: c}
	}
	// A tenant conflict is kept as no tenant's: attached to the operation, the event
	// (another tenant's body, or a reporter's of another tenant) would be in that
	// operation's tenant's scope. Only an operator over every tenant sees it, with the
	// operation its reference found named in the detail.
	conflict := func(format string, args ...any) verdict {
		return verdict{disposition: store.EvidenceQuarantined, reason: ReasonTenantConflict,
			detail: fmt.Sprintf(format, args...) + fmt.Sprintf(" (its reference found tenants/%s/operations/%s)", op.TenantID, op.ID)}
	}
	if e.Source == store.SourceReported && e.ClaimedTenant != op.TenantID {
		return conflict("reported for tenant %s; its reference names an operation of another tenant", e.ClaimedTenant)
	}
	if c.Payload != nil {
		if ok, why := contract.Evidence.TenantMatches(e.Body, c.Payload); !ok {
			return conflict("%s", why)
		}
		if ok, why := contract.Evidence.FieldsMatch(e.Body, c.Payload); !ok {
			return quarantine(ReasonPayloadMismatch, "%s", why)
		}
	}
	if e.RemoteRef != "" && op.RemoteRef != "" && e.RemoteRef != op.RemoteRef {
		return quarantine(ReasonContradictsLedger, "the event names the target reference %q; the ledger recorded %q", e.RemoteRef, op.RemoteRef)
	}
	observed := verdict{disposition: store.EvidenceObserved, candidate: c}
	change := func(to store.State, reason, summary string) verdict {
		ch := &store.EvidenceChange{Revision: op.Revision, From: op.State, To: to, Actor: actor, Reason: reason,
			Observation: store.Observation{Source: "EVIDENCE", Outcome: reason, EventID: e.EventID,
				Summary: fmt.Sprintf("%s: event %s of type %s %s", summary, e.EventID, e.EventType, via(e))}}
		if to == store.StateSucceeded {
			ch.RemoteRef = e.RemoteRef
		}
		return verdict{disposition: store.EvidenceApplied, candidate: c, change: ch}
	}
	meaning := target.Meaning(e.Meaning)
	switch op.State {
	case store.StatePrepared, store.StateCancelled:
		return quarantine(ReasonContradictsLedger, "the target reports an effect (%s) of an operation that is %s: no send of it can have taken effect", e.EventType, op.State)
	case store.StateInFlight, store.StateUnknown:
		switch meaning {
		case target.MeaningSucceeded:
			if e.RemoteRef == "" && op.RemoteRef == "" {
				return quarantine(ReasonIncomplete, "a success event without the target's reference")
			}
			return change(store.StateSucceeded, eventSucceeded, "the target reported the effect succeeded")
		case target.MeaningFailed:
			if c.VerifiedSuccess {
				return quarantine(ReasonContradictsLedger, "the target reports a final failure (%s) of an operation whose send it answered with a verified success", e.EventType)
			}
			return change(store.StateFailedTerminal, eventFailed, "the target reported the effect failed, in a state it documents as final and without effect")
		default:
			if op.State == store.StateInFlight {
				return observed // its send's answer is still to come
			}
			v := change(store.StateUnknown, eventPending, "the target reported the request accepted and not finished")
			v.change.AcceptedUnfinished = true
			return v
		}
	case store.StateEscalated:
		return change(store.StateEscalated, "EVIDENCE_"+e.Meaning, "the target reported "+meaningWords(meaning)+", for the owner of the escalation to judge")
	case store.StateSucceeded:
		if meaning == target.MeaningFailed {
			return quarantine(ReasonContradictsTerminal, "the target reports a final failure (%s) of an operation recorded SUCCEEDED", e.EventType)
		}
		return observed
	default: // FAILED_TERMINAL
		if meaning == target.MeaningSucceeded {
			return quarantine(ReasonContradictsTerminal, "the target reports a success (%s) of an operation recorded FAILED_TERMINAL", e.EventType)
		}
		return observed
	}
}

func meaningWords(m target.Meaning) string {
	switch m {
	case target.MeaningSucceeded:
		return "the effect succeeded"
	case target.MeaningFailed:
		return "the effect failed"
	}
	return "the request accepted and not finished"
}

// via says how the event came.
func via(e store.InboundEvidence) string {
	if e.Source == store.SourceReported {
		return "reported by " + e.Reporter
	}
	return "by signed webhook"
}
