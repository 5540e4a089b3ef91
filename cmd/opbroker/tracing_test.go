package main

import (
	"context"
	"encoding/hex"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/storetest"
)

// receiver is an OTLP trace receiver in the test's process, as a collector would run.
type receiver struct {
	collectortrace.UnimplementedTraceServiceServer
	mu       sync.Mutex
	spans    []*tracepb.Span
	services map[string]bool
}

func (r *receiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, a := range rs.GetResource().GetAttributes() {
			if a.GetKey() == "service.name" {
				r.services[a.GetValue().GetStringValue()] = true
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// named returns the spans received so far with that name.
func (r *receiver) named(name string) []*tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range r.spans {
		if s.GetName() == name {
			out = append(out, s)
		}
	}
	return out
}

func startReceiver(t *testing.T) (*receiver, string) {
	t.Helper()
	r := &receiver{services: map[string]bool{}}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(srv, r)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return r, lis.Addr().String()
}

// TestTracesFollowAnOperation: with OpenTelemetry's standard variables set, the broker
// exports over OTLP a span for the call that prepared an operation (in the caller's
// trace), for its claim, for its send (linked to the caller's trace, its traceparent
// sent to the target), and for its reconciliation and lookup after the send's
// connection was reset; and no span carries the payload, the tenant, the intent, the
// key or the target's reference. The send's span names its target, operation, fence and
// attempt, its outcome, and whether it was sent.
func TestTracesFollowAnOperation(t *testing.T) {
	t.Parallel()
	collector, collectorAt := startReceiver(t)
	sim := simtarget.New(simtarget.Config{Fault: simtarget.FaultCommitThenReset})
	t.Cleanup(sim.Close)
	var mu sync.Mutex
	sent := map[string]string{} // traceparent by request method
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		sent[r.Method] = r.Header.Get("traceparent")
		mu.Unlock()
		sim.ServeHTTP(w, r)
	}))
	t.Cleanup(target.Close)

	url := storetest.Schema(t)
	broker := startEnv(t, []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + collectorAt, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
		"OTEL_BSP_SCHEDULE_DELAY=100", "OTEL_SERVICE_NAME=opbroker-test"},
		serveArgs(url, targetsFile(t, target.URL))...)
	client := opbrokerv1.NewOperationServiceClient(dial(t, broker.waitReady(t)))
	const callerTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	ctx := metadata.AppendToOutgoingContext(context.Background(), "traceparent", "00-"+callerTrace+"-00f067aa0ba902b7-01")
	resp, err := prepare(ctx, client, "order-traced")
	require.NoError(t, err)
	openLedger(t, url).waitState(resp.GetOperation().GetName(), "SUCCEEDED")

	traceOf := func(s *tracepb.Span) string { return hex.EncodeToString(s.GetTraceId()) }
	require.Eventually(t, func() bool {
		return len(collector.named("opbroker.reconcile.lookup")) > 0 && len(collector.named("opbroker.reconcile")) > 0
	}, 15*time.Second, 50*time.Millisecond, "the reconciliation's spans")
	collector.mu.Lock()
	require.True(t, collector.services["opbroker-test"], "OTEL_SERVICE_NAME names the service")
	collector.mu.Unlock()

	rpc := collector.named("opbroker.v1.OperationService/PrepareOperation")
	require.Len(t, rpc, 1)
	require.Equal(t, callerTrace, traceOf(rpc[0]), "the call's span is in the caller's trace")
	require.NotEmpty(t, collector.named("opbroker.dispatch.claim"))

	sends := collector.named("opbroker.dispatch.send")
	require.Len(t, sends, 1)
	require.Len(t, sends[0].GetLinks(), 1)
	require.Equal(t, callerTrace, hex.EncodeToString(sends[0].GetLinks()[0].GetTraceId()), "the send links to the caller's trace")
	sendAttributes := map[string]bool{}
	for _, a := range sends[0].GetAttributes() {
		sendAttributes[a.GetKey()] = true
	}
	for _, key := range []string{"opbroker.target", "opbroker.operation", "opbroker.fence", "opbroker.attempt",
		"opbroker.outcome", "opbroker.sent"} {
		require.Contains(t, sendAttributes, key, "the send's span says what was sent and how it ended")
	}
	mu.Lock()
	require.Contains(t, sent[http.MethodPost], traceOf(sends[0]), "the target got the send's trace context")
	mu.Unlock()

	lookup := collector.named("opbroker.reconcile.lookup")[0]
	reconcile := collector.named("opbroker.reconcile")[0]
	require.Equal(t, traceOf(reconcile), traceOf(lookup), "the lookup is a step of the reconciliation")
	require.Len(t, reconcile.GetLinks(), 1)
	require.Equal(t, callerTrace, hex.EncodeToString(reconcile.GetLinks()[0].GetTraceId()), "the reconciliation links to the caller's trace")
	mu.Lock()
	require.Contains(t, sent[http.MethodGet], traceOf(lookup), "the target got the lookup's trace context")
	mu.Unlock()

	remote := openLedger(t, url).remoteKey(resp.GetOperation().GetName())
	var ref string
	require.NoError(t, openLedger(t, url).conn.QueryRow(context.Background(), `SELECT remote_ref FROM operations WHERE remote_key::text = $1`, remote).Scan(&ref))
	collector.mu.Lock()
	defer collector.mu.Unlock()
	for _, s := range collector.spans {
		for _, a := range s.GetAttributes() {
			v := a.GetValue().String()
			for _, secret := range []string{`"amount"`, "acme", "order-traced", remote, ref} {
				require.False(t, strings.Contains(v, secret), "span %s attribute %s carries %q", s.GetName(), a.GetKey(), secret)
			}
		}
	}
}
