package tracing_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/opbroker/opbroker/tracing"
)

// TestOffUnlessAskedFor: without an OTLP endpoint in the environment, or with the SDK
// disabled, nothing is exported; an unknown protocol or exporter is an error.
func TestOffUnlessAskedFor(t *testing.T) {
	for _, env := range []map[string]string{
		{},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"},
	} {
		for k, v := range env {
			t.Setenv(k, v)
		}
		p, err := tracing.New(context.Background(), "test")
		require.NoError(t, err)
		require.False(t, p.Exporting, "%v", env)
		require.NoError(t, p.Shutdown(context.Background()))
	}
	t.Setenv("OTEL_SDK_DISABLED", "")
	t.Setenv("OTEL_TRACES_EXPORTER", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318")
	p, err := tracing.New(context.Background(), "test")
	require.NoError(t, err)
	require.True(t, p.Exporting, "the traces' own endpoint is enough")
	require.NoError(t, p.Shutdown(context.Background()))
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
	_, err = tracing.New(context.Background(), "test")
	require.ErrorContains(t, err, `OTLP protocol "http/json"`)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	t.Setenv("OTEL_TRACES_EXPORTER", "zipkin")
	_, err = tracing.New(context.Background(), "test")
	require.ErrorContains(t, err, "only otlp")
}

// TestTraceParentRoundTrip: what TraceParent records, LinkTo links to; nothing and
// garbage link to nothing.
func TestTraceParentRoundTrip(t *testing.T) {
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx := tracing.Propagator.Extract(context.Background(), propagation.MapCarrier{"traceparent": parent})
	require.Equal(t, parent, tracing.TraceParent(ctx))
	require.Empty(t, tracing.TraceParent(context.Background()))

	opts := tracing.LinkTo(parent)
	require.Len(t, opts, 1)
	cfg := trace.NewSpanStartConfig(opts...)
	require.Len(t, cfg.Links(), 1)
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e4736", cfg.Links()[0].SpanContext.TraceID().String())
	require.Empty(t, tracing.LinkTo(""))
	require.Empty(t, tracing.LinkTo("not a traceparent"))
}
