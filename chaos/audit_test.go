package chaos

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/simtarget"
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
// after answers documented as not executed, or attempts given back unsent, and only
// then, reading each attempt's class and whether it left from its holder's outcome.
func TestAuditReadsAnAttemptsClass(t *testing.T) {
	state := func(s string) *string { return &s }
	for class, want := range map[string]int{"NOT_EXECUTED": 0, "NOT_STARTED": 0, "TIMEOUT": 1} {
		sent := class != "NOT_STARTED"
		original := &ledgerOp{Name: "original", State: "CANCELLED", Events: []ledgerEvent{
			{Revision: 1, To: "PREPARED"},
			{Revision: 2, From: state("PREPARED"), To: "IN_FLIGHT", Fence: 1},
			{Revision: 3, From: state("IN_FLIGHT"), To: "PREPARED", Fence: 1, Reason: class + " " + class, Class: class, Sent: &sent},
			{Revision: 4, From: state("PREPARED"), To: "CANCELLED", Fence: 1},
		}}
		amendment := &ledgerOp{Name: "amendment", Events: []ledgerEvent{{Revision: 1, To: "PREPARED", Reason: "SUPERSEDES_PREPARED "}}}
		var found []string
		auditAmendment(amendment, original, nil, func(id, format string, args ...any) { found = append(found, id) })
		require.Len(t, found, want, class)
	}
}

// TestAuditOfEvidence: I5 accepts evidence that takes an IN_FLIGHT operation under the
// next fence, and only that; I14 flags a fabricated event that was applied, a change
// recorded from an event the ledger quarantined, an event the target never sent and an
// acknowledged forgery; I15 flags a matched event whose operation disagrees with it or
// is not its charge's.
func TestAuditOfEvidence(t *testing.T) {
	state := func(s string) *string { return &s }
	history := func(fence int64, eventID string) []ledgerEvent {
		return []ledgerEvent{
			{Revision: 1, To: "PREPARED"},
			{Revision: 2, From: state("PREPARED"), To: "IN_FLIGHT", Fence: 1},
			{Revision: 3, From: state("IN_FLIGHT"), To: "SUCCEEDED", Fence: fence, EventID: eventID},
		}
	}
	for fence, want := range map[int64]int{2: 0, 1: 1} {
		var found []string
		auditEvents(&ledgerOp{State: "SUCCEEDED", Events: history(fence, "evt_1")}, func(id, format string, args ...any) {
			found = append(found, id+": "+fmt.Sprintf(format, args...))
		})
		require.Len(t, found, want, "evidence under fence %d: %v", fence, found)
	}

	op := &ledgerOp{Name: "op", State: "SUCCEEDED", RemoteKey: "k1", RemoteRef: "ch_1", Events: history(2, "evt_1")}
	truth := map[string]*simtarget.KeyTruth{"k1": {Effects: 1, IDs: []string{"ch_1"}}}
	genuine := simtarget.WebhookTruth{EventID: "evt_1", Type: "charge.succeeded", Reference: "k1", EffectID: "ch_1", Genuine: true, Acknowledged: true}
	applied := ledgerEvidence{EventID: "evt_1", Meaning: "SUCCEEDED", Disposition: "APPLIED", Name: "op"}
	reportedApplied := applied
	reportedApplied.Reporter = reporterName
	for name, c := range map[string]struct {
		op      ledgerOp
		sent    []simtarget.WebhookTruth
		kept    map[string]ledgerEvidence
		reports []report
		want    string
	}{
		"a report for another tenant, applied": {*op, []simtarget.WebhookTruth{genuine}, keyed(applied, reportedApplied),
			[]report{{eventID: "evt_1", tenant: "tenant-2", wrong: true}}, "I14: event evt_1, reported for tenant tenant-2"},
		"a report the ledger lost": {*op, []simtarget.WebhookTruth{genuine}, keyed(applied),
			[]report{{eventID: "evt_1", tenant: "tenant-1"}}, "I14: event evt_1 was reported and acknowledged"},
		"a genuine success applied": {*op, []simtarget.WebhookTruth{genuine}, keyed(applied), nil, ""},
		"a fabricated event applied": {*op, []simtarget.WebhookTruth{func() simtarget.WebhookTruth { g := genuine; g.Genuine = false; return g }()},
			keyed(applied), nil, "I14: event evt_1, fabricated"},
		"a change from a quarantined event": {*op, []simtarget.WebhookTruth{genuine},
			keyed(ledgerEvidence{EventID: "evt_1", Disposition: "QUARANTINED", Name: "op"}), nil, "I14: op: revision 3 records event evt_1"},
		"applied without an operation event": {ledgerOp{Name: "op", State: "SUCCEEDED", RemoteKey: "k1", RemoteRef: "ch_1"},
			[]simtarget.WebhookTruth{genuine}, keyed(applied), nil, "I14: event evt_1 was kept as applied to op, which has no event"},
		"an event never sent": {ledgerOp{Name: "op", State: "SUCCEEDED", RemoteKey: "k1", RemoteRef: "ch_1"}, nil,
			keyed(ledgerEvidence{EventID: "evt_9", Disposition: "QUARANTINED"}), nil, "I14: event evt_9 was kept, but the target never sent it"},
		"an acknowledged forgery": {ledgerOp{Name: "op", State: "SUCCEEDED", RemoteKey: "k1", RemoteRef: "ch_1"},
			[]simtarget.WebhookTruth{{EventID: "evt_1", Forged: true, Acknowledged: true, LastStatus: 200}}, nil, nil, "I14: event evt_1: a copy signed with a wrong secret"},
		"a success beside FAILED_TERMINAL": {ledgerOp{Name: "op", State: "FAILED_TERMINAL", RemoteKey: "k1"}, []simtarget.WebhookTruth{genuine},
			keyed(ledgerEvidence{EventID: "evt_1", Meaning: "SUCCEEDED", Disposition: "OBSERVED", Name: "op"}), nil, "I15: op is FAILED_TERMINAL"},
		"another charge's event": {ledgerOp{Name: "op", State: "SUCCEEDED", RemoteKey: "k2", RemoteRef: "ch_1"}, []simtarget.WebhookTruth{genuine},
			keyed(ledgerEvidence{EventID: "evt_1", Meaning: "SUCCEEDED", Disposition: "OBSERVED", Name: "op"}), nil, "I15: event evt_1, about the charge under key k1"},
	} {
		var found []string
		r := &Report{Faults: map[string]int{}, Evidence: EvidenceCounts{Quarantined: map[string]int{}}}
		auditEvidence(r, map[string]*ledgerOp{"op": &c.op}, truth, c.sent, c.kept, c.reports, func(id, format string, args ...any) {
			found = append(found, id+": "+fmt.Sprintf(format, args...))
		})
		if c.want == "" {
			require.Empty(t, found, name)
			continue
		}
		require.Len(t, found, 1, "%s: %v", name, found)
		require.Contains(t, found[0], c.want, name)
	}
}

// keyed returns kept events by their audit key.
func keyed(events ...ledgerEvidence) map[string]ledgerEvidence {
	out := map[string]ledgerEvidence{}
	for _, e := range events {
		out[evidenceKey(e.EventID, e.Reporter)] = e
	}
	return out
}

// TestEveryWebhookFaultOnTwoCharges: the first intents carry each webhook fault on two
// charges, never on the ninth (always amended), so that one charge ending without
// effect leaves the fault on another.
func TestEveryWebhookFaultOnTwoCharges(t *testing.T) {
	t.Parallel()
	seen := map[int]int{}
	for i := range 40 {
		if k := webhookFaultOf(i); k >= 0 {
			seen[k]++
		}
	}
	require.Len(t, seen, len(simtarget.WebhookFaults))
	for k, n := range seen {
		require.Equal(t, 2, n, "fault %s", simtarget.WebhookFaults[k])
	}
	require.Equal(t, -1, webhookFaultOf(0))
	require.Equal(t, -1, webhookFaultOf(len(simtarget.WebhookFaults)+1), "the amended intent")
}

// TestAuditFailsOnEscalationsLeft: I16 breaks when an operation is still ESCALATED at
// the audit of work that settled (work that did not may escalate after the operator's
// last look), and whenever the operator says it left escalations (or may have), even
// with none in the ledger it read.
func TestAuditFailsOnEscalationsLeft(t *testing.T) {
	state := func(s string) *string { return &s }
	escalated := []ledgerEvent{
		{Revision: 1, To: "PREPARED"},
		{Revision: 2, From: state("PREPARED"), To: "IN_FLIGHT", Fence: 1},
		{Revision: 3, From: state("IN_FLIGHT"), To: "UNKNOWN", Fence: 1},
		{Revision: 4, From: state("UNKNOWN"), To: "ESCALATED", Fence: 1},
	}
	resolved := append(slices.Clone(escalated), ledgerEvent{Revision: 5, From: state("ESCALATED"), To: "FAILED_TERMINAL", Fence: 1,
		Actor: "operator:on-call", Reason: "MANUAL_RESOLUTION", Summary: "checked", Evidence: "the target's record"})
	for name, c := range map[string]struct {
		op      ledgerOp
		settled bool
		left    string
		want    string
	}{
		"every escalation resolved":                 {ledgerOp{Name: "op", State: "FAILED_TERMINAL", RemoteKey: "k1", Events: resolved}, true, "", ""},
		"an escalation left in the ledger":          {ledgerOp{Name: "op", State: "ESCALATED", Escalated: true, RemoteKey: "k1", Events: escalated}, true, "", "op: still ESCALATED"},
		"an escalation of work that did not settle": {ledgerOp{Name: "op", State: "ESCALATED", Escalated: true, RemoteKey: "k1", Events: escalated}, false, "", ""},
		"the operator gave up":                      {ledgerOp{Name: "op", State: "FAILED_TERMINAL", RemoteKey: "k1", Events: resolved}, true, "escalations left after 150 looks", "the operator: escalations left after 150 looks"},
		"the operator gave up on unsettled work":    {ledgerOp{Name: "op", State: "FAILED_TERMINAL", RemoteKey: "k1", Events: resolved}, false, "escalations left after 150 looks", "the operator: escalations left after 150 looks"},
	} {
		r := &Report{Faults: map[string]int{}, ByState: map[string]int{}, Evidence: EvidenceCounts{Quarantined: map[string]int{}},
			Settled: c.settled, EscalationsLeft: c.left}
		audit(r, map[string]*ledgerOp{"op": &c.op}, map[string]*simtarget.KeyTruth{}, &history{}, nil, evidenceAudit{})
		i := slices.IndexFunc(r.Invariants, func(i Invariant) bool { return i.ID == "I16" })
		require.GreaterOrEqual(t, i, 0, "I16 is audited")
		if c.want == "" {
			require.True(t, r.Invariants[i].Held, "%s: %v", name, r.Invariants[i].Violations)
			continue
		}
		require.False(t, r.Invariants[i].Held, name)
		require.Len(t, r.Invariants[i].Violations, 1, name)
		require.Contains(t, r.Invariants[i].Violations[0], c.want, name)
	}
}
