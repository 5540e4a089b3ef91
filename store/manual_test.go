package store_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// unknownOp prepares an operation and takes it to UNKNOWN through a send.
func (b *testBundle) unknownOp(t *testing.T, intent string) store.Operation {
	t.Helper()
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", intent, `{"amount":1}`))
	require.NoError(t, err)
	claimed, err := b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	return b.recordOutcome(t, store.OutcomeParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Actor: "test", Observation: store.Observation{Outcome: "TIMEOUT"}})
}

// TestResolveManually: an operator resolves an UNKNOWN operation with evidence; the
// event keeps who, why and what was checked; a stale revision, a reconciler at work or
// a state that is not unsettled records nothing; a reconciler that held the operation
// before can no longer record.
func TestResolveManually(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknownOp(t, "manual")
	resolution := store.ManualResolution{TenantID: "acme", ID: op.ID, Revision: op.Revision, State: store.StateSucceeded,
		RemoteRef: "ch_123", Reason: "found in the provider's dashboard", Evidence: "charge ch_123, 1.00 EUR",
		EvidenceURL: "https://dashboard.example.com/charges/ch_123", Actor: "operator:alice"}

	// A reconciler holds it now.
	held, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, held, 1)
	_, err = b.all.ResolveManually(b.ctx, resolution)
	require.ErrorIs(t, err, store.ErrBeingReconciled)
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET lease_expires_at = now() - interval '1 second' WHERE operation_id = $1`, op.ID)
	require.NoError(t, err)

	stale := resolution
	stale.Revision--
	_, err = b.all.ResolveManually(b.ctx, stale)
	require.ErrorIs(t, err, store.ErrRevisionChanged)

	resolved, err := b.all.ResolveManually(b.ctx, resolution)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, resolved.State)
	require.Equal(t, "ch_123", resolved.RemoteRef)
	require.Greater(t, resolved.FenceToken, held[0].FenceToken, "the reconciler's fence is lost")
	events, err := b.all.Events(b.ctx, "acme", op.ID, resolved.Revision-1, 10)
	require.NoError(t, err)
	require.Len(t, events, 1)
	ev := events[0]
	require.Equal(t, "operator:alice", ev.Actor)
	require.Equal(t, "MANUAL_RESOLUTION", ev.Reason)
	require.Equal(t, "OPERATOR", ev.Observation.Source)
	require.Equal(t, "found in the provider's dashboard", ev.Observation.Summary)
	require.Equal(t, "charge ch_123, 1.00 EUR", ev.Observation.Evidence)
	require.Equal(t, "https://dashboard.example.com/charges/ch_123", ev.Observation.EvidenceURL)
	require.WithinDuration(t, time.Now(), ev.Observation.ObservedAt, time.Minute, "observed by the database's clock")

	_, err = b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: op.ID, Fence: held[0].FenceToken,
		State: store.StateFailedTerminal, Actor: "reconciler:late"})
	require.ErrorIs(t, err, store.ErrFenceLost, "the late reconciler records nothing")

	again := resolution
	again.Revision = resolved.Revision
	_, err = b.all.ResolveManually(b.ctx, again)
	var stateErr *store.StateError
	require.ErrorAs(t, err, &stateErr, "a settled operation is not resolved again")

	_, err = b.all.ResolveManually(b.ctx, store.ManualResolution{TenantID: "acme", ID: uuid.New(), Revision: 1,
		State: store.StateFailedTerminal, Reason: "x", Actor: "operator:alice"})
	require.ErrorIs(t, err, store.ErrNotFound)
	noRef := resolution
	noRef.RemoteRef = ""
	_, err = b.all.ResolveManually(b.ctx, noRef)
	require.ErrorContains(t, err, "needs the target's reference")
}

// TestTwoOperatorResolution: a proposal leaves the operation unsettled with the
// proposal in its last observation and an event by the proposer; only another operator
// can approve it, at the proposal's revision and before it expires; the approval
// applies it with an event by the approver that names the proposer.
func TestTwoOperatorResolution(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknownOp(t, "four-eyes")
	resolution := store.ManualResolution{TenantID: "acme", ID: op.ID, Revision: op.Revision, State: store.StateSucceeded,
		RemoteRef: "ch_9", Reason: "seen in the dashboard", Evidence: "charge ch_9", Actor: "operator:alice"}

	_, err := b.all.ApproveResolution(b.ctx, "acme", op.ID, op.Revision, "operator:bob", settles(0))
	require.ErrorIs(t, err, store.ErrNoProposal)

	proposed, err := b.all.ProposeResolution(b.ctx, resolution, time.Hour)
	require.NoError(t, err)
	require.Equal(t, store.StateUnknown, proposed.State, "nothing applied yet")
	require.Equal(t, op.Revision+1, proposed.Revision)
	require.Equal(t, op.FenceToken, proposed.FenceToken)
	require.Empty(t, proposed.RemoteRef)
	p := proposed.LastObservation.Proposal
	require.NotNil(t, p)
	require.Equal(t, store.StateSucceeded, p.State)
	require.Equal(t, "ch_9", p.RemoteRef)
	require.Equal(t, "operator:alice", p.ProposedBy)
	require.WithinDuration(t, time.Now().Add(time.Hour), p.ExpiresAt, time.Minute)

	_, err = b.all.ApproveResolution(b.ctx, "acme", op.ID, proposed.Revision, "operator:alice", settles(0))
	require.ErrorIs(t, err, store.ErrSameOperator)
	_, err = b.all.ApproveResolution(b.ctx, "acme", op.ID, op.Revision, "operator:bob", settles(0))
	require.ErrorIs(t, err, store.ErrRevisionChanged, "approved at another revision than the proposal's")

	resolved, err := b.all.ApproveResolution(b.ctx, "acme", op.ID, proposed.Revision, "operator:bob", settles(0))
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, resolved.State)
	require.Equal(t, "ch_9", resolved.RemoteRef)
	require.Greater(t, resolved.FenceToken, proposed.FenceToken)
	events, err := b.all.Events(b.ctx, "acme", op.ID, op.Revision, 10)
	require.NoError(t, err)
	require.Len(t, events, 2)
	require.Equal(t, "operator:alice", events[0].Actor)
	require.Equal(t, "RESOLUTION_PROPOSED", events[0].Reason)
	require.Equal(t, "operator:bob", events[1].Actor)
	require.Equal(t, "MANUAL_RESOLUTION", events[1].Reason)
	require.Equal(t, "operator:alice", events[1].Observation.ProposedBy)
	require.Equal(t, "charge ch_9", events[1].Observation.Evidence)

	// An expired proposal applies nothing.
	late := b.unknownOp(t, "four-eyes-late")
	resolution.ID, resolution.Revision = late.ID, late.Revision
	proposed, err = b.all.ProposeResolution(b.ctx, resolution, time.Millisecond)
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond)
	_, err = b.all.ApproveResolution(b.ctx, "acme", late.ID, proposed.Revision, "operator:bob", settles(0))
	require.ErrorIs(t, err, store.ErrProposalExpired)
	got, err := b.all.Get(b.ctx, "acme", late.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateUnknown, got.State)
}

// TestPeriodStats: per tenant and target, the UNKNOWN operations entered by day, the
// time from UNKNOWN to resolution, the open escalations, the payload mismatches refused
// and the operations created, by state.
func TestPeriodStats(t *testing.T) {
	t.Parallel()
	b := setup(t)
	from := time.Now().Add(-time.Minute)
	op := b.unknownOp(t, "stats-resolved")
	_, err := b.all.ResolveManually(b.ctx, store.ManualResolution{TenantID: "acme", ID: op.ID, Revision: op.Revision,
		State: store.StateFailedTerminal, Reason: "not there", Evidence: "searched", Actor: "operator:alice"})
	require.NoError(t, err)
	// A same-key replay whose answer is unclear again, then one that succeeds: one
	// operation that became UNKNOWN today, resolved once.
	replayed := b.unknownOp(t, "stats-replayed")
	for i, state := range []store.State{store.StateUnknown, store.StateSucceeded} {
		held, err := b.all.ClaimUnknown(b.ctx, unknownParams())
		require.NoError(t, err)
		require.Len(t, held, 1, "round %d", i)
		replay, err := b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: replayed.ID, Fence: held[0].FenceToken,
			Worker: "rec", Lease: time.Minute})
		require.NoError(t, err)
		answer, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: replayed.ID, Fence: replay.FenceToken,
			State: state, RemoteRef: "ch_r", Actor: "test", Observation: store.Observation{Outcome: "TEST"}})
		require.NoError(t, err)
		got, err := b.all.Get(b.ctx, "acme", replayed.ID)
		require.NoError(t, err)
		require.EqualValues(t, i+1, got.Replays)
		require.Equal(t, store.RecordedOutcomeOf(got), answer, "a replay's outcome is answered with its count of replays")
	}
	b.unknownOp(t, "stats-open")
	_, _, err = b.all.Prepare(b.ctx, prepareParams("acme", "stats-open", `{"amount":2}`))
	require.Error(t, err, "another payload")
	_, _, err = b.all.Prepare(b.ctx, prepareParams("globex", "stats-other", `{}`))
	require.NoError(t, err)
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'ESCALATED', revision = revision + 1,
		escalation = jsonb_build_object('owner', 'oncall', 'reason', 'test', 'escalated_at', now() - interval '1 hour')
		WHERE intent_ref = 'stats-open'`)
	require.NoError(t, err)

	stats, err := b.all.PeriodStats(b.ctx, store.PeriodParams{From: from, To: time.Now().Add(time.Minute),
		Targets: map[string]string{"demo.charge": "payments"}})
	require.NoError(t, err)
	require.Len(t, stats, 2)
	acme, globex := stats[0], stats[1]
	require.Equal(t, "acme", acme.TenantID)
	require.Equal(t, "payments", acme.Target)
	require.Equal(t, map[string]int64{time.Now().UTC().Format(time.DateOnly): 3}, acme.UnknownEntered, "each operation once")
	require.Equal(t, int64(2), acme.Resolved, "by hand, and by the replay")
	require.Positive(t, acme.WorstToResolution)
	require.GreaterOrEqual(t, acme.WorstToResolution, acme.MedianToResolution)
	require.Equal(t, int64(1), acme.OpenEscalated)
	require.InDelta(t, time.Hour.Seconds(), acme.OldestEscalation.Seconds(), 60)
	require.Equal(t, int64(1), acme.PayloadMismatches)
	require.Equal(t, map[store.State]int64{store.StateFailedTerminal: 1, store.StateEscalated: 1, store.StateSucceeded: 1}, acme.ByState)
	require.Equal(t, "globex", globex.TenantID)
	require.Equal(t, map[store.State]int64{store.StatePrepared: 1}, globex.ByState)
	require.Zero(t, globex.PayloadMismatches)

	scoped, err := b.store.Tenant("globex").PeriodStats(b.ctx, store.PeriodParams{From: from, To: time.Now().Add(time.Minute)})
	require.NoError(t, err)
	require.Len(t, scoped, 1, "a tenant's scope reads its own")
	require.Equal(t, "", scoped[0].Target, "a type no target serves")
}

// TestFailureWaitsForTheLastSend: an operation is resolved as FAILED_TERMINAL by hand,
// proposed so or approved, only once its target's settling time has passed since its
// last send ended; until then nothing is recorded and the error says how long is left.
// A success, which names the effect, needs no wait.
func TestFailureWaitsForTheLastSend(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.unknownOp(t, "too-soon")
	failed := store.ManualResolution{TenantID: "acme", ID: op.ID, Revision: op.Revision, State: store.StateFailedTerminal,
		Reason: "not at the target", Evidence: "no charge under the key", Actor: "operator:alice", FailureSettlesAfter: time.Hour}

	_, err := b.all.ResolveManually(b.ctx, failed)
	var mayLand *store.SendMayStillLandError
	require.ErrorAs(t, err, &mayLand)
	require.InDelta(t, time.Hour.Seconds(), mayLand.Wait.Seconds(), 60, "how long is left, by the database's clock")
	_, err = b.all.ProposeResolution(b.ctx, failed, time.Hour)
	require.ErrorIs(t, err, store.ErrSendMayStillLand, "nor proposed")
	now, err := b.all.Get(b.ctx, "acme", op.ID)
	require.NoError(t, err)
	require.Equal(t, op.Revision, now.Revision, "nothing recorded")

	succeeded := failed
	succeeded.State, succeeded.RemoteRef = store.StateSucceeded, "ch_1"
	other := b.unknownOp(t, "found")
	succeeded.ID, succeeded.Revision = other.ID, other.Revision
	_, err = b.all.ResolveManually(b.ctx, succeeded)
	require.NoError(t, err, "a success names its effect: no wait")

	// Proposed with no wait, approved only once the target's wait has passed.
	failed.FailureSettlesAfter = 0
	proposed, err := b.all.ProposeResolution(b.ctx, failed, time.Hour)
	require.NoError(t, err)
	_, err = b.all.ApproveResolution(b.ctx, "acme", op.ID, proposed.Revision, "operator:bob", settles(time.Hour))
	require.ErrorAs(t, err, &mayLand)
	b.sentEarlier(t, op, 59*time.Minute)
	_, err = b.all.ApproveResolution(b.ctx, "acme", op.ID, proposed.Revision, "operator:bob", settles(time.Hour))
	require.ErrorAs(t, err, &mayLand)
	require.InDelta(t, time.Minute.Seconds(), mayLand.Wait.Seconds(), 10, "a minute left")
	b.sentEarlier(t, op, time.Minute)
	resolved, err := b.all.ApproveResolution(b.ctx, "acme", op.ID, proposed.Revision, "operator:bob", settles(time.Hour))
	require.NoError(t, err)
	require.Equal(t, store.StateFailedTerminal, resolved.State)
}

// sentEarlier moves op's history back by d, as if its sends had ended that much
// earlier (the events are append-only: their guard is set aside for it).
func (b *testBundle) sentEarlier(t *testing.T, op store.Operation, d time.Duration) {
	t.Helper()
	storetest.ExecAsideGuards(t, b.pool, `UPDATE operation_events SET created_at = created_at - $2::interval WHERE operation_id = $1`, op.ID, d)
}

// settles is a target's settling time for a failure by hand, the same for every
// operation.
func settles(d time.Duration) func(store.Operation) time.Duration {
	return func(store.Operation) time.Duration { return d }
}
