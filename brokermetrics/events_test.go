package brokermetrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/store"
)

// TestEventsCountUnknownAndItsResolutions: an operation recorded UNKNOWN counts by its
// target and the class that made it so; a resolution (by the reconciler, or a same-key
// replay's outcome) is observed with the time from the first send, by state; anything
// else records nothing. Every Events of one MeterProvider adds to the same series, as
// the dispatcher's and the reconciler's do.
func TestEventsCountUnknownAndItsResolutions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	mp, scrapeNow := meters(t)
	dispatcher, err := brokermetrics.NewEvents(mp)
	require.NoError(t, err)
	reconciler, err := brokermetrics.NewEvents(mp)
	require.NoError(t, err)
	payments, _ := demoTargets(t).ByName("demo-payments")

	firstSent := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	op := func(state store.State, after time.Duration) store.Operation {
		return store.Operation{State: state, FirstSentAt: &firstSent, UpdatedAt: firstSent.Add(after)}
	}
	recorded := func(state store.State, replays int32, after time.Duration) store.RecordedOutcome {
		return store.RecordedOutcome{State: state, Replays: replays, FirstSentAt: &firstSent, UpdatedAt: firstSent.Add(after)}
	}
	dispatcher.Sent(ctx, payments, recorded(store.StateUnknown, 0, time.Second), "TIMEOUT")
	dispatcher.Sent(ctx, payments, recorded(store.StateUnknown, 1, time.Hour), "TIMEOUT") // a replay's timeout
	dispatcher.Sent(ctx, payments, recorded(store.StateUnknown, 0, time.Second), "HTTP_5XX")
	dispatcher.Sent(ctx, payments, recorded(store.StateSucceeded, 0, time.Second), "VERIFIED_SUCCESS")    // a first send: no resolution
	dispatcher.Sent(ctx, payments, recorded(store.StateSucceeded, 2, 90*time.Second), "VERIFIED_SUCCESS") // a replay's success
	reconciler.Resolved(ctx, payments, op(store.StateSucceeded, 30*time.Minute))                          // a lookup's
	reconciler.Resolved(ctx, payments, op(store.StateUnknown, 30*time.Minute))                            // a look: no resolution
	reconciler.Resolved(ctx, payments, store.Operation{})                                                 // nothing recorded
	reconciler.Resolved(ctx, nil, op(store.StateEscalated, 73*time.Hour))                                 // no contract any more
	reconciler.UnknownEntered(ctx, payments, "LEASE_EXPIRED", 3)                                          // as a sweeper would
	var none *brokermetrics.Events
	none.Sent(ctx, payments, recorded(store.StateUnknown, 0, time.Second), "TIMEOUT")
	none.Resolved(ctx, payments, op(store.StateSucceeded, time.Second))

	got := scrapeNow()
	require.Equal(t, scrape{
		`opbroker_unknown_entered_total{cause="TIMEOUT",target="demo-payments"}`:       2,
		`opbroker_unknown_entered_total{cause="HTTP_5XX",target="demo-payments"}`:      1,
		`opbroker_unknown_entered_total{cause="LEASE_EXPIRED",target="demo-payments"}`: 3,
	}, got.matching("opbroker_unknown_entered_total"))
	require.Equal(t, scrape{
		`opbroker_unknown_resolution_seconds_count{state="SUCCEEDED",target="demo-payments"}`: 2,
		`opbroker_unknown_resolution_seconds_count{state="ESCALATED",target="(none)"}`:        1,
	}, got.matching("opbroker_unknown_resolution_seconds_count"))
	require.Equal(t, scrape{
		`opbroker_unknown_resolution_seconds_sum{state="SUCCEEDED",target="demo-payments"}`: 90 + 1800,
		`opbroker_unknown_resolution_seconds_sum{state="ESCALATED",target="(none)"}`:        73 * 3600,
	}, got.matching("opbroker_unknown_resolution_seconds_sum"))
	require.Equal(t, 1.0, got[`opbroker_unknown_resolution_seconds_bucket{le="300",state="SUCCEEDED",target="demo-payments"}`])
	require.Equal(t, 2.0, got[`opbroker_unknown_resolution_seconds_bucket{le="3600",state="SUCCEEDED",target="demo-payments"}`])
	require.Equal(t, 0.0, got[`opbroker_unknown_resolution_seconds_bucket{le="259200",state="ESCALATED",target="(none)"}`])
	require.Equal(t, 1.0, got[`opbroker_unknown_resolution_seconds_bucket{le="345600",state="ESCALATED",target="(none)"}`])
}
