package brokermetrics_test

import (
	"context"
	"log/slog"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokermetrics"
	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// TestLedgerGaugesReportTheLastReading: before its first reading a Ledger reports
// nothing; a reading gives, for every target of the contracts and every open state, the
// count (zero included) and the oldest age, the PREPARED operations ready to send, and
// opbroker_database_up 1; operation types no contract serves are reported as target
// "(none)". A failed reading keeps the last values and reports the database down.
func TestLedgerGaugesReportTheLastReading(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := storetest.Pool(t, storetest.Schema(t))
	st := store.New(pool)
	mp, scrapeNow := meters(t)
	ledger, err := brokermetrics.NewLedger(brokermetrics.LedgerConfig{Store: st, Targets: demoTargets(t), MeterProvider: mp,
		Logger: slog.New(slog.DiscardHandler), Interval: time.Minute})
	require.NoError(t, err)

	require.Empty(t, scrapeNow().matching("opbroker_operations_open"), "nothing before the first reading")
	require.Empty(t, scrapeNow().matching("opbroker_database_up"))

	storetest.PrepareJSON(t, st, "acme", "demo.charge", "c-1", `{"amount":1}`)
	storetest.PrepareJSON(t, st, "globex", "demo.charge", "c-2", `{"amount":2}`)
	storetest.PrepareJSON(t, st, "acme", "demo.notify", "n-1", `{"to":"ops"}`)
	storetest.PrepareJSON(t, st, "acme", "legacy.thing", "l-1", `{}`) // no contract serves it
	flying := storetest.PrepareJSON(t, st, "acme", "demo.object", "o-1", `{"name":"a"}`)
	claimed, err := st.AllTenants().Claim(ctx, store.ClaimParams{FairClaim: store.FairClaim{
		OperationTypes: []string{"demo.object"}, Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}})
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.Equal(t, flying.ID, claimed[0].ID)

	require.NoError(t, ledger.Refresh(ctx))
	got := scrapeNow()
	want := scrape{}
	for _, name := range []string{"demo-notify", "demo-objects", "demo-payments"} {
		for _, state := range []string{"ESCALATED", "IN_FLIGHT", "PREPARED", "UNKNOWN"} {
			want[`opbroker_operations_open{state="`+state+`",target="`+name+`"}`] = 0
		}
		want[`opbroker_operations_ready{target="`+name+`"}`] = 0
	}
	want[`opbroker_operations_open{state="PREPARED",target="demo-payments"}`] = 2
	want[`opbroker_operations_ready{target="demo-payments"}`] = 2
	want[`opbroker_operations_open{state="PREPARED",target="demo-notify"}`] = 1
	want[`opbroker_operations_ready{target="demo-notify"}`] = 1
	want[`opbroker_operations_open{state="IN_FLIGHT",target="demo-objects"}`] = 1
	want[`opbroker_operations_open{state="PREPARED",target="(none)"}`] = 1
	want[`opbroker_operations_ready{target="(none)"}`] = 1
	opened := got.matching("opbroker_operations_open")
	for series, v := range got.matching("opbroker_operations_ready") {
		opened[series] = v
	}
	require.Equal(t, want, opened)
	require.Equal(t, scrape{`opbroker_database_up{}`: 1}, got.matching("opbroker_database_up"))

	ages := got.matching("opbroker_operations_oldest_age_seconds")
	require.Len(t, ages, 13, "every target and open state, and the operations no contract serves")
	for series, age := range ages {
		switch series {
		case `opbroker_operations_oldest_age_seconds{state="PREPARED",target="demo-payments"}`,
			`opbroker_operations_oldest_age_seconds{state="PREPARED",target="demo-notify"}`,
			`opbroker_operations_oldest_age_seconds{state="PREPARED",target="(none)"}`,
			`opbroker_operations_oldest_age_seconds{state="IN_FLIGHT",target="demo-objects"}`:
			require.Greater(t, age, 0.0, series)
			require.Less(t, age, 60.0, series)
		default:
			require.Zero(t, age, series)
		}
	}

	pool.Close()
	require.Error(t, ledger.Refresh(ctx))
	down := scrapeNow()
	require.Equal(t, scrape{`opbroker_database_up{}`: 0}, down.matching("opbroker_database_up"))
	require.Equal(t, got.matching("opbroker_operations_open"), down.matching("opbroker_operations_open"), "the last reading stays")
}

// TestLedgerCountsContradictedOperations: opbroker_operations_contradicted reports, for
// every target and both end states (zero included), the operations the ledger ended
// otherwise than a late verified success of the target's says: read at the first
// reading and again once ContradictedInterval has passed since the last try; a failed
// reading keeps the last values, for up to three intervals after the last success.
func TestLedgerCountsContradictedOperations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st, admin := storetest.NewStore(t)
	mp, scrapeNow := meters(t)
	var logs logtest.Buffer
	ledger, err := brokermetrics.NewLedger(brokermetrics.LedgerConfig{Store: st, Targets: demoTargets(t), MeterProvider: mp,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)), Interval: time.Minute, ContradictedInterval: 5 * time.Minute})
	require.NoError(t, err)
	now := time.Now()
	ledger.SetNow(func() time.Time { return now })
	zero := scrape{}
	for _, name := range []string{"demo-notify", "demo-objects", "demo-payments"} {
		for _, state := range []string{"FAILED_TERMINAL", "SUCCEEDED"} {
			zero[`opbroker_operations_contradicted{state="`+state+`",target="`+name+`"}`] = 0
		}
	}
	require.NoError(t, ledger.Refresh(ctx))
	require.Equal(t, zero, scrapeNow().matching("opbroker_operations_contradicted"))

	// A charge whose sender's lease expired, failed by a lookup, then answered 200.
	all := st.AllTenants()
	storetest.PrepareJSON(t, st, "acme", "demo.charge", "c-1", `{"amount":1}`)
	claim := store.FairClaim{OperationTypes: []string{"demo.charge"}, Worker: "test", Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}
	sent, err := all.Claim(ctx, store.ClaimParams{FairClaim: claim})
	require.NoError(t, err)
	require.Len(t, sent, 1)
	_, err = all.SweepExpiredLeases(ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 1})
	require.NoError(t, err)
	looked, err := all.ClaimUnknown(ctx, claim)
	require.NoError(t, err)
	require.Len(t, looked, 1)
	_, err = all.ResolveUnknown(ctx, store.ResolveParams{TenantID: "acme", ID: sent[0].ID, Fence: looked[0].FenceToken,
		State: store.StateFailedTerminal, Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, Actor: "test"})
	require.NoError(t, err)
	_, err = all.RecordOutcome(ctx, store.OutcomeParams{TenantID: "acme", ID: sent[0].ID, Fence: sent[0].FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_late", Actor: "test",
		Observation: store.Observation{Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}})
	require.ErrorAs(t, err, new(*store.ContradictionError))

	now = now.Add(4 * time.Minute)
	require.NoError(t, ledger.Refresh(ctx))
	require.Equal(t, zero, scrapeNow().matching("opbroker_operations_contradicted"), "not read again within its interval")
	now = now.Add(time.Minute)
	require.NoError(t, ledger.Refresh(ctx))
	counted := maps.Clone(zero)
	counted[`opbroker_operations_contradicted{state="FAILED_TERMINAL",target="demo-payments"}`] = 1
	require.Equal(t, counted, scrapeNow().matching("opbroker_operations_contradicted"))

	// Read last at +5m. The reading fails from +10m.
	_, err = admin.Exec(ctx, `ALTER TABLE stale_outcomes RENAME TO stale_outcomes_gone`)
	require.NoError(t, err)
	failures := func() int { return strings.Count(logs.String(), "the contradicted operations were not read") }
	now = now.Add(5 * time.Minute)
	require.NoError(t, ledger.Refresh(ctx), "the open operations are read all the same")
	require.Equal(t, 1, failures())
	require.Equal(t, counted, scrapeNow().matching("opbroker_operations_contradicted"), "a failed reading keeps the last values")
	now = now.Add(time.Minute)
	require.NoError(t, ledger.Refresh(ctx))
	require.Equal(t, 1, failures(), "a failure is not tried again within the interval")
	now = now.Add(8 * time.Minute) // +19m
	require.NoError(t, ledger.Refresh(ctx))
	require.Equal(t, 2, failures())
	require.Equal(t, counted, scrapeNow().matching("opbroker_operations_contradicted"), "reported for three intervals")
	now = now.Add(time.Minute) // +20m
	require.NoError(t, ledger.Refresh(ctx))
	require.Empty(t, scrapeNow().matching("opbroker_operations_contradicted"), "and then not")
}

// TestAFailedReadingOfTheContradictedLeavesTheDatabaseUp: the contradicted operations'
// reading failing (here its table gone) is no outage: the open operations are read, the
// database reported up, and the contradicted gauge reports nothing it did not read.
func TestAFailedReadingOfTheContradictedLeavesTheDatabaseUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st, admin := storetest.NewStore(t)
	_, err := admin.Exec(ctx, `ALTER TABLE stale_outcomes RENAME TO stale_outcomes_gone`)
	require.NoError(t, err)
	mp, scrapeNow := meters(t)
	ledger, err := brokermetrics.NewLedger(brokermetrics.LedgerConfig{Store: st, Targets: demoTargets(t), MeterProvider: mp,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, ledger.Refresh(ctx))
	got := scrapeNow()
	require.Equal(t, scrape{`opbroker_database_up{}`: 1}, got.matching("opbroker_database_up"))
	require.NotEmpty(t, got.matching("opbroker_operations_open"))
	require.Empty(t, got.matching("opbroker_operations_contradicted"))
}

// TestLedgerLifecycle: Stop is safe without Start and idempotent; a Ledger that was
// stopped starts again; a cancelled reading does not report the database down.
func TestLedgerLifecycle(t *testing.T) {
	t.Parallel()
	st, _ := storetest.NewStore(t)
	mp, scrapeNow := meters(t)
	ledger, err := brokermetrics.NewLedger(brokermetrics.LedgerConfig{Store: st, Targets: demoTargets(t), MeterProvider: mp,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	ledger.Stop()
	require.NoError(t, ledger.Start(t.Context()))
	require.True(t, ledger.Running())
	ledger.Stop()
	ledger.Stop()
	require.False(t, ledger.Running())
	require.NoError(t, ledger.Start(t.Context()))
	ledger.Stop()

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, ledger.Refresh(context.Background()))
	require.Error(t, ledger.Refresh(cancelled))
	require.Equal(t, scrape{`opbroker_database_up{}`: 1}, scrapeNow().matching("opbroker_database_up"))
}
