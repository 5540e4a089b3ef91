package main

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/storetest"
)

// TestMain runs the tests, or, as the child process of opbench watch, the program.
func TestMain(m *testing.M) {
	if os.Getenv(asChild) != "" {
		main()
		return
	}
	storetest.Main(m)
}

// TestDispatchBenchRuns keeps the benchmark working; its numbers are not judged here.
func TestDispatchBenchRuns(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	app := newApp()
	app.Writer = &out
	require.NoError(t, app.Run(context.Background(), []string{"opbench", "dispatch", "--database-url", storetest.URL(t),
		"--ops", "50", "--rate", "100", "--period", "300ms"}))
	require.Contains(t, out.String(), "dispatch PREPARED -> SUCCEEDED: pool size 32, claim batch 64")
	for _, line := range []string{`burn-down noop +\d+ operations/s  \(50 in`, `burn-down http +\d+ operations/s  \(50 in`,
		`steady +noop +\d+ operations/s  \(\d+ offered at 100/s`, `steady +http +\d+ operations/s  \(\d+ offered at 100/s`} {
		require.Regexp(t, line, out.String())
	}
	require.Error(t, newApp().Run(context.Background(), []string{"opbench", "dispatch", "--targets", "nope"}), "an unknown target is refused")
}

func TestWatchBenchRuns(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	app := newApp()
	app.Writer = &out
	require.NoError(t, app.Run(context.Background(), []string{"opbench", "watch", "--database-url", storetest.URL(t), "--watchers", "20", "--latency-watchers", "20", "--changes", "10"}))
	require.Contains(t, out.String(), "watch: 20 idle WatchOperation streams")
	require.Contains(t, out.String(), "KB per watcher in the server")
	require.Regexp(t, `goroutine stack per idle stream: -?\d+\.\d KB`, out.String())
}

func TestPrepareBenchRuns(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	app := newApp()
	app.Writer = &out
	require.NoError(t, app.Run(context.Background(), []string{"opbench", "prepare", "--database-url", storetest.URL(t), "--period", "100ms"}))
	require.Contains(t, out.String(), "PrepareOperation over gRPC vs a plain single-row INSERT")
	require.Regexp(t, `(?m)^64 +\d+`, out.String(), "a row per concurrency")
}

func TestReconcileBenchRuns(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	app := newApp()
	app.Writer, app.ErrWriter = &out, &bytes.Buffer{}
	require.NoError(t, app.Run(context.Background(), []string{"opbench", "reconcile", "--database-url", storetest.URL(t), "--ops", "40"}))
	require.Regexp(t, `reconciliation: 40 UNKNOWN -> SUCCEEDED by lookup in .*: \d+ resolved/s`, out.String())
}

func TestLedgerBenchRuns(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	app := newApp()
	app.Writer, app.ErrWriter = &out, &bytes.Buffer{}
	require.NoError(t, app.Run(context.Background(), []string{"opbench", "ledger", "--database-url", storetest.URL(t),
		"--operations", "2000", "--period", "100ms"}))
	for _, size := range []string{"0", "200", "2000"} {
		require.Regexp(t, `(?m)^`+size+` +\d+ .*ms +\d+\.\d+ms +\d+\.\d+ms +\d+\.\d+ms +\d+\.\d+ms$`, out.String(), "a row at %s operations", size)
	}
}
