// Command river burns down a backlog of no-op jobs with River's own engine (the River
// library with its pgx driver) and prints how long it took, as one line of JSON on
// stdout. opbench compare-river runs it, alternating with the broker's burn-down on the
// same PostgreSQL; it is a module of its own so that the broker's go.mod does not
// depend on River.
//
//	river --database-url URL --jobs 20000
//
// It migrates River's tables into a fresh schema, inserts the jobs with InsertMany,
// subscribes to the completion events and starts the client. The time runs from
// Client.Start to the last completion event; River sends an event only after the
// statement that completed the job has committed. The schema is dropped afterwards.
//
// On stdout, before the result, it tells opbench where the burn-down begins and ends,
// so that opbench measures what PostgreSQL spends on it alone: it prints "loaded" once
// the jobs are in, waits for a line on stdin before it starts the client, and prints
// "completed" at the last completion event.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// config is what one burn-down runs with. The River settings default to those of
// River's own benchmark (riverbench), which its authors tuned for throughput.
type config struct {
	databaseURL       string
	jobs              int
	workers           int
	fetchCooldown     time.Duration
	fetchPollInterval time.Duration
	limit             time.Duration
}

// result is the line printed on stdout; opbench reads it (riverResult in
// cmd/opbench/river.go).
type result struct {
	Jobs              int     `json:"jobs"`
	Seconds           float64 `json:"seconds"`
	River             string  `json:"river"`
	Workers           int     `json:"workers"`
	FetchCooldown     string  `json:"fetch_cooldown"`
	FetchPollInterval string  `json:"fetch_poll_interval"`
	MaxConns          int32   `json:"max_conns"`
}

func main() {
	var cfg config
	flag.StringVar(&cfg.databaseURL, "database-url", os.Getenv("DATABASE_URL"), "PostgreSQL to run on (an administrator: it creates and drops a schema)")
	flag.IntVar(&cfg.jobs, "jobs", 20000, "no-op jobs to insert and burn down")
	flag.IntVar(&cfg.workers, "workers", 2000, "MaxWorkers of the queue")
	flag.DurationVar(&cfg.fetchCooldown, "fetch-cooldown", 2*time.Millisecond, "Config.FetchCooldown")
	flag.DurationVar(&cfg.fetchPollInterval, "fetch-poll-interval", 20*time.Millisecond, "Config.FetchPollInterval")
	flag.DurationVar(&cfg.limit, "limit", 10*time.Minute, "give up when the burn-down takes longer")
	flag.Parse()
	if cfg.databaseURL == "" || cfg.jobs <= 0 {
		fmt.Fprintln(os.Stderr, "river: --database-url and a positive --jobs are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "river:", err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		fmt.Fprintln(os.Stderr, "river:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) (result, error) {
	schema := fmt.Sprintf("riverbench_%d", time.Now().UnixNano())
	poolCfg, err := pgxpool.ParseConfig(cfg.databaseURL)
	if err != nil {
		return result{}, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return result{}, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return result{}, fmt.Errorf("schema: %w", err)
	}
	defer func() {
		_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()

	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, &rivermigrate.Config{Schema: schema, Logger: quietLogger()})
	if err != nil {
		return result{}, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return result{}, fmt.Errorf("migrate: %w", err)
	}

	workers := river.NewWorkers()
	river.AddWorker(workers, &noopWorker{})
	client, err := river.NewClient(driver, &river.Config{
		Schema:            schema,
		FetchCooldown:     cfg.fetchCooldown,
		FetchPollInterval: cfg.fetchPollInterval,
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: cfg.workers}},
		Workers:           workers,
		Logger:            quietLogger(),
	})
	if err != nil {
		return result{}, err
	}
	if err := insert(ctx, client, cfg.jobs); err != nil {
		return result{}, err
	}
	// Statistics of the loaded table, as autovacuum's automatic ANALYZE would take them
	// on a server where it runs (opbroker's side does the same).
	if _, err := pool.Exec(ctx, "ANALYZE "+pgx.Identifier{schema, "river_job"}.Sanitize()); err != nil {
		return result{}, fmt.Errorf("analyze: %w", err)
	}

	// A channel that holds every event: River drops the events a full channel cannot
	// take, and a dropped completion would leave the count short.
	events, unsubscribe := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: cfg.jobs + 1000,
		Kinds:    []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled},
	})
	defer unsubscribe()

	fmt.Println("loaded")
	if !bufio.NewScanner(os.Stdin).Scan() {
		return result{}, errors.New("stdin closed before the go-ahead")
	}
	start := time.Now()
	if err := client.Start(ctx); err != nil {
		return result{}, err
	}
	defer func() { _ = client.Stop(context.WithoutCancel(ctx)) }()
	end, err := lastCompletion(ctx, events, cfg.jobs, cfg.limit)
	if err != nil {
		return result{}, err
	}
	fmt.Println("completed")

	// Not timed: the ledger agrees with the events.
	var completed int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "river_job"}.Sanitize()+" WHERE state = 'completed'").
		Scan(&completed); err != nil {
		return result{}, err
	}
	if completed != cfg.jobs {
		return result{}, fmt.Errorf("%d completion events but %d jobs completed in river_job", cfg.jobs, completed)
	}
	return result{
		Jobs: cfg.jobs, Seconds: end.Sub(start).Seconds(), River: riverVersion(),
		Workers: cfg.workers, FetchCooldown: cfg.fetchCooldown.String(), FetchPollInterval: cfg.fetchPollInterval.String(),
		MaxConns: poolCfg.MaxConns,
	}, nil
}

// insert inserts n no-op jobs with InsertMany, 5,000 at a time.
func insert(ctx context.Context, client *river.Client[pgx.Tx], n int) error {
	const batch = 5000
	params := make([]river.InsertManyParams, 0, batch)
	for i := range n {
		params = append(params, river.InsertManyParams{Args: noopArgs{Num: i}})
		if len(params) == batch || i == n-1 {
			if _, err := client.InsertMany(ctx, params); err != nil {
				return fmt.Errorf("insert: %w", err)
			}
			params = params[:0]
		}
	}
	return nil
}

// lastCompletion counts completion events until there are n, and returns when the
// last arrived. A failed or cancelled job is an error: a no-op job never fails.
func lastCompletion(ctx context.Context, events <-chan *river.Event, n int, limit time.Duration) (time.Time, error) {
	timeout := time.NewTimer(limit)
	defer timeout.Stop()
	for done := 0; ; {
		select {
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		case <-timeout.C:
			return time.Time{}, fmt.Errorf("%d of %d jobs completed after %s", done, n, limit)
		case ev, ok := <-events:
			if !ok {
				return time.Time{}, errors.New("the subscription closed before the last completion")
			}
			if ev.Kind != river.EventKindJobCompleted {
				return time.Time{}, fmt.Errorf("job %d: %s", ev.Job.ID, ev.Kind)
			}
			if done++; done == n {
				return time.Now(), nil
			}
		}
	}
}

type noopArgs struct {
	Num int `json:"num"`
}

func (noopArgs) Kind() string { return "noop" }

// noopWorker does nothing: what is measured is River's own cost per job.
type noopWorker struct {
	river.WorkerDefaults[noopArgs]
}

func (*noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

// riverVersion is the version of River this program was built with.
func riverVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == "github.com/riverqueue/river" {
				return dep.Version
			}
		}
	}
	return "unknown"
}

// quietLogger keeps River's warnings and errors, on stderr.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
