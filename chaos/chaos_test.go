package chaos_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/brokertest"
	"github.com/opbroker/opbroker/chaos"
	"github.com/opbroker/opbroker/formation"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/storetest"
)

// broker is the opbroker the tests run as processes.
var broker string

func TestMain(m *testing.M) {
	var remove func()
	var err error
	if broker, remove, err = brokertest.Build("../cmd/opbroker", "opchaos-bin-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	remove()
	os.Exit(code)
}

// TestShortChaosRun is the short, fixed-seed chaos run: three replicas as processes,
// every fault of the targets, crash points, kill -9, SIGSTOP past the lease,
// pg_terminate_backend, a rotation of a target's credential and (on the embedded
// PostgreSQL) an immediate restart, every fault of the charge target's webhooks, then
// the audit of I1–I16.
func TestShortChaosRun(t *testing.T) {
	var log bytes.Buffer
	report, err := chaos.Run(context.Background(), chaos.Config{
		Seed: 20261130, Broker: broker, DatabaseURL: os.Getenv(storetest.EnvDatabaseURL),
		Intents: 60, Tenants: 4, FaultInterval: 500 * time.Millisecond,
		ResolutionDeadline: 6 * time.Second, SettleBound: 45 * time.Second, Log: &log,
	})
	require.NoError(t, err, log.String())
	var text bytes.Buffer
	report.WriteText(&text)
	t.Log(text.String())

	require.True(t, report.Passed(), text.String())
	require.Zero(t, report.Lost+report.Duplicated+report.Unconfirmed+report.FalseFailed)
	require.True(t, report.Settled, "the work settles after healing")
	for _, kind := range []string{"kill -9 of a replica", "SIGSTOP of a replica past its lease",
		"pg_terminate_backend of the replicas' connections", "credential rotation"} {
		require.Positive(t, report.Faults[kind], "%s never happened", kind)
	}
	if os.Getenv(storetest.EnvDatabaseURL) == "" {
		require.Positive(t, report.Faults["PostgreSQL immediate restart"])
	}
	require.Positive(t, report.Crashes)
	require.Positive(t, report.Recovered, "some operations went through UNKNOWN and were resolved")
	require.Positive(t, report.Probes)
	require.Positive(t, report.Amendments, "some amendments were recorded")
	require.Positive(t, report.ResolvedByHand, "the operator resolved the escalations through the API; the run's log ends:\n%s", logTail(&log, 40))
	require.Positive(t, report.Pending, "some answers were pending")
	require.Positive(t, report.Resent, "some operations were sent again after an answer documented as not executed")
	for _, f := range simtarget.WebhookFaults {
		require.Positive(t, report.Faults["webhook: "+string(f)], "no charge's webhooks had the fault %s", f)
	}
	require.True(t, report.Evidence.Settled, "every delivery ended and every event was decided; the run's log ends:\n%s", logTail(&log, 40))
	require.Positive(t, report.Evidence.Applied, "some webhooks resolved their operations")
	require.Positive(t, report.Evidence.Forged, "some deliveries were signed with a wrong secret")
	require.Positive(t, report.Evidence.Reported, "the reporter reported some events")
	require.Positive(t, report.Evidence.ReportedForAnotherTenant, "one of them for another tenant")
	for _, reason := range []string{"UNMATCHED", "TENANT_CONFLICT", "PAYLOAD_MISMATCH"} {
		require.Positive(t, report.Evidence.Quarantined[reason], "no event was quarantined as %s", reason)
	}
}

// TestShortChaosRunWithFailovers is the short run on a replicated PostgreSQL (package
// formation): its primary killed, then stopped, and more at random (every 20 s on
// average), each returning as a standby, beside every other fault, then the same audit. It runs when
// formation.EnvTest is 1 (make test-ha, .ci/run).
func TestShortChaosRunWithFailovers(t *testing.T) {
	if os.Getenv(formation.EnvTest) != "1" {
		t.Skipf("set %s=1 to run the chaos run with failovers (make test-ha)", formation.EnvTest)
	}
	var log bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	report, err := chaos.Run(ctx, chaos.Config{
		Seed: 20261201, Broker: broker, Failover: true, FailoverInterval: 20 * time.Second,
		Intents: 60, Tenants: 4, FaultInterval: time.Second,
		ResolutionDeadline: 6 * time.Second, SettleBound: 90 * time.Second, Log: &log,
	})
	require.NoError(t, err, log.String())
	var text bytes.Buffer
	report.WriteText(&text)
	t.Log(text.String())
	t.Log(log.String())

	require.NoError(t, ctx.Err(), "the run did not end within 10 minutes")
	require.True(t, report.Passed(), text.String())
	require.Zero(t, report.Lost+report.Duplicated+report.Unconfirmed+report.FalseFailed)
	require.True(t, report.Settled, "the work settles after healing")
	for _, kind := range []string{"kill -9 of the PostgreSQL primary", "SIGSTOP of the PostgreSQL primary (a partition)"} {
		require.Positive(t, report.Faults[kind], "%s never happened", kind)
	}
	require.GreaterOrEqual(t, len(report.Failovers), 2)
	for _, f := range report.Failovers {
		require.Empty(t, f.Error, "%s went wrong", f.Fault)
		require.Positive(t, f.NewPrimary, "%s: no new primary", f.Fault)
		require.True(t, f.Recovered, "%s: the prober's calls failed to the end", f.Fault)
	}
}

// logTail is the last n lines of a run's log, for a failure's message.
func logTail(log *bytes.Buffer, n int) string {
	lines := strings.Split(strings.TrimRight(log.String(), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
