// Package tracing exports the broker's traces over OTLP when OpenTelemetry's standard
// environment variables ask for it, and carries an operation's trace context through
// the ledger, so that the send of an operation links back to the call that prepared it.
//
// Spans never carry payload bytes, intent references, tenants' names, keys, remote
// references or anything else a customer's data could be read from: only the broker's
// own identifiers (the operation's id, its fence), the target's name and what happened.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Propagator reads and writes W3C trace context (traceparent, tracestate): on the
// gRPC calls the broker serves and on the requests it sends to targets.
var Propagator propagation.TextMapPropagator = propagation.TraceContext{}

// Provider is the broker's tracer provider and what ends it.
type Provider struct {
	trace.TracerProvider
	// Shutdown sends the spans not yet exported and stops; a no-op when tracing is
	// off.
	Shutdown func(context.Context) error
	// Exporting reports whether spans are exported: false when the environment does
	// not ask for it.
	Exporting bool
}

// New returns a provider that exports over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (and neither OTEL_SDK_DISABLED=true nor
// OTEL_TRACES_EXPORTER=none says otherwise), and one that records nothing otherwise.
// The protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL:
// grpc or http/protobuf (the default); the exporters read the other standard variables
// (headers, timeouts, certificates) themselves. The service is named opbroker unless
// OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say otherwise.
func New(ctx context.Context, version string) (*Provider, error) {
	off := &Provider{TracerProvider: noop.NewTracerProvider(), Shutdown: func(context.Context) error { return nil }}
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") || os.Getenv("OTEL_TRACES_EXPORTER") == "none" {
		return off, nil
	}
	if os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return off, nil
	}
	if e := os.Getenv("OTEL_TRACES_EXPORTER"); e != "" && e != "otlp" {
		return nil, fmt.Errorf("tracing: OTEL_TRACES_EXPORTER=%q: only otlp (or none) is supported", e)
	}
	protocol := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	var exporter sdktrace.SpanExporter
	var err error
	switch protocol {
	case "grpc":
		exporter, err = otlptracegrpc.New(ctx)
	case "", "http/protobuf":
		exporter, err = otlptracehttp.New(ctx)
	default:
		return nil, fmt.Errorf("tracing: OTLP protocol %q: grpc or http/protobuf", protocol)
	}
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", "opbroker"), attribute.String("service.version", version)),
		resource.WithFromEnv())
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return &Provider{TracerProvider: tp, Shutdown: tp.Shutdown, Exporting: true}, nil
}

// TraceParent returns the W3C traceparent of the span ctx carries, or "" when it
// carries none that is valid: what the ledger keeps with an operation.
func TraceParent(ctx context.Context) string {
	carrier := propagation.MapCarrier{}
	Propagator.Inject(ctx, carrier)
	return carrier.Get("traceparent")
}

// LinkTo returns the option that links a span to the trace of traceparent, as
// TraceParent recorded it; none when it is empty or not valid.
func LinkTo(traceparent string) []trace.SpanStartOption {
	if traceparent == "" {
		return nil
	}
	sc := trace.SpanContextFromContext(Propagator.Extract(context.Background(), propagation.MapCarrier{"traceparent": traceparent}))
	if !sc.IsValid() {
		return nil
	}
	return []trace.SpanStartOption{trace.WithLinks(trace.Link{SpanContext: sc})}
}

// End ends span, marked failed with err's message when err is not nil: errors of the
// store and of the broker's background services, whose messages name no customer data.
func End(span trace.Span, err error) {
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
