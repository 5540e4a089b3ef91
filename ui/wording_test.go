package ui

import (
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/target"
)

// everyOutcome is every outcome an observation records: each literal that the
// broker's code (not its tests or benchmarks) gives an observation's outcome or a
// result's class, found in the source, so that a new outcome without wording fails
// TestEveryStateAndOutcomeReads; and the empty one.
func everyOutcome(t *testing.T) []string {
	t.Helper()
	literal := regexp.MustCompile(`(?:Outcome:|Outcome =|outcome:|Class:|Class[A-Za-z]* *=|event[A-Z][a-z]+ *=) *"([A-Z0-9_]+)"`)
	found := map[string]bool{"": true}
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && (d.Name() == "opbench" || d.Name() == "simtarget" || strings.HasPrefix(d.Name(), ".")) && path != "..":
			return filepath.SkipDir
		case d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go"):
			return nil
		}
		src, err := os.ReadFile(path)
		for _, m := range literal.FindAllStringSubmatch(string(src), -1) {
			found[m[1]] = true
		}
		return err
	})
	require.NoError(t, err)
	require.Contains(t, found, target.ClassServerError, "the walk reaches the connector's classes")
	require.Contains(t, found, "EVIDENCE_SUCCEEDED", "and the evidence's outcomes")
	return slices.Sorted(maps.Keys(found))
}

var code = regexp.MustCompile(`[A-Z]{2,}_[A-Z]|\{\{|<nil>`)

// TestEveryStateAndOutcomeReads: for every state and every outcome, the sentences are
// whole, name the provider, and show no code or template left-over.
func TestEveryStateAndOutcomeReads(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	outcomes := everyOutcome(t)
	for state := range opbrokerv1.Operation_State_name {
		if state == 0 {
			continue
		}
		for _, outcome := range outcomes {
			op := &opbrokerv1.Operation{State: opbrokerv1.Operation_State(state), RemoteRef: "ch_1",
				LastObservation: &opbrokerv1.Operation_Observation{Outcome: outcome}}
			s := describe(op, "the payment provider", now)
			for _, text := range []string{s.Headline, s.Why, s.Next} {
				require.NotEmpty(t, text, "%v %s", op.GetState(), outcome)
				require.False(t, code.MatchString(text), "%v %s: %q", op.GetState(), outcome, text)
			}
			require.Contains(t, s.Why+s.Headline, "payment provider", "%v %s", op.GetState(), outcome)
			if op.GetState() == opbrokerv1.Operation_STATE_UNKNOWN || op.GetState() == opbrokerv1.Operation_STATE_ESCALATED {
				require.Contains(t, s.Why, "do not ask the customer to try again", "%v %s: the outcome is open", op.GetState(), outcome)
			}
			require.Contains(t, []string{"ok", "pending", "attention", "failed", "neutral"}, s.Tone)
			line := eventLine(&opbrokerv1.OperationEvent{ToState: op.GetState(), Observation: op.GetLastObservation()}, "the payment provider")
			require.False(t, code.MatchString(line), "%q", line)
		}
	}
	classified := []map[string]bool{stillProcessing, reportedSuccess, slowedDown, cannotSignIn, declined, notSentInTime, stoppedBefore, noAnswer}
	for _, outcome := range outcomes {
		n := 0
		for _, group := range classified {
			if group[outcome] {
				n++
			}
		}
		switch outcome {
		case target.ClassVerifiedSuccess, "FOUND", "ESCALATED", "MANUAL_RESOLUTION", "RESOLUTION_PROPOSED", "":
			require.Zero(t, n, "%s ends in a state that says it all", outcome)
		default:
			require.Equal(t, 1, n, "%s is in exactly one group of wording", outcome)
		}
	}
}

// TestWording is what support reads for the cases they meet most, word for word.
func TestWording(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	obs := func(source opbrokerv1.Operation_Source, outcome string) *opbrokerv1.Operation_Observation {
		return &opbrokerv1.Operation_Observation{Source: source, Outcome: outcome}
	}
	for name, c := range map[string]struct {
		op   *opbrokerv1.Operation
		want Status
	}{
		"succeeded": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_SUCCEEDED, RemoteRef: "ch_42",
			LastObservation: obs(opbrokerv1.Operation_SOURCE_DISPATCH, target.ClassVerifiedSuccess)},
			Status{"Confirmed by the payment provider", "The payment provider confirmed it; their reference is ch_42.", "Nothing more to do.", "ok"}},
		"unknown after a timeout": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_UNKNOWN,
			NextCheckTime: timestamppb.New(now.Add(30 * time.Second)), LastObservation: obs(opbrokerv1.Operation_SOURCE_DISPATCH, target.ClassTimeout)},
			Status{"Confirmation pending: we are checking with the payment provider",
				"We did not get a clear answer from the payment provider, so we do not know yet whether it went through. " +
					"It may already have gone through: do not ask the customer to try again.",
				"We will check with the payment provider again in about 30 seconds (2 Dec 2026 10:00:30 UTC). " +
					"If we send it again, it is the same request, which the payment provider carries out at most once.",
				"pending"}},
		"unknown, still processing": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_UNKNOWN,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_LOOKUP, "FOUND_PENDING")},
			Status{"Confirmation pending: we are checking with the payment provider",
				"The payment provider is still processing it, so we do not know yet whether it went through. " +
					"It may already have gone through: do not ask the customer to try again.",
				"We will check with the payment provider again shortly. If we send it again, it is the same request, which the payment provider carries out at most once.",
				"pending"}},
		"sent again after the provider did not carry it out": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_PREPARED, AttemptCount: 1,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_DISPATCH, target.ClassNotExecuted)},
			Status{"Received: to be sent again", "An earlier attempt did not go through at the payment provider; we will send it again. " +
				"The customer need not try again: this request will still be sent.",
				"It will be sent shortly.", "neutral"}},
		"escalated": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_ESCALATED,
			Escalation: &opbrokerv1.Operation_Escalation{Owner: "payments-oncall (https://runbooks.example.com/pay)"}},
			Status{"Needs attention: payments-oncall is looking into it", "We could not confirm it with the payment provider automatically, so a person will. " +
				"It may already have gone through: do not ask the customer to try again.",
				"Payments-oncall will settle it with the payment provider; the broker sends nothing more.", "attention"}},
		"declined": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_FAILED_TERMINAL,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_DISPATCH, target.ClassDocumentedRejection)},
			Status{"Not done: the payment provider declined it", "The payment provider said no, and nothing happened there.",
				"Nothing more will happen. The customer can try again with a new request.", "failed"}},
		"deadline passed": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_FAILED_TERMINAL,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_BROKER, "DISPATCH_DEADLINE_PASSED")},
			Status{"Not done: it could not be sent in time", "Its deadline passed before it could go through, and nothing happened at the payment provider.",
				"Nothing more will happen. The customer can try again with a new request.", "failed"}},
		"resolved by an operator": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_FAILED_TERMINAL,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_OPERATOR, "MANUAL_RESOLUTION")},
			Status{"Not done: confirmed by our team", "Our team checked with the payment provider that nothing happened there.",
				"Nothing more will happen. The customer can try again with a new request.", "failed"}},
		"prepared for later": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_PREPARED, NotBefore: timestamppb.New(now.Add(time.Hour)),
			DispatchDeadline: timestamppb.New(now.Add(2 * time.Hour))},
			Status{"Received: not sent yet", "We have the request and will send it to the payment provider.",
				"It will be sent after 2 Dec 2026 11:00:00 UTC. If it cannot be sent by 2 Dec 2026 12:00:00 UTC, it will not be sent at all.", "neutral"}},
		"unknown, throttled after an earlier send": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_UNKNOWN,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_DISPATCH, target.ClassThrottled)},
			Status{"Confirmation pending: we are checking with the payment provider",
				"We do not know yet whether it went through at the payment provider. The payment provider asked us to slow down, " +
					"so we are waiting before asking again. It may already have gone through: do not ask the customer to try again.",
				"We will check with the payment provider again shortly. If we send it again, it is the same request, which the payment provider carries out at most once.",
				"pending"}},
		"failed, then confirmed by the provider": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_FAILED_TERMINAL,
			LastObservation: obs(opbrokerv1.Operation_SOURCE_LOOKUP, "NOT_FOUND"),
			Contradiction:   &opbrokerv1.Operation_Contradiction{RemoteRef: "ch_late"}},
			Status{"Needs attention: the payment provider confirmed it after we recorded it as not done",
				"We recorded it as not done, but the payment provider then confirmed that it went through; their reference is ch_late. " +
					"Do not tell the customer it failed, and do not ask them to try again.",
				"The people who run the broker have been alerted and will settle it with the payment provider; this record will not change.",
				"attention"}},
		"succeeded, and an earlier attempt confirmed too": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_SUCCEEDED, RemoteRef: "ch_2",
			LastObservation: obs(opbrokerv1.Operation_SOURCE_DISPATCH, target.ClassVerifiedSuccess),
			Contradiction:   &opbrokerv1.Operation_Contradiction{RemoteRef: "ch_1"}},
			Status{"Needs attention: the payment provider confirmed it twice",
				"The payment provider confirmed it with reference ch_2, and confirmed an earlier attempt too, with reference ch_1: it may have gone through twice.",
				"The people who run the broker have been alerted and will settle it with the payment provider; this record will not change.",
				"attention"}},
		"cancelled": {&opbrokerv1.Operation{State: opbrokerv1.Operation_STATE_CANCELLED},
			Status{"Cancelled", "It was cancelled before it could go through; nothing happened at the payment provider.",
				"Nothing more will happen.", "neutral"}},
	} {
		require.Equal(t, c.want, describe(c.op, "the payment provider", now), name)
	}
}
