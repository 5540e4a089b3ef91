package dispatcher

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/targettest"
)

// TestAnOutcomeRecordedBeforeIsNotALostFence: an outcome tried again after its first
// try was recorded (the answer to its commit lost), once the operation has moved on, is
// logged as such, not as a lost fence, and the UNKNOWN it made is counted.
func TestAnOutcomeRecordedBeforeIsNotALostFence(t *testing.T) {
	t.Parallel()
	st, _ := storetest.NewStore(t)
	_, targets := targettest.Demo(t, simtarget.Config{})
	var logs logtest.Buffer
	reader := sdkmetric.NewManualReader()
	d, err := New(Config{Store: st, Targets: targets, Connector: target.NewConnector(),
		Logger: slog.New(slog.NewTextHandler(&logs, nil)), MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	contract, ok := targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)

	ctx := context.Background()
	storetest.PrepareJSON(t, st, "acme", simtarget.DemoCharge, "order-1", `{"amount":1}`)
	claimed, err := st.AllTenants().Claim(ctx, targettest.Claim(t, targets, contract.Name, store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "w", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	c := claimed[0]
	// The first try, recorded; its answer never reached the dispatcher.
	_, err = st.AllTenants().RecordOutcome(ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
		State: store.StateUnknown, Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "TIMEOUT"},
		Actor: "dispatcher:w"})
	require.NoError(t, err)
	_, err = st.AllTenants().ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{simtarget.DemoCharge}, Worker: "r",
		Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}) // the operation moves on
	require.NoError(t, err)
	d.record(contract, c, target.Result{Outcome: target.Unknown, Class: "TIMEOUT", Sent: true}) // the try again

	require.Contains(t, logs.String(), "outcome recorded by an earlier try")
	require.NotContains(t, logs.String(), "fence lost")
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	var entered int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "opbroker.unknown.entered" {
				for _, dp := range sum.DataPoints {
					entered += dp.Value
				}
			}
		}
	}
	require.Equal(t, int64(1), entered, "the UNKNOWN the first try made is counted")
}
