package store_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

func claimParams(limit int) store.ClaimParams {
	return store.ClaimParams{FairClaim: store.FairClaim{
		OperationTypes: []string{"demo.charge"}, Worker: "test-worker",
		Lease: time.Minute, Limit: limit, PerTenant: limit, MaxTenants: 100,
	}}
}

// uuidBytes returns n random ids' bytes: a value that does not compress.
func uuidBytes(n int) []byte {
	var b []byte
	for range n {
		id := uuid.New()
		b = append(b, id[:]...)
	}
	return b
}

// claimN prepares n operations of tenant and claims them.
func (b *testBundle) claimN(t *testing.T, tenant string, n int) []store.Claimed {
	t.Helper()
	b.prepareN(t, tenant, n)
	claimed, err := b.all.Claim(b.ctx, claimParams(n))
	require.NoError(t, err)
	require.Len(t, claimed, n)
	return claimed
}

func (b *testBundle) prepareN(t *testing.T, tenant string, n int) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	for i := range n {
		op, _, err := b.all.Prepare(b.ctx, prepareParams(tenant, fmt.Sprintf("%s-%d", tenant, i), fmt.Sprintf(`{"n":%d}`, i)))
		require.NoError(t, err)
		ids[i] = op.ID
	}
	return ids
}

func TestClaimTakesPreparedOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.prepareN(t, "acme", 3)

	claimed, err := b.all.Claim(b.ctx, claimParams(10))
	require.NoError(t, err)
	require.Len(t, claimed, 3)
	for i, c := range claimed {
		require.Equal(t, ids[i], c.ID, "oldest first")
		require.Equal(t, store.StateInFlight, c.State)
		require.Equal(t, int64(1), c.FenceToken)
		require.Equal(t, int32(1), c.AttemptCount)
		require.Equal(t, int64(2), c.Revision)
		require.NotNil(t, c.FirstSentAt)
		require.NotEmpty(t, c.Payload)
		require.NotEqual(t, uuid.Nil, c.RemoteKey)
		require.Equal(t, time.Minute, c.LeaseLeft, "measured by the database")
		require.Zero(t, c.SinceFirstSend, "first sent by this claim")
		require.Nil(t, c.DeadlineLeft)
	}
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM operation_events
		WHERE from_state = 'PREPARED' AND to_state = 'IN_FLIGHT' AND fence_token = 1 AND actor = 'dispatcher:test-worker' AND sent IS NULL`))

	again, err := b.all.Claim(b.ctx, claimParams(10))
	require.NoError(t, err)
	require.Empty(t, again)

	other := claimParams(10)
	other.OperationTypes = []string{"demo.notify"}
	b.prepareN(t, "globex", 1)
	none, err := b.all.Claim(b.ctx, other)
	require.NoError(t, err)
	require.Empty(t, none, "a claim takes only its target's operation types")
}

// TestConcurrentClaimersNeverShare: many claimers racing over many operations give
// exactly one claim per operation (fault-injection test 3 of docs/testing.md, at the store).
func TestConcurrentClaimersNeverShare(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, tenant := range []string{"a", "b", "c", "d"} {
		b.prepareN(t, tenant, 150)
	}
	var mu sync.Mutex
	seen := map[uuid.UUID]int{}
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			p := claimParams(7)
			p.PerTenant = 3
			p.Worker = fmt.Sprintf("w%d", w)
			for {
				claimed, err := b.all.Claim(b.ctx, p)
				if !assert.NoError(t, err) || len(claimed) == 0 { // not require: this is not the test's goroutine
					return
				}
				mu.Lock()
				for _, c := range claimed {
					seen[c.ID]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Len(t, seen, 600)
	for id, n := range seen {
		require.Equal(t, 1, n, "operation %s claimed %d times", id, n)
	}
	require.Equal(t, 600, b.count(t, `SELECT count(*) FROM operation_events WHERE to_state = 'IN_FLIGHT'`))
}

// TestClaimIsFairAcrossTenants: one tenant's backlog cannot delay another tenant's new
// operation behind it.
func TestClaimIsFairAcrossTenants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.prepareN(t, "big", 300)
	small := b.prepareN(t, "small", 1)

	p := claimParams(10)
	p.PerTenant = 5
	claimed, err := b.all.Claim(b.ctx, p)
	require.NoError(t, err)
	var got []uuid.UUID
	for _, c := range claimed {
		got = append(got, c.ID)
	}
	require.Contains(t, got, small[0], "the first claim reaches the small tenant")

	// With a cap on tenants per claim, the rotating cursor reaches every tenant.
	for i := range 12 {
		b.prepareN(t, fmt.Sprintf("t%02d", i), 2)
	}
	p.MaxTenants, p.PerTenant, p.Limit = 3, 1, 3
	reached := map[string]bool{}
	for range 8 {
		claimed, err := b.all.Claim(b.ctx, p)
		require.NoError(t, err)
		for _, c := range claimed {
			reached[c.TenantID] = true
			p.AfterTenant = c.TenantID
		}
		if len(claimed) < p.MaxTenants {
			p.AfterTenant = ""
		}
	}
	for i := range 12 {
		require.True(t, reached[fmt.Sprintf("t%02d", i)], "tenant t%02d reached", i)
	}
}

// TestClaimGoesRoundTheTenants: a claim whose cursor is past the last tenant with due
// work continues from the first tenant, for both the dispatcher's claim and the
// reconciler's, instead of coming back empty.
func TestClaimGoesRoundTheTenants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, tenant := range []string{"a", "b", "c"} {
		b.prepareN(t, tenant, 4)
	}
	p := claimParams(6)
	p.PerTenant, p.AfterTenant = 2, "b"
	claimed, err := b.all.Claim(b.ctx, p)
	require.NoError(t, err)
	tenants := map[string]int{}
	for _, c := range claimed {
		tenants[c.TenantID]++
	}
	require.Equal(t, map[string]int{"c": 2, "a": 2, "b": 2}, tenants, "after b: c, then round to a and b")

	for _, c := range claimed {
		_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
			State: store.StateUnknown, Observation: store.Observation{Outcome: "TIMEOUT"}, Actor: "w"})
		require.NoError(t, err)
	}
	f := p.FairClaim
	f.AfterTenant = "c"
	unknown, err := b.all.ClaimUnknown(b.ctx, f)
	require.NoError(t, err)
	require.Len(t, unknown, 6, "the reconciler's claim goes round too")
}

func TestRecordOutcomeOnlyUnderTheFence(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.prepareN(t, "acme", 2)
	claimed, err := b.all.Claim(b.ctx, claimParams(2))
	require.NoError(t, err)
	first, second := claimed[0], claimed[1]

	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}
	op, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: first.ID, Fence: 1,
		State: store.StateSucceeded, RemoteRef: "ch_1", Observation: obs, Actor: "dispatcher:test"})
	require.NoError(t, err)
	got, err := b.all.Get(b.ctx, "acme", first.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, got.State)
	require.Equal(t, "ch_1", got.RemoteRef)
	require.Equal(t, "VERIFIED_SUCCESS", got.LastObservation.Outcome)
	require.NotNil(t, got.FirstSentAt)
	require.Equal(t, store.RecordedOutcomeOf(got), op, "answered with the operation as the outcome left it")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events WHERE operation_id = $1 AND from_state = 'IN_FLIGHT'
		AND fence_token = 1 AND sent AND remote_ref = 'ch_1' AND (observation->>'http_status')::int = 200`, first.ID))

	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: second.ID, Fence: 1,
		State: store.StateSucceeded, Observation: obs, Actor: "dispatcher:test"})
	require.Error(t, err, "SUCCEEDED needs a remote reference")

	// The sweeper takes the second away; the late holder's outcome is evidence only.
	n, err := b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 10})
	require.NoError(t, err)
	require.Equal(t, 1, n.Total())
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: second.ID, Fence: 1,
		State: store.StateSucceeded, RemoteRef: "ch_2", Observation: obs, Actor: "dispatcher:test"})
	require.ErrorIs(t, err, store.ErrFenceLost)
	swept, err := b.all.Get(b.ctx, "acme", second.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateUnknown, swept.State)
	require.Equal(t, "LEASE_EXPIRED", swept.LastObservation.Outcome)
	require.Empty(t, swept.RemoteRef)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1 AND fence_token = 1
		AND remote_ref = 'ch_2' AND outcome = 'VERIFIED_SUCCESS' AND sent AND actor = 'dispatcher:test'`, second.ID),
		"the stale worker's observation is kept as evidence")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM operation_events WHERE operation_id = $1`, second.ID),
		"and changed nothing: created, claimed, swept")
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: second.ID, Fence: 1,
		State: store.StateUnknown, Observation: store.Observation{Outcome: "TIMEOUT"}, Actor: "dispatcher:test"})
	require.ErrorIs(t, err, store.ErrFenceLost)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1 AND fence_token = 1`, second.ID),
		"one stale outcome per fence")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1 AND outcome = 'VERIFIED_SUCCESS'`, second.ID),
		"the first stale outcome of a fence is the one kept")
	_, err = b.pool.Exec(b.ctx, `UPDATE stale_outcomes SET outcome = 'rewritten' WHERE operation_id = $1`, second.ID)
	require.ErrorContains(t, err, "append-only", "a stale outcome is never rewritten")

	// An outcome recorded again by its holder, after it was applied (an earlier try
	// whose answer was lost), is answered as that try was, and adds nothing.
	again, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: first.ID, Fence: 1,
		State: store.StateSucceeded, RemoteRef: "ch_1", Observation: obs, Actor: "dispatcher:test"})
	require.NoError(t, err)
	require.Equal(t, op, again, "answered with the operation as the earlier try left it")
	// Another outcome under that fence is not that try's.
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: first.ID, Fence: 1,
		State: store.StateUnknown, Observation: store.Observation{Outcome: "TIMEOUT"}, Actor: "dispatcher:test"})
	require.ErrorIs(t, err, store.ErrFenceLost)
	require.Zero(t, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1`, first.ID),
		"an applied outcome repeated is not a stale one, nor another after it")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM operation_events WHERE operation_id = $1`, first.ID),
		"nor an event: created, claimed, succeeded")
	// Nor does an outcome under a fence that was never claimed.
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: first.ID, Fence: 7,
		State: store.StateUnknown, Observation: store.Observation{Outcome: "TIMEOUT"}, Actor: "dispatcher:test"})
	require.ErrorIs(t, err, store.ErrFenceLost)
	require.Zero(t, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1`, first.ID))

	extended, err := b.all.ExtendLeases(b.ctx, []store.HeldLease{{OperationKey: store.OperationKey{TenantID: "acme", ID: second.ID}, Fence: 1}}, time.Minute)
	require.NoError(t, err)
	require.Empty(t, extended.Left, "a swept claim's lease is not extended")
	require.Empty(t, extended.Busy)
}

// sentThenSwept prepares n operations of acme and claims them, as sent, then sweeps
// their leases and claims them as a reconciler: the sends' claims, and the reconciler's
// (in its order).
func sentThenSwept(t *testing.T, b *testBundle, n int) ([]store.Claimed, []store.UnknownClaim) {
	t.Helper()
	b.prepareN(t, "acme", n)
	claimed, err := b.all.Claim(b.ctx, claimParams(n))
	require.NoError(t, err)
	require.Len(t, claimed, n)
	swept, err := b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: n})
	require.NoError(t, err)
	require.Equal(t, n, swept.Total())
	unknown, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, unknown, n)
	return claimed, unknown
}

// TestAStaleSuccessThatContradictsTheLedgerIsSaidSo: a worker's verified success that
// reaches the ledger after its lease expired, once the operation ended FAILED_TERMINAL,
// or SUCCEEDED with another reference, is kept and answered with a *ContradictionError
// (still ErrFenceLost): the target made an effect the ledger does not record. One that
// agrees, or finds the operation still open, is answered ErrFenceLost alone.
func TestAStaleSuccessThatContradictsTheLedgerIsSaidSo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	claimed, unknown := sentThenSwept(t, b, 5)
	resolve := func(c store.UnknownClaim, state store.State, ref string) {
		t.Helper()
		_, err := b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: c.ID, Fence: c.FenceToken, State: state,
			RemoteRef: ref, Observation: store.Observation{Source: "LOOKUP", Outcome: "LOOKUP"}, Actor: "rec"})
		require.NoError(t, err)
	}
	resolve(unknown[0], store.StateFailedTerminal, "")
	resolve(unknown[1], store.StateSucceeded, "ch_other")
	resolve(unknown[2], store.StateSucceeded, "ch_late")
	// unknown[3] and [4] stay UNKNOWN, held by the reconciler.

	sentUnder := map[uuid.UUID]int64{}
	for _, c := range claimed {
		sentUnder[c.ID] = c.FenceToken
	}
	late := func(c store.UnknownClaim) error {
		_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: c.ID, Fence: sentUnder[c.ID],
			State: store.StateSucceeded, RemoteRef: "ch_late", Actor: "dispatcher:test",
			Observation: store.Observation{Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}})
		return err
	}
	for i, want := range []*store.ContradictionError{
		{State: store.StateFailedTerminal},
		{State: store.StateSucceeded, RemoteRef: "ch_other"},
		nil, nil,
	} {
		err := late(unknown[i])
		require.ErrorIs(t, err, store.ErrFenceLost, "operation %d", i)
		var got *store.ContradictionError
		if want == nil {
			require.False(t, errors.As(err, &got), "operation %d: %v", i, err)
		} else {
			require.ErrorAs(t, err, &got, "operation %d", i)
			require.Equal(t, want, got, "operation %d", i)
		}
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1
			AND outcome = 'VERIFIED_SUCCESS' AND remote_ref = 'ch_late'`, unknown[i].ID), "kept, operation %d", i)
	}
	// The same answer tried again (its first try's answer lost) is said again: nothing
	// else tells whether the first reached the caller.
	require.ErrorAs(t, late(unknown[0]), new(*store.ContradictionError))
	final, err := b.all.Get(b.ctx, "acme", unknown[0].ID)
	require.NoError(t, err)
	require.Equal(t, store.StateFailedTerminal, final.State, "a terminal state never changes")
	// Reading an operation (as the API does) tells of the contradiction.
	require.NotNil(t, final.Contradiction)
	require.Equal(t, "ch_late", final.Contradiction.RemoteRef)
	require.WithinDuration(t, time.Now(), final.Contradiction.RecordedAt, time.Minute)
	listed, _, err := b.store.Tenant("acme").List(b.ctx, store.ListParams{TenantID: "acme", Limit: 10})
	require.NoError(t, err)
	require.Len(t, listed, 5)
	for _, op := range listed {
		switch op.ID {
		case unknown[0].ID, unknown[1].ID:
			require.NotNil(t, op.Contradiction, "%s", op.ID)
			require.Equal(t, "ch_late", op.Contradiction.RemoteRef)
		default: // agrees, or still open
			require.Nil(t, op.Contradiction, "%s", op.ID)
		}
	}

	// A failure that commits while the success is being kept (it holds the row, which
	// keeping the success waits for) is seen: the statement that tells reads the
	// operation after the success is kept, not as it was when keeping began.
	failing, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = failing.Rollback(context.Background()) }) // on a failure
	_, err = failing.Exec(b.ctx, `SELECT FROM operations WHERE operation_id = $1 FOR UPDATE`, unknown[4].ID)
	require.NoError(t, err)
	_, err = failing.Exec(b.ctx, `UPDATE operations SET state = 'FAILED_TERMINAL', revision = revision + 1,
		fence_token = fence_token + 1, lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL
		WHERE operation_id = $1`, unknown[4].ID)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- late(unknown[4]) }()
	b.waitedOn(t, failing)
	require.NoError(t, failing.Commit(b.ctx))
	require.ErrorAs(t, <-done, new(*store.ContradictionError))

	contradicted, err := b.all.Contradicted(b.ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, []store.ContradictedGroup{
		{State: store.StateFailedTerminal, OperationType: "demo.charge", Count: 2},
		{State: store.StateSucceeded, OperationType: "demo.charge", Count: 1},
	}, contradicted, "the ledger's count of them, read for a gauge")
}

// TestTheLatestContradictionIsTheOneSaid: with two late successes of different sends,
// the operation's Contradiction and StaleSuccess (which an operator's refused failure
// names) give the same one, the latest fence's.
func TestTheLatestContradictionIsTheOneSaid(t *testing.T) {
	t.Parallel()
	b := setup(t)
	claimed, unknown := sentThenSwept(t, b, 1)
	replay, err := b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: unknown[0].ID,
		Fence: unknown[0].FenceToken, Worker: "rec", Lease: time.Minute})
	require.NoError(t, err)
	swept, err := b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 1})
	require.NoError(t, err)
	require.Equal(t, 1, swept.Total())
	again, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, again, 1)
	_, err = b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: again[0].ID, Fence: again[0].FenceToken,
		State: store.StateFailedTerminal, Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, Actor: "rec"})
	require.NoError(t, err)
	for fence, ref := range map[int64]string{claimed[0].FenceToken: "ch_first", replay.FenceToken: "ch_second"} {
		_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: replay.ID, Fence: fence,
			State: store.StateSucceeded, RemoteRef: ref, Actor: "dispatcher:test",
			Observation: store.Observation{Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}})
		require.ErrorAs(t, err, new(*store.ContradictionError), ref)
	}
	got, err := b.all.Get(b.ctx, "acme", replay.ID)
	require.NoError(t, err)
	require.Equal(t, "ch_second", got.Contradiction.RemoteRef)
	ref, ok, err := b.all.StaleSuccess(b.ctx, "acme", replay.ID)
	require.NoError(t, err)
	require.Equal(t, [2]any{"ch_second", true}, [2]any{ref, ok})
}

// TestAnEndRecordedAfterAStaleSuccessIsCounted: a verified success kept while the
// operation is still open (here during a same-key replay, and while it is UNKNOWN)
// contradicts the end the ledger records for it later: the replay's own rejection, its
// success with another reference (a second effect). Nothing answers the stale success
// with a ContradictionError then; the ledger's count (Contradicted) finds each. An
// operator's failure is refused (TargetConfirmedError), proposed or not.
func TestAnEndRecordedAfterAStaleSuccessIsCounted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	claimed, unknown := sentThenSwept(t, b, 4)
	success := store.Observation{Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}
	replays := make([]store.Claimed, 3)
	var err error
	for i := range replays {
		replays[i], err = b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: unknown[i].ID,
			Fence: unknown[i].FenceToken, Worker: "rec", Lease: time.Minute})
		require.NoError(t, err)
	}
	for _, c := range claimed { // every first send's late success, kept while the operation is open
		_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
			State: store.StateSucceeded, RemoteRef: "ch_late", Observation: success, Actor: "dispatcher:test"})
		require.ErrorIs(t, err, store.ErrFenceLost)
		require.False(t, errors.As(err, new(*store.ContradictionError)), "still open when it was kept")
	}
	replayed := func(i int, state store.State, ref string, obs store.Observation) {
		t.Helper()
		_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: replays[i].ID, Fence: replays[i].FenceToken,
			State: state, RemoteRef: ref, Observation: obs, Actor: "dispatcher:test"})
		require.NoError(t, err)
	}
	replayed(0, store.StateFailedTerminal, "", store.Observation{Source: "DISPATCH", Outcome: "DOCUMENTED_REJECTION", HTTPStatus: 400})
	replayed(1, store.StateSucceeded, "ch_other", success)
	replayed(2, store.StateSucceeded, "ch_late", success) // the same effect: agrees
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET lease_expires_at = now() - interval '1 second'
		WHERE operation_id = $1`, unknown[3].ID) // the reconciler's lease over
	require.NoError(t, err)
	now, err := b.all.Get(b.ctx, "acme", unknown[3].ID)
	require.NoError(t, err)
	// An operator's failure is refused while the target's success is on record: the
	// effect exists, whatever a look at the target showed later.
	resolution := store.ManualResolution{TenantID: "acme", ID: now.ID, Revision: now.Revision,
		State: store.StateFailedTerminal, Reason: "not found at the target", Actor: "ops@example.com"}
	_, err = b.all.ResolveManually(b.ctx, resolution)
	var confirmed *store.TargetConfirmedError
	require.ErrorAs(t, err, &confirmed)
	require.Equal(t, "ch_late", confirmed.RemoteRef)
	_, err = b.all.ProposeResolution(b.ctx, resolution, time.Hour)
	require.ErrorAs(t, err, &confirmed, "nor proposed")
	resolution.State, resolution.RemoteRef = store.StateSucceeded, "ch_late"
	_, err = b.all.ResolveManually(b.ctx, resolution)
	require.NoError(t, err)

	contradicted, err := b.all.Contradicted(b.ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, []store.ContradictedGroup{
		{State: store.StateFailedTerminal, OperationType: "demo.charge", Count: 1},
		{State: store.StateSucceeded, OperationType: "demo.charge", Count: 1},
	}, contradicted)
	own, err := b.store.Tenant("acme").Contradicted(b.ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, contradicted, own, "the tenant's own scope sees its own")
	none, err := b.store.Tenant("globex").Contradicted(b.ctx)
	require.NoError(t, err)
	require.Empty(t, none, "another tenant's scope sees none of them")
}

// TestAnOutcomeTriedAgainAfterTheOperationMovedOn: an outcome tried again after its
// earlier try was applied (its answer lost), once the operation has moved on (here a
// reconciler claimed it), is answered ErrRecordedBefore, not ErrFenceLost (the log and
// the metrics said the outcome was lost), and changes nothing.
func TestAnOutcomeTriedAgainAfterTheOperationMovedOn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.claimN(t, "acme", 1)[0]
	p := store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateUnknown,
		Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "TIMEOUT"}, Actor: "dispatcher:test"}
	_, err := b.all.RecordOutcome(b.ctx, p)
	require.NoError(t, err)
	unknown, err := b.all.ClaimUnknown(b.ctx, store.FairClaim{OperationTypes: []string{"demo.charge"}, Worker: "test-reconciler",
		Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1})
	require.NoError(t, err)
	require.Len(t, unknown, 1)
	_, err = b.all.RecordOutcome(b.ctx, p)
	require.ErrorIs(t, err, store.ErrRecordedBefore)
	op, err := b.all.Get(b.ctx, c.TenantID, c.ID)
	require.NoError(t, err)
	require.Equal(t, unknown[0].Revision, op.Revision, "nothing changed")
	require.Zero(t, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1`, c.ID))
}

// TestAnOutcomeStatementThatDeadlocksIsWrittenAgain: an outcome statement chosen as a
// deadlock's victim changed nothing; it is written again, and its outcomes recorded,
// not failed (every operation in its batch went UNKNOWN at its lease's end). The
// deadlock is made for certain: a transaction holds an event row the outcome's event
// must wait for, after the outcome's update took the operation's row, and then asks
// for that row; it waits longer than the server before looking for a deadlock, so the
// outcome's session finds it and is the victim.
func TestAnOutcomeStatementThatDeadlocksIsWrittenAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// The event the outcome's will collide with, its revision the next.
	c, tx := b.claimAndHold(t, `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state,
			fence_token, actor, reason, sent)
		SELECT tenant_id, operation_id, revision + 1, 'IN_FLIGHT', 'UNKNOWN', fence_token, 'test', 'TIMEOUT', true
		FROM operations WHERE operation_id = $1 AND fence_token = $2`)
	_, err := tx.Exec(b.ctx, `SET LOCAL deadlock_timeout = '10s'`)
	require.NoError(t, err)
	err = b.recordWhile(t, tx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_1", Actor: "dispatcher:test",
		Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}}, func() {
		// The cycle (the outcome's update holds the row): the outcome is its victim.
		_, err := tx.Exec(b.ctx, `SELECT 1 FROM operations WHERE operation_id = $1 FOR UPDATE`, c.ID)
		require.NoError(t, err)
		require.NoError(t, tx.Rollback(b.ctx))
	})
	require.NoError(t, err, "the victim is written again")
	op, err := b.all.Get(b.ctx, c.TenantID, c.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, op.State)
}

// TestAnOutcomeAtFaultFailsAlone: outcomes written together, two of which the
// statement cannot write (a reference with a NUL, one too long for its index), are
// written again in halves: every other outcome is applied, and only the ones at fault
// fail, each with its own error, its operation still in flight. (Before, the combined
// statement failed for all of them, and each operation waited for its lease to end as
// UNKNOWN.)
func TestAnOutcomeAtFaultFailsAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	claimed := b.claimN(t, "acme", 7)
	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}
	ps := make([]store.OutcomeParams, len(claimed))
	for i, c := range claimed {
		ps[i] = store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateSucceeded,
			RemoteRef: fmt.Sprintf("ch_%d", i), Observation: obs, Actor: "dispatcher:test"}
	}
	const faulty, oversized, stale, sentAgain = 4, 6, 1, 5
	// The outcomes applied leave their operations in four states, so that each answer
	// is told from the others.
	classes := map[store.State]string{store.StateFailedTerminal: "HTTP_4XX", store.StateUnknown: "TIMEOUT",
		store.StatePrepared: "NOT_EXECUTED"}
	for i, state := range map[int]store.State{2: store.StateFailedTerminal, 3: store.StateUnknown, sentAgain: store.StatePrepared} {
		ps[i].State, ps[i].RemoteRef, ps[i].Observation.Outcome = state, "", classes[state]
	}
	ps[sentAgain].NotExecuted, ps[sentAgain].SendAgainAfter = true, time.Hour           // an answer documented as not executed
	ps[faulty].RemoteRef = "ch_\x00"                                                    // refused as data
	ps[oversized].RemoteRef = "ch_" + base64.StdEncoding.EncodeToString(uuidBytes(450)) // past the index entry's size
	ps[stale].Fence++
	code := map[int]string{faulty: "22021", oversized: "54000"}
	ops, errs := b.all.RecordOutcomesTogether(b.ctx, ps)
	for i := range ps {
		switch i {
		case faulty, oversized:
			var pgErr *pgconn.PgError
			require.ErrorAs(t, errs[i], &pgErr)
			require.Equal(t, code[i], pgErr.Code, "outcome %d failed for another reason: %v", i, errs[i])
			op, err := b.all.Get(b.ctx, "acme", claimed[i].ID)
			require.NoError(t, err)
			require.Equal(t, store.StateInFlight, op.State, "the outcome at fault wrote nothing")
		case stale:
			require.ErrorIs(t, errs[i], store.ErrFenceLost)
		default:
			require.NoError(t, errs[i], "outcome %d failed with the one at fault", i)
			op, err := b.all.Get(b.ctx, "acme", claimed[i].ID)
			require.NoError(t, err)
			require.Equal(t, ps[i].State, op.State)
			require.Equal(t, ps[i].RemoteRef, op.RemoteRef)
			require.Equal(t, store.RecordedOutcomeOf(op), ops[i], "outcome %d answered with another's operation", i)
		}
	}
}

// TestTwoOutcomesForOneFenceAreNotBothApplied: the dispatcher records one outcome per
// claim, but were two of different states recorded for one fence in a batch, the
// statement applies one of them, and only that one is answered as applied.
func TestTwoOutcomesForOneFenceAreNotBothApplied(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.claimN(t, "acme", 1)[0]
	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH"}
	success, unknown := obs, obs
	success.Outcome, unknown.Outcome = "VERIFIED_SUCCESS", "TIMEOUT"
	_, errs := b.all.RecordOutcomesTogether(b.ctx, []store.OutcomeParams{
		{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateSucceeded, RemoteRef: "ch_1", Observation: success, Actor: "w"},
		{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateUnknown, Observation: unknown, Actor: "w"}})
	op, err := b.all.Get(b.ctx, "acme", c.ID)
	require.NoError(t, err)
	for i, state := range []store.State{store.StateSucceeded, store.StateUnknown} {
		if state == op.State {
			require.NoError(t, errs[i], "the outcome applied")
		} else {
			require.ErrorIs(t, errs[i], store.ErrFenceLost, "the %s outcome was not applied: the operation is %s", state, op.State)
		}
	}
}

func TestExtendLeases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.prepareN(t, "acme", 2)
	b.prepareN(t, "beta", 1)
	claimed, err := b.all.Claim(b.ctx, claimParams(3))
	require.NoError(t, err)
	require.Len(t, claimed, 3)
	held := func(c store.Claimed, fence int64) store.HeldLease {
		return store.HeldLease{OperationKey: store.OperationKey{TenantID: c.TenantID, ID: c.ID}, Fence: fence}
	}
	got, err := b.all.ExtendLeases(b.ctx, []store.HeldLease{held(claimed[0], 1), held(claimed[1], 2), held(claimed[2], 1)}, time.Hour)
	require.NoError(t, err)
	require.Equal(t, map[store.OperationKey]time.Duration{
		{TenantID: claimed[0].TenantID, ID: claimed[0].ID}: time.Hour,
		{TenantID: claimed[2].TenantID, ID: claimed[2].ID}: time.Hour,
	}, got.Left, "measured by the database; the claim held with a fence it does not have is not extended")
	require.Empty(t, got.Busy, "nor is it busy: its fence is lost")
	n, err := b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(30 * time.Minute), Limit: 10})
	require.NoError(t, err)
	require.Equal(t, 1, n.Total(), "an extended lease is not swept; the other one is")
}

// claimAndHold claims a new operation and runs sql (given its id and fence) in a
// transaction it leaves open, rolled back at the end of the test unless committed.
func (b *testBundle) claimAndHold(t *testing.T, sql string) (store.Claimed, pgx.Tx) {
	t.Helper()
	b.prepareN(t, "acme", 1)
	claimed, err := b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	_, err = tx.Exec(b.ctx, sql, claimed[0].ID, claimed[0].FenceToken)
	require.NoError(t, err)
	return claimed[0], tx
}

// recordBehind records p while tx holds the operation's row, commits tx once the
// outcome waits for it, and returns the outcome's answer.
func (b *testBundle) recordBehind(t *testing.T, tx pgx.Tx, p store.OutcomeParams) error {
	t.Helper()
	return b.recordWhile(t, tx, p, func() { require.NoError(t, tx.Commit(b.ctx)) })
}

// recordWhile records p while tx holds what it needs, runs then once the outcome waits
// for tx, and returns the outcome's answer.
func (b *testBundle) recordWhile(t *testing.T, tx pgx.Tx, p store.OutcomeParams, then func()) error {
	t.Helper()
	recorded := make(chan error, 1)
	go func() {
		_, err := b.all.RecordOutcome(b.ctx, p)
		recorded <- err
	}()
	b.waitedOn(t, tx)
	then()
	return <-recorded
}

// An outcome that waits for the row while its lease is being extended records once the
// extension commits: the extension changed the row, not the fence.
func TestOutcomeAfterAConcurrentLeaseExtension(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c, extension := b.claimAndHold(t, `UPDATE operations SET lease_expires_at = now() + interval '1 minute'
		WHERE operation_id = $1 AND fence_token = $2`)
	err := b.recordBehind(t, extension, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_1", Actor: "dispatcher:test",
		Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}})
	require.NoError(t, err, "the fence held")
	op, err := b.all.Get(b.ctx, c.TenantID, c.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, op.State)
}

// TestOutcomeRepeatedWhileTheFirstCommits: an outcome recorded again by its holder
// (a retry after the connection failed, say) while the first is still being written
// waits for it, then finds it: the first outcome is the operation's, the repeat is
// answered as the first was, and it is not kept as a stale one beside it.
func TestOutcomeRepeatedWhileTheFirstCommits(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// The first outcome, as RecordOutcome writes it, not yet committed.
	c, first := b.claimAndHold(t, `WITH upd AS (
			UPDATE operations SET state = 'UNKNOWN', revision = revision + 1, lease_owner = NULL, lease_expires_at = NULL,
				next_check_at = now(), updated_at = now()
			WHERE operation_id = $1 AND fence_token = $2 RETURNING *)
		INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor, reason, sent)
		SELECT tenant_id, operation_id, revision, 'IN_FLIGHT', state, fence_token, 'dispatcher:test', 'TIMEOUT', true FROM upd`)
	err := b.recordBehind(t, first, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
		State: store.StateUnknown, Actor: "dispatcher:test",
		Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "TIMEOUT"}})
	require.NoError(t, err, "the repeat is answered as the first")
	require.Zero(t, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE operation_id = $1`, c.ID),
		"the holder's outcome, applied, is not also a stale one")
}

// TestStaleOutcomeNotKeptIsAnError: a stale worker whose outcome could not be kept as
// evidence is told so, not that it was kept.
func TestStaleOutcomeNotKeptIsAnError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.prepareN(t, "acme", 1)
	claimed, err := b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	_, err = b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 10})
	require.NoError(t, err)
	_, err = b.pool.Exec(b.ctx, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
			$$ BEGIN RAISE EXCEPTION 'refused for the test'; END $$;
		CREATE TRIGGER refuse BEFORE INSERT ON stale_outcomes FOR EACH ROW EXECUTE FUNCTION refuse()`)
	require.NoError(t, err)
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: claimed[0].ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Actor: "dispatcher:test", Observation: store.Observation{Outcome: "TIMEOUT"}})
	require.ErrorContains(t, err, "refused for the test")
	require.NotErrorIs(t, err, store.ErrFenceLost)
}

func TestExpireDeadlines(t *testing.T) {
	t.Parallel()
	b := setup(t)
	soon := time.Now().Add(time.Minute)
	p := prepareParams("acme", "late", `{}`)
	p.DispatchDeadline = &soon
	late, _, err := b.all.Prepare(b.ctx, p)
	require.NoError(t, err)
	b.prepareN(t, "acme", 1)

	n, err := b.all.ExpireDeadlines(b.ctx, store.SweepParams{Now: time.Now().Add(2 * time.Minute), Limit: 10})
	require.NoError(t, err)
	require.Equal(t, store.Swept{"demo.charge": 1}, n)
	op, err := b.all.Get(b.ctx, "acme", late.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateFailedTerminal, op.State)
	require.Equal(t, "DISPATCH_DEADLINE_PASSED", op.LastObservation.Outcome)
	require.Zero(t, op.FenceToken, "it was never sent")
}

func TestCancelRacesClaim(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.prepareN(t, "acme", 40)
	var wg sync.WaitGroup
	cancelled := make(chan uuid.UUID, len(ids))
	wg.Go(func() {
		for _, id := range ids {
			if _, err := b.all.Cancel(b.ctx, store.CancelParams{TenantID: "acme", ID: id, Actor: "test"}); err == nil {
				cancelled <- id
			}
		}
	})
	claimedIDs := map[uuid.UUID]bool{}
	wg.Go(func() {
		for range 40 {
			claimed, err := b.all.Claim(b.ctx, claimParams(1))
			assert.NoError(t, err) // not require: this is not the test's goroutine
			for _, c := range claimed {
				claimedIDs[c.ID] = true
			}
		}
	})
	wg.Wait()
	close(cancelled)
	for id := range cancelled {
		require.False(t, claimedIDs[id], "an operation was both cancelled and claimed")
	}
}

// TestConcurrentOutcomesEachGetTheirOwnAnswer: outcomes recorded at once are written
// together, yet each caller gets its own answer: its operation moved, or ErrFenceLost
// for a stale fence; and each attempt says whether it was applied.
func TestConcurrentOutcomesEachGetTheirOwnAnswer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.prepareN(t, "acme", 40)
	b.prepareN(t, "globex", 40)
	claimed, err := b.all.Claim(b.ctx, claimParams(100))
	require.NoError(t, err)
	require.Len(t, claimed, 80)

	var wg sync.WaitGroup
	errs := make([]error, len(claimed))
	stale := make([]error, len(claimed))
	for i, c := range claimed {
		state := []store.State{store.StateSucceeded, store.StateUnknown, store.StateFailedTerminal}[i%3]
		wg.Go(func() {
			_, errs[i] = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
				State: state, RemoteRef: fmt.Sprint("ch_", i), Observation: store.Observation{Outcome: "X"}, Actor: "w"})
		})
		if i%4 == 0 { // a stale worker of the same operation at the same time
			wg.Go(func() {
				_, stale[i] = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken - 1,
					State: store.StateSucceeded, RemoteRef: "ch_stale", Observation: store.Observation{Outcome: "X"}, Actor: "stale"})
			})
		}
	}
	wg.Wait()
	for i, c := range claimed {
		require.NoError(t, errs[i])
		if i%4 == 0 {
			require.ErrorIs(t, stale[i], store.ErrFenceLost)
		}
		got, err := b.all.Get(b.ctx, c.TenantID, c.ID)
		require.NoError(t, err)
		require.Equal(t, []store.State{store.StateSucceeded, store.StateUnknown, store.StateFailedTerminal}[i%3], got.State)
		require.NotEqual(t, "ch_stale", got.RemoteRef)
	}
	require.Equal(t, 80, b.count(t, `SELECT count(*) FROM operation_events WHERE from_state = 'IN_FLIGHT' AND sent`))
	require.Zero(t, b.count(t, `SELECT count(*) FROM stale_outcomes`), "a fence never claimed leaves no stale outcome")
}

// TestClaimMeasuresTheDeadlineByTheDatabase: a claim says what is left before the
// dispatch deadline by the database's clock.
func TestClaimMeasuresTheDeadlineByTheDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t)
	p := prepareParams("acme", "with-deadline", `{"amount":1}`)
	deadline := time.Now().Add(time.Hour)
	p.DispatchDeadline = &deadline
	_, _, err := b.all.Prepare(b.ctx, p)
	require.NoError(t, err)
	claimed, err := b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	var wantMicros int64
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT floor(extract(epoch FROM dispatch_deadline - (lease_expires_at - interval '1 minute')) * 1e6)::bigint
		FROM operations WHERE operation_id = $1`, claimed[0].ID).Scan(&wantMicros))
	require.NotNil(t, claimed[0].DeadlineLeft)
	require.Equal(t, time.Duration(wantMicros)*time.Microsecond, *claimed[0].DeadlineLeft)
}

// TestNotExecutedGoesBackToPrepared: an answer the target documents as not executed
// puts the operation back to PREPARED, counted, not to be claimed before its time;
// the schema refuses PREPARED once any attempt may have executed.
func TestNotExecutedGoesBackToPrepared(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.prepareN(t, "acme", 1)[0]
	notExecuted := func(c store.Claimed, wait time.Duration) store.Operation {
		return b.recordOutcome(t, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
			State: store.StatePrepared, NotExecuted: true, SendAgainAfter: wait, Actor: "test",
			Observation: store.Observation{Outcome: "NOT_EXECUTED", HTTPStatus: 429}})
	}
	claimOne := func() []store.Claimed {
		claimed, err := b.all.Claim(b.ctx, claimParams(10))
		require.NoError(t, err)
		return claimed
	}

	first := claimOne()
	require.Len(t, first, 1)
	op := notExecuted(first[0], time.Hour)
	require.Equal(t, store.StatePrepared, op.State)
	require.EqualValues(t, 1, op.AttemptCount)
	require.EqualValues(t, 1, op.NotExecuted)
	require.NotNil(t, op.NextCheckAt, "the next send's time is visible")
	require.Empty(t, claimOne(), "not claimed before its time")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events WHERE operation_id = $1 AND from_state = 'IN_FLIGHT' AND NOT sent`, id),
		"an attempt documented as not executed counts as one that had no effect")

	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET next_check_at = now() WHERE operation_id = $1`, id)
	require.NoError(t, err)
	second := claimOne()
	require.Len(t, second, 1, "claimed again once its time has come")
	require.EqualValues(t, 2, second[0].AttemptCount)
	require.Nil(t, second[0].NextCheckAt)
	require.Greater(t, second[0].FenceToken, first[0].FenceToken)
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: id, Fence: second[0].FenceToken,
		State: store.StatePrepared, Actor: "test", Observation: store.Observation{Outcome: "TIMEOUT"}})
	require.ErrorContains(t, err, "only an answer documented as not executed sends again")

	// The schema refuses PREPARED unless every attempt was documented as not executed.
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'PREPARED', revision = revision + 1 WHERE operation_id = $1`, id)
	require.ErrorContains(t, err, "operations_unsent", "PREPARED means nothing sent took effect")
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: id, Fence: second[0].FenceToken,
		State: store.StateUnknown, Actor: "test", Observation: store.Observation{Outcome: "TIMEOUT"}})
	require.NoError(t, err)

	// Every attempt not executed: cancelling is still safe.
	other := b.prepareN(t, "globex", 1)[0]
	c := claimOne()
	require.Len(t, c, 1)
	notExecuted(c[0], 0)
	cancelled, err := b.all.Cancel(b.ctx, store.CancelParams{TenantID: "globex", ID: other, Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, store.StateCancelled, cancelled.State)
}

// TestKeyWindowAndScopesAreThoseOfTheFirstSendThatCanExecute: the first claim records
// the key's window (by the database's clock), its scope and the lookup's. A claim
// after an answer documented as not executed records the scopes it is sent under,
// since its send is the first that can take effect, and the window only if it ends
// sooner (the target may have kept the key of the send it did not execute); once a
// send may have taken effect, nothing can change them.
func TestKeyWindowAndScopesAreThoseOfTheFirstSendThatCanExecute(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var ids []uuid.UUID
	claimedAs := func(id uuid.UUID, retention time.Duration, keyScope, lookupScope string) store.Claimed {
		t.Helper()
		p := claimParams(1)
		p.KeyRetention, p.KeyScope, p.LookupScope = retention, keyScope, lookupScope
		claimed, err := b.all.Claim(b.ctx, p)
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		require.Equal(t, id, claimed[0].ID)
		return claimed[0]
	}
	notExecuted := func(c store.Claimed) {
		t.Helper()
		_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
			State: store.StatePrepared, NotExecuted: true, Actor: "test", Observation: store.Observation{Outcome: "NOT_EXECUTED"}})
		require.NoError(t, err)
	}
	// Claimed under one contract, answered as not executed, then claimed under an
	// edited one (a rolling deploy, a rollback): a longer retention, then a shorter.
	for i, second := range []time.Duration{48 * time.Hour, time.Minute} {
		ids = append(ids, b.prepareN(t, []string{"acme", "globex"}[i], 1)[0])
		first := claimedAs(ids[i], time.Hour, "scope-1", "aa01")
		require.NotNil(t, first.KeyWindowLeft)
		require.InDelta(t, time.Hour, *first.KeyWindowLeft, float64(time.Minute))
		require.Equal(t, "scope-1", first.KeyScope)
		require.Equal(t, "aa01", first.LookupScope)
		notExecuted(first)
		again := claimedAs(ids[i], second, "scope-2", "aa02")
		require.InDelta(t, min(time.Hour, second), *again.KeyWindowLeft, float64(30*time.Second), "the earlier end")
		require.Equal(t, "scope-2", again.KeyScope, "the scope of the send that can execute")
		require.Equal(t, "aa02", again.LookupScope, "and its lookup's")
	}

	for _, set := range []string{"key_scope = 'scope-3'", "key_scope = NULL", "lookup_scope = 'lookup-3'", "lookup_scope = NULL",
		"key_window_end = key_window_end + interval '1 day'", "key_window_end = key_window_end - interval '1 second'"} {
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET `+set+` WHERE operation_id = $1`, ids[0])
		require.ErrorContains(t, err, "immutable column changed", set)
	}
	// While PREPARED again, only the window's coming sooner and the scopes are allowed.
	prepared := b.prepareN(t, "initech", 1)[0]
	notExecuted(claimedAs(prepared, time.Hour, "scope-1", "aa01"))
	for set, allowed := range map[string]bool{
		"key_window_end = key_window_end + interval '1 second'": false, "key_window_end = NULL": false,
		"key_window_end = key_window_end - interval '1 second'": true, "key_scope = 'scope-3', lookup_scope = NULL": true,
	} {
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET `+set+` WHERE operation_id = $1`, prepared)
		if allowed {
			require.NoError(t, err, set)
		} else {
			require.ErrorContains(t, err, "immutable column changed", set)
		}
	}
}

// TestExtendLeasesSkipsLockedRows: a lease extension that meets a row another
// transaction holds (an outcome being written) neither waits for it nor fails: it
// extends the other claims and reports that one busy, not lost. (A statement that
// waited would wait for an outcome that may wait for it; one that failed left every
// claim it carried unextended, and a slow outcome cut them all at their leases' end.)
func TestExtendLeasesSkipsLockedRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	claimed := b.claimN(t, "acme", 3)
	held := make([]store.HeldLease, len(claimed))
	for i, c := range claimed {
		held[i] = store.HeldLease{OperationKey: store.OperationKey{TenantID: c.TenantID, ID: c.ID}, Fence: c.FenceToken}
	}
	held[2].Fence++ // lost: neither extended nor busy
	tx, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = tx.Exec(b.ctx, `SELECT 1 FROM operations WHERE operation_id = $1 FOR UPDATE`, claimed[0].ID)
	require.NoError(t, err)
	// A lock that shares the key, as a foreign key's check holds, does not stop it.
	shared, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = shared.Rollback(b.ctx) }()
	_, err = shared.Exec(b.ctx, `SELECT 1 FROM operations WHERE operation_id = $1 FOR KEY SHARE`, claimed[1].ID)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	got, err := b.all.ExtendLeases(ctx, held, time.Hour)
	require.NoError(t, err, "a locked row does not fail the statement")
	require.Equal(t, map[store.OperationKey]bool{held[0].OperationKey: true}, got.Busy)
	require.Equal(t, map[store.OperationKey]time.Duration{held[1].OperationKey: time.Hour}, got.Left)

	require.NoError(t, tx.Rollback(b.ctx))
	got, err = b.all.ExtendLeases(ctx, held, time.Hour)
	require.NoError(t, err)
	require.Empty(t, got.Busy)
	require.Equal(t, map[store.OperationKey]time.Duration{held[0].OperationKey: time.Hour, held[1].OperationKey: time.Hour}, got.Left,
		"released, the row is extended")
}

// A target of several types: each tenant's share is its oldest operations of any of
// them, as for one type, within the per-tenant and total limits.
func TestClaimOfSeveralTypesTakesTheOldestOfEach(t *testing.T) {
	t.Parallel()
	b := setup(t)
	oldest := map[string][]uuid.UUID{}
	for i := range 8 {
		for _, tenant := range []string{"acme", "beta", "gamma"} {
			p := prepareParams(tenant, fmt.Sprintf("%s-%d", tenant, i), fmt.Sprintf(`{"n":%d}`, i))
			p.OperationType = []string{"demo.charge", "demo.notify"}[i%2]
			op, _, err := b.all.Prepare(b.ctx, p)
			require.NoError(t, err)
			if len(oldest[tenant]) < 2 {
				oldest[tenant] = append(oldest[tenant], op.ID)
			}
		}
	}
	p := claimParams(5)
	p.PerTenant, p.OperationTypes = 2, []string{"demo.charge", "demo.notify"}
	claimed, err := b.all.Claim(b.ctx, p)
	require.NoError(t, err)
	require.Len(t, claimed, 5, "the total limit")
	per := map[string][]uuid.UUID{}
	for _, c := range claimed {
		per[c.TenantID] = append(per[c.TenantID], c.ID)
	}
	for tenant, ids := range per {
		require.LessOrEqual(t, len(ids), 2, tenant)
		require.Subset(t, oldest[tenant], ids, "%s: its oldest, of both types", tenant)
	}
}
