package sweeper_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/sweeper"
	"github.com/opbroker/opbroker/target"
)

func TestMain(m *testing.M) { storetest.Main(m) }

func newSweeper(t *testing.T, st *store.Store, retention time.Duration) *sweeper.Sweeper {
	t.Helper()
	return newSweeperOf(t, st, nil, retention)
}

func newSweeperOf(t *testing.T, st *store.Store, targets *target.Targets, retention time.Duration) *sweeper.Sweeper {
	t.Helper()
	s, err := sweeper.New(sweeper.Config{Store: st, Targets: targets, Logger: slog.New(slog.DiscardHandler),
		MeterProvider: noop.NewMeterProvider(), Interval: 10 * time.Millisecond, PayloadRetention: retention})
	require.NoError(t, err)
	t.Cleanup(s.Stop)
	return s
}

// demoTargets returns the demo contracts with the data retentions of charges and
// notifications.
func demoTargets(t *testing.T, charges, notifications time.Duration) *target.Targets {
	t.Helper()
	contracts := simtarget.DemoContracts("http://127.0.0.1:1")
	for _, c := range contracts {
		switch c.OperationTypes[0] {
		case simtarget.DemoCharge:
			c.Data.Retention = target.Duration(charges)
		case simtarget.DemoNotify:
			c.Data.Retention = target.Duration(notifications)
		}
	}
	targets, err := target.New(contracts...)
	require.NoError(t, err)
	return targets
}

// aged prepares an operation of typ, cancels it when terminal, and backdates it by age.
func aged(t *testing.T, st *store.Store, pool *pgxpool.Pool, typ, intent string, terminal bool, age time.Duration) store.Operation {
	t.Helper()
	ctx := context.Background()
	op := storetest.PrepareJSON(t, st, "acme", typ, intent, `{"amount":1}`)
	if terminal {
		_, err := st.AllTenants().Cancel(ctx, store.CancelParams{TenantID: "acme", ID: op.ID, Actor: "test"})
		require.NoError(t, err)
	}
	_, err := pool.Exec(ctx, `UPDATE operations SET updated_at = now() - $2::interval WHERE operation_id = $1`, op.ID, age)
	require.NoError(t, err)
	return op
}

// hasPayload reports whether op still has its payload bytes.
func hasPayload(t *testing.T, pool *pgxpool.Pool, op store.Operation) (kept bool) {
	t.Helper()
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT payload IS NOT NULL FROM operations WHERE operation_id = $1`, op.ID).Scan(&kept))
	return kept
}

// TestPurgesByTheTargetsRetention: each target's data.retention decides when its
// operations' payloads go; --payload-retention only for a type no target serves, and 0
// there keeps those payloads without keeping the targets'. Open operations keep theirs.
func TestPurgesByTheTargetsRetention(t *testing.T) {
	t.Parallel()
	st, pool := storetest.NewStore(t)
	ctx := context.Background()
	charge := aged(t, st, pool, simtarget.DemoCharge, "charge", true, 2*time.Hour)
	open := aged(t, st, pool, simtarget.DemoCharge, "open", false, 48*time.Hour)
	notify := aged(t, st, pool, simtarget.DemoNotify, "notify", true, 2*time.Hour)
	legacy := aged(t, st, pool, "legacy.export", "legacy", true, 4*time.Hour)
	recent := aged(t, st, pool, "legacy.export", "recent", true, 2*time.Hour)
	targets := demoTargets(t, time.Hour, 3*time.Hour)

	require.NoError(t, newSweeperOf(t, st, targets, 3*time.Hour).Sweep(ctx, time.Time{}))
	for _, tc := range []struct {
		op   store.Operation
		kept bool
	}{{charge, false}, {open, true}, {notify, true}, {legacy, false}, {recent, true}} {
		require.Equal(t, tc.kept, hasPayload(t, pool, tc.op), tc.op.IntentRef)
	}

	late := aged(t, st, pool, simtarget.DemoNotify, "late", true, 4*time.Hour)
	old := aged(t, st, pool, "legacy.export", "old", true, 365*24*time.Hour)
	require.NoError(t, newSweeperOf(t, st, targets, 0).Sweep(ctx, time.Time{}))
	require.False(t, hasPayload(t, pool, late), "no default: the target's retention still applies")
	require.True(t, hasPayload(t, pool, old), "no default: a type no target serves keeps its payloads")
	require.True(t, hasPayload(t, pool, open))
}

// TestContractWithoutRetentionGetsTheDefault: a contract built in code without
// data.retention (target.New judges no controls) is purged by --payload-retention.
func TestContractWithoutRetentionGetsTheDefault(t *testing.T) {
	t.Parallel()
	st, pool := storetest.NewStore(t)
	ctx := context.Background()
	op := aged(t, st, pool, simtarget.DemoNotify, "notify", true, 2*time.Hour)
	targets := demoTargets(t, time.Hour, 0)

	require.NoError(t, newSweeperOf(t, st, targets, 3*time.Hour).Sweep(ctx, time.Time{}))
	require.True(t, hasPayload(t, pool, op), "within the default")
	require.NoError(t, newSweeperOf(t, st, targets, time.Hour).Sweep(ctx, time.Time{}))
	require.False(t, hasPayload(t, pool, op), "past the default")
}

// TestPurgesPayloadsAfterRetention: with a payload retention, the sweeper removes the
// bytes of operations terminal for longer; without one, it keeps them.
func TestPurgesPayloadsAfterRetention(t *testing.T) {
	t.Parallel()
	st, pool := storetest.NewStore(t)
	ctx := context.Background()
	op := storetest.PrepareJSON(t, st, "acme", "demo.charge", "done", `{"amount":1}`)
	_, err := st.AllTenants().Cancel(ctx, store.CancelParams{TenantID: "acme", ID: op.ID, Actor: "test"})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE operations SET updated_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	kept := func() (kept bool) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT payload IS NOT NULL FROM operations`).Scan(&kept))
		return kept
	}

	require.NoError(t, newSweeper(t, st, 0).Sweep(ctx, time.Time{}))
	require.True(t, kept(), "no retention: payloads are kept")
	require.NoError(t, newSweeper(t, st, 3*time.Hour).Sweep(ctx, time.Time{}))
	require.True(t, kept(), "within the retention")
	require.NoError(t, newSweeper(t, st, time.Hour).Sweep(ctx, time.Time{}))
	require.False(t, kept(), "past the retention")
}

// TestSweepsOnItsOwn: a started sweeper makes an expired lease UNKNOWN without being
// asked, and starts again after Stop.
func TestSweepsOnItsOwn(t *testing.T) {
	t.Parallel()
	st, _ := storetest.NewStore(t)
	ctx := context.Background()
	s := newSweeper(t, st, 0)
	for i, intent := range []string{"first", "second"} {
		op := storetest.PrepareJSON(t, st, "acme", "demo.charge", intent, `{"amount":1}`)
		_, err := st.AllTenants().Claim(ctx, store.ClaimParams{FairClaim: store.FairClaim{OperationTypes: []string{"demo.charge"},
			Worker: "gone", Lease: time.Millisecond, Limit: 1, PerTenant: 1, MaxTenants: 1}})
		require.NoError(t, err)
		require.NoError(t, s.Start(ctx))
		require.Eventually(t, func() bool {
			got, err := st.AllTenants().Get(ctx, "acme", op.ID)
			require.NoError(t, err)
			return got.State == store.StateUnknown
		}, 10*time.Second, 10*time.Millisecond, "run %d", i)
		s.Stop()
	}
}

// TestExpiredLeasesCountAsUnknownEntered: an operation the sweeper makes UNKNOWN counts
// in opbroker_unknown_entered_total under its target, with cause LEASE_EXPIRED, and in
// opbroker_leases_expired_total, which starts at zero.
func TestExpiredLeasesCountAsUnknownEntered(t *testing.T) {
	t.Parallel()
	st, _ := storetest.NewStore(t)
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	s, err := sweeper.New(sweeper.Config{Store: st, Targets: demoTargets(t, time.Hour, time.Hour), Logger: slog.New(slog.DiscardHandler),
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	for _, intent := range []string{"first", "second"} {
		storetest.PrepareJSON(t, st, "acme", simtarget.DemoCharge, intent, `{"amount":1}`)
	}
	_, err = st.AllTenants().Claim(ctx, store.ClaimParams{FairClaim: store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "gone", Lease: time.Millisecond, Limit: 2, PerTenant: 2, MaxTenants: 1}})
	require.NoError(t, err)
	counted := func(name string) map[string]int64 {
		var rm metricdata.ResourceMetrics
		require.NoError(t, reader.Collect(ctx, &rm))
		counts := map[string]int64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == name {
					for _, dp := range sum.DataPoints {
						target, _ := dp.Attributes.Value("target")
						cause, _ := dp.Attributes.Value("cause")
						counts[target.AsString()+" "+cause.AsString()] += dp.Value
					}
				}
			}
		}
		return counts
	}
	// From zero, so that an alert on the increase sees the first sweep.
	require.Equal(t, map[string]int64{" ": 0}, counted("opbroker.leases.expired"))
	require.NoError(t, s.Sweep(ctx, time.Now().Add(time.Minute)))

	require.Equal(t, map[string]int64{"demo-payments LEASE_EXPIRED": 2}, counted("opbroker.unknown.entered"))
	require.Equal(t, map[string]int64{" ": 2}, counted("opbroker.leases.expired"))
}

// TestStuckSweepIsReported: a pass the database never answers (a broken network: no
// error, no answer) is given up after ten intervals and logged, not left hanging in
// silence.
func TestStuckSweepIsReported(t *testing.T) {
	t.Parallel()
	st, _, proxy := storetest.NewStoreBehindProxy(t)
	logs := &logtest.Buffer{}
	s, err := sweeper.New(sweeper.Config{Store: st, Logger: slog.New(slog.NewTextHandler(logs, nil)),
		MeterProvider: noop.NewMeterProvider(), Interval: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(s.Stop)
	proxy.Freeze()
	t.Cleanup(proxy.Thaw)
	require.NoError(t, s.Start(context.Background()))
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "sweep failed") }, 10*time.Second, 20*time.Millisecond)
}
