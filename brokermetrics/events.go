package brokermetrics

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// meterName is the instrumentation scope of the package's instruments.
const meterName = "github.com/opbroker/opbroker/brokermetrics"

// Resolution buckets, in seconds: from a replay's seconds to past the default resolution
// deadline (72 hours from the first send), where an operation is escalated at the
// latest.
var resolutionBuckets = []float64{1, 5, 15, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600,
	24 * 3600, 48 * 3600, 72 * 3600, 96 * 3600, 7 * 24 * 3600}

// Events counts what happens to UNKNOWN operations, when it happens: the dispatcher and
// the reconciler each make one (NewEvents) and call it once the ledger has recorded the
// change. Instruments of the same MeterProvider are shared, so every Events of a broker
// adds to the same series. A nil *Events records nothing.
type Events struct {
	unknownEntered metric.Int64Counter
	resolutions    metric.Float64Histogram
	byCause        *Pairs // target, cause
	byState        *Pairs // target, state
}

// NewEvents returns the instruments of mp.
func NewEvents(mp metric.MeterProvider) (*Events, error) {
	meter := mp.Meter(meterName)
	e := &Events{byCause: NewPairs("target", "cause"), byState: NewPairs("target", "state")}
	var err error
	if e.unknownEntered, err = meter.Int64Counter("opbroker.unknown.entered", metric.WithUnit("{operation}"),
		metric.WithDescription("Operations that became UNKNOWN, by target and cause (the outcome class of the observation that made them UNKNOWN)")); err != nil {
		return nil, err
	}
	if e.resolutions, err = meter.Float64Histogram("opbroker.unknown.resolution", metric.WithUnit("s"),
		metric.WithDescription("UNKNOWN operations resolved, by target and the state they ended in (SUCCEEDED, FAILED_TERMINAL, ESCALATED): the time from their first send to the resolution, by the database's clock"),
		metric.WithExplicitBucketBoundaries(resolutionBuckets...)); err != nil {
		return nil, err
	}
	return e, nil
}

// Sent counts what a send's outcome did, given what the ledger recorded
// (store.Scope.RecordOutcome's result) and cause, the class of the send's observation:
// an operation that became UNKNOWN, by cause; a same-key replay (op.Replays > 0: only a
// reconciler's replay of an UNKNOWN operation counts one) that ended SUCCEEDED or
// FAILED_TERMINAL, as a resolution.
func (e *Events) Sent(ctx context.Context, contract *target.Contract, op store.RecordedOutcome, cause string) {
	if e == nil {
		return
	}
	switch {
	case op.State == store.StateUnknown:
		e.UnknownEntered(ctx, contract, cause, 1)
	case op.Replays > 0:
		e.resolved(ctx, contract, op.State, op.FirstSentAt, op.UpdatedAt)
	}
}

// Resolved records the resolution of an UNKNOWN operation, given the operation as its
// resolution left it (by the reconciler, an operator or a target's event): its state and
// the time from its first send to the resolution, both written by the database. Any
// other state (a zero Operation included) records nothing. contract may be nil: the
// operation's type has no contract any more.
func (e *Events) Resolved(ctx context.Context, contract *target.Contract, op store.Operation) {
	e.resolved(ctx, contract, op.State, op.FirstSentAt, op.UpdatedAt)
}

// resolved records a resolution into state at the database's time at, of an operation
// first sent at firstSent (nil: never sent, nothing is recorded).
func (e *Events) resolved(ctx context.Context, contract *target.Contract, state store.State, firstSent *time.Time, at time.Time) {
	if e == nil || firstSent == nil {
		return
	}
	switch state {
	case store.StateSucceeded, store.StateFailedTerminal, store.StateEscalated:
	default:
		return
	}
	e.resolutions.Record(ctx, max(0, at.Sub(*firstSent).Seconds()), e.byState.Of(targetName(contract), string(state)))
}

// UnknownEntered counts n operations of the contract's that became UNKNOWN because of
// cause (an outcome class: TIMEOUT, HTTP_5XX, LEASE_EXPIRED, …); contract may be nil.
func (e *Events) UnknownEntered(ctx context.Context, contract *target.Contract, cause string, n int) {
	if e == nil || n <= 0 {
		return
	}
	if cause == "" {
		cause = "UNSPECIFIED"
	}
	e.unknownEntered.Add(ctx, int64(n), e.byCause.Of(targetName(contract), cause))
}

func targetName(c *target.Contract) string {
	if c == nil {
		return NoTarget
	}
	return c.Name
}
