package chaos

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestAuditFindsOutcomesOutsideTheirFence: I5 reads the attempts from the events and
// the stale outcomes, and flags an outcome that is not its holder's, one under another
// fence than its claim's, and a stale outcome where no attempt was left unapplied.
func TestAuditFindsOutcomesOutsideTheirFence(t *testing.T) {
	at := time.Now()
	state := func(s string) *string { return &s }
	sent := true
	history := func(last ledgerEvent) []ledgerEvent {
		return []ledgerEvent{
			{Revision: 1, To: "PREPARED", At: at},
			{Revision: 2, From: state("PREPARED"), To: "IN_FLIGHT", Fence: 1, Actor: "dispatcher:w", At: at},
			last,
		}
	}
	holders := ledgerEvent{Revision: 3, From: state("IN_FLIGHT"), To: "SUCCEEDED", Fence: 1, Class: "VERIFIED_SUCCESS", Sent: &sent}
	swept := ledgerEvent{Revision: 3, From: state("IN_FLIGHT"), To: "UNKNOWN", Fence: 1, Actor: "sweeper", Class: "LEASE_EXPIRED"}
	notHolders := holders
	notHolders.Sent = nil
	otherFence := holders
	otherFence.Fence = 2
	late := staleOutcome{Fence: 1, Outcome: "TIMEOUT", At: at}
	never := staleOutcome{Fence: 5, Outcome: "TIMEOUT", At: at}

	for name, c := range map[string]struct {
		op        ledgerOp
		violation string
	}{
		"the holder's outcome":                     {ledgerOp{State: "SUCCEEDED", Events: history(holders)}, ""},
		"swept, then its worker's late outcome":    {ledgerOp{State: "UNKNOWN", Events: history(swept), Stale: []staleOutcome{late}}, ""},
		"a success that is not its holder's":       {ledgerOp{State: "SUCCEEDED", Events: history(notHolders)}, "not as its holder's outcome"},
		"an outcome under another fence":           {ledgerOp{State: "SUCCEEDED", Events: history(otherFence)}, "entered under 1"},
		"a stale outcome beside the applied one":   {ledgerOp{State: "SUCCEEDED", Events: history(holders), Stale: []staleOutcome{late}}, "no unapplied attempt"},
		"a stale outcome of a fence never claimed": {ledgerOp{State: "UNKNOWN", Events: history(swept), Stale: []staleOutcome{never}}, "no unapplied attempt"},
	} {
		var found []string
		auditEvents(&c.op, func(id, format string, args ...any) { found = append(found, id+": "+fmt.Sprintf(format, args...)) })
		if c.violation == "" {
			require.Empty(t, found, name)
			continue
		}
		require.Len(t, found, 1, name)
		require.Contains(t, found[0], "I5: ", name)
		require.Contains(t, found[0], c.violation, name)
	}
}

// TestAuditReadsAnAttemptsClass: I11 accepts an amendment of an original PREPARED again
// after answers documented as not executed, and only then, reading each attempt's class
// from its holder's outcome.
func TestAuditReadsAnAttemptsClass(t *testing.T) {
	state := func(s string) *string { return &s }
	notSent := false
	for class, want := range map[string]int{"NOT_EXECUTED": 0, "TIMEOUT": 1} {
		original := &ledgerOp{Name: "original", State: "CANCELLED", Events: []ledgerEvent{
			{Revision: 1, To: "PREPARED"},
			{Revision: 2, From: state("PREPARED"), To: "IN_FLIGHT", Fence: 1},
			{Revision: 3, From: state("IN_FLIGHT"), To: "PREPARED", Fence: 1, Reason: class + " " + class, Class: class, Sent: &notSent},
			{Revision: 4, From: state("PREPARED"), To: "CANCELLED", Fence: 1},
		}}
		amendment := &ledgerOp{Name: "amendment", Events: []ledgerEvent{{Revision: 1, To: "PREPARED", Reason: "SUPERSEDES_PREPARED "}}}
		var found []string
		auditAmendment(amendment, original, nil, func(id, format string, args ...any) { found = append(found, id) })
		require.Len(t, found, want, class)
	}
}
