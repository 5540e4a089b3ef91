package reconciler_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/clocktest"
	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// skewedReconciler returns a reconciler whose clock, and its dispatcher's, is skew off
// the database's.
func (b *testBundle) skewedReconciler(t *testing.T, skew time.Duration) *reconciler.Reconciler {
	t.Helper()
	clock := clocktest.New(skew)
	d, err := dispatcher.New(dispatcher.Config{Store: b.store, Targets: b.targets, Connector: target.NewConnector(),
		Logger: b.log, MeterProvider: noop.NewMeterProvider(), Clock: clock.Now})
	require.NoError(t, err)
	t.Cleanup(d.Stop)
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: b.targets, Connector: target.NewConnector(),
		Deliverer: d, Logger: b.log, MeterProvider: noop.NewMeterProvider(), Worker: fmt.Sprint("skewed", skew),
		PollInterval: 20 * time.Millisecond, MaxLooks: 6, Lease: 10 * time.Second, Clock: clock.Now})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	return r
}

// unknownNeverSent records op's first send as one that never left, so that only a
// same-key replay can complete it.
func (b *testBundle) unknownNeverSent(t *testing.T, op store.Operation) {
	t.Helper()
	claimed, err := b.store.AllTenants().Claim(b.ctx, dispatcher.ClaimParams(b.payments(t), store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "w", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.Equal(t, op.ID, claimed[0].ID)
	_, err = b.store.AllTenants().RecordOutcome(b.ctx, store.OutcomeParams{TenantID: op.TenantID, ID: op.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, NotSent: true, Observation: store.Observation{Source: "DISPATCH", Outcome: "CONNECT_FAILED"}, Actor: "w"})
	require.NoError(t, err)
}

// replayOnly is a target with capability A alone: a key kept for retention, no lookup.
func replayOnly(retention time.Duration) func(*target.Contract) {
	return func(c *target.Contract) {
		if c.Idempotency != nil {
			c.Idempotency.Retention = target.Duration(retention)
			c.Lookup = nil
		}
	}
}

// TestReplayWindowHoldsUnderClockSkew: the key's window is judged by the database's
// clock, so a reconciler whose clock is ten seconds off replays inside a short window
// and never after it.
func TestReplayWindowHoldsUnderClockSkew(t *testing.T) {
	t.Parallel()
	for _, skew := range clocktest.Skews {
		t.Run(fmt.Sprint("inside the window, skew ", skew), func(t *testing.T) {
			t.Parallel()
			b := setup(t, simtarget.Config{}, replayOnly(5*time.Second))
			op := b.prepare(t, simtarget.DemoCharge, "inside", `{"amount":1}`)
			b.unknownNeverSent(t, op)
			require.NoError(t, b.skewedReconciler(t, skew).Start(b.ctx))
			got := b.waitState(t, op, store.StateSucceeded)
			require.Equal(t, int32(1), got.Replays)
			require.Equal(t, 1, b.truth(t, op).Effects)
		})
		t.Run(fmt.Sprint("after the window, skew ", skew), func(t *testing.T) {
			t.Parallel()
			// The target forgets a key after a second, as its contract says: a replay
			// after that would execute again.
			b := setup(t, simtarget.Config{Retention: time.Second}, replayOnly(time.Second))
			op := b.prepare(t, simtarget.DemoCharge, "after", fault(simtarget.FaultCommitThenReset))
			require.NoError(t, b.dispatcher.Start(b.ctx))
			b.waitState(t, op, store.StateUnknown)
			require.Eventually(t, func() bool {
				var closed bool
				require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT now() - first_sent_at > interval '1200 milliseconds'
					FROM operations WHERE operation_id = $1`, op.ID).Scan(&closed))
				return closed
			}, 10*time.Second, 20*time.Millisecond, "the window closes by the database's clock")
			require.NoError(t, b.skewedReconciler(t, skew).Start(b.ctx))
			got := b.waitState(t, op, store.StateEscalated)
			require.Zero(t, got.Replays)
			require.Contains(t, got.Escalation.Reason, "retention window")
			require.Equal(t, 1, b.truth(t, op).Effects)
			require.Equal(t, 1, b.truth(t, op).Attempts, "never replayed")
		})
	}
}
