package reconciler_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/targettest"
)

type testBundle struct {
	ctx        context.Context
	log        *slog.Logger
	store      *store.Store
	pool       *pgxpool.Pool
	sim        *simtarget.Target
	targets    *target.Targets
	dispatcher *dispatcher.Dispatcher
}

// setup runs a ledger, a simulated target with its demo contracts, and a dispatcher.
func setup(t *testing.T, cfg simtarget.Config, adjust ...func(*target.Contract)) *testBundle {
	t.Helper()
	return setupLogged(t, slog.New(slog.DiscardHandler), cfg, adjust...)
}

// setupLogged is setup with the dispatcher and reconcilers logging to log.
func setupLogged(t *testing.T, log *slog.Logger, cfg simtarget.Config, adjust ...func(*target.Contract)) *testBundle {
	t.Helper()
	st, pool := storetest.NewStore(t)
	sim, targets := targettest.Demo(t, cfg, adjust...)
	d, err := dispatcher.New(dispatcher.Config{Store: st, Targets: targets, Connector: target.NewConnector(),
		Logger: log, MeterProvider: noop.NewMeterProvider(), PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(d.Stop)
	return &testBundle{ctx: context.Background(), log: log, store: st, pool: pool, sim: sim, targets: targets, dispatcher: d}
}

func (b *testBundle) reconciler(t *testing.T, worker string) *reconciler.Reconciler {
	t.Helper()
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: target.NewConnector(),
		Deliverer: b.dispatcher, Logger: b.log, MeterProvider: noop.NewMeterProvider(),
		Worker: worker, PollInterval: 20 * time.Millisecond, MaxLooks: 6, Lease: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	return r
}

func (b *testBundle) prepare(t *testing.T, typ, intent, body string, supersedes ...uuid.UUID) store.Operation {
	t.Helper()
	if len(supersedes) == 0 {
		return storetest.PrepareJSON(t, b.store, "acme", typ, intent, body)
	}
	op, err := b.amend(typ, intent, body, supersedes[0])
	require.NoError(t, err)
	return op
}

// amend prepares an amendment of the operation supersedes.
func (b *testBundle) amend(typ, intent, body string, supersedes uuid.UUID) (store.Operation, error) {
	digest, err := payload.Hash("application/json", []byte(body))
	if err != nil {
		return store.Operation{}, err
	}
	op, _, err := b.store.AllTenants().Prepare(b.ctx, store.PrepareParams{TenantID: "acme", OperationType: typ, IntentRef: intent,
		ContentType: "application/json", Payload: []byte(body), PayloadSHA256: digest[:], Actor: "test",
		SupersedesID: uuid.NullUUID{UUID: supersedes, Valid: true}})
	return op, err
}

// payments is the contract of the demo target's charges.
func (b *testBundle) payments(t *testing.T) *target.Contract {
	t.Helper()
	contract, ok := b.targets.ByName("demo-payments")
	require.True(t, ok)
	return contract
}

func (b *testBundle) get(t *testing.T, op store.Operation) store.Operation {
	t.Helper()
	got, err := b.store.AllTenants().Get(b.ctx, op.TenantID, op.ID)
	require.NoError(t, err)
	return got
}

func (b *testBundle) waitState(t *testing.T, op store.Operation, want store.State) store.Operation {
	t.Helper()
	require.Eventually(t, func() bool { return b.get(t, op).State == want }, 30*time.Second, 10*time.Millisecond,
		"operation never reached %s: %+v", want, b.get(t, op).LastObservation)
	return b.get(t, op)
}

// unknownThenReconciled starts the dispatcher, waits for op to become UNKNOWN, and
// starts a reconciler.
func (b *testBundle) unknownThenReconciled(t *testing.T, op store.Operation) {
	t.Helper()
	require.NoError(t, b.dispatcher.Start(b.ctx))
	b.waitState(t, op, store.StateUnknown)
	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
}

func (b *testBundle) truth(t *testing.T, op store.Operation) *simtarget.KeyTruth {
	t.Helper()
	kt := b.sim.Snapshot().Keys[storetest.RemoteKey(t, b.pool, op.ID)]
	if kt == nil {
		return &simtarget.KeyTruth{}
	}
	return kt
}

func fault(f simtarget.Fault) string { return `{"amount":100,"sim":{"fault":"` + string(f) + `"}}` }

// TestCommittedThenDroppedResolvesByLookup (fault-injection test 1, docs/testing.md):
// the server commits and the response is dropped: UNKNOWN, then SUCCEEDED after
// reconciliation, exactly one remote object, no second send.
func TestCommittedThenDroppedResolvesByLookup(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	op := b.prepare(t, simtarget.DemoCharge, "order-1", fault(simtarget.FaultCommitThenReset))
	b.unknownThenReconciled(t, op)
	got := b.waitState(t, op, store.StateSucceeded)
	kt := b.truth(t, op)
	require.Equal(t, 1, kt.Effects)
	require.Equal(t, 1, kt.Attempts, "resolved by asking, not by re-sending")
	require.Equal(t, kt.IDs[0], got.RemoteRef)
	require.Equal(t, "FOUND", got.LastObservation.Outcome)
}

// TestNotFoundWhileSlowStaysUnknown (fault-injection test 5, docs/testing.md): a lookup
// that finds nothing while the target lags never makes the operation FAILED_TERMINAL.
func TestNotFoundWhileSlowStaysUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{LookupLag: time.Hour}, func(c *target.Contract) {
		if c.Idempotency != nil {
			c.Idempotency.Retention = target.Duration(time.Millisecond) // no replay: only asking is left
		}
	})
	op := b.prepare(t, simtarget.DemoCharge, "order-slow", fault(simtarget.FaultCommitThenReset))
	require.NoError(t, b.dispatcher.Start(b.ctx))
	b.waitState(t, op, store.StateUnknown)
	r := b.reconciler(t, "r1")
	require.NoError(t, r.Start(b.ctx))
	require.Eventually(t, func() bool { return b.get(t, op).Checks >= 2 }, 30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Equal(t, store.StateUnknown, got.State, "absence is not final")
	require.Equal(t, "NOT_FOUND", got.LastObservation.Outcome)
	require.Equal(t, 1, b.truth(t, op).Effects)
	require.Equal(t, 1, b.truth(t, op).Attempts)
}

// TestNeverSentAgainAfterThePreconditionFailed: a conditional replay the target refuses
// with 412 (an earlier send made the effect) is the last send, though the lookup still
// does not find the effect (it lags here; the object may also have been removed since):
// the operation is escalated, and nothing can create the object a second time.
func TestNeverSentAgainAfterThePreconditionFailed(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{LookupLag: time.Hour}, func(c *target.Contract) {
		if c.Lookup != nil {
			c.Lookup.VisibilityDelay = target.Duration(100 * time.Millisecond)
		}
	})
	op := b.prepare(t, simtarget.DemoObject, "object-412", fault(simtarget.FaultCommitThenReset))
	b.unknownThenReconciled(t, op)
	got := b.waitState(t, op, store.StateEscalated)
	require.Contains(t, got.Escalation.Reason, "never sent again")
	kt := b.truth(t, op)
	require.Equal(t, 1, kt.Effects)
	require.Equal(t, 2, kt.Attempts, "the first send, and one conditional replay that the target refused")
	require.Equal(t, int32(1), got.Replays)
}

// TestTenantsPastTheWalkAreReconciled: a claim of UNKNOWN operations walks over at
// most MaxTenants tenants; while the first of them hold only looks backed off for
// later, a tenant after them is still reached.
func TestTenantsPastTheWalkAreReconciled(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	var ops []store.Operation
	for _, tenant := range []string{"a1", "a2", "a3", "a4", "zz"} {
		ops = append(ops, storetest.PrepareJSON(t, b.store, tenant, simtarget.DemoCharge, "order", fault(simtarget.FaultCommitThenReset)))
	}
	require.NoError(t, b.dispatcher.Start(b.ctx))
	for _, op := range ops {
		b.waitState(t, op, store.StateUnknown)
	}
	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET next_check_at = now() + interval '1 hour' WHERE tenant_id <> 'zz'`)
	require.NoError(t, err)
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: target.NewConnector(),
		Deliverer: b.dispatcher, Logger: b.log, MeterProvider: noop.NewMeterProvider(),
		Worker: "r1", PollInterval: 20 * time.Millisecond, Lease: 10 * time.Second, MaxTenants: 2})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	require.NoError(t, r.Start(b.ctx))
	b.waitState(t, ops[4], store.StateSucceeded)
}

// TestReplayInsideTheWindow: nothing arrived; a same-key replay inside the retention
// window completes the intent with one effect.
func TestReplayInsideTheWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	// The first send is recorded as one that never left (CONNECT_FAILED): no attempt can
	// have executed, so a replay is safe on the key alone.
	op := b.prepare(t, simtarget.DemoCharge, "order-2", `{"amount":100}`)
	claimed, err := b.store.AllTenants().Claim(b.ctx, dispatcher.ClaimParams(b.payments(t), store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "w", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}))
	require.NoError(t, err)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Observation: store.Observation{Source: "DISPATCH", Outcome: "CONNECT_FAILED"}, Actor: "test"})
	require.NoError(t, err, "a send that never left, recorded UNKNOWN")

	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	got := b.waitState(t, op, store.StateSucceeded)
	require.Equal(t, int32(1), got.Replays)
	require.Equal(t, int32(2), got.AttemptCount)
	kt := b.truth(t, op)
	require.Equal(t, 1, kt.Effects)
	require.Equal(t, 1, kt.Attempts, "the original never arrived; the replay did")
}

// TestNoReplayAfterTheWindow: outside the key's retention window a replay could make a
// second effect, so the reconciler looks and finally escalates instead.
func TestNoReplayAfterTheWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{}, func(c *target.Contract) {
		if c.Idempotency != nil {
			c.Idempotency.Retention = target.Duration(time.Millisecond)
		}
	})
	op := b.prepare(t, simtarget.DemoCharge, "order-3", fault(simtarget.FaultResetBeforeCommit))
	b.unknownThenReconciled(t, op)
	require.Eventually(t, func() bool { return b.get(t, op).Checks >= 2 }, 30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Contains(t, []store.State{store.StateUnknown, store.StateEscalated}, got.State)
	require.Zero(t, got.Replays)
	require.Equal(t, 1, b.truth(t, op).Attempts, "never replayed outside the window")
}

// TestProvidersThatCacheOrForgetErrors: a 5xx after commit is UNKNOWN; a lookup finds
// the effect, so nothing is replayed, whether the provider replays saved errors (Stripe
// v1) or re-executes after them (a replay would duplicate).
func TestProvidersThatCacheOrForgetErrors(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]simtarget.Config{"replays saved 5xx": {}, "saves only successes": {SaveOnlySuccesses: true}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, cfg)
			op := b.prepare(t, simtarget.DemoCharge, "order-5xx", fault(simtarget.Fault5xxAfterCommit))
			b.unknownThenReconciled(t, op)
			b.waitState(t, op, store.StateSucceeded)
			require.Equal(t, 1, b.truth(t, op).Effects, "exactly one effect")
			require.Equal(t, 1, b.truth(t, op).Attempts)
		})
	}
}

// TestNoReplayOfAnUncoveredAttemptAfterAFailedLookup: the provider saves only successes,
// the first attempt commits and answers 500 (so nothing is saved under its key), and the
// lookup fails. A same-key replay would execute again and make a second effect; the
// reconciler must look again instead, and resolve by the lookup once it answers.
func TestNoReplayOfAnUncoveredAttemptAfterAFailedLookup(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{SaveOnlySuccesses: true, LookupFailures: 1})
	op := b.prepare(t, simtarget.DemoCharge, "provision-1", fault(simtarget.Fault5xxAfterCommit))
	b.unknownThenReconciled(t, op)
	require.Eventually(t, func() bool { got := b.get(t, op); return got.Checks >= 2 || got.Replays > 0 },
		30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Zero(t, got.Replays, "no replay after a failed lookup: %s", got.LastObservation.Summary)
	require.Equal(t, "LOOKUP_FAILED", got.LastObservation.Outcome)
	require.Contains(t, got.LastObservation.Summary, "saves only successes")
	require.Equal(t, 1, b.truth(t, op).Attempts)
	require.Equal(t, 1, b.truth(t, op).Effects)

	b.sim.Heal() // the lookup answers again
	got = b.waitState(t, op, store.StateSucceeded)
	require.Equal(t, "FOUND", got.LastObservation.Outcome)
	require.Equal(t, b.truth(t, op).IDs, []string{got.RemoteRef}, "one effect, the first attempt's")
	require.Equal(t, 1, b.truth(t, op).Attempts)
}

// TestNoReplayAfterTheTargetAcceptedTheRequest: a request the target accepted without
// finishing (202, pending, a status not confirmed; a 409 for a key that saves only
// successes) may still execute, queued where a lookup cannot see it yet, so a lookup's
// "not found" after the visibility delay does not allow a replay: the operation is
// looked at again, marked accepted. A 409 for a key that saves every answer is only the
// key in use, and is replayed (the key returns that request's answer).
func TestNoReplayAfterTheTargetAcceptedTheRequest(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		class       string
		everyAnswer bool
		replayed    bool
	}{
		{target.ClassAccepted, false, false},
		{target.ClassPending, false, false},
		{target.ClassNotConfirmed, false, false},
		{target.ClassInProgress, false, false},
		{target.ClassAccepted, true, false},
		{target.ClassInProgress, true, true},
	} {
		t.Run(fmt.Sprintf("%s every_answer=%v", c.class, c.everyAnswer), func(t *testing.T) {
			t.Parallel()
			b := setup(t, simtarget.Config{SaveOnlySuccesses: !c.everyAnswer}, func(k *target.Contract) {
				if k.Lookup != nil {
					k.Lookup.VisibilityDelay = target.Duration(time.Millisecond)
				}
			})
			op := b.prepare(t, simtarget.DemoCharge, "accepted-1", `{"amount":100}`)
			b.answered(t, op, store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: c.class, HTTPStatus: 202})
			require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
			require.Eventually(t, func() bool { got := b.get(t, op); return got.Checks >= 1 || got.Replays > 0 },
				30*time.Second, 10*time.Millisecond)
			got := b.get(t, op)
			if c.replayed {
				require.Equal(t, int32(1), got.Replays)
				return
			}
			require.Zero(t, got.Replays, "replayed after %s: %s", c.class, got.LastObservation.Summary)
			require.Zero(t, b.truth(t, op).Attempts, "nothing was sent again")
			require.Equal(t, "NOT_FOUND", got.LastObservation.Outcome)
			require.True(t, got.AcceptedUnfinished, "marked, so that no replay ever follows")
		})
	}
}

// TestNoReplayAfterAnAcceptedAnswerThatCameLate: the sender's lease expired (the sweeper
// made the operation UNKNOWN), and then the target's 202 arrived: kept as a stale
// outcome, not as the operation's last observation. It still forbids a replay after a
// lookup that finds nothing.
func TestNoReplayAfterAnAcceptedAnswerThatCameLate(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{SaveOnlySuccesses: true}, func(k *target.Contract) {
		if k.Lookup != nil {
			k.Lookup.VisibilityDelay = target.Duration(time.Millisecond)
		}
	})
	op := b.prepare(t, simtarget.DemoCharge, "late-202", `{"amount":100}`)
	contract, _ := b.targets.ForType(op.OperationType)
	claimed, err := b.store.AllTenants().Claim(b.ctx, dispatcher.ClaimParams(contract, store.FairClaim{OperationTypes: []string{op.OperationType}, Worker: "w", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	swept, err := b.store.AllTenants().SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 10})
	require.NoError(t, err)
	require.NotEmpty(t, swept)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: op.TenantID, ID: op.ID,
		Fence: claimed[0].FenceToken, State: store.StateUnknown, Actor: "test",
		Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: target.ClassAccepted, HTTPStatus: 202}})
	require.ErrorIs(t, err, store.ErrFenceLost, "the answer came after the lease: kept as a stale outcome")
	require.Equal(t, store.OutcomeLeaseExpired, b.get(t, op).LastObservation.Outcome)

	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	require.Eventually(t, func() bool { got := b.get(t, op); return got.Checks >= 1 || got.Replays > 0 },
		30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Zero(t, got.Replays, "replayed after a late 202: %s", got.LastObservation.Summary)
	require.Zero(t, b.truth(t, op).Attempts)
	require.True(t, got.AcceptedUnfinished)
}

// notFinding is a target whose lookups never find anything.
type notFinding struct{}

func (notFinding) Lookup(context.Context, *target.Contract, uuid.UUID, []byte) target.LookupResult {
	return target.LookupResult{Outcome: target.LookupNotFound, HTTPStatus: 404}
}

// TestAVerifiedSuccessIsNeverFailedByALookup: the target answered the operation's send
// with a verified success after the sender's lease had expired. A lookup that then
// finds nothing, past the time the contract says a request can take effect and with no
// replay possible, would otherwise make the operation FAILED_TERMINAL: a client would
// then make the effect again. It is escalated, saying why.
func TestAVerifiedSuccessIsNeverFailedByALookup(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{}, func(k *target.Contract) {
		if k.Lookup != nil {
			k.Lookup.VisibilityDelay = target.Duration(time.Millisecond)
			k.Lookup.AbsenceFinalAfter = target.Duration(time.Millisecond)
		}
	})
	op := b.prepare(t, simtarget.DemoCharge, "late-200", `{"amount":100}`)
	contract, _ := b.targets.ForType(op.OperationType)
	// A key window that closes at once: no same-key replay is possible.
	params := dispatcher.ClaimParams(contract, store.FairClaim{OperationTypes: []string{op.OperationType}, Worker: "w", Lease: time.Minute,
		Limit: 1, PerTenant: 1, MaxTenants: 1})
	params.KeyRetention = time.Millisecond
	claimed, err := b.store.AllTenants().Claim(b.ctx, params)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	_, err = b.store.AllTenants().SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 10})
	require.NoError(t, err)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: op.TenantID, ID: op.ID,
		Fence: claimed[0].FenceToken, State: store.StateSucceeded, RemoteRef: "ch_late", Actor: "test",
		Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: target.ClassVerifiedSuccess, HTTPStatus: 200}})
	require.ErrorIs(t, err, store.ErrFenceLost, "the answer came after the lease: kept as a stale outcome")

	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: notFinding{},
		Deliverer: b.dispatcher, Logger: b.log, MeterProvider: noop.NewMeterProvider(),
		Worker: "r1", PollInterval: 20 * time.Millisecond, MaxLooks: 6, Lease: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	require.NoError(t, r.Start(b.ctx))
	require.Eventually(t, func() bool { return b.get(t, op).State != store.StateUnknown }, 30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Equal(t, store.StateEscalated, got.State, "%s", got.LastObservation.Summary)
	require.Contains(t, got.Escalation.Reason, "verified success")
	require.Zero(t, got.Replays)
}

// hangingLooker is a target whose lookups never answer: each ends only when its context
// does.
type hangingLooker struct{ calls atomic.Int32 }

func (h *hangingLooker) Lookup(ctx context.Context, _ *target.Contract, _ uuid.UUID, _ []byte) target.LookupResult {
	h.calls.Add(1)
	<-ctx.Done()
	return target.LookupResult{Summary: "no answer"}
}

// TestALookupThatHangsIsRecordedAndEscalated: a lookup that takes the whole claim (a
// target that never answers, with a timeout as long as the reconciler's lease) is cut
// early enough for the decision to be recorded: the look counts, and past the
// resolution deadline the operation is escalated, instead of being looked up again at
// every claim with nothing recorded.
func TestALookupThatHangsIsRecordedAndEscalated(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{SaveOnlySuccesses: true}) // no replay after a failed lookup
	op := b.prepare(t, simtarget.DemoCharge, "hang-1", `{"amount":100}`)
	b.answered(t, op, store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: target.ClassTimeout})
	looker := &hangingLooker{}
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: looker,
		Deliverer: b.dispatcher, Logger: b.log, MeterProvider: noop.NewMeterProvider(),
		Worker: "r1", PollInterval: 20 * time.Millisecond, Lease: time.Second, ResolutionDeadline: time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	require.NoError(t, r.Start(b.ctx))
	got := b.waitState(t, op, store.StateEscalated)
	require.Positive(t, looker.calls.Load())
	require.Contains(t, got.Escalation.Reason, "the lookup failed")
}

// TestAReplayAfterALookupThatHungTakesTheFreedSlot: a lookup that hung until the end of
// the reconciler's wait frees its slot; a replay decided then (a key that saves every
// answer) takes it, though the wait is over, rather than being put off as if no slot
// were free (with both ready, a wait could end either way: four operations make a
// chance pass unlikely).
func TestAReplayAfterALookupThatHungTakesTheFreedSlot(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	var ops []store.Operation
	for i := range 4 {
		op := b.prepare(t, simtarget.DemoCharge, fmt.Sprintf("hung-then-replay-%d", i), `{"amount":100}`)
		b.answered(t, op, store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: target.ClassTimeout})
		ops = append(ops, op)
	}
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: &hangingLooker{},
		Deliverer: b.dispatcher, Logger: b.log, MeterProvider: noop.NewMeterProvider(),
		Worker: "r1", PollInterval: 20 * time.Millisecond, Lease: time.Second})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	require.NoError(t, r.Start(b.ctx))
	for _, op := range ops {
		require.Eventually(t, func() bool { return b.get(t, op).Replays > 0 }, 30*time.Second, 10*time.Millisecond)
		require.Zero(t, b.get(t, op).Checks, "replayed at once, not put off: %s", b.get(t, op).LastObservation.Summary)
	}
}

// TestAReplayWithNoSlotIsRecordedAsALook: a replay decided while the target's every slot
// stays taken (its sends hang) is recorded as a look, with what held it up, to be
// decided again after a wait, instead of holding the claim until its lease ends with
// nothing recorded.
func TestAReplayWithNoSlotIsRecordedAsALook(t *testing.T) {
	t.Parallel()
	b, op := reconcileWithSlotsTaken(t, "no-slot-1", 0)
	require.Eventually(t, func() bool { return b.get(t, op).Checks >= 1 }, 30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Zero(t, got.Replays)
	require.Equal(t, store.StateUnknown, got.State)
	require.Contains(t, got.LastObservation.Summary, "a replay was decided, but no slot of the target's came free in time")
	require.Zero(t, b.truth(t, op).Attempts)
}

// TestAReplayThatNeverFindsASlotIsEscalated: while the target's slots stay taken, the
// reconciler decides the same replay at every claim and records each as a look; once
// the looks are spent it escalates instead of looking for good.
func TestAReplayThatNeverFindsASlotIsEscalated(t *testing.T) {
	t.Parallel()
	b, op := reconcileWithSlotsTaken(t, "no-slot-2", 1)
	require.Eventually(t, func() bool { return b.get(t, op).State != store.StateUnknown }, 15*time.Second, 10*time.Millisecond,
		"still UNKNOWN: %+v", b.get(t, op).LastObservation)
	got := b.get(t, op)
	require.Equal(t, store.StateEscalated, got.State)
	require.Contains(t, got.Escalation.Reason, "no slot of the target's came free in time, and the budget for looking is spent")
	require.Zero(t, got.Replays)
	require.Zero(t, b.truth(t, op).Attempts)
}

// reconcileWithSlotsTaken makes an UNKNOWN operation whose send timed out, at a target
// whose key saves every answer (a failed lookup allows a replay), takes every slot of
// the target's for the rest of the test, and starts a reconciler with a one-second
// lease and maxLooks (zero: the default).
func reconcileWithSlotsTaken(t *testing.T, intent string, maxLooks int) (*testBundle, store.Operation) {
	t.Helper()
	b := setup(t, simtarget.Config{})
	op := b.prepare(t, simtarget.DemoCharge, intent, `{"amount":100}`)
	b.answered(t, op, store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: target.ClassTimeout})
	contract, _ := b.targets.ForType(simtarget.DemoCharge)
	limiter := b.dispatcher.Limiter()
	for limiter.Free(contract.Name) > 0 {
		require.NoError(t, limiter.Acquire(b.ctx, contract.Name))
		t.Cleanup(func() { limiter.Release(contract.Name, 1) })
	}
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: target.NewConnector(),
		Deliverer: b.dispatcher, Logger: b.log, MeterProvider: noop.NewMeterProvider(),
		Worker: "r1", PollInterval: 20 * time.Millisecond, Lease: time.Second, MaxLooks: maxLooks})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	require.NoError(t, r.Start(b.ctx))
	return b, op
}

// answered records op as sent and answered with obs (UNKNOWN), without sending it.
func (b *testBundle) answered(t *testing.T, op store.Operation, obs store.Observation) {
	t.Helper()
	contract, ok := b.targets.ForType(op.OperationType)
	require.True(t, ok)
	claimed, err := b.store.AllTenants().Claim(b.ctx, dispatcher.ClaimParams(contract, store.FairClaim{OperationTypes: []string{op.OperationType}, Worker: "w", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: op.TenantID, ID: op.ID,
		Fence: claimed[0].FenceToken, State: store.StateUnknown, Observation: obs, Actor: "test"})
	require.NoError(t, err)
}

// TestAReplayWaitsForTheTargetsRetryAfter: an answer that left the operation UNKNOWN
// and asked for a wait (503 with Retry-After) holds the replay back that long after
// the send, through the looks in between (here a lookup that finds nothing yet).
func TestAReplayWaitsForTheTargetsRetryAfter(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	op := b.prepare(t, simtarget.DemoCharge, "order-retry-after", `{"amount":100}`)
	b.answered(t, op, store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "SERVER_ERROR", HTTPStatus: 503,
		RetryAfterSeconds: 3})
	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	got := b.waitState(t, op, store.StateSucceeded)
	require.Equal(t, int32(1), got.Replays)
	var replayedAfter time.Duration
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT r.created_at - u.created_at FROM operation_events u, operation_events r
		WHERE u.operation_id = $1 AND r.operation_id = $1 AND u.to_state = 'UNKNOWN' AND u.from_state = 'IN_FLIGHT'
		  AND r.reason = 'SAME_KEY_REPLAY'`, op.ID).Scan(&replayedAfter))
	require.GreaterOrEqual(t, replayedAfter, 3*time.Second, "the replay waited for the Retry-After")
	var looks int
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT count(*) FROM operation_events WHERE operation_id = $1
		AND from_state = 'UNKNOWN' AND to_state = 'UNKNOWN'`, op.ID).Scan(&looks))
	require.Positive(t, looks, "it looked in between")
}

// TestReplayAfterProvenAbsence: on a provider that saves only successes, an attempt
// that answered 503 without executing is replayed once a lookup made after the
// visibility delay proves its absence, never sooner; the intent completes with one
// effect.
func TestReplayAfterProvenAbsence(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{SaveOnlySuccesses: true, Fault: simtarget.Fault5xxBeforeCommit})
	op := b.prepare(t, simtarget.DemoCharge, "provision-2", `{"amount":100}`)
	require.NoError(t, b.dispatcher.Start(b.ctx))
	b.waitState(t, op, store.StateUnknown)
	b.sim.Heal() // the replay goes through

	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	got := b.waitState(t, op, store.StateSucceeded)
	require.Equal(t, int32(1), got.Replays)
	kt := b.truth(t, op)
	require.Equal(t, 2, kt.Attempts, "the original arrived and executed nothing; the replay executed")
	require.Equal(t, 1, kt.Effects)

	var replayedAfter time.Duration
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT r.created_at - u.created_at FROM operation_events u, operation_events r
		WHERE u.operation_id = $1 AND r.operation_id = $1 AND u.to_state = 'UNKNOWN' AND u.from_state = 'IN_FLIGHT'
		  AND r.reason = 'SAME_KEY_REPLAY'`, op.ID).Scan(&replayedAfter))
	require.GreaterOrEqual(t, replayedAfter, 300*time.Millisecond, "absence counts only after the visibility delay")
}

// TestUnkeyedTargetEscalatesToItsOwner: capability D is never retried.
func TestUnkeyedTargetEscalatesToItsOwner(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	op := b.prepare(t, simtarget.DemoNotify, "note-1", `{"to":"ops","sim":{"fault":"commit_then_reset"}}`)
	b.unknownThenReconciled(t, op)
	got := b.waitState(t, op, store.StateEscalated)
	require.Contains(t, got.Escalation.Owner, "demo-oncall")
	require.Contains(t, got.Escalation.Reason, "no way to find out")
	require.Equal(t, 1, b.truth(t, op).Attempts, "never re-sent")
}

// TestAFoundObjectWithoutAUsableReferenceIsEscalatedSayingSo: a lookup that finds the
// effect, but no usable reference of the target's in it (here the contract points at a
// field the target does not have), escalates it, and the reason says so; it used to say
// that the object did not match the approved payload.
func TestAFoundObjectWithoutAUsableReferenceIsEscalatedSayingSo(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{}, func(c *target.Contract) {
		if c.Lookup != nil {
			c.Lookup.Found.RemoteRef = "/no_such_field"
		}
	})
	op := b.prepare(t, simtarget.DemoCharge, "order-1", fault(simtarget.FaultCommitThenReset))
	b.unknownThenReconciled(t, op)
	got := b.waitState(t, op, store.StateEscalated)
	require.Contains(t, got.Escalation.Reason, "without a usable reference")
	require.NotContains(t, got.Escalation.Reason, "approved payload")
	require.Equal(t, 1, b.truth(t, op).Effects)
}

// TestAmendmentWhileOriginalUnknown: an amendment of an operation whose outcome is
// unknown is refused, since the original may have taken effect (here it has); once the
// reconciler has resolved the original, the amendment is recorded and sent. Before the
// rule, both were sent while the original was UNKNOWN: two credits for one change.
func TestAmendmentWhileOriginalUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	orig := b.prepare(t, simtarget.DemoCharge, "credit-1", fault(simtarget.FaultCommitThenReset))
	require.NoError(t, b.dispatcher.Start(b.ctx))
	b.waitState(t, orig, store.StateUnknown)
	_, err := b.amend(simtarget.DemoCharge, "credit-1-amended", `{"amount":40}`, orig.ID)
	var unresolved *store.SupersededUnresolvedError
	require.ErrorAs(t, err, &unresolved, "an amendment of an UNKNOWN operation is refused")
	require.Equal(t, store.StateUnknown, unresolved.Superseded.State)

	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	b.waitState(t, orig, store.StateSucceeded)
	require.Equal(t, 1, b.truth(t, orig).Effects)
	amend := b.prepare(t, simtarget.DemoCharge, "credit-1-amended", `{"amount":40}`, orig.ID)
	b.waitState(t, amend, store.StateSucceeded)
	require.Equal(t, 1, b.truth(t, amend).Effects, "the amendment, sent once its original was settled")
	require.Len(t, b.truth(t, orig).PayloadSHA256, 1, "the original's key only ever carried its own payload")
}

// TestTwoReconcilersRace: every operation is resolved once, with no double replay.
func TestTwoReconcilersRace(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	var ops []store.Operation
	for i := range 40 {
		ops = append(ops, b.prepare(t, simtarget.DemoCharge, fmt.Sprintf("race-%d", i), fmt.Sprintf(`{"amount":%d,"sim":{"fault":"commit_then_reset"}}`, i+1)))
	}
	require.NoError(t, b.dispatcher.Start(b.ctx))
	for _, op := range ops {
		b.waitState(t, op, store.StateUnknown)
	}
	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	require.NoError(t, b.reconciler(t, "r2").Start(b.ctx))
	for _, op := range ops {
		b.waitState(t, op, store.StateSucceeded)
		require.Equal(t, 1, b.truth(t, op).Attempts)
	}
	var resolutions int
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT count(*) FROM operation_events WHERE from_state = 'UNKNOWN' AND to_state = 'SUCCEEDED'`).Scan(&resolutions))
	require.Equal(t, len(ops), resolutions, "each resolved exactly once")
}

// TestAReplayWaitsForARefusedCredential: while the target refuses the broker's
// credential the dispatcher sends nothing to it, and neither does a reconciler. A
// replay it decides (here after a lookup that failed on the same credential) is
// recorded as a look, not sent, and the replay budget is kept; once the credential
// changes, the replay goes and the intent completes with one effect.
func TestAReplayWaitsForARefusedCredential(t *testing.T) {
	t.Parallel()
	auth, secret := targettest.BearerFile(t, "old-token")
	b := setup(t, simtarget.Config{Auth: auth, Credential: "old-token"})
	op := b.prepare(t, simtarget.DemoCharge, "unknown-while-refused", `{"amount":100}`)
	b.answered(t, op, store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "TIMEOUT"})
	b.sim.SetCredential("rotated-token") // the vendor revoked the old one
	refused := b.prepare(t, simtarget.DemoCharge, "refused", `{"amount":5}`)
	require.NoError(t, b.dispatcher.Start(b.ctx))
	require.Eventually(t, func() bool {
		obs := b.get(t, refused).LastObservation
		return obs != nil && obs.Outcome == "CREDENTIAL_REFUSED"
	},
		10*time.Second, 10*time.Millisecond)

	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	require.Eventually(t, func() bool { return b.get(t, op).Checks >= 2 }, 30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Equal(t, store.StateUnknown, got.State)
	require.Zero(t, got.Replays, "no replay while the target refuses the credential")
	require.Contains(t, got.LastObservation.Summary, "refused the broker's credential")
	require.Zero(t, b.truth(t, op).Attempts)

	require.NoError(t, os.WriteFile(secret, []byte("rotated-token"), 0o600))
	got = b.waitState(t, op, store.StateSucceeded)
	require.Equal(t, int32(1), got.Replays)
	require.Equal(t, 1, b.truth(t, op).Effects)
}
