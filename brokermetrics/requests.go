package brokermetrics

import (
	"context"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/metric"

	"github.com/opbroker/opbroker/target"
)

// Request latency buckets, in seconds: a target's timeout is at most a minute or so.
var requestBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// Connector is how the dispatcher and the reconciler reach targets: *target.Connector.
type Connector interface {
	Send(ctx context.Context, req target.Request) target.Result
	CredentialVersion(contract *target.Contract) string
	Lookup(ctx context.Context, contract *target.Contract, remoteKey uuid.UUID, approved []byte) target.LookupResult
}

// TimedConnector is a Connector whose sends and lookups are timed, by target and kind
// (send, lookup), whatever their outcome: a timeout counts its whole wait.
type TimedConnector struct {
	Connector
	duration metric.Float64Histogram
	byKind   *Pairs // target, kind
}

// TimeRequests returns c timed into mp's opbroker.target.request.duration.
func TimeRequests(c Connector, mp metric.MeterProvider) (*TimedConnector, error) {
	h, err := mp.Meter(meterName).Float64Histogram("opbroker.target.request.duration", metric.WithUnit("s"),
		metric.WithDescription("Requests to targets by target and kind (send, lookup), whatever their outcome"),
		metric.WithExplicitBucketBoundaries(requestBuckets...))
	if err != nil {
		return nil, err
	}
	return &TimedConnector{Connector: c, duration: h, byKind: NewPairs("target", "kind")}, nil
}

// Send sends through the wrapped Connector and records how long it took.
func (t *TimedConnector) Send(ctx context.Context, req target.Request) target.Result {
	start := time.Now()
	res := t.Connector.Send(ctx, req)
	t.record(req.Contract, "send", start)
	return res
}

// Lookup looks up through the wrapped Connector and records how long it took.
func (t *TimedConnector) Lookup(ctx context.Context, contract *target.Contract, remoteKey uuid.UUID, approved []byte) target.LookupResult {
	start := time.Now()
	res := t.Connector.Lookup(ctx, contract, remoteKey, approved)
	t.record(contract, "lookup", start)
	return res
}

func (t *TimedConnector) record(contract *target.Contract, kind string, start time.Time) {
	// A context of its own: the call's may be cancelled by now, and a measurement is not
	// part of the call.
	t.duration.Record(context.Background(), time.Since(start).Seconds(), t.byKind.Of(targetName(contract), kind))
}
