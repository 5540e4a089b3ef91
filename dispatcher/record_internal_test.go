package dispatcher

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/opbroker/opbroker/logtest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/targettest"
)

// TestAnOutcomeRecordedBeforeIsNotALostFence: an outcome tried again after its first
// try was recorded (the answer to its commit lost), once the operation has moved on, is
// logged as such, not as a lost fence, and the UNKNOWN it made is counted.
func TestAnOutcomeRecordedBeforeIsNotALostFence(t *testing.T) {
	t.Parallel()
	var logs logtest.Buffer
	f := claimOneCharge(t, slog.New(slog.NewTextHandler(&logs, nil)))
	st, c, ctx := f.st, f.claimed, context.Background()
	// The first try, recorded; its answer never reached the dispatcher.
	_, err := st.AllTenants().RecordOutcome(ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
		State: store.StateUnknown, Observation: store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "TIMEOUT"},
		Actor: "dispatcher:w"})
	require.NoError(t, err)
	_, err = st.AllTenants().ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{simtarget.DemoCharge}, Worker: "r",
		Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1}) // the operation moves on
	require.NoError(t, err)
	f.d.record(f.contract, c, target.Result{Outcome: target.Unknown, Class: "TIMEOUT", Sent: true}) // the try again

	require.Contains(t, logs.String(), "outcome recorded by an earlier try")
	require.NotContains(t, logs.String(), "fence lost")
	require.Equal(t, map[string]int64{"TIMEOUT": 1}, enteredUnknown(t, f.reader), "the UNKNOWN the first try made is counted")
}

// TestALateSuccessThatContradictsTheLedgerIsRaised: a verified success that reaches
// the ledger after the lease, once the operation ended FAILED_TERMINAL, is logged at
// error, without the target's reference: a false failure, which a person must reconcile
// (the ledger's gauge counts it for the alert).
func TestALateSuccessThatContradictsTheLedgerIsRaised(t *testing.T) {
	t.Parallel()
	var logs logtest.Buffer
	f := claimOneCharge(t, slog.New(slog.NewTextHandler(&logs, nil)))
	st, c, ctx := f.st, f.claimed, context.Background()
	swept, err := st.AllTenants().SweepExpiredLeases(ctx, store.SweepParams{Now: time.Now().Add(time.Hour), Limit: 1})
	require.NoError(t, err)
	require.Equal(t, 1, swept.Total())
	unknown, err := st.AllTenants().ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{simtarget.DemoCharge}, Worker: "r",
		Lease: time.Minute, Limit: 1, PerTenant: 1, MaxTenants: 1})
	require.NoError(t, err)
	require.Len(t, unknown, 1)
	_, err = st.AllTenants().ResolveUnknown(ctx, store.ResolveParams{TenantID: c.TenantID, ID: c.ID, Fence: unknown[0].FenceToken,
		State: store.StateFailedTerminal, Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, Actor: "r"})
	require.NoError(t, err)

	f.d.record(f.contract, c, target.Result{Outcome: target.Succeeded, Class: target.ClassVerifiedSuccess, HTTPStatus: 200,
		RemoteRef: "ch_late", Sent: true})
	require.Contains(t, logs.String(), `level=ERROR msg="the target's verified success came after the lease and contradicts the ledger`)
	require.Contains(t, logs.String(), "ledger_state=FAILED_TERMINAL")
	require.NotContains(t, logs.String(), "ch_late", "a target's reference is never logged")
	require.NotContains(t, logs.String(), "fence lost")
}

// TestAnUnknownOutcomeIsCountedByItsCause: a send recorded UNKNOWN counts once, by the
// class of its observation.
func TestAnUnknownOutcomeIsCountedByItsCause(t *testing.T) {
	t.Parallel()
	f := claimOneCharge(t, slog.New(slog.DiscardHandler))
	f.d.record(f.contract, f.claimed, target.Result{Outcome: target.Unknown, Class: "HTTP_5XX", HTTPStatus: 503, Sent: true})

	got, err := f.st.AllTenants().Get(context.Background(), "acme", f.claimed.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateUnknown, got.State)
	require.Equal(t, map[string]int64{"HTTP_5XX": 1}, enteredUnknown(t, f.reader))
}

// recordFixture is a dispatcher on a ledger of its own, the reader of its metrics, and
// the one demo charge it has claimed (tenant acme, worker w).
type recordFixture struct {
	d        *Dispatcher
	st       *store.Store
	contract *target.Contract
	reader   *sdkmetric.ManualReader
	claimed  store.Claimed
}

// claimOneCharge prepares a demo charge and claims it for a dispatcher logging to logger.
func claimOneCharge(t *testing.T, logger *slog.Logger) recordFixture {
	t.Helper()
	st, _ := storetest.NewStore(t)
	f, claimed := claimCharges(t, st, Config{Logger: logger}, 1)
	f.claimed = claimed[0]
	return f
}

// claimCharges prepares n demo charges in st and claims them for a dispatcher of cfg,
// with the demo targets and a metrics reader; f.claimed is left for the caller.
func claimCharges(t *testing.T, st *store.Store, cfg Config, n int) (recordFixture, []store.Claimed) {
	t.Helper()
	_, targets := targettest.Demo(t, simtarget.Config{})
	f := recordFixture{st: st, reader: sdkmetric.NewManualReader()}
	cfg.Store, cfg.Targets, cfg.Connector = st, targets, target.NewConnector()
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(f.reader))
	var err error
	f.d, err = New(cfg)
	require.NoError(t, err)
	var ok bool
	f.contract, ok = targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)
	for i := range n {
		storetest.PrepareJSON(t, st, "acme", simtarget.DemoCharge, fmt.Sprintf("order-%d", i+1), `{"amount":1}`)
	}
	claimed, err := st.AllTenants().Claim(context.Background(), ClaimParams(f.contract, store.FairClaim{
		OperationTypes: []string{simtarget.DemoCharge}, Worker: "w", Lease: time.Minute, Limit: n, PerTenant: n, MaxTenants: 1}))
	require.NoError(t, err)
	require.Len(t, claimed, n)
	return f, claimed
}

// enteredUnknown returns the counts of operations that became UNKNOWN, by cause.
func enteredUnknown(t *testing.T, reader sdkmetric.Reader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	entered := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "opbroker.unknown.entered" {
				for _, dp := range sum.DataPoints {
					cause, _ := dp.Attributes.Value("cause")
					entered[cause.AsString()] += dp.Value
				}
			}
		}
	}
	return entered
}

// TestAnOutcomeIsWrittenWithinTheRecordTimeout: an outcome whose database is out of
// reach is written once it is back within RecordTimeout, and given up at about
// RecordTimeout when it is not (its statement may still be written later; if not, the
// lease ends and the sweeper makes the operation UNKNOWN), not waited for as long as a
// statement may take.
func TestAnOutcomeIsWrittenWithinTheRecordTimeout(t *testing.T) {
	t.Parallel()
	const recordTimeout = 2 * time.Second
	st, _, proxy := storetest.NewStoreBehindProxy(t)
	t.Cleanup(proxy.Thaw)
	f, claimed := claimCharges(t, st, Config{Logger: slog.New(slog.DiscardHandler), RecordTimeout: recordTimeout}, 2)
	d, contract := f.d, f.contract
	succeeded := target.Result{Outcome: target.Succeeded, Class: "SUCCEEDED", RemoteRef: "ch_1", Sent: true}
	state := func(c store.Claimed) store.State {
		got, err := st.AllTenants().Get(context.Background(), c.TenantID, c.ID)
		require.NoError(t, err)
		return got.State
	}

	proxy.Freeze()
	time.AfterFunc(recordTimeout/4, proxy.Thaw)
	d.record(contract, claimed[0], succeeded)
	require.Equal(t, store.StateSucceeded, state(claimed[0]), "written once the database was back")

	proxy.Freeze()
	began := time.Now()
	d.record(contract, claimed[1], succeeded)
	took := time.Since(began)
	proxy.Thaw()
	require.Less(t, took, 2*recordTimeout, "given up at about the record timeout")
	require.GreaterOrEqual(t, took, recordTimeout)
}

// TestOutcomesBegunTogetherShareADeadline: the outcomes that begin within a hundredth of
// RecordTimeout are written on one context, each with at least RecordTimeout left; a
// later one gets a context of its own, which ends later.
func TestOutcomesBegunTogetherShareADeadline(t *testing.T) {
	t.Parallel()
	const recordTimeout = 20 * time.Second // a hundredth: 200 ms
	d := &Dispatcher{cfg: Config{RecordTimeout: recordTimeout}}
	first, made := d.recordContext(), time.Now()
	second, at := d.recordContext(), time.Now()
	require.Same(t, first, second, "begun within the hundredth: one context")
	deadline, ok := second.Deadline()
	require.True(t, ok)
	require.GreaterOrEqual(t, deadline.Sub(at), recordTimeout, "the later of the two still has the whole timeout")
	require.LessOrEqual(t, deadline.Sub(made), recordTimeout+recordTimeout/100, "and at most a hundredth more")

	time.Sleep(recordTimeout/100 + 50*time.Millisecond)
	third := d.recordContext()
	require.NotSame(t, first, third, "begun after the hundredth: a context of its own")
	later, _ := third.Deadline()
	require.True(t, later.After(deadline))
}
