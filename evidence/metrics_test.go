package evidence_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/opbroker/opbroker/evidence"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/targettest"
)

// TestAlertedCountsStartAtZero: a matcher reports no quarantined event yet, for every
// reason, and its webhook listener no refused delivery, for every reason, for each
// target with evidence (a webhook) and for no other, so that an alert on the counter's
// increase sees the first one (a series that first appears at 1 shows Prometheus no
// increase).
func TestAlertedCountsStartAtZero(t *testing.T) {
	t.Parallel()
	// demo-payments has evidence by webhook, the other demo targets none.
	_, targets := targettest.Demo(t, simtarget.Config{
		Webhooks: &simtarget.WebhookConfig{SecretSource: target.Secret{Env: "UNUSED_WEBHOOK_SECRET"}}})
	reader := sdkmetric.NewManualReader()
	m, err := evidence.New(evidence.Config{Targets: targets, Logger: slog.New(slog.DiscardHandler),
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	require.NoError(t, err)
	evidence.NewWebhooks(m, targets, 0, nil)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, metric := range sm.Metrics {
			if sum, ok := metric.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range sum.DataPoints {
					series := metric.Name
					for _, kv := range dp.Attributes.ToSlice() {
						series += " " + string(kv.Key) + "=" + kv.Value.String()
					}
					got[series] = dp.Value
				}
			}
		}
	}
	want := map[string]int64{}
	for _, reason := range evidence.Reasons {
		want["opbroker.evidence.decided disposition="+store.EvidenceQuarantined+" reason="+reason+" target=demo-payments"] = 0
	}
	for _, reason := range evidence.RejectionReasons {
		want["opbroker.webhook.rejected reason="+reason+" target=demo-payments"] = 0
	}
	require.Equal(t, want, got)
}
