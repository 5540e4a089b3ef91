package reconciler

import (
	"time"
)

// EvidenceKind is what the reconciler has learned about an UNKNOWN operation's effect.
type EvidenceKind int

const (
	// NoEvidence: only the sender's unclear observation (the target offers no lookup,
	// or none has been made yet).
	NoEvidence EvidenceKind = iota
	// Found: a lookup found the effect by the operation's reference.
	Found
	// NotFound: a lookup found nothing. Weak evidence: the request may never have
	// arrived, may still be executing, or may not be visible yet.
	NotFound
	// InProgress: the target says the request was accepted and is not finished (202,
	// 409 for the key, a reference without completion, an object whose status is
	// pending or not one the contract lists).
	InProgress
	// LookupFailed: the lookup itself got no usable answer (timeout, 5xx).
	LookupFailed
	// FoundFailed: a lookup found the object, matching, with a status the contract
	// documents as final and without effect (a canceled payment).
	FoundFailed
	// KeyInUse: the last answer said an earlier request with this key was still
	// executing (409), at a target whose key saves every answer: a later same-key
	// replay returns that request's answer instead of executing again.
	KeyInUse
	// Exists: a conditional target refused a send because its precondition failed: an
	// earlier send made the effect. Not yet confirmed to match the approved payload.
	Exists
)

// Evidence is one observation, checked before it reaches Decide.
type Evidence struct {
	Kind EvidenceKind
	// RemoteRef is the target's reference, for Found.
	RemoteRef string
	// Matches reports, for Found, that the remote object carries the operation's
	// reference and that its key fields agree with the approved payload.
	Matches bool
	// Why says, for Found and FoundFailed that do not match, what the lookup found
	// wrong (the object carries another reference, no usable reference of the target's,
	// or a field that disagrees with the approved payload).
	Why string
}

// mismatch is why a found object is not taken for the operation's.
func (ev Evidence) mismatch() string {
	switch {
	case ev.Why != "":
		return ev.Why
	case ev.Matches: // Found, with no reference
		return "the target gave no usable reference for it"
	default:
		return "it does not match the approved payload"
	}
}

// Input is everything Decide may use. It is plain data: the function is pure.
type Input struct {
	Evidence Evidence

	// Capabilities of the target: Replay is A (same-key replay), Lookup is B (lookup by
	// reference), Conditional is C (every send carries a precondition under which the
	// target creates the effect only if it does not exist yet).
	Replay      bool
	Lookup      bool
	Conditional bool
	// KeyCoversEveryAttempt: the target saves every answer under the key, errors
	// included, so a repeat of the key never executes an attempt that already began.
	// Without it the target saves only successes, and a replay after an attempt that
	// may have executed would execute it again.
	KeyCoversEveryAttempt bool
	// KeyWindowLeft is what is left of the key's retention window as the ledger fixed it
	// at the first send (zero or less: closed, or never recorded). KeyScopeChanged: the
	// contract's key scope (endpoint, static headers, key scope, credential identity)
	// is not the one the key was first sent in, so the key may not mean the same there.
	KeyWindowLeft   time.Duration
	KeyScopeChanged bool
	// LookupScopeChanged: the contract's lookup (its method, URL or not-found statuses)
	// is not the one the operation was first sent under, so a "not found" there proves
	// nothing about the sends.
	LookupScopeChanged bool
	// VisibilityDelay is how long a write may take to become visible to lookups.
	VisibilityDelay time.Duration
	// AbsenceFinalAfter, if set, is how long after a send the target documents that the
	// request can no longer take effect.
	AbsenceFinalAfter time.Duration
	// EventsWithin, for a target that reports its effects by events (webhooks), is how
	// long after a send they can be expected: without a lookup, an operation that would
	// otherwise be escalated waits for them until then (the events resolve it).
	EventsWithin time.Duration

	// MayHaveExecuted: some earlier attempt may have reached the target (anything but a
	// send that provably never left).
	MayHaveExecuted bool
	// SinceLastSend is the time since the broker stopped waiting for the operation's
	// last send. A lookup's "not found" says nothing of that send's write until
	// VisibilityDelay has passed since then.
	SinceLastSend time.Duration
	// BusinessDeadlinePassed: the business no longer wants the effect created (the
	// dispatch deadline passed), so nothing may be sent that could create it.
	BusinessDeadlinePassed bool
	// ResolutionLeft is the time left before the operation must be resolved or handed
	// to its owner.
	ResolutionLeft time.Duration

	// Replays and Looks made so far, and their budgets.
	Replays, MaxReplays int
	Looks, MaxLooks     int
	// AcceptedBefore: some earlier answer said the target accepted the request without
	// finishing it. No replay may follow.
	AcceptedBefore bool
	// VerifiedSuccess: the target answered one of the operation's sends with a verified
	// success, which reached a worker after it lost its fence. Nothing the reconciler
	// learns afterwards makes that a failure, or the request worth sending again.
	VerifiedSuccess bool
	// RetryAfter is the wait the target asked for in its answer to the last send (its
	// Retry-After): no replay before it has passed since that send.
	RetryAfter time.Duration
	// EffectExists: the target refused one of the operation's sends because its
	// precondition failed, saying an earlier send made the effect. Nothing the
	// reconciler learns afterwards makes the request worth sending again, or its absence
	// final: a lookup that does not find it may lag, or the object was removed since.
	EffectExists bool

	// Jitter in [0, 1) spreads waits; the caller draws it.
	Jitter float64
}

// Action is what to do next.
type Action int

const (
	// RecordSuccess: SUCCEEDED with the found reference.
	RecordSuccess Action = iota + 1
	// RecordFailure: FAILED_TERMINAL; nothing happened and nothing can.
	RecordFailure
	// Replay the original request with the same key and the same bytes.
	Replay
	// Wait, then look again.
	Wait
	// Escalate to the target's owner.
	Escalate
)

func (a Action) String() string {
	return [...]string{"", "RECORD_SUCCESS", "RECORD_FAILURE", "REPLAY", "WAIT", "ESCALATE"}[a]
}

// Decision is Decide's answer.
type Decision struct {
	Action Action
	// After is how long to wait, for Wait.
	After time.Duration
	// RemoteRef, for RecordSuccess.
	RemoteRef string
	// Reason says why, in words an operator reads; for Escalate it names what is missing.
	Reason string
}

// Backoff bounds.
const (
	minWait = time.Second
	maxWait = 5 * time.Minute
)

// Decide chooses the next action for an UNKNOWN operation. It is conservative:
//   - a found effect is a success only if it matches the approved payload and its status
//     (where the target finishes later) says it succeeded; one that is still pending is
//     looked at again, never replayed; one whose status the target documents as final
//     and without effect is a failure; a mismatch is escalated, never accepted;
//   - "not found" counts only once the visibility delay has passed since the last send
//     ended; it becomes a failure only when absence is provably final (the visibility
//     delay waited out, the target documents that the request can no longer take
//     effect, and no same-key replay is possible);
//   - a replay happens only with capability A, inside the retention window fixed at the
//     first send and in the scope the key was sent in, or with capability C under its
//     precondition; before the business deadline, within its budget, and never after
//     the target accepted the request without finishing it;
//   - a replay never follows an attempt that may have executed unless the key covers
//     that attempt (the target saves every answer) or a lookup proved its absence:
//     never after a failed lookup, never without a lookup, for a target whose key
//     saves only successes;
//   - a verified success the target answered is never followed by a failure or a replay:
//     a lookup that contradicts it, once the last send's write would be visible, is
//     escalated;
//   - waiting never loops forever: when the look budget or the resolution deadline is
//     spent, the operation is escalated.
func Decide(in Input) Decision {
	ev := in.Evidence
	if ev.Kind == Found {
		if ev.Matches && ev.RemoteRef != "" {
			return Decision{Action: RecordSuccess, RemoteRef: ev.RemoteRef, Reason: "the target has the effect, and it matches the approved payload"}
		}
		return Decision{Action: Escalate, Reason: "the target has an effect under this reference that cannot be taken for this operation's: " + ev.mismatch()}
	}

	if ev.Kind == FoundFailed && !in.VerifiedSuccess {
		if ev.Matches {
			return Decision{Action: RecordFailure, Reason: "the target has the object, and its status is one it documents as final and without effect"}
		}
		return Decision{Action: Escalate, Reason: "the target has a failed object under this reference that cannot be taken for this operation's: " + ev.mismatch()}
	}

	budgetSpent := in.BudgetSpent()

	if in.VerifiedSuccess {
		return in.afterVerifiedSuccess(budgetSpent)
	}
	if in.EffectExists || ev.Kind == Exists {
		return in.afterEffectExists(budgetSpent)
	}

	switch ev.Kind {
	case KeyInUse:
		replayable, whyNot := in.replayable(false)
		if !replayable || !in.KeyCoversEveryAttempt {
			return in.waitOrEscalate(budgetSpent, 0, "an earlier request with this key was still executing; no replay: "+whyNot)
		}
		if budgetSpent {
			return Decision{Action: Escalate, Reason: "an earlier request with this key was still executing, and the budget for waiting is spent"}
		}
		// Give the earlier request time to finish: the wait doubles with each replay, and
		// is at least what the target asked for (its Retry-After).
		if due, wait := in.replayWaits(true); in.SinceLastSend < due {
			return Decision{Action: Wait, After: min(wait-in.SinceLastSend, in.ResolutionLeft),
				Reason: "an earlier request with this key is still executing; replay with the same key once it has had time to finish"}
		}
		return Decision{Action: Replay, Reason: "an earlier request with this key was still executing; the key saves every answer, so a same-key replay returns its answer"}
	case InProgress:
		return in.waitOrEscalate(budgetSpent, 0, "the target accepted the request and has not finished it; no replay, keep looking")
	case NotFound:
		if in.SinceLastSend < in.VisibilityDelay {
			return in.waitOrEscalate(budgetSpent, in.VisibilityDelay-in.SinceLastSend, "not found, but the last send's write may not be visible yet")
		}
		// A lookup that finds nothing this late proves that no attempt took effect, if it
		// asks where the operation was sent.
		replayable, whyNot := in.replayable(in.Lookup && !in.LookupScopeChanged)
		if in.absenceFinal(replayable) {
			return Decision{Action: RecordFailure, Reason: "not found after the visibility delay, past the time the target documents a request can take effect, and no replay is possible"}
		}
		if replayable {
			return in.replay("not found after the visibility delay; a same-key replay is safe inside the retention window")
		}
		if in.LookupScopeChanged {
			whyNot = "the lookup changed since the operation was first sent, so its \"not found\" proves nothing; " + whyNot
		}
		return in.waitOrEscalate(budgetSpent, 0, "not found, and absence is not provably final: "+whyNot)
	case LookupFailed:
		replayable, whyNot := in.replayable(false)
		if replayable {
			return in.replay("the lookup failed; a same-key replay is safe: the key covers every earlier attempt, inside its retention window")
		}
		return in.waitOrEscalate(budgetSpent, 0, "the lookup failed; look again (no replay: "+whyNot+")")
	default: // NoEvidence
		if in.Lookup {
			return in.waitOrEscalate(budgetSpent, 0, "look the operation up at the target")
		}
		replayable, whyNot := in.replayable(false)
		if replayable {
			return in.replay("no lookup; a same-key replay is safe: the key covers every earlier attempt, inside its retention window")
		}
		if in.EventsWithin > in.SinceLastSend {
			return in.waitOrEscalate(budgetSpent, 0, "the outcome is unknown: "+whyNot)
		}
		return Decision{Action: Escalate, Reason: "the outcome is unknown and the target offers no way to find out: " + whyNot}
	}
}

// replay replays, once the wait the target asked for in its last answer (RetryAfter)
// and a backoff that doubles with each replay so far have passed since the last send;
// until then it waits, so that a target answering 503 or 429 is not sent the replay
// budget within a second. With the look budget or the resolution deadline spent
// (BudgetSpent), when no wait may follow, it escalates instead.
func (in Input) replay(reason string) Decision {
	due, wait := in.replayWaits(in.Replays > 0)
	const waits = "; it waits first for the target's Retry-After, or a backoff after the replays so far"
	switch {
	case in.SinceLastSend >= due:
		return Decision{Action: Replay, Reason: reason}
	case in.BudgetSpent():
		// Sent now, it would hammer a target that asked for time; sent later, it would
		// be sent after the budget: an owner decides.
		return Decision{Action: Escalate, Reason: reason + waits + ", and the budget for looking is spent"}
	}
	return Decision{Action: Wait, After: min(wait-in.SinceLastSend, in.ResolutionLeft), Reason: reason + waits}
}

// replayWaits returns how long after the last send a replay is due, and how long this
// look waits for it: the target's Retry-After, and with backoff the replays' backoff.
// The wait is jittered; due is the least it can be, so that a later look, with another
// jitter, never finds a wait it already waited out still running (and, with its budget
// spent, escalates instead of replaying).
func (in Input) replayWaits(backoff bool) (due, wait time.Duration) {
	due, wait = in.RetryAfter, in.RetryAfter
	if backoff {
		least := in
		least.Jitter = 0
		due, wait = max(due, least.backoff(in.Replays, 0)), max(wait, in.backoff(in.Replays, 0))
	}
	return due, wait
}

// BudgetSpent reports whether the operation has used up its looks or its time to be
// resolved: it is escalated rather than looked at again.
func (in Input) BudgetSpent() bool {
	return in.ResolutionLeft <= 0 || (in.MaxLooks > 0 && in.Looks >= in.MaxLooks)
}

// afterVerifiedSuccess decides for an operation whose sends the target answered with a
// verified success, when the evidence is not the found effect: the lookup may lag, or
// the contract may misread the target, but neither a failure nor a replay can follow.
func (in Input) afterVerifiedSuccess(budgetSpent bool) Decision {
	const answered = "the target answered a send with a verified success after its sender lost the fence"
	if d, ok := in.notVisibleYet(budgetSpent, answered); ok {
		return d
	}
	switch in.Evidence.Kind {
	case NotFound:
		return Decision{Action: Escalate, Reason: answered + ", but a lookup after the visibility delay does not find the effect: the contract or the target contradicts itself"}
	case FoundFailed:
		return Decision{Action: Escalate, Reason: answered + ", but a lookup finds the object failed: the contract or the target contradicts itself"}
	default:
		return in.waitOrEscalate(budgetSpent, 0, answered+"; look again (no replay, no failure)")
	}
}

// afterEffectExists decides for an operation one of whose sends the target refused
// because an earlier send made the effect, when the evidence is not the found effect:
// neither a replay nor a failure can follow.
func (in Input) afterEffectExists(budgetSpent bool) Decision {
	const refused = "the target refused a send because its precondition failed: an earlier send made the effect"
	if d, ok := in.notVisibleYet(budgetSpent, refused); ok {
		return d
	}
	if in.Evidence.Kind == NotFound {
		return Decision{Action: Escalate, Reason: refused + ", but a lookup after the visibility delay does not find it: it may have been removed since; it is never sent again"}
	}
	return in.waitOrEscalate(budgetSpent, 0, refused+"; look it up to confirm it matches (no replay, no failure)")
}

// notVisibleYet waits (or escalates, with the budget spent) while a lookup's "not found"
// may only mean that the last send's write is not visible yet, saying so after what;
// ok is false otherwise.
func (in Input) notVisibleYet(budgetSpent bool, what string) (d Decision, ok bool) {
	if in.Evidence.Kind != NotFound || in.SinceLastSend >= in.VisibilityDelay {
		return Decision{}, false
	}
	return in.waitOrEscalate(budgetSpent, in.VisibilityDelay-in.SinceLastSend,
		what+"; the lookup does not find it yet, and the last send's write may not be visible"), true
}

// replayable reports whether a same-key replay is allowed now, and if not, why.
// absenceProven says that a lookup has shown that no earlier attempt took effect.
//
// A conditional target (C) is sent again under its precondition, which the target
// refuses if an earlier send made the effect: neither the key's window nor what the key
// covers matters then, only that the contract still names the same object.
func (in Input) replayable(absenceProven bool) (bool, string) {
	switch {
	case !in.Replay && !in.Conditional:
		return false, "the target has neither an idempotency key nor a precondition to send again with"
	case in.KeyScopeChanged:
		return false, "the contract changed since the key was first sent (endpoint, headers, key scope, precondition or credential), so the key may not mean the same at the target"
	case in.BusinessDeadlinePassed:
		return false, "the business deadline passed: nothing that could create the effect may be sent"
	case in.AcceptedBefore:
		return false, "the target accepted the request earlier without finishing it"
	case in.EffectExists || in.Evidence.Kind == Exists:
		return false, "the target refused a send because an earlier send made the effect"
	case in.MaxReplays > 0 && in.Replays >= in.MaxReplays:
		return false, "the replay budget is spent"
	case in.Conditional:
		return true, ""
	case in.KeyWindowLeft <= 0:
		return false, "the key's retention window, as the ledger recorded it for the sends, has closed"
	case !absenceProven && in.mayExecuteAgain():
		return false, "an earlier attempt may have executed, and the target's key saves only successes, so a replay would execute it again; only a lookup that proves absence allows one"
	}
	return true, ""
}

// mayExecuteAgain reports whether a same-key replay could execute an earlier attempt a
// second time: one may have executed, and the key does not cover it.
func (in Input) mayExecuteAgain() bool { return in.MayHaveExecuted && !in.KeyCoversEveryAttempt }

// absenceFinal applies the conditions for turning "not found" into a failure: the
// write of the last send would be visible, the target documents that a request sent
// that long ago can no longer take effect, and no same-key replay is possible. Never
// once the contract changed since the key was first sent, or its lookup since the
// operation was: the lookup asks the contract as it is now (another endpoint, account,
// credential or lookup URL), where the effect of a send made under the old one need not
// be found.
func (in Input) absenceFinal(replayable bool) bool {
	return in.Lookup && !in.KeyScopeChanged && !in.LookupScopeChanged &&
		in.SinceLastSend >= in.VisibilityDelay &&
		in.AbsenceFinalAfter > 0 && in.SinceLastSend >= in.AbsenceFinalAfter &&
		!replayable
}

// waitOrEscalate waits (exponential backoff with jitter, at least atLeast) unless the
// budget is spent or there is no way to look again; without a lookup, it waits for the
// target's events while they can still be expected.
func (in Input) waitOrEscalate(budgetSpent bool, atLeast time.Duration, reason string) Decision {
	if !in.Lookup {
		if left := in.EventsWithin - in.SinceLastSend; left > 0 && !budgetSpent {
			return Decision{Action: Wait, After: min(max(left, minWait), max(in.ResolutionLeft, minWait)),
				Reason: reason + "; the target offers no lookup: wait for its events"}
		}
		return Decision{Action: Escalate, Reason: reason + "; the target offers no lookup"}
	}
	if budgetSpent {
		return Decision{Action: Escalate, Reason: reason + "; the budget for looking is spent"}
	}
	wait := in.backoff(in.Looks, atLeast)
	if in.ResolutionLeft > 0 {
		wait = min(wait, in.ResolutionLeft)
	}
	return Decision{Action: Wait, After: wait, Reason: reason}
}

// backoff is the wait after n earlier tries: minWait doubling up to maxWait, with
// +-20% jitter so that operations that went UNKNOWN together do not act together, and
// at least atLeast.
func (in Input) backoff(n int, atLeast time.Duration) time.Duration {
	wait := min(minWait<<min(max(n, 0), 10), maxWait)
	wait = time.Duration(float64(wait) * (0.8 + 0.4*in.Jitter))
	return max(wait, atLeast, minWait)
}
