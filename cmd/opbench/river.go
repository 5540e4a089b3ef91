package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/embeddedpg"
)

// benchCompareRiver burns down the same number of no-op jobs with River's engine (the
// program in bench/river, a module of its own) and no-op operations with the broker's
// dispatcher, on the same PostgreSQL, alternating which goes first, each on a fresh
// schema; and prints both rates per round and the median and range of both rates and of
// their ratio. Each side is timed by its own completion signal, not by polling.
func benchCompareRiver(ctx context.Context, cmd *cli.Command) error {
	n, rounds := cmd.Int("ops"), cmd.Int("rounds")
	if n <= 0 || rounds <= 0 {
		return fmt.Errorf("--ops and --rounds must be positive")
	}
	out, errOut := cmd.Root().Writer, cmd.Root().ErrWriter
	bin, removeBin, err := riverProgram(ctx, cmd.String("river-bench"), errOut)
	if err != nil {
		return err
	}
	defer removeBin()
	url, stopCluster, err := cluster(ctx, cmd.String("database-url"))
	if err != nil {
		return err
	}
	defer stopCluster()
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer admin.Close()
	rc := runConfig{target: "noop", rls: true, tenants: cmd.Int("tenants"), poolSize: cmd.Int("pool-size"), claimBatch: cmd.Int("claim-batch")}
	limit := cmd.Duration("limit")

	fmt.Fprintf(out, "burn-down of %d no-op jobs (River) and %d no-op operations (opbroker) on the same PostgreSQL, alternating which goes first, each on a fresh schema; rounds: %d\n",
		n, n, rounds)
	fmt.Fprintf(out, "%-5s  %-8s  %-8s  %14s  %14s  %14s  %s\n", "round", "first", "load", "River jobs/s", "opbroker ops/s", "opbroker/River",
		"PostgreSQL's cost per job (River) and per operation (opbroker)")
	var riverRates, opRates, ratios []float64
	var cpus, wals, clients [2][]float64 // River's, opbroker's
	var riverRun riverResult
	var where, settings string
	for round := 1; round <= rounds; round++ {
		load := loadAverage()
		var riverSecs, opSecs float64
		var riverCost, opCost workCost
		side := func(river bool) error {
			if river {
				res, cost, err := runRiver(ctx, bin, url, admin, n, cmd.Int("river-workers"), limit, errOut)
				riverRun, riverSecs, riverCost = res, res.Seconds, cost
				return err
			}
			run, err := newDispatchRun(ctx, url, rc)
			if err != nil {
				return err
			}
			defer run.close()
			elapsed, cost, err := run.timedBurnDown(ctx, n, limit)
			opSecs, opCost = elapsed.Seconds(), cost
			if where == "" {
				where, settings = machine(ctx, run.pool), pgSettings(ctx, run.pool, cmd.String("database-url") == "")
			}
			return err
		}
		riverFirst := round%2 == 1
		name := map[bool]string{true: "River", false: "opbroker"}
		for _, river := range []bool{riverFirst, !riverFirst} {
			if err := side(river); err != nil {
				return fmt.Errorf("round %d, %s: %w", round, name[river], err)
			}
		}
		riverRate, opRate := float64(n)/riverSecs, float64(n)/opSecs
		riverRates, opRates, ratios = append(riverRates, riverRate), append(opRates, opRate), append(ratios, opRate/riverRate)
		for i, c := range []workCost{riverCost, opCost} {
			wals[i] = append(wals[i], float64(c.walBytes)/float64(n))
			if c.cpuKnown {
				cpus[i] = append(cpus[i], millisPer(c.cpu, n))
			}
			if c.clientKnown {
				clients[i] = append(clients[i], millisPer(c.clientCPU, n))
			}
		}
		fmt.Fprintf(out, "%-5d  %-8s  %-8s  %14.0f  %14.0f  %14.3f  River %s; opbroker %s\n", round, name[riverFirst], load, riverRate, opRate,
			opRate/riverRate, riverCost.per(n), opCost.per(n))
	}
	r, o, q := summarize(riverRates), summarize(opRates), summarize(ratios)
	costs := func(i int, of func(spread, string) string) string {
		return sideCosts(len(ratios), cpus[i], wals[i], clients[i], of)
	}
	median := func(s spread, verb string) string { return fmt.Sprintf(verb, s.median) }
	fmt.Fprintf(out, "%-5s  %-8s  %-8s  %14.0f  %14.0f  %14.3f  River %s; opbroker %s\n",
		"median", "", "", r.median, o.median, q.median, costs(0, median), costs(1, median))
	fmt.Fprintf(out, "%-5s  %-8s  %-8s  %14s  %14s  %14s  River %s; opbroker %s\n",
		"range", "", "", r.format("%.0f"), o.format("%.0f"), q.format("%.3f"), costs(0, spread.format), costs(1, spread.format))
	if ratio, ok := cpuRatio(len(ratios), cpus, clients); ok {
		fmt.Fprintf(out, "  by the CPU both sides spend per unit (the medians of PostgreSQL's and the client's): %.2f\n", ratio)
	}
	fmt.Fprintf(out, "  River %s: its library and pgx driver (bench/river), MaxWorkers %d, FetchCooldown %s, FetchPollInterval %s, pool of %d connections;\n",
		riverRun.River, riverRun.Workers, riverRun.FetchCooldown, riverRun.FetchPollInterval, riverRun.MaxConns)
	fmt.Fprintf(out, "    jobs inserted with InsertMany, timed from Client.Start to the last job-completed event (sent after the completion's commit)\n")
	fmt.Fprintf(out, "  opbroker: the dispatcher with a no-op sender in process, pool size %d, claim batch %d, %d tenants, row-level security on;\n",
		rc.poolSize, rc.claimBatch, rc.tenants)
	fmt.Fprintf(out, "    operations prepared through the store, timed from Dispatcher.Start to the events wake-up of the commit that left none unfinished\n")
	fmt.Fprintf(out, "  load: the 1-minute load average as the round began\n")
	fmt.Fprintf(out, "  PostgreSQL's cost, during each side's burn-down alone (not its loading), per job or operation: the CPU of every process named postgres\n")
	fmt.Fprintf(out, "    on this machine (from /proc), the WAL written, the transaction ids assigned; client CPU: of River's program, and of this process\n")
	fmt.Fprintf(out, "    for opbroker (its dispatcher and store; and the sampling of /proc, a few milliseconds a second)\n")
	fmt.Fprintf(out, "  Go's collector: River's program at GOGC %s; this process at the broker's (below)\n", cmp.Or(os.Getenv("GOGC"), "100 (Go's default)"))
	fmt.Fprintf(out, "  %s\n  %s\n", where, settings)
	return nil
}

// sideCosts formats one side's PostgreSQL CPU, WAL and client CPU per unit over rounds
// rounds, each by of (its median, or its range); a CPU not known in every round is "-".
func sideCosts(rounds int, cpu, wal, client []float64, of func(spread, string) string) string {
	val := func(xs []float64, verb, unit string) string {
		if len(xs) < rounds {
			return "-"
		}
		return of(summarize(xs), verb) + unit
	}
	return fmt.Sprintf("PostgreSQL CPU %s, WAL %s, client CPU %s", val(cpu, "%.3f", " ms"), val(wal, "%.0f", " B"), val(client, "%.3f", " ms"))
}

// cpuRatio is the two sides' ratio by the CPU each spends per unit, from the medians
// over rounds rounds: River's PostgreSQL CPU and its program's per job, over
// opbroker's PostgreSQL CPU and its process's per operation. Both burn-downs keep the
// machine's cores busy, so it is what the ratio of the rates comes to without the
// rounds' noise. It is not known unless every round measured all four.
func cpuRatio(rounds int, cpus, clients [2][]float64) (float64, bool) {
	for i := range 2 {
		if len(cpus[i]) < rounds || len(clients[i]) < rounds {
			return 0, false
		}
	}
	per := func(i int) float64 { return summarize(cpus[i]).median + summarize(clients[i]).median }
	return per(0) / per(1), true
}

// spread is the median and range of a measurement over the rounds.
type spread struct{ median, min, max float64 }

func summarize(xs []float64) spread {
	s := slices.Sorted(slices.Values(xs))
	if len(s) == 0 {
		return spread{}
	}
	m := len(s) / 2
	median := s[m]
	if len(s)%2 == 0 {
		median = (s[m-1] + s[m]) / 2
	}
	return spread{median: median, min: s[0], max: s[len(s)-1]}
}

func (s spread) format(verb string) string {
	return fmt.Sprintf(verb+"-"+verb, s.min, s.max)
}

// riverResult is what the bench/river program prints: one line of JSON.
type riverResult struct {
	Jobs              int     `json:"jobs"`
	Seconds           float64 `json:"seconds"`
	River             string  `json:"river"`
	Workers           int     `json:"workers"`
	FetchCooldown     string  `json:"fetch_cooldown"`
	FetchPollInterval string  `json:"fetch_poll_interval"`
	MaxConns          int32   `json:"max_conns"`
}

// runRiver runs one River burn-down of n jobs on the PostgreSQL at url, and measures
// what PostgreSQL spends on it (admin reads the server's counters) from the program's
// "loaded" to its "completed" (bench/river).
func runRiver(ctx context.Context, bin, url string, admin *pgxpool.Pool, n, workers int, limit time.Duration, errOut io.Writer) (riverResult, workCost, error) {
	c := exec.CommandContext(ctx, bin, "--database-url", url, "--jobs", strconv.Itoa(n),
		"--workers", strconv.Itoa(workers), "--limit", limit.String())
	c.Stderr = errOut
	// Interrupted, the program stops its client and drops its schema before it exits.
	c.Cancel = func() error { return c.Process.Signal(os.Interrupt) }
	c.WaitDelay = 30 * time.Second
	stdin, err := c.StdinPipe()
	if err != nil {
		return riverResult{}, workCost{}, err
	}
	stdout, err := c.StdoutPipe()
	if err != nil {
		return riverResult{}, workCost{}, err
	}
	if err := c.Start(); err != nil {
		return riverResult{}, workCost{}, fmt.Errorf("%s: %w", bin, err)
	}
	res, cost, talkErr := talkToRiver(ctx, admin, c.Process.Pid, bufio.NewScanner(stdout), stdin)
	_ = stdin.Close()
	if err := c.Wait(); err != nil {
		return riverResult{}, workCost{}, errors.Join(fmt.Errorf("%s: %w", bin, err), talkErr)
	}
	if talkErr != nil {
		return riverResult{}, workCost{}, fmt.Errorf("%s: %w", bin, talkErr)
	}
	if res.Jobs != n || res.Seconds <= 0 {
		return riverResult{}, workCost{}, fmt.Errorf("%s: %d jobs in %gs, asked for %d", bin, res.Jobs, res.Seconds, n)
	}
	return res, cost, nil
}

// talkToRiver follows the output of the program (process pid): at "loaded" it starts
// measuring and lets the burn-down begin, at "completed" it stops, and the last line is
// the result.
func talkToRiver(ctx context.Context, admin *pgxpool.Pool, pid int, out *bufio.Scanner, in io.Writer) (riverResult, workCost, error) {
	expect := func(want string) error {
		if !out.Scan() {
			return fmt.Errorf("ended before %q: %v", want, out.Err())
		}
		if got := out.Text(); got != want {
			return fmt.Errorf("printed %q, expected %q", got, want)
		}
		return nil
	}
	if err := expect("loaded"); err != nil {
		return riverResult{}, workCost{}, err
	}
	stop, err := measureCost(ctx, admin, pid)
	if err != nil {
		return riverResult{}, workCost{}, err
	}
	if _, err := io.WriteString(in, "go\n"); err != nil {
		_, _ = stop()
		return riverResult{}, workCost{}, err
	}
	err = expect("completed")
	cost, costErr := stop()
	if err := errors.Join(err, costErr); err != nil {
		return riverResult{}, workCost{}, err
	}
	if !out.Scan() {
		return riverResult{}, workCost{}, fmt.Errorf("ended before its result: %v", out.Err())
	}
	var res riverResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		return riverResult{}, workCost{}, fmt.Errorf("printed %q: %w", out.Text(), err)
	}
	return res, cost, nil
}

// riverFolder begins the names of the folders River's program is built into.
const riverFolder = "opbench-river-"

// riverProgram returns the River burn-down program: path when given, else one built
// from ./bench/river (the working directory is the repository's root, as in make bench)
// into a temporary folder, with a function that removes it. The folder is locked while
// this process lives (embeddedpg.TempFolder): a later run removes it if this one is
// killed before it does.
func riverProgram(ctx context.Context, path string, errOut io.Writer) (string, func(), error) {
	if path != "" {
		return path, func() {}, nil
	}
	dir, remove, err := embeddedpg.TempFolder(riverFolder)
	if err != nil {
		return "", nil, err
	}
	bin := filepath.Join(dir, "river")
	build := exec.CommandContext(ctx, "go", "build", "-ldflags=-s -w", "-o", bin, ".")
	build.Dir = filepath.Join("bench", "river")
	build.Stdout, build.Stderr = errOut, errOut
	if err := build.Run(); err != nil {
		remove()
		return "", nil, fmt.Errorf("building ./bench/river (run from the repository's root, or pass --river-bench): %w", err)
	}
	return bin, remove, nil
}

// pgSettings describes the server and the settings that change a burn-down, beyond
// machine's.
func pgSettings(ctx context.Context, pool *pgxpool.Pool, embedded bool) string {
	var autovacuum, maxWAL, maxConns string
	_ = pool.QueryRow(ctx, `SELECT current_setting('autovacuum'), current_setting('max_wal_size'), current_setting('max_connections')`).
		Scan(&autovacuum, &maxWAL, &maxConns)
	server := "the PostgreSQL of --database-url"
	if embedded {
		server = "an embedded PostgreSQL started for the run"
	}
	s := fmt.Sprintf("%s: autovacuum %s, max_wal_size %s, max_connections %s", server, autovacuum, maxWAL, maxConns)
	if autovacuum == "off" {
		s += "; with autovacuum off nothing removes the dead row versions a burn-down leaves within its round (the next round starts on a fresh schema)"
	}
	return s
}

// loadAverage is the 1-minute load average, or "-" where /proc does not give it.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "-"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "-"
}
