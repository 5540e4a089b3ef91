package reconciler_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/targettest"
)

// TestLookupsAndReplaysShareTheTargetsSlots: a contract's concurrency bounds every
// request the broker makes to the target at once: first sends, same-key replays and
// lookups together, however many operations the reconciler has in hand.
func TestLookupsAndReplaysShareTheTargetsSlots(t *testing.T) {
	t.Parallel()
	// Every create answers 503 without executing: each operation is sent, looked up (not
	// found), replayed, looked up again, for as long as the test runs. (A fault that
	// resets the connection would let the broker's next request arrive before the
	// simulator counted the last one finished.)
	b := setup(t, simtarget.Config{Fault: simtarget.Fault5xxBeforeCommit, Latency: 50 * time.Millisecond},
		func(c *target.Contract) { c.Concurrency = 2 })
	for i := range 12 {
		b.prepare(t, simtarget.DemoCharge, fmt.Sprint("bounded-", i), fmt.Sprintf(`{"amount":%d}`, i+1))
	}
	require.NoError(t, b.dispatcher.Start(b.ctx))
	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	require.Eventually(t, func() bool {
		var replays, checks int
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT coalesce(sum(replays), 0), coalesce(sum(checks), 0) FROM operations`).Scan(&replays, &checks))
		return replays >= 8 && checks >= 8
	}, 30*time.Second, 20*time.Millisecond)
	require.LessOrEqual(t, b.sim.Snapshot().MaxConcurrent, 2, "the contract allows 2 concurrent requests")
}

// TestStopReturnsWhileTheDatabaseIsUnreachable: a reconciler deciding an operation when
// the database stops answering (a broken network: no error, no answer) still stops
// promptly; what it leaves undone is decided again after its claim's lease.
func TestStopReturnsWhileTheDatabaseIsUnreachable(t *testing.T) {
	t.Parallel()
	st, _, proxy := storetest.NewStoreBehindProxy(t)
	started, release := make(chan struct{}, 1), make(chan struct{})
	lookups := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		select {
		case started <- struct{}{}:
		default:
		}
		<-release
		w.WriteHeader(http.StatusNotFound)
	}))
	t.Cleanup(lookups.Close)
	_, targets := targettest.Demo(t, simtarget.Config{}, func(c *target.Contract) {
		if c.Lookup != nil {
			c.Lookup.URL = lookups.URL + "/v1/charges?reference={remote_key}"
		}
	})
	op := storetest.PrepareJSON(t, st, "acme", simtarget.DemoCharge, "frozen", fault(simtarget.FaultCommitThenReset))
	log := slog.New(slog.DiscardHandler)
	d, err := dispatcher.New(dispatcher.Config{Store: st, Targets: targets, Connector: target.NewConnector(),
		Logger: log, MeterProvider: noop.NewMeterProvider(), PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, d.Start(ctx))
	require.Eventually(t, func() bool {
		got, err := st.AllTenants().Get(ctx, op.TenantID, op.ID)
		require.NoError(t, err)
		return got.State == store.StateUnknown
	}, 30*time.Second, 10*time.Millisecond)
	d.Stop()

	r, err := reconciler.New(reconciler.Config{Store: st, Targets: targets, Connector: target.NewConnector(), Deliverer: d,
		Logger: log, MeterProvider: noop.NewMeterProvider(), PollInterval: 20 * time.Millisecond, Lease: time.Minute})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the reconciler never looked the operation up")
	}
	proxy.Freeze()
	close(release) // the lookup answers; recording what it found now waits on the database

	stopped := make(chan struct{})
	go func() { r.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("Stop hangs while the database is unreachable")
	}
}
