package brokermetrics

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/opbroker/opbroker/store"
)

// Evidence counts the events targets report (package evidence): received, decided, and
// the webhook deliveries refused before anything of them was kept. A nil *Evidence
// records nothing.
type Evidence struct {
	received metric.Int64Counter
	decided  metric.Int64Counter
	rejected metric.Int64Counter
	ignored  metric.Int64Counter
}

// NewEvidence returns the instruments of mp.
func NewEvidence(mp metric.MeterProvider) (*Evidence, error) {
	meter := mp.Meter(meterName)
	e := &Evidence{}
	var err error
	if e.received, err = meter.Int64Counter("opbroker.evidence.received", metric.WithUnit("{event}"),
		metric.WithDescription("Verified events kept, by target, source (WEBHOOK, REPORTED) and whether the target had reported the event's id before (duplicate)")); err != nil {
		return nil, err
	}
	if e.decided, err = meter.Int64Counter("opbroker.evidence.decided", metric.WithUnit("{event}"),
		metric.WithDescription("Events decided, by target, disposition (APPLIED, OBSERVED, QUARANTINED) and, for the quarantined, reason")); err != nil {
		return nil, err
	}
	if e.rejected, err = meter.Int64Counter("opbroker.webhook.rejected", metric.WithUnit("{delivery}"),
		metric.WithDescription("Webhook deliveries refused and not kept, by target (empty for an unknown path) and reason: the signature's (missing, malformed, mismatch, timestamp), or unknown_path, too_large, malformed_event, secret_unreadable, unavailable")); err != nil {
		return nil, err
	}
	if e.ignored, err = meter.Int64Counter("opbroker.evidence.ignored", metric.WithUnit("{event}"),
		metric.WithDescription("Verified events of a type the target's contract does not list, acknowledged and not kept, by target")); err != nil {
		return nil, err
	}
	return e, nil
}

// StartQuarantineAtZero reports no quarantined event yet for each of targets and each of
// reasons: an alert on the counter's increase then sees the first one, which it misses
// when the series first appears at 1.
func (e *Evidence) StartQuarantineAtZero(targets, reasons []string) {
	if e == nil {
		return
	}
	for _, t := range targets {
		for _, reason := range reasons {
			e.decided.Add(context.Background(), 0, decidedAttributes(t, store.EvidenceQuarantined, reason))
		}
	}
}

// StartRejectedAtZero reports no refused webhook delivery yet for target, for each of
// reasons: an alert on the counter's increase then sees the first refusals.
func (e *Evidence) StartRejectedAtZero(target string, reasons []string) {
	if e == nil {
		return
	}
	for _, reason := range reasons {
		e.rejected.Add(context.Background(), 0, rejectedAttributes(target, reason))
	}
}

// Received counts a verified event kept (fresh) or repeated.
func (e *Evidence) Received(ctx context.Context, target, source string, fresh bool) {
	if e == nil {
		return
	}
	e.received.Add(ctx, 1, metric.WithAttributes(attribute.String("target", target), attribute.String("source", source),
		attribute.Bool("duplicate", !fresh)))
}

// Decided counts an event's disposition; reason is "" unless it was quarantined.
func (e *Evidence) Decided(ctx context.Context, target, disposition, reason string) {
	if e == nil {
		return
	}
	e.decided.Add(ctx, 1, decidedAttributes(target, disposition, reason))
}

func decidedAttributes(target, disposition, reason string) metric.AddOption {
	return metric.WithAttributes(attribute.String("target", target), attribute.String("disposition", disposition),
		attribute.String("reason", reason))
}

// Rejected counts a webhook delivery refused before anything of it was kept.
func (e *Evidence) Rejected(ctx context.Context, target, reason string) {
	if e == nil {
		return
	}
	e.rejected.Add(ctx, 1, rejectedAttributes(target, reason))
}

func rejectedAttributes(target, reason string) metric.AddOption {
	return metric.WithAttributes(attribute.String("target", target), attribute.String("reason", reason))
}

// Ignored counts a verified event of a type the contract does not list.
func (e *Evidence) Ignored(ctx context.Context, target string) {
	if e == nil {
		return
	}
	e.ignored.Add(ctx, 1, metric.WithAttributes(attribute.String("target", target)))
}
