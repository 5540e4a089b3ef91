package store_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

// statsBundle moves operations of its own into each open state, one step at a time.
type statsBundle struct {
	*testBundle
	t *testing.T
}

func (b statsBundle) prepare(tenant, typ, intent string) store.Operation {
	b.t.Helper()
	p := prepareParams(tenant, intent, `{"intent":"`+intent+`"}`)
	p.OperationType = typ
	op, _, err := b.all.Prepare(b.ctx, p)
	require.NoError(b.t, err)
	return op
}

// claim claims every ready operation of typ, which must be exactly want.
func (b statsBundle) claim(typ string, want ...uuid.UUID) map[uuid.UUID]store.Claimed {
	b.t.Helper()
	p := claimParams(100)
	p.OperationTypes = []string{typ}
	claimed, err := b.all.Claim(b.ctx, p)
	require.NoError(b.t, err)
	byID := map[uuid.UUID]store.Claimed{}
	for _, c := range claimed {
		byID[c.ID] = c
	}
	require.Len(b.t, byID, len(want))
	for _, id := range want {
		require.Contains(b.t, byID, id)
	}
	return byID
}

func (b statsBundle) record(c store.Claimed, p store.OutcomeParams) store.Operation {
	b.t.Helper()
	p.TenantID, p.ID, p.Fence, p.Actor = c.TenantID, c.ID, c.FenceToken, "test"
	return b.recordOutcome(b.t, p)
}

// entered returns when the operation entered its current state, by its events.
func (b statsBundle) entered(id uuid.UUID) time.Time {
	b.t.Helper()
	var at time.Time
	require.NoError(b.t, b.pool.QueryRow(b.ctx, `SELECT created_at FROM operation_events
		WHERE operation_id = $1 AND from_state IS DISTINCT FROM to_state ORDER BY revision DESC LIMIT 1`, id).Scan(&at))
	return at
}

func (b statsBundle) stats(scope store.Scope, now time.Time) map[store.State]map[string]store.OpenGroup {
	b.t.Helper()
	groups, err := scope.OpenStats(b.ctx, store.OpenStatsParams{Now: now})
	require.NoError(b.t, err)
	byState := map[store.State]map[string]store.OpenGroup{}
	for _, g := range groups {
		if byState[g.State] == nil {
			byState[g.State] = map[string]store.OpenGroup{}
		}
		require.NotContains(b.t, byState[g.State], g.OperationType, "one group per state and type")
		byState[g.State][g.OperationType] = g
	}
	return byState
}

// TestOpenStatsCountsOpenOperationsAndTheirAges: one statement counts every tenant's
// open operations by state and type, the PREPARED ones the dispatcher may claim now, and
// the age of the longest-waiting one of each group: UNKNOWN since the first send (a look
// that resolves nothing does not make one younger), ESCALATED since the escalation,
// IN_FLIGHT since the claim, PREPARED since it became ready. Terminal operations are not
// counted.
func TestOpenStatsCountsOpenOperationsAndTheirAges(t *testing.T) {
	t.Parallel()
	b := statsBundle{testBundle: setup(t), t: t}
	const charge, notify = "demo.charge", "demo.notify"
	timeout := store.OutcomeParams{State: store.StateUnknown, Observation: store.Observation{Source: "DISPATCH", Outcome: "TIMEOUT"}}

	// Two UNKNOWN: one is escalated, the other looked at without a resolution.
	u1, u2 := b.prepare("acme", charge, "u-1"), b.prepare("globex", charge, "u-2")
	sent := b.claim(charge, u1.ID, u2.ID)
	b.record(sent[u1.ID], timeout)
	b.record(sent[u2.ID], timeout)
	unknown, err := b.all.ClaimUnknown(b.ctx, store.FairClaim{OperationTypes: []string{charge}, Worker: "rec", Lease: time.Minute,
		Limit: 10, PerTenant: 10, MaxTenants: 10})
	require.NoError(t, err)
	require.Len(t, unknown, 2)
	for _, c := range unknown {
		if c.ID == u1.ID {
			_, err = b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
				State: store.StateEscalated, Observation: store.Observation{Source: "BROKER", Outcome: "ESCALATED"},
				Escalation: &store.Escalation{Owner: "payments", Reason: "test", EscalatedAt: time.Now()}, Actor: "test"})
		} else {
			_, err = b.all.RecordCheck(b.ctx, store.CheckParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
				Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, CheckAfter: time.Hour, Actor: "test"})
		}
		require.NoError(t, err)
	}
	// One IN_FLIGHT; one PREPARED again after an answer documented as not executed,
	// waiting an hour to be sent again; two PREPARED ready to send.
	inFlight := b.prepare("acme", charge, "f-1")
	b.claim(charge, inFlight.ID)
	resend := b.prepare("acme", charge, "r-1")
	waiting := b.record(b.claim(charge, resend.ID)[resend.ID], store.OutcomeParams{State: store.StatePrepared,
		NotExecuted: true, SendAgainAfter: time.Hour, Observation: store.Observation{Source: "DISPATCH", Outcome: "RATE_LIMITED"}})
	ready1, _ := b.prepare("globex", charge, "p-1"), b.prepare("acme", charge, "p-2")
	// Another type: one SUCCEEDED (not counted), one PREPARED.
	done := b.prepare("acme", notify, "s-1")
	b.record(b.claim(notify, done.ID)[done.ID], store.OutcomeParams{State: store.StateSucceeded, RemoteRef: "ref-1",
		Observation: store.Observation{Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}})
	notified := b.prepare("acme", notify, "n-1")

	var claimedAt time.Time
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT updated_at FROM operations WHERE operation_id = $1`, inFlight.ID).Scan(&claimedAt))
	var checkedAt time.Time
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT updated_at FROM operations WHERE operation_id = $1`, u2.ID).Scan(&checkedAt))
	require.True(t, checkedAt.After(b.entered(u2.ID)), "the look bumped updated_at after the operation entered UNKNOWN")
	u2Sent, err := b.all.Get(b.ctx, "globex", u2.ID)
	require.NoError(t, err)
	require.NotNil(t, u2Sent.FirstSentAt)

	now := time.Now().Add(time.Minute).Truncate(time.Microsecond)
	got := b.stats(b.all, now)
	require.Equal(t, map[store.State]map[string]store.OpenGroup{
		store.StatePrepared: {
			charge: {State: store.StatePrepared, OperationType: charge, Count: 3, Ready: 2, OldestAge: now.Sub(ready1.CreatedAt)},
			notify: {State: store.StatePrepared, OperationType: notify, Count: 1, Ready: 1, OldestAge: now.Sub(notified.CreatedAt)},
		},
		store.StateInFlight:  {charge: {State: store.StateInFlight, OperationType: charge, Count: 1, OldestAge: now.Sub(claimedAt)}},
		store.StateUnknown:   {charge: {State: store.StateUnknown, OperationType: charge, Count: 1, OldestAge: now.Sub(*u2Sent.FirstSentAt)}},
		store.StateEscalated: {charge: {State: store.StateEscalated, OperationType: charge, Count: 1, OldestAge: now.Sub(b.entered(u1.ID))}},
	}, got)

	// Once the resend is due it is ready, and has been since it became due.
	require.NotNil(t, waiting.NextCheckAt)
	later := waiting.NextCheckAt.Add(time.Second)
	prepared := b.stats(b.all, later)[store.StatePrepared][charge]
	require.Equal(t, int64(3), prepared.Ready)
	require.Equal(t, later.Sub(ready1.CreatedAt), prepared.OldestAge, "the oldest ready one is still the one ready since its creation")

	// A tenant's scope counts that tenant's operations only.
	globex := b.stats(b.store.Tenant("globex"), now)
	require.Equal(t, int64(1), globex[store.StatePrepared][charge].Count)
	require.Equal(t, int64(1), globex[store.StateUnknown][charge].Count)
	require.NotContains(t, globex, store.StateEscalated)
	require.NotContains(t, globex, store.StateInFlight)
}

func TestOpenStatsOfAnEmptyLedger(t *testing.T) {
	t.Parallel()
	b := setup(t)
	groups, err := b.all.OpenStats(b.ctx, store.OpenStatsParams{})
	require.NoError(t, err)
	require.Empty(t, groups)

	_, err = store.Scope{}.OpenStats(b.ctx, store.OpenStatsParams{})
	require.ErrorIs(t, err, store.ErrNoScope)
}
