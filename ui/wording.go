package ui

import (
	"fmt"
	"strings"
	"time"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
)

// Status is what support reads about an operation: one line, why, and what happens
// next, in words. Tone picks the colour (ok, pending, attention, failed, neutral).
type Status struct {
	Headline string
	Why      string
	Next     string
	Tone     string
}

// The outcome classes, by what they mean for the customer. An outcome not listed
// reads as "no clear answer" (the honest default for UNKNOWN).
var (
	stillProcessing = set("PENDING", "IN_PROGRESS", "ACCEPTED_NOT_CONFIRMED", "FOUND_PENDING", "FOUND_NOT_CONFIRMED",
		"ACCEPTED_UNFINISHED", "STATUS_NOT_CONFIRMED", "EVIDENCE_PENDING")
	// PRECONDITION_FAILED: a conditional send found the effect an earlier send made.
	reportedSuccess = set("SUCCESS_WITHOUT_REFERENCE", "EVIDENCE_SUCCEEDED", "EFFECT_EXISTS", "STALE_VERIFIED_SUCCESS",
		"PRECONDITION_FAILED")
	slowedDown    = set("THROTTLED")
	cannotSignIn  = set("CREDENTIAL_REFUSED", "CREDENTIAL_UNAVAILABLE")
	declined      = set("DOCUMENTED_REJECTION", "DOCUMENTED_FAILURE", "FOUND_FAILED", "NOT_EXECUTED", "EVIDENCE_FAILED")
	notSentInTime = set("DISPATCH_DEADLINE_PASSED", "NOT_STARTED")
	stoppedBefore = set("PAYLOAD_INTEGRITY")
	noAnswer      = set("TIMEOUT", "CONNECT_FAILED", "CONNECTION_ERROR", "HTTP_5XX", "LEASE_EXPIRED", "UNLISTED_STATUS",
		"REDIRECT_NOT_FOLLOWED", "LOOKUP_FAILED", "NOT_FOUND", "NO_EVIDENCE", "REPLAY_WINDOW_CLOSED", "KEY_SCOPE_CHANGED",
		"KEY_IN_USE", "FOUND_MISMATCH")
)

// sendAgain is what support may tell about a resend: it is the same request, which the
// provider carries out at most once (a target without that guarantee is never sent
// again: its unclear operations go to a person).
const sendAgain = "If we send it again, it is the same request, which %s carries out at most once."

// noRetry is what support must not do while the outcome is open: a new request from the
// customer is a new intent, and can take effect a second time.
const noRetry = "It may already have gone through: do not ask the customer to try again."

func set(outcomes ...string) map[string]bool {
	m := map[string]bool{}
	for _, o := range outcomes {
		m[o] = true
	}
	return m
}

// describe is the one place that turns an operation's state and last observation into
// what support reads. provider is how the target is named to them ("the payment
// provider"); owner is who an escalation went to.
func describe(op *opbrokerv1.Operation, provider string, now time.Time) Status {
	if c := op.GetContradiction(); c != nil {
		return contradicted(op, c, provider)
	}
	outcome := op.GetLastObservation().GetOutcome()
	switch op.GetState() {
	case opbrokerv1.Operation_STATE_PREPARED:
		next := "It will be sent shortly."
		if t := op.GetNextCheckTime(); t != nil && t.AsTime().After(now) {
			next = "It will be sent " + whenFrom(t.AsTime(), now) + "."
		} else if nb := op.GetNotBefore(); nb != nil && nb.AsTime().After(now) {
			next = "It will be sent after " + when(nb.AsTime()) + "."
		}
		if d := op.GetDispatchDeadline(); d != nil {
			next += " If it cannot be sent by " + when(d.AsTime()) + ", it will not be sent at all."
		}
		if op.GetAttemptCount() > 0 {
			return Status{"Received: to be sent again", "An earlier attempt did not go through at " + provider +
				"; we will send it again. The customer need not try again: this request will still be sent.", next, "neutral"}
		}
		return Status{"Received: not sent yet", "We have the request and will send it to " + provider + ".", next, "neutral"}
	case opbrokerv1.Operation_STATE_IN_FLIGHT:
		return Status{"Being sent to " + provider, "We have sent it and are waiting for " + provider + "'s answer.",
			"The answer usually comes within seconds.", "pending"}
	case opbrokerv1.Operation_STATE_SUCCEEDED:
		why := capital(provider) + " confirmed it."
		if ref := op.GetRemoteRef(); ref != "" {
			why = capital(provider) + " confirmed it; their reference is " + ref + "."
		}
		return Status{"Confirmed by " + provider, why, "Nothing more to do.", "ok"}
	case opbrokerv1.Operation_STATE_FAILED_TERMINAL:
		headline, why := "Not done", "Nothing happened at "+provider+"."
		switch {
		case declined[outcome]:
			headline, why = "Not done: "+provider+" declined it", capital(provider)+" said no, and nothing happened there."
		case notSentInTime[outcome]:
			headline, why = "Not done: it could not be sent in time", "Its deadline passed before it could go through, and nothing happened at "+provider+"."
		case stoppedBefore[outcome]:
			headline, why = "Not done: stopped before sending", "We stopped it before sending because its stored request was damaged; nothing happened at "+provider+"."
		case op.GetLastObservation().GetSource() == opbrokerv1.Operation_SOURCE_OPERATOR:
			headline, why = "Not done: confirmed by our team", "Our team checked with "+provider+" that nothing happened there."
		}
		return Status{headline, why, "Nothing more will happen. The customer can try again with a new request.", "failed"}
	case opbrokerv1.Operation_STATE_UNKNOWN:
		why := "We do not know yet whether it went through at " + provider + "."
		switch {
		case noAnswer[outcome]:
			why = "We did not get a clear answer from " + provider + ", so we do not know yet whether it went through."
		case stillProcessing[outcome]:
			why = capital(provider) + " is still processing it, so we do not know yet whether it went through."
		case reportedSuccess[outcome]:
			why = capital(provider) + " indicated that it went through; we are confirming it before we call it done."
		case slowedDown[outcome]:
			why += " " + capital(provider) + " asked us to slow down, so we are waiting before asking again."
		case cannotSignIn[outcome]:
			why += " We could not sign in to " + provider + " to check; the people who run the broker have been alerted."
		}
		why += " " + noRetry
		next := "We will check with " + provider + " again shortly."
		if t := op.GetNextCheckTime(); t != nil {
			next = "We will check with " + provider + " again " + whenFrom(t.AsTime(), now) + "."
		}
		return Status{"Confirmation pending: we are checking with " + provider, why,
			next + " " + fmt.Sprintf(sendAgain, provider), "pending"}
	case opbrokerv1.Operation_STATE_ESCALATED:
		owner, _, _ := strings.Cut(op.GetEscalation().GetOwner(), " (") // the team, without its runbook's address
		if owner == "" {
			owner = "the team that owns " + provider
		}
		return Status{"Needs attention: " + owner + " is looking into it",
			"We could not confirm it with " + provider + " automatically, so a person will. " + noRetry,
			capital(owner) + " will settle it with " + provider + "; the broker sends nothing more.", "attention"}
	case opbrokerv1.Operation_STATE_CANCELLED:
		return Status{"Cancelled", "It was cancelled before it could go through; nothing happened at " + provider + ".",
			"Nothing more will happen.", "neutral"}
	}
	return Status{"Status not known to this page", "This page does not know the state the broker reports.", "Ask the broker's operators.", "attention"}
}

// contradicted is what support reads of a terminal operation whose end the provider
// contradicts (a confirmation that came after the send's lease): what it confirmed,
// that the record stays as it is, and that the broker's operators are alerted.
func contradicted(op *opbrokerv1.Operation, c *opbrokerv1.Operation_Contradiction, provider string) Status {
	next := "The people who run the broker have been alerted and will settle it with " + provider + "; this record will not change."
	if op.GetState() == opbrokerv1.Operation_STATE_SUCCEEDED {
		return Status{"Needs attention: " + provider + " confirmed it twice",
			capital(provider) + " confirmed it with reference " + op.GetRemoteRef() + ", and confirmed an earlier attempt too, with reference " +
				c.GetRemoteRef() + ": it may have gone through twice.", next, "attention"}
	}
	return Status{"Needs attention: " + provider + " confirmed it after we recorded it as not done",
		"We recorded it as not done, but " + provider + " then confirmed that it went through; their reference is " + c.GetRemoteRef() +
			". Do not tell the customer it failed, and do not ask them to try again.", next, "attention"}
}

// eventLine is one step of an operation's history in words.
func eventLine(e *opbrokerv1.OperationEvent, provider string) string {
	to, outcome := e.GetToState(), e.GetObservation().GetOutcome()
	by := ""
	if e.GetObservation().GetSource() == opbrokerv1.Operation_SOURCE_OPERATOR {
		by = " (by " + e.GetActor() + ")"
	}
	from := e.GetFromState()
	switch {
	case to == opbrokerv1.Operation_STATE_PREPARED && from == opbrokerv1.Operation_STATE_IN_FLIGHT:
		return capital(provider) + " did not carry it out; it will be sent again" + by
	case to == opbrokerv1.Operation_STATE_PREPARED:
		return "Request received" + by
	case to == opbrokerv1.Operation_STATE_IN_FLIGHT && from == opbrokerv1.Operation_STATE_UNKNOWN:
		return "Sent again with the same request, which " + provider + " carries out at most once" + by
	case to == opbrokerv1.Operation_STATE_IN_FLIGHT:
		return "Sent to " + provider + by
	case to == opbrokerv1.Operation_STATE_SUCCEEDED:
		return "Confirmed by " + provider + by
	case to == opbrokerv1.Operation_STATE_CANCELLED:
		return "Cancelled" + by
	case to == opbrokerv1.Operation_STATE_ESCALATED && from == opbrokerv1.Operation_STATE_ESCALATED && reportedSuccess[outcome]:
		return capital(provider) + " indicated that it went through; a person is confirming it" + by
	case to == opbrokerv1.Operation_STATE_ESCALATED && from == opbrokerv1.Operation_STATE_ESCALATED && declined[outcome]:
		return capital(provider) + " indicated that it did not go through; a person is confirming it" + by
	case to == opbrokerv1.Operation_STATE_ESCALATED && from == opbrokerv1.Operation_STATE_ESCALATED:
		return "Noted while a person looks into it" + by
	case to == opbrokerv1.Operation_STATE_ESCALATED:
		return "Handed to a person to check with " + provider + by
	case to == opbrokerv1.Operation_STATE_FAILED_TERMINAL:
		return describe(&opbrokerv1.Operation{State: to, LastObservation: e.GetObservation()}, provider, time.Time{}).Headline + by
	case to == opbrokerv1.Operation_STATE_UNKNOWN && from == opbrokerv1.Operation_STATE_UNKNOWN:
		return "Checked with " + provider + ": no confirmation yet" + by
	case to == opbrokerv1.Operation_STATE_UNKNOWN && stillProcessing[outcome]:
		return capital(provider) + " is still processing it" + by
	case to == opbrokerv1.Operation_STATE_UNKNOWN && reportedSuccess[outcome]:
		return capital(provider) + " indicated that it went through; we are confirming it" + by
	case to == opbrokerv1.Operation_STATE_UNKNOWN && slowedDown[outcome]:
		return "No confirmation yet: " + provider + " asked us to slow down" + by
	case to == opbrokerv1.Operation_STATE_UNKNOWN && cannotSignIn[outcome]:
		return "No confirmation yet: we could not sign in to " + provider + by
	case to == opbrokerv1.Operation_STATE_UNKNOWN:
		return "No clear answer from " + provider + by
	}
	return "Changed" + by
}

func when(t time.Time) string { return t.UTC().Format("2 Jan 2006 15:04:05 UTC") }

// whenFrom says when t is from now: "in about 30 seconds", or the time itself.
func whenFrom(t, now time.Time) string {
	d := t.Sub(now).Round(time.Second)
	switch {
	case d <= 0:
		return "now"
	case d < 2*time.Minute:
		return fmt.Sprintf("in about %d seconds (%s)", int(d.Seconds()), when(t))
	case d < 2*time.Hour:
		return fmt.Sprintf("in about %d minutes (%s)", int(d.Minutes()), when(t))
	}
	return "at " + when(t)
}

func capital(s string) string {
	if s == "" || s[0] < 'a' || s[0] > 'z' {
		return s
	}
	return string(s[0]-'a'+'A') + s[1:]
}

// waited says how long something has waited, in hours and minutes.
func waited(d time.Duration) string {
	d = d.Round(time.Minute)
	switch {
	case d < time.Minute:
		return "under a minute"
	case d < time.Hour:
		return fmt.Sprintf("%d min", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%d h %d min", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%d days", int(d.Hours())/24)
}
