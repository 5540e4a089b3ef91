// Command opbench measures the broker and prints what it measured; it asserts nothing.
//
//	opbench dispatch --ops 20000 --pool-size 32 --claim-batch 64
//
// dispatch prepares N operations, then times the dispatcher's burn-down from PREPARED
// to SUCCEEDED against the simulated target in its fastest profile (in-process, over
// loopback HTTP), with the full audit trail written. It runs against --database-url (in
// a schema of its own, dropped afterwards) or an embedded PostgreSQL.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/embeddedpg"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newApp().Run(ctx, os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "opbench:", err)
		os.Exit(1)
	}
}

func newApp() *cli.Command {
	return &cli.Command{
		Name:  "opbench",
		Usage: "measure opbroker; prints numbers, asserts nothing",
		Commands: []*cli.Command{{
			Name:  "dispatch",
			Usage: "burn-down throughput PREPARED -> SUCCEEDED against the simulated target",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "database-url", Sources: cli.EnvVars("DATABASE_URL"), Usage: "default: an embedded PostgreSQL"},
				&cli.IntFlag{Name: "ops", Value: 20000, Usage: "operations to prepare and dispatch"},
				&cli.IntFlag{Name: "tenants", Value: 8},
				&cli.IntFlag{Name: "pool-size", Value: 32, Usage: "concurrent sends"},
				&cli.IntFlag{Name: "claim-batch", Value: 64, Usage: "operations per claim statement"},
				cpuProfileFlag(),
				&cli.BoolFlag{Name: "rls", Value: true, Usage: "run as an ordinary role bound by row-level security, as the broker does (--rls=false: as the administrator, to measure its cost)"},
			},
			Action: benchDispatch,
		}, {
			Name:  "prepare",
			Usage: "PrepareOperation throughput and latency over gRPC at concurrency 1, 8, 32, 64, next to a plain INSERT",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "database-url", Sources: cli.EnvVars("DATABASE_URL"), Usage: "default: an embedded PostgreSQL"},
				&cli.DurationFlag{Name: "period", Value: 5 * time.Second, Usage: "how long each measurement runs"},
				cpuProfileFlag(),
			},
			Action: benchPrepare,
		}, {
			Name:  "watch",
			Usage: "memory per idle WatchOperation stream (server and client in this process: an upper bound), and latency from commit to watcher",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "database-url", Sources: cli.EnvVars("DATABASE_URL"), Usage: "default: an embedded PostgreSQL"},
				&cli.IntFlag{Name: "watchers", Value: 10000, Usage: "idle streams for the memory measurement"},
				&cli.IntFlag{Name: "latency-watchers", Value: 1000, Usage: "streams, one operation each, for the latency measurement"},
				&cli.IntFlag{Name: "changes", Value: 200, Usage: "changes whose latency is measured"},
			},
			Action: benchWatch,
		}, {
			Name:   "watch-clients",
			Usage:  "the clients of opbench watch, run by it in a child process",
			Hidden: true,
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "addr", Required: true},
				&cli.StringFlag{Name: "name", Required: true},
				&cli.IntFlag{Name: "watchers", Required: true},
			},
			Action: watchClients,
		}},
	}
}

// database returns a pool on a fresh, migrated schema and a function that removes it.
// With rls the pool's role is bound by row-level security, as the broker's is; without,
// it is the administrator's.
func database(ctx context.Context, url string, rls bool) (*pgxpool.Pool, func(), error) {
	var cleanup []func()
	done := func() {
		for i := len(cleanup) - 1; i >= 0; i-- {
			cleanup[i]()
		}
	}
	if url == "" {
		dir, err := os.MkdirTemp("", "opbench-pg-")
		if err != nil {
			return nil, nil, err
		}
		cleanup = append(cleanup, func() { os.RemoveAll(dir) })
		if err := os.Chmod(dir, 0o755); err != nil { // the server may run as another user
			done()
			return nil, nil, err
		}
		pg, err := embeddedpg.Start(ctx, embeddedpg.Config{DataDir: dir})
		if err != nil {
			done()
			return nil, nil, err
		}
		cleanup = append(cleanup, func() { _ = pg.Stop() })
		url = pg.URL()
	}
	schema := fmt.Sprintf("opbench_%d", time.Now().UnixNano())
	appURL, err := store.Provision(ctx, url, "opbroker_bench", schema)
	if err != nil {
		done()
		return nil, nil, err
	}
	cleanup = append(cleanup, func() { _ = store.DropSchema(context.Background(), url, schema) })
	// As the broker runs: an ordinary role bound by row-level security.
	cfg, err := pgxpool.ParseConfig(appURL)
	if err != nil {
		done()
		return nil, nil, err
	}
	cfg.MaxConns = 40
	if !rls {
		delete(cfg.ConnConfig.RuntimeParams, "role")
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		done()
		return nil, nil, err
	}
	cleanup = append(cleanup, pool.Close)
	if err := store.Migrate(ctx, pool); err != nil {
		done()
		return nil, nil, err
	}
	return pool, done, nil
}

// prepareOne records one demo.charge intent for a benchmark.
func prepareOne(ctx context.Context, st *store.Store, intent, body string) (store.Operation, error) {
	digest, err := payload.Hash("application/json", []byte(body))
	if err != nil {
		return store.Operation{}, err
	}
	op, _, err := st.Prepare(store.WithTenant(ctx, "tenant-0"), store.PrepareParams{TenantID: "tenant-0", OperationType: simtarget.DemoCharge,
		IntentRef: intent, ContentType: "application/json", Payload: []byte(body), PayloadSHA256: digest[:], Actor: "opbench"})
	return op, err
}

func benchDispatch(ctx context.Context, cmd *cli.Command) error {
	ctx = store.WithAllTenants(ctx)
	n, tenants := cmd.Int("ops"), max(1, cmd.Int("tenants"))
	pool, cleanup, err := database(ctx, cmd.String("database-url"), cmd.Bool("rls"))
	if err != nil {
		return err
	}
	defer cleanup()
	st := store.New(pool)

	sim, err := simtarget.Start(simtarget.Config{})
	if err != nil {
		return err
	}
	defer sim.Close()
	targets, err := sim.Targets()
	if err != nil {
		return err
	}

	fmt.Fprintf(os.Stderr, "preparing %d operations across %d tenants ...\n", n, tenants)
	body := []byte(`{"amount":100,"currency":"EUR"}`)
	digest, err := payload.Hash("application/json", body)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < n; i += 8 {
				_, _, err := st.Prepare(ctx, store.PrepareParams{TenantID: fmt.Sprintf("tenant-%d", i%tenants),
					OperationType: simtarget.DemoCharge, IntentRef: fmt.Sprintf("bench-%d", i), ContentType: "application/json",
					Payload: body, PayloadSHA256: digest[:], Actor: "opbench"})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}

	stopProfile, err := profile(cmd)
	if err != nil {
		return err
	}
	defer stopProfile()
	d, err := dispatcher.New(dispatcher.Config{
		Store: st, Targets: targets, Connector: target.NewConnector(),
		Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider(),
		PoolSize: cmd.Int("pool-size"), ClaimBatch: cmd.Int("claim-batch"),
	})
	if err != nil {
		return err
	}
	start := time.Now()
	if err := d.Start(ctx); err != nil {
		return err
	}
	for {
		counts, err := st.CountByState(ctx)
		done := int(counts[store.StateSucceeded])
		if err != nil {
			return err
		}
		if done == n {
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(100 * time.Millisecond)
	}
	elapsed := time.Since(start)
	d.Stop()

	var version string
	_ = pool.QueryRow(ctx, `SELECT current_setting('server_version')`).Scan(&version)
	out := cmd.Root().Writer
	fmt.Fprintf(out, "dispatch burn-down: %d operations PREPARED -> SUCCEEDED in %s: %.0f operations/s\n", n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds())
	fmt.Fprintf(out, "  pool size %d, claim batch %d, %d tenants; simulated target in-process over loopback HTTP, no latency\n",
		cmd.Int("pool-size"), cmd.Int("claim-batch"), tenants)
	fmt.Fprintf(out, "  every operation: claim + attempt record + 2 events + outcome, durable commits; row-level security %s\n",
		map[bool]string{true: "on (an ordinary role)", false: "bypassed (the administrator)"}[cmd.Bool("rls")])
	fmt.Fprintf(out, "  machine: %d cores, %s/%s, PostgreSQL %s\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, version)
	return nil
}
