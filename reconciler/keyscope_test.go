package reconciler_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// editedReconciler returns a reconciler (and its dispatcher) that reads the test's
// contracts as edit changed them, as a broker restarted with an edited targets file.
func (b *testBundle) editedReconciler(t *testing.T, edit func(*target.Contract)) *reconciler.Reconciler {
	t.Helper()
	var contracts []*target.Contract
	for _, c := range b.targets.All() {
		copied := *c
		if c.Idempotency != nil {
			idem := *c.Idempotency
			copied.Idempotency = &idem
			edit(&copied)
		}
		contracts = append(contracts, &copied)
	}
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	d, err := dispatcher.New(dispatcher.Config{Store: b.store, Targets: targets, Connector: target.NewConnector(),
		Logger: b.log, MeterProvider: noop.NewMeterProvider()})
	require.NoError(t, err)
	t.Cleanup(d.Stop)
	r, err := reconciler.New(reconciler.Config{Store: b.store, Targets: targets, Connector: target.NewConnector(),
		Deliverer: d, Logger: b.log, MeterProvider: noop.NewMeterProvider(), Worker: "edited",
		PollInterval: 20 * time.Millisecond, MaxLooks: 6, Lease: 10 * time.Second})
	require.NoError(t, err)
	t.Cleanup(r.Stop)
	return r
}

// TestAKeyKeepsItsScope: what a key means is fixed when it is first sent. A contract
// edited between the send and the replay (a longer retention, another endpoint,
// another API version) never replays the key: the window and the scope are the ones
// the ledger recorded, and the operation is escalated with the reason instead.
func TestAKeyKeepsItsScope(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		retention time.Duration // the key's retention when it was sent
		edit      func(*target.Contract)
		reason    string
	}{
		"a longer retention": {time.Second, func(c *target.Contract) { c.Idempotency.Retention = target.Duration(time.Hour) },
			"retention window"},
		"another endpoint": {time.Hour, func(c *target.Contract) { c.Endpoint.URL += "?api=v2" }, "contract changed"},
		"another API version": {time.Hour, func(c *target.Contract) { c.Headers = map[string]string{"Api-Version": "2026-12-01"} },
			"contract changed"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, simtarget.Config{}, replayOnly(tc.retention))
			op := b.prepare(t, simtarget.DemoCharge, "sent-before-the-edit", `{"amount":1}`)
			b.unknownNeverSent(t, op)
			if tc.retention < time.Minute {
				require.Eventually(t, func() bool {
					var closed bool
					require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT now() > key_window_end FROM operations WHERE operation_id = $1`,
						op.ID).Scan(&closed))
					return closed
				}, 10*time.Second, 20*time.Millisecond, "the window recorded at the send closes")
			}
			require.NoError(t, b.editedReconciler(t, tc.edit).Start(b.ctx))
			got := b.waitState(t, op, store.StateEscalated)
			require.Zero(t, got.Replays, "never replayed")
			require.Contains(t, got.Escalation.Reason, tc.reason)
			require.Zero(t, b.truth(t, op).Attempts)
		})
	}
}

// TestALookupRepointedSinceTheSendProvesNothing: the charge was made and its answer
// lost (UNKNOWN), then the contract's lookup was repointed (another URL, as at another
// account), where nothing is found. Past the time the contract says a request can take
// effect, with the key's window closed, that "not found" would make the operation
// FAILED_TERMINAL though the charge exists, and its client would make it again. The
// ledger kept the lookup the operation was sent under, so the operation stays UNKNOWN
// (to be escalated when the looks run out), saying why.
func TestALookupRepointedSinceTheSendProvesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{}, func(c *target.Contract) {
		if c.Lookup != nil && c.Idempotency != nil {
			c.Lookup.VisibilityDelay = target.Duration(time.Millisecond)
			c.Lookup.AbsenceFinalAfter = target.Duration(time.Millisecond)
			c.Idempotency.Retention = target.Duration(time.Millisecond)
		}
	})
	op := b.prepare(t, simtarget.DemoCharge, "sent-before-the-lookup-moved", fault(simtarget.FaultCommitThenReset))
	require.NoError(t, b.dispatcher.Start(b.ctx))
	b.waitState(t, op, store.StateUnknown)
	b.dispatcher.Stop()

	require.NoError(t, b.editedReconciler(t, func(c *target.Contract) {
		moved := *c.Lookup
		moved.URL = strings.Replace(moved.URL, "/v1/charges", "/v1/other-account/charges", 1)
		c.Lookup = &moved
	}).Start(b.ctx))
	require.Eventually(t, func() bool { got := b.get(t, op); return got.Checks >= 2 || got.State != store.StateUnknown },
		30*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Equal(t, store.StateUnknown, got.State, "%s", got.LastObservation.Summary)
	require.Equal(t, "NOT_FOUND", got.LastObservation.Outcome)
	require.Contains(t, got.LastObservation.Summary, "the lookup changed since the operation was first sent")
	require.Zero(t, got.Replays)
	require.Equal(t, 1, b.truth(t, op).Effects)
}
