// Command opbench measures the broker and prints what it measured; it asserts nothing.
//
//	opbench prepare                       # PrepareOperation next to a plain INSERT
//	opbench dispatch --ops 20000          # burn-down and steady stream, no-op and HTTP target
//	opbench compare-river --ops 20000     # the no-op burn-down side by side with River's
//	opbench watch                         # memory per idle watcher, commit-to-watcher latency
//	opbench reconcile                     # UNKNOWN operations resolved per second by lookup
//	opbench ledger --operations 1000000   # claim and Prepare latency as the ledger grows
//
// Each runs against --database-url (in schemas of its own, dropped afterwards) or an
// embedded PostgreSQL, and prints the machine with its numbers.
package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/embeddedpg"
	"github.com/opbroker/opbroker/gcpace"
	"github.com/opbroker/opbroker/payload"
	"github.com/opbroker/opbroker/provision"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
)

func main() {
	_ = gcpace.Default() // as the broker's process runs, for its code that runs in this one
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
			Usage: "dispatch throughput PREPARED -> SUCCEEDED: a backlog's burn-down and a steady stream, with a no-op in-process target and the simulated HTTP target",
			Flags: []cli.Flag{
				databaseURLFlag(),
				&cli.StringSliceFlag{Name: "targets", Value: []string{"noop", "http"}, Usage: "noop (answers at once, in process: the broker alone) and/or http (the simulated target over loopback HTTP)"},
				&cli.StringSliceFlag{Name: "modes", Value: []string{"burn-down", "steady"}, Usage: "burn-down (a prepared backlog) and/or steady (intents prepared at --rate while dispatching)"},
				&cli.IntFlag{Name: "ops", Value: 20000, Usage: "operations in the backlog"},
				&cli.IntFlag{Name: "rate", Value: 1000, Usage: "intents per second offered in the steady stream"},
				&cli.DurationFlag{Name: "period", Value: 10 * time.Second, Usage: "how long the steady stream runs"},
				&cli.IntFlag{Name: "tenants", Value: 8},
				&cli.IntFlag{Name: "pool-size", Value: dispatcher.DefaultPoolSize, Usage: "concurrent sends"},
				&cli.IntFlag{Name: "claim-batch", Value: dispatcher.DefaultClaimBatch, Usage: "operations per claim statement"},
				&cli.IntFlag{Name: "payload-bytes", Usage: "the size of every intent's JSON payload, padded with random letters (0: a 31-byte payload)"},
				cpuProfileFlag(),
				&cli.BoolFlag{Name: "rls", Value: true, Usage: "run as an ordinary role bound by row-level security, as the broker does (--rls=false: as the administrator, to measure its cost)"},
			},
			Action: benchDispatch,
		}, {
			Name:  "compare-river",
			Usage: "the no-op burn-down side by side with River's (its engine, built from bench/river) on the same PostgreSQL, alternating, several rounds: both rates and their ratio",
			Flags: []cli.Flag{
				databaseURLFlag(),
				&cli.IntFlag{Name: "ops", Value: 20000, Usage: "operations, and jobs, in each backlog"},
				&cli.IntFlag{Name: "rounds", Value: 5, Usage: "rounds, each a River and an opbroker burn-down"},
				&cli.IntFlag{Name: "tenants", Value: 8},
				&cli.IntFlag{Name: "pool-size", Value: dispatcher.DefaultPoolSize, Usage: "the dispatcher's concurrent sends"},
				&cli.IntFlag{Name: "claim-batch", Value: dispatcher.DefaultClaimBatch, Usage: "operations per claim statement"},
				&cli.IntFlag{Name: "river-workers", Value: 2000, Usage: "River's MaxWorkers (2,000: River's own benchmark's)"},
				&cli.StringFlag{Name: "river-bench", Usage: "a built bench/river program (default: build ./bench/river into a temporary directory)"},
				&cli.DurationFlag{Name: "limit", Value: 10 * time.Minute, Usage: "give up on a burn-down that takes longer"},
			},
			Action: benchCompareRiver,
		}, {
			Name:  "reconcile",
			Usage: "UNKNOWN operations resolved per second by lookup at the target",
			Flags: []cli.Flag{
				databaseURLFlag(),
				&cli.IntFlag{Name: "ops", Value: 5000, Usage: "UNKNOWN operations to resolve"},
				&cli.IntFlag{Name: "tenants", Value: 8},
				&cli.IntFlag{Name: "concurrency", Value: 64, Usage: "lookups at once (the reconciler's default)"},
				cpuProfileFlag(),
			},
			Action: benchReconcile,
		}, {
			Name:  "ledger",
			Usage: "Prepare and claim latency on an empty ledger and as it grows to --operations",
			Flags: []cli.Flag{
				databaseURLFlag(),
				&cli.IntFlag{Name: "operations", Value: 1_000_000, Usage: "finished operations the ledger grows to (measured at none, a tenth and all)"},
				&cli.IntFlag{Name: "tenants", Value: 8},
				&cli.DurationFlag{Name: "period", Value: 3 * time.Second, Usage: "how long each Prepare measurement runs"},
				&cli.IntFlag{Name: "backlog", Value: 1280, Usage: "operations prepared at each size, then claimed 64 at a time (a fifth of it to warm up)"},
			},
			Action: benchLedger,
		}, {
			Name:  "prepare",
			Usage: "PrepareOperation throughput and latency over gRPC at concurrency 1, 8, 32, 64, next to a plain INSERT",
			Flags: []cli.Flag{
				databaseURLFlag(),
				&cli.DurationFlag{Name: "period", Value: 5 * time.Second, Usage: "how long each measurement runs"},
				&cli.IntSliceFlag{Name: "concurrency", Value: []int{1, 8, 32, 64}, Usage: "calls at once, one measurement each"},
				&cli.BoolFlag{Name: "formation", Usage: "compare the single server with three nodes in strict synchronous mode (Patroni, etcd: Debian's patroni and etcd-server), alternating"},
				&cli.IntFlag{Name: "rounds", Value: 3, Usage: "rounds of the comparison, with --formation"},
				cpuProfileFlag(),
			},
			Action: benchPrepare,
		}, {
			Name:  "watch",
			Usage: "memory per idle WatchOperation stream (server and client in this process: an upper bound), and latency from commit to watcher",
			Flags: []cli.Flag{
				databaseURLFlag(),
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

// databaseURLFlag is the --database-url flag of every benchmark: a new one for each
// command (a flag holds its parsed value).
func databaseURLFlag() cli.Flag {
	return &cli.StringFlag{Name: "database-url", Sources: cli.EnvVars("DATABASE_URL"), Usage: "default: an embedded PostgreSQL"}
}

// pgFolder begins the names of the folders of the embedded servers the runs start:
// embeddedpg.StartTemp stops and removes the orphans under it, so no other folder's name
// may begin with it.
const pgFolder = "opbench-pg-"

// cluster returns the URL of the PostgreSQL to measure on: url, or an embedded one
// started for the run, with a function that stops it and removes its folder
// (embeddedpg.Server.StopAndRemove: a server that did not stop keeps it, for a later
// run to find). The servers that killed runs left are stopped and removed first
// (embeddedpg.StartTemp).
func cluster(ctx context.Context, url string) (string, func(), error) {
	if url != "" {
		return url, func() {}, nil
	}
	pg, err := embeddedpg.StartTemp(ctx, pgFolder, embeddedpg.Config{})
	if err != nil {
		return "", nil, err
	}
	return pg.URL(), func() {
		if err := pg.StopAndRemove(); err != nil {
			fmt.Fprintln(os.Stderr, "opbench:", err)
		}
	}, nil
}

// database returns a pool on a fresh, migrated schema of the cluster at url and a
// function that removes it. With rls the pool's role is bound by row-level security, as
// the broker's is; without, it is the administrator's.
func database(ctx context.Context, url string, rls bool) (*pgxpool.Pool, func(), error) {
	schema := fmt.Sprintf("opbench_%d", time.Now().UnixNano())
	appURL, err := provision.Schema(ctx, url, "opbroker_bench", schema)
	if err != nil {
		return nil, nil, err
	}
	drop := func() { _ = provision.DropSchema(context.Background(), url, schema) }
	cfg, err := pgxpool.ParseConfig(appURL)
	if err != nil {
		drop()
		return nil, nil, err
	}
	cfg.MaxConns = 40
	if !rls {
		delete(cfg.ConnConfig.RuntimeParams, "role")
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		drop()
		return nil, nil, err
	}
	if err := store.Migrate(ctx, pool); err != nil {
		pool.Close()
		drop()
		return nil, nil, err
	}
	return pool, func() { pool.Close(); drop() }, nil
}

// openDatabase is cluster and database together, for a benchmark that needs one schema.
func openDatabase(ctx context.Context, cmd *cli.Command, rls bool) (*pgxpool.Pool, func(), error) {
	url, stop, err := cluster(ctx, cmd.String("database-url"))
	if err != nil {
		return nil, nil, err
	}
	pool, drop, err := database(ctx, url, rls)
	if err != nil {
		stop()
		return nil, nil, err
	}
	return pool, func() { drop(); stop() }, nil
}

// machine describes where the numbers were measured.
func machine(ctx context.Context, pool *pgxpool.Pool) string {
	var version, sharedBuffers, syncCommit, fsync string
	gogc, _ := gcpace.Describe()
	_ = pool.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('shared_buffers'),
		current_setting('synchronous_commit'), current_setting('fsync')`).Scan(&version, &sharedBuffers, &syncCommit, &fsync)
	return fmt.Sprintf("machine: %d cores, %s/%s, PostgreSQL %s (shared_buffers %s, synchronous_commit %s, fsync %s) on the same machine; this process's Go collector at GOGC %s",
		runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, version, sharedBuffers, syncCommit, fsync, gogc)
}

// prepareIntent records one demo.charge intent of tenant, in that tenant's scope.
func prepareIntent(ctx context.Context, st *store.Store, tenant, intent string, body []byte) (store.Operation, error) {
	digest, err := payload.Hash("application/json", body)
	if err != nil {
		return store.Operation{}, err
	}
	op, _, err := st.Tenant(tenant).Prepare(ctx, store.PrepareParams{TenantID: tenant, OperationType: simtarget.DemoCharge,
		IntentRef: intent, ContentType: "application/json", Payload: body, PayloadSHA256: digest[:], Actor: "opbench"})
	return op, err
}

var benchBody = []byte(`{"amount":100,"currency":"EUR"}`)

// payloadOf returns benchBody with a "note" of random letters that makes it n bytes
// long (PostgreSQL compresses such a note little), or benchBody when n is too small.
func payloadOf(n int) []byte {
	const head = `{"amount":100,"currency":"EUR","note":"`
	pad := n - len(head) - len(`"}`)
	if pad <= 0 {
		return benchBody
	}
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
	note := make([]byte, pad)
	for i := range note {
		note[i] = letters[rand.IntN(len(letters))]
	}
	return []byte(head + string(note) + `"}`)
}
