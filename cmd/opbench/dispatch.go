package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// benchDispatch measures the dispatcher from PREPARED to SUCCEEDED, with the full audit
// trail written (a claim with its event, an outcome with its event),
// for each target and mode asked, each on a fresh schema of the same PostgreSQL.
func benchDispatch(ctx context.Context, cmd *cli.Command) error {
	for _, t := range cmd.StringSlice("targets") {
		if t != "noop" && t != "http" {
			return fmt.Errorf("--targets: %q is neither noop nor http", t)
		}
	}
	for _, m := range cmd.StringSlice("modes") {
		switch {
		case m != "burn-down" && m != "steady":
			return fmt.Errorf("--modes: %q is neither burn-down nor steady", m)
		case m == "steady" && (cmd.Int("rate") <= 0 || cmd.Duration("period") <= 0):
			return errors.New("--rate and --period must be positive for the steady stream (or --modes burn-down alone)")
		case m == "burn-down" && cmd.Int("ops") <= 0:
			return errors.New("--ops must be positive for the burn-down")
		}
	}
	url, stopCluster, err := cluster(ctx, cmd.String("database-url"))
	if err != nil {
		return err
	}
	defer stopCluster()
	stopProfile, err := profile(cmd)
	if err != nil {
		return err
	}
	defer stopProfile()

	out := cmd.Root().Writer
	rls := map[bool]string{true: "on (an ordinary role)", false: "bypassed (the administrator)"}[cmd.Bool("rls")]
	fmt.Fprintf(out, "dispatch PREPARED -> SUCCEEDED: pool size %d, claim batch %d, %d tenants, row-level security %s\n",
		cmd.Int("pool-size"), cmd.Int("claim-batch"), cmd.Int("tenants"), rls)
	body := payloadOf(cmd.Int("payload-bytes"))
	fmt.Fprintf(out, "  every operation: claim + event, then outcome + event (which records whether the request left); durable commits; a %d-byte payload\n", len(body))
	var where string
	for _, mode := range cmd.StringSlice("modes") {
		for _, tgt := range cmd.StringSlice("targets") {
			run, err := newDispatchRun(ctx, url, runConfig{target: tgt, rls: cmd.Bool("rls"), tenants: cmd.Int("tenants"),
				poolSize: cmd.Int("pool-size"), claimBatch: cmd.Int("claim-batch"), body: body})
			if err != nil {
				return err
			}
			var line string
			if mode == "burn-down" {
				line, err = run.burnDown(ctx, cmd.Int("ops"))
			} else {
				line, err = run.steady(ctx, cmd.Int("rate"), cmd.Duration("period"))
			}
			if where == "" {
				where = machine(ctx, run.pool)
			}
			run.close()
			if err != nil {
				return fmt.Errorf("%s, %s target: %w", mode, tgt, err)
			}
			fmt.Fprintf(out, "  %-9s %-4s  %s\n", mode, tgt, line)
		}
	}
	fmt.Fprintf(out, "  noop: the target answers at once, in process; http: the simulated target, in process over loopback HTTP\n")
	fmt.Fprintf(out, "  %s\n", where)
	return nil
}

// noopSender answers every send at once as a success, without a network: what is left
// is the broker's own cost per operation.
type noopSender struct{ n atomic.Int64 }

func (s *noopSender) Send(_ context.Context, req target.Request) target.Result {
	if req.OnSent != nil {
		req.OnSent()
	}
	return target.Result{Outcome: target.Succeeded, Class: "NOOP", RemoteRef: fmt.Sprint("noop_", s.n.Add(1)), Sent: true}
}

func (s *noopSender) CredentialVersion(*target.Contract) string { return "" }

// dispatchRun is one measurement: a fresh schema, a target and a dispatcher for it.
type dispatchRun struct {
	pool   *pgxpool.Pool
	reader *pgxpool.Pool // the administrator's, for the measurements

	st      *store.Store
	sim     *simtarget.Server
	targets *target.Targets
	d       *dispatcher.Dispatcher
	noop    *noopSender // the dispatcher's sender, when the target is noop
	tenants int
	body    []byte
	seq     atomic.Int64
	close   func()
}

// runConfig says what a dispatchRun measures with.
type runConfig struct {
	target               string // noop or http
	rls                  bool
	tenants              int
	poolSize, claimBatch int
	sim                  simtarget.Config
	body                 []byte // of every intent; default benchBody
}

func newDispatchRun(ctx context.Context, url string, rc runConfig) (*dispatchRun, error) {
	pool, dropDatabase, err := database(ctx, url, rc.rls)
	if err != nil {
		return nil, err
	}
	// The measurements read the ledger beneath the store they measure, as the
	// administrator (row-level security does not bind it).
	readerCfg := pool.Config().Copy()
	delete(readerCfg.ConnConfig.RuntimeParams, "role")
	reader, err := pgxpool.NewWithConfig(ctx, readerCfg)
	if err != nil {
		dropDatabase()
		return nil, err
	}
	drop := func() { reader.Close(); dropDatabase() }
	sim, err := simtarget.Start(rc.sim)
	if err != nil {
		drop()
		return nil, err
	}
	closeAll := func() { sim.Close(); drop() }
	targets, err := sim.Targets()
	if err != nil {
		closeAll()
		return nil, err
	}
	var sender dispatcher.Sender = target.NewConnector()
	var noopTarget *noopSender
	if rc.target == "noop" {
		noopTarget = &noopSender{}
		sender = noopTarget
	}
	st := store.New(pool)
	d, err := dispatcher.New(dispatcher.Config{
		Store: st, Targets: targets, Connector: sender,
		Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider(),
		PoolSize: rc.poolSize, ClaimBatch: rc.claimBatch,
	})
	if err != nil {
		closeAll()
		return nil, err
	}
	body := rc.body
	if body == nil {
		body = benchBody
	}
	return &dispatchRun{pool: pool, reader: reader, st: st, sim: sim, targets: targets, d: d, noop: noopTarget, tenants: max(1, rc.tenants), body: body,
		close: func() { d.Stop(); closeAll() }}, nil
}

// prepare records one new intent, in the tenants in turn.
func (r *dispatchRun) prepare(ctx context.Context) error {
	i := r.seq.Add(1)
	_, err := prepareIntent(ctx, r.st, fmt.Sprintf("tenant-%d", i%int64(r.tenants)), fmt.Sprintf("bench-%d", i), r.body)
	return err
}

// waitFor waits until n operations are in state and returns when that was seen.
func (r *dispatchRun) waitFor(ctx context.Context, state store.State, n int, limit time.Duration) (time.Time, error) {
	deadline := time.Now().Add(limit)
	for {
		counts, err := r.countByState(ctx)
		if err != nil {
			return time.Time{}, err
		}
		if int(counts[state]) >= n {
			return time.Now(), nil
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("%d of %d %s after %s (%v)", counts[state], n, state, limit, counts)
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return time.Time{}, err
		}
	}
}

// burnDown prepares a backlog of n, then times the dispatcher's work through it
// (timedBurnDown).
func (r *dispatchRun) burnDown(ctx context.Context, n int) (string, error) {
	elapsed, spent, err := r.timedBurnDown(ctx, n, 10*time.Minute)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%6.0f operations/s  (%d in %s); per operation: %s", float64(n)/elapsed.Seconds(), n,
		elapsed.Round(time.Millisecond), spent.per(n)), nil
}

// timedBurnDown prepares a backlog of n, then times the dispatcher's work through it,
// from Dispatcher.Start: for the noop target by the broker's own completion signal
// (untilSignalled), for the simulated one by a count of the SUCCEEDED operations every
// 100 ms (untilCounted; the count reads the whole table, which PostgreSQL's cost then
// includes). It returns that time, and what PostgreSQL spent meanwhile.
func (r *dispatchRun) timedBurnDown(ctx context.Context, n int, limit time.Duration) (time.Duration, workCost, error) {
	if err := r.backlog(ctx, n); err != nil {
		return 0, workCost{}, err
	}
	cost, err := measureCost(ctx, r.reader, os.Getpid())
	if err != nil {
		return 0, workCost{}, err
	}
	until := r.untilCounted
	if r.noop != nil {
		until = r.untilSignalled
	}
	elapsed, err := until(ctx, n, limit)
	spent, costErr := cost()
	return elapsed, spent, errors.Join(err, costErr)
}

// untilCounted starts the dispatcher and waits until a count finds n SUCCEEDED.
func (r *dispatchRun) untilCounted(ctx context.Context, n int, limit time.Duration) (time.Duration, error) {
	start := time.Now()
	if err := r.d.Start(ctx); err != nil {
		return 0, err
	}
	end, err := r.waitFor(ctx, store.StateSucceeded, n, limit)
	if err != nil {
		return 0, err
	}
	return end.Sub(start), nil
}

// untilSignalled starts the dispatcher and waits for the wake-up of the commit that
// left none of n unfinished: the store's events wake-up fires after each commit that
// moved operations. Until the noop sender has answered all n, outcomes are still to come
// and a wake-up needs no look; after, each wake-up is checked with one count of the
// operations not yet finished.
func (r *dispatchRun) untilSignalled(ctx context.Context, n int, limit time.Duration) (time.Duration, error) {
	events, unsubscribe := r.st.SubscribeEvents() // after the backlog: its wake-ups are not the dispatcher's
	defer unsubscribe()
	timeout := time.NewTimer(limit)
	defer timeout.Stop()
	start := time.Now()
	if err := r.d.Start(ctx); err != nil {
		return 0, err
	}
	for {
		var woke time.Time
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-timeout.C:
			counts, err := r.countByState(ctx)
			return 0, errors.Join(fmt.Errorf("not finished after %s: %d sent, %v", limit, r.noop.n.Load(), counts), err)
		case <-events:
			woke = time.Now()
		}
		if r.noop.n.Load() < int64(n) {
			continue
		}
		var unfinished int
		if err := r.reader.QueryRow(ctx, `SELECT count(*) FROM operations WHERE state IN ('PREPARED', 'IN_FLIGHT')`).Scan(&unfinished); err != nil {
			return 0, err
		}
		if unfinished > 0 {
			continue
		}
		select {
		case <-events: // the last commit's wake-up came during the count
			woke = time.Now()
		default:
		}
		elapsed := woke.Sub(start)
		// Not timed: every operation finished as SUCCEEDED, not in another final state.
		counts, err := r.countByState(ctx)
		if err != nil {
			return 0, err
		}
		if int(counts[store.StateSucceeded]) != n {
			return 0, fmt.Errorf("%d of %d SUCCEEDED (%v)", counts[store.StateSucceeded], n, counts)
		}
		return elapsed, nil
	}
}

// backlog prepares n intents, 16 at a time.
func (r *dispatchRun) backlog(ctx context.Context, n int) error {
	var wg sync.WaitGroup
	var failed atomic.Pointer[error]
	for w := range 16 {
		wg.Go(func() {
			for i := w; i < n && failed.Load() == nil; i += 16 {
				if err := r.prepare(ctx); err != nil {
					failed.Store(&err)
				}
			}
		})
	}
	wg.Wait()
	if p := failed.Load(); p != nil {
		return *p
	}
	return analyze(ctx, r.reader)
}

// analyze takes statistics of the loaded ledger, as autovacuum's automatic ANALYZE
// would on a server where it runs. Without them, plans made while the tables were empty
// stay: the outcome's attempt update, say, scans instead of using the primary key.
func analyze(ctx context.Context, admin *pgxpool.Pool) error {
	_, err := admin.Exec(ctx, `ANALYZE operations; ANALYZE operation_keys; ANALYZE operation_events`)
	return err
}

// steady offers intents at rate for period while the dispatcher runs, and reports the
// rate of completions and the time from each intent's commit to its SUCCEEDED commit,
// read from the ledger.
func (r *dispatchRun) steady(ctx context.Context, rate int, period time.Duration) (string, error) {
	if err := r.d.Start(ctx); err != nil {
		return "", err
	}
	inFlight := make(chan struct{}, 256) // calls outstanding at once; beyond that the offer falls behind
	var wg sync.WaitGroup
	var failed atomic.Pointer[error]
	start := time.Now()
	offered := 0
	for ; time.Since(start) < period && failed.Load() == nil; offered++ {
		if err := sleep(ctx, time.Until(start.Add(time.Duration(offered)*time.Second/time.Duration(rate)))); err != nil {
			return "", err
		}
		inFlight <- struct{}{}
		wg.Go(func() {
			defer func() { <-inFlight }()
			if err := r.prepare(ctx); err != nil {
				failed.Store(&err)
			}
		})
	}
	wg.Wait()
	if p := failed.Load(); p != nil {
		return "", *p
	}
	prepared := time.Since(start)
	end, err := r.waitFor(ctx, store.StateSucceeded, offered, 10*time.Minute)
	if err != nil {
		return "", err
	}
	latencies, err := r.timesToState(ctx, store.StateSucceeded)
	if err != nil {
		return "", err
	}
	slices.Sort(latencies)
	return fmt.Sprintf("%6.0f operations/s  (%d offered at %d/s over %s, all SUCCEEDED %s later; intent to SUCCEEDED p50 %.1f ms, p99 %.1f ms)",
		float64(offered)/end.Sub(start).Seconds(), offered, rate, prepared.Round(time.Millisecond),
		end.Sub(start.Add(prepared)).Round(time.Millisecond), ms(latencies[len(latencies)/2]), ms(latencies[len(latencies)*99/100])), nil
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// countByState returns how many operations are in each state.
func (r *dispatchRun) countByState(ctx context.Context) (map[store.State]int64, error) {
	rows, _ := r.reader.Query(ctx, `SELECT state::text, count(*) FROM operations GROUP BY state`)
	counts := map[store.State]int64{}
	var state store.State
	var n int64
	_, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		counts[state] = n
		return nil
	})
	return counts, err
}

// timesToState returns, for every operation that has reached state, the time from its
// creation to the commit that first moved it there, as the event log records them.
func (r *dispatchRun) timesToState(ctx context.Context, state store.State) ([]time.Duration, error) {
	rows, _ := r.reader.Query(ctx, `SELECT floor(extract(epoch FROM min(e.created_at) - o.created_at) * 1e6)::bigint
		FROM operations o JOIN operation_events e
		  ON e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id AND e.to_state = $1::text::operation_state
		GROUP BY o.tenant_id, o.operation_id, o.created_at`, string(state))
	micros, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	times := make([]time.Duration, len(micros))
	for i, us := range micros {
		times[i] = time.Duration(us) * time.Microsecond
	}
	return times, err
}
