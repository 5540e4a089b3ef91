package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/embeddedpg"
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
		"--ops", "50", "--rate", "100", "--period", "300ms", "--payload-bytes", "2000"}))
	require.Contains(t, out.String(), "dispatch PREPARED -> SUCCEEDED: pool size 32, claim batch 512")
	require.Contains(t, out.String(), "a 2000-byte payload")
	for _, line := range []string{`burn-down noop +\d+ operations/s  \(50 in \S+\); per operation: PostgreSQL CPU \S+( ms)?, WAL [1-9]\d* B`, `burn-down http +\d+ operations/s  \(50 in`,
		`steady +noop +\d+ operations/s  \(\d+ offered at 100/s`, `steady +http +\d+ operations/s  \(\d+ offered at 100/s`} {
		require.Regexp(t, line, out.String())
	}
	require.Error(t, newApp().Run(context.Background(), []string{"opbench", "dispatch", "--targets", "nope"}), "an unknown target is refused")
	require.ErrorContains(t, newApp().Run(context.Background(), []string{"opbench", "dispatch", "--rate", "0"}), "--rate",
		"a steady stream of no intents is refused, not divided by")
}

// TestCompareRiverRuns runs the comparison with a stand-in for the bench/river program
// (building River here would fetch its modules): the broker's side, the rounds and the
// protocol between the two programs.
func TestCompareRiverRuns(t *testing.T) {
	t.Parallel()
	fake := filepath.Join(t.TempDir(), "river")
	require.NoError(t, os.WriteFile(fake, []byte(`#!/bin/sh
echo loaded
read go || exit 3
echo completed
echo '{"jobs":50,"seconds":0.01,"river":"v0.0.0-fake","workers":2000,"fetch_cooldown":"2ms","fetch_poll_interval":"20ms","max_conns":4}'
`), 0o755))
	url := storetest.URL(t)
	var out bytes.Buffer
	app := newApp()
	app.Writer, app.ErrWriter = &out, &bytes.Buffer{}
	require.NoError(t, app.Run(context.Background(), []string{"opbench", "compare-river", "--database-url", url,
		"--ops", "50", "--rounds", "2", "--river-bench", fake}))
	cost := `PostgreSQL CPU (\d+\.\d{3} ms|-), WAL \d+ B, \d+\.\d{4} write transactions; client CPU \d+\.\d{3} ms`
	require.Regexp(t, `(?m)^1 +River +\S+ +5000 +\d+ +\d+\.\d{3}  River `+cost+`; opbroker `+cost+`$`, out.String())
	require.Regexp(t, `(?m)^2 +opbroker +\S+ +5000 +\d+ +\d+\.\d{3}  River `+cost+`; opbroker `+cost+`$`, out.String())
	require.Regexp(t, `(?m)^median +5000 +\d+ +\d+\.\d{3}  River PostgreSQL CPU \d+\.\d{3} ms, WAL \d+ B, client CPU \d+\.\d{3} ms; `+
		`opbroker PostgreSQL CPU \d+\.\d{3} ms, WAL [1-9]\d* B, client CPU \d+\.\d{3} ms$`, out.String())
	require.Regexp(t, `(?m)^  by the CPU both sides spend per unit \(the medians of PostgreSQL's and the client's\): \d+\.\d\d$`, out.String())
	require.Contains(t, out.String(), "River v0.0.0-fake: its library and pgx driver (bench/river), MaxWorkers 2000")
	require.Contains(t, out.String(), "the PostgreSQL of --database-url: autovacuum ")

	app = newApp()
	app.Writer, app.ErrWriter = &bytes.Buffer{}, &bytes.Buffer{}
	err := app.Run(context.Background(), []string{"opbench", "compare-river", "--database-url", url,
		"--ops", "40", "--rounds", "1", "--river-bench", fake})
	require.ErrorContains(t, err, "50 jobs in 0.01s, asked for 40", "a burn-down of another size is refused")

	silent := filepath.Join(t.TempDir(), "river")
	require.NoError(t, os.WriteFile(silent, []byte("#!/bin/sh\necho '{\"jobs\":50}'\n"), 0o755))
	app = newApp()
	app.Writer, app.ErrWriter = &bytes.Buffer{}, &bytes.Buffer{}
	err = app.Run(context.Background(), []string{"opbench", "compare-river", "--database-url", url,
		"--ops", "50", "--rounds", "1", "--river-bench", silent})
	require.ErrorContains(t, err, `expected "loaded"`, "a program that does not say where its burn-down begins is refused")
}

// TestMeasureCostCountsToTheEnd checks that the cost of a stretch of work includes its
// end: the client's CPU spent after the sampler's last tick counts (the sampler reads
// /proc a few times a second, and a burn-down lasts about a second).
func TestMeasureCostCountsToTheEnd(t *testing.T) {
	t.Parallel()
	admin, err := pgxpool.New(context.Background(), storetest.URL(t))
	require.NoError(t, err)
	defer admin.Close()
	self := os.Getpid()
	stop, err := measureCost(context.Background(), admin, self)
	require.NoError(t, err)
	began, ok := processCPU(self)
	require.True(t, ok, "this process's CPU time is read from /proc")
	var spent time.Duration
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && spent-began < 100*time.Millisecond; {
		spent, _ = processCPU(self)
	}
	c, err := stop()
	require.NoError(t, err)
	require.True(t, c.clientKnown)
	require.GreaterOrEqual(t, c.clientCPU, spent-began, "the CPU spent up to the stop counts")

	none, err := measureCost(context.Background(), admin, 0)
	require.NoError(t, err)
	c, err = none()
	require.NoError(t, err)
	require.False(t, c.clientKnown, "no client, no client CPU")
	require.Contains(t, c.per(1), "client CPU -")
}

// TestSummarize checks the comparison's arithmetic: the median of an even number of
// rounds is the mean of the middle two; the ratio by CPU per unit is the medians'.
func TestSummarize(t *testing.T) {
	t.Parallel()
	require.Equal(t, spread{median: 2, min: 1, max: 9}, summarize([]float64{9, 1, 2}))
	require.Equal(t, spread{median: 2.5, min: 1, max: 9}, summarize([]float64{3, 9, 1, 2}))
	require.Equal(t, spread{median: 4, min: 4, max: 4}, summarize([]float64{4}))
	require.Equal(t, "1.000-9.000", summarize([]float64{1, 9}).format("%.3f"))

	median := func(s spread, verb string) string { return fmt.Sprintf(verb, s.median) }
	require.Equal(t, "PostgreSQL CPU 0.050 ms, WAL 1900 B, client CPU 0.020 ms",
		sideCosts(2, []float64{0.04, 0.06}, []float64{1800, 2000}, []float64{0.01, 0.03}, median))
	require.Equal(t, "PostgreSQL CPU -, WAL 1800-2000 B, client CPU 0.010-0.030 ms",
		sideCosts(2, []float64{0.04}, []float64{1800, 2000}, []float64{0.01, 0.03}, spread.format),
		"a CPU unknown in a round is not summarized from the others")

	// (0.064 + 0.025) / (0.090 + 0.033): the medians, not the rounds' own ratios.
	// The rounds' own ratios are 0.72, 0.64 and 0.64.
	ratio, ok := cpuRatio(3, [2][]float64{{0.064, 0.070, 0.060}, {0.090, 0.120, 0.080}},
		[2][]float64{{0.025, 0.020, 0.030}, {0.033, 0.020, 0.060}})
	require.True(t, ok)
	require.InDelta(t, 0.089/0.123, ratio, 1e-9)
	_, ok = cpuRatio(3, [2][]float64{{0.064, 0.070, 0.060}, {0.090, 0.120}}, [2][]float64{{0.025, 0.020, 0.030}, {0.033, 0.033, 0.040}})
	require.False(t, ok, "not known unless every round measured every part")
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
		"--operations", "2000", "--period", "100ms", "--backlog", "128"}))
	for _, size := range []string{"0", "200", "2000"} {
		require.Regexp(t, `(?m)^`+size+` +\d+ .*ms +\d+\.\d+ms +\d+\.\d+ms +\d+\.\d+ms +\d+\.\d+ms$`, out.String(), "a row at %s operations", size)
	}
}

// TestRiversProgramIsBuiltIntoALockedFolder: compare-river builds River's program into
// a folder locked while the run lives, so that a later run removes it only if this one
// was killed, and removes it itself when done. A module of one empty command stands in
// for bench/river.
func TestRiversProgramIsBuiltIntoALockedFolder(t *testing.T) {
	root, tmp := t.TempDir(), t.TempDir()
	module := filepath.Join(root, "bench", "river")
	require.NoError(t, os.MkdirAll(module, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(module, "go.mod"), []byte("module river\n\ngo 1.26\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(module, "main.go"), []byte("package main\n\nfunc main() {}\n"), 0o644))
	t.Chdir(root)
	t.Setenv("TMPDIR", tmp)

	bin, remove, err := riverProgram(context.Background(), "", io.Discard)
	require.NoError(t, err)
	require.FileExists(t, bin)
	dir := filepath.Dir(bin)
	require.Equal(t, tmp, filepath.Dir(dir))
	old := time.Now().Add(-2 * time.Minute) // as old as a killed run's
	require.NoError(t, os.Chtimes(filepath.Join(dir, "lock"), old, old))
	embeddedpg.RemoveOrphans(tmp, riverFolder)
	require.FileExists(t, bin, "a live run's folder is kept")
	remove()
	require.NoDirExists(t, dir)
}
