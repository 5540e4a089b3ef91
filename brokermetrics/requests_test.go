package brokermetrics_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/target"
)

// connector answers every call at once, as told.
type connector struct {
	sent, looked int
}

func (c *connector) Send(context.Context, target.Request) target.Result {
	c.sent++
	return target.Result{Class: target.ClassTimeout}
}

func (c *connector) CredentialVersion(*target.Contract) string { return "v7" }

func (c *connector) Lookup(context.Context, *target.Contract, uuid.UUID, []byte) target.LookupResult {
	c.looked++
	return target.LookupResult{Outcome: target.LookupNotFound}
}

// TestTimedConnectorTimesEveryRequest: sends and lookups pass through unchanged and are
// timed by target and kind, whatever their outcome.
func TestTimedConnectorTimesEveryRequest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	mp, scrapeNow := meters(t)
	inner := &connector{}
	timed, err := brokermetrics.TimeRequests(inner, mp)
	require.NoError(t, err)
	targets := demoTargets(t)
	payments, _ := targets.ByName("demo-payments")
	notify, _ := targets.ByName("demo-notify")

	require.Equal(t, target.ClassTimeout, timed.Send(ctx, target.Request{Contract: payments}).Class)
	timed.Send(ctx, target.Request{Contract: notify})
	require.Equal(t, target.LookupNotFound, timed.Lookup(ctx, payments, uuid.New(), nil).Outcome)
	require.Equal(t, "v7", timed.CredentialVersion(payments))
	require.Equal(t, 2, inner.sent)
	require.Equal(t, 1, inner.looked)

	require.Equal(t, scrape{
		`opbroker_target_request_duration_seconds_count{kind="send",target="demo-payments"}`:   1,
		`opbroker_target_request_duration_seconds_count{kind="send",target="demo-notify"}`:     1,
		`opbroker_target_request_duration_seconds_count{kind="lookup",target="demo-payments"}`: 1,
	}, scrapeNow().matching("opbroker_target_request_duration_seconds_count"))
}
