package sweeper_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/sweeper"
)

func TestMain(m *testing.M) { storetest.Main(m) }

func newSweeper(t *testing.T, st *store.Store, retention time.Duration) *sweeper.Sweeper {
	t.Helper()
	s, err := sweeper.New(sweeper.Config{Store: st, Logger: slog.New(slog.DiscardHandler),
		MeterProvider: noop.NewMeterProvider(), Interval: 10 * time.Millisecond, PayloadRetention: retention})
	require.NoError(t, err)
	t.Cleanup(s.Stop)
	return s
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
		_, err := st.AllTenants().Claim(ctx, store.ClaimParams{Target: "demo", FairClaim: store.FairClaim{OperationTypes: []string{"demo.charge"},
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
