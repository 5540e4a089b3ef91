package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/opbroker/opbroker/formation"
	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
)

// benchPrepare measures PrepareOperation over gRPC at each concurrency, next to the same
// PostgreSQL's plain single-row INSERT at the same concurrency: the physical limit of a
// durable write per call. With --formation it compares the single server with a
// replicated one instead.
func benchPrepare(ctx context.Context, cmd *cli.Command) error {
	if cmd.Bool("formation") {
		return benchPrepareReplicated(ctx, cmd)
	}
	url, stopCluster, err := cluster(ctx, cmd.String("database-url"))
	if err != nil {
		return err
	}
	defer stopCluster()
	b, err := newPrepareBench(ctx, url)
	if err != nil {
		return err
	}
	defer b.close()

	stopProfile, err := profile(cmd)
	if err != nil {
		return err
	}
	defer stopProfile()
	out := cmd.Root().Writer
	period := cmd.Duration("period")
	fmt.Fprintf(out, "PrepareOperation over gRPC vs a plain single-row INSERT, %s per measurement, durable commits\n", period)
	fmt.Fprintf(out, "%-11s  %-30s  %-30s  %-30s  %s\n", "concurrency", "PrepareOperation ops/s p50 p99", "store.Prepare ops/s p50 p99", "INSERT ops/s p50 p99", "ratio")
	for _, n := range cmd.IntSlice("concurrency") {
		prepare := measure(ctx, n, period, b.prepare)
		direct := measure(ctx, n, period, b.storePrepare)
		insert := measure(ctx, n, period, plainInsert(b.pool))
		if err := errors.Join(prepare.err, direct.err, insert.err); err != nil {
			return fmt.Errorf("concurrency %d: %w", n, err)
		}
		fmt.Fprintf(out, "%-11d  %-30s  %-30s  %-30s  %.0f%%\n", n, prepare, direct, insert, 100*prepare.rate/insert.rate)
	}
	fmt.Fprintf(out, "  %s; client, server and PostgreSQL share it\n", machine(ctx, b.pool))
	return nil
}

// benchPrepareReplicated measures PrepareOperation and the plain INSERT on one server
// (--database-url or an embedded one) and on a formation of three nodes in strict
// synchronous mode (package formation), alternating, --rounds times, at each
// concurrency: what acknowledged-means-replicated costs.
func benchPrepareReplicated(ctx context.Context, cmd *cli.Command) error {
	singleURL, stopCluster, err := cluster(ctx, cmd.String("database-url"))
	if err != nil {
		return err
	}
	defer stopCluster()
	dir, err := os.MkdirTemp("", "opbench-formation-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil { // the nodes may run as another user
		return err
	}
	ha, err := formation.Start(ctx, formation.Config{Dir: dir})
	if err != nil {
		return err
	}
	defer ha.Close()
	single, err := newPrepareBench(ctx, singleURL)
	if err != nil {
		return err
	}
	defer single.close()
	replicated, err := newPrepareBench(ctx, ha.URL())
	if err != nil {
		return err
	}
	defer replicated.close()
	if err := replicated.st.CheckSynchronousReplication(ctx); err != nil {
		return err
	}

	out := cmd.Root().Writer
	period := cmd.Duration("period")
	fmt.Fprintf(out, "PrepareOperation and a plain INSERT: one server, then three nodes in strict synchronous mode (Patroni), %s per measurement, %d rounds\n",
		period, cmd.Int("rounds"))
	fmt.Fprintf(out, "%-5s  %-11s  %-11s  %-30s  %-30s\n", "round", "concurrency", "database", "PrepareOperation ops/s p50 p99", "INSERT ops/s p50 p99")
	for round := 1; round <= cmd.Int("rounds"); round++ {
		for _, n := range cmd.IntSlice("concurrency") {
			for _, side := range []struct {
				name string
				b    *prepareBench
			}{{"single", single}, {"replicated", replicated}} {
				prepare := measure(ctx, n, period, side.b.prepare)
				insert := measure(ctx, n, period, plainInsert(side.b.pool))
				if err := errors.Join(prepare.err, insert.err); err != nil {
					return fmt.Errorf("%s, concurrency %d: %w", side.name, n, err)
				}
				fmt.Fprintf(out, "%-5d  %-11d  %-11s  %-30s  %-30s\n", round, n, side.name, prepare, insert)
			}
		}
	}
	fmt.Fprintf(out, "  single: %s\n  replicated: %s, its three nodes on the same machine; client, server and PostgreSQL share it\n",
		machine(ctx, single.pool), machine(ctx, replicated.pool))
	return nil
}

// prepareBench is a migrated schema with a table for the plain INSERT, and the API
// serving it on loopback.
type prepareBench struct {
	pool    *pgxpool.Pool
	st      *store.Store
	conns   []*grpc.ClientConn
	seq     atomic.Int64
	cleanup []func()
}

func newPrepareBench(ctx context.Context, url string) (b *prepareBench, err error) {
	b = &prepareBench{}
	defer func() {
		if err != nil {
			b.close()
		}
	}()
	pool, drop, err := database(ctx, url, true)
	if err != nil {
		return b, err
	}
	b.pool, b.cleanup = pool, append(b.cleanup, drop)
	if _, err := pool.Exec(ctx, `CREATE TABLE bench_insert (id bigserial PRIMARY KEY, tenant_id text NOT NULL, payload bytea NOT NULL)`); err != nil {
		return b, err
	}
	b.st = store.New(pool)
	addr, stop, err := serveAPI(ctx, b.st)
	if err != nil {
		return b, err
	}
	b.cleanup = append(b.cleanup, stop)
	for range 4 {
		c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return b, err
		}
		b.cleanup = append(b.cleanup, func() { c.Close() })
		b.conns = append(b.conns, c)
	}
	return b, nil
}

// prepare is one PrepareOperation over gRPC of a new intent.
func (b *prepareBench) prepare(ctx context.Context, worker int) error {
	i := b.seq.Add(1)
	_, err := opbrokerv1.NewOperationServiceClient(b.conns[worker%len(b.conns)]).PrepareOperation(ctx,
		&opbrokerv1.PrepareOperationRequest{Tenant: fmt.Sprintf("tenant-%d", i%8), OperationType: simtarget.DemoCharge,
			IntentRef: fmt.Sprintf("bench-%d", i), Payload: benchBody, ContentType: "application/json"})
	return err
}

// storePrepare is one store.Prepare of a new intent, without gRPC.
func (b *prepareBench) storePrepare(ctx context.Context, _ int) error {
	_, err := prepareIntent(ctx, b.st, "tenant-0", fmt.Sprintf("direct-%d", b.seq.Add(1)), benchBody)
	return err
}

func (b *prepareBench) close() {
	for _, f := range slices.Backward(b.cleanup) {
		f()
	}
}

// cpuProfileFlag is the --cpuprofile flag of the benchmarks that take one: a new one
// for each command (a flag holds its parsed value).
func cpuProfileFlag() cli.Flag {
	return &cli.StringFlag{Name: "cpuprofile", Usage: "write a CPU profile of this process (client and server) to the file"}
}

// profile starts the CPU profile --cpuprofile asks for, and returns how to stop it.
func profile(cmd *cli.Command) (func(), error) {
	path := cmd.String("cpuprofile")
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

func plainInsert(pool *pgxpool.Pool) func(context.Context, int) error {
	return func(ctx context.Context, worker int) error {
		_, err := pool.Exec(ctx, `INSERT INTO bench_insert (tenant_id, payload) VALUES ($1, $2)`,
			fmt.Sprintf("tenant-%d", worker%8), benchBody)
		return err
	}
}

// result is one measurement: calls per second and latency percentiles.
type result struct {
	rate     float64
	p50, p99 time.Duration
	err      error
}

func (r result) String() string {
	return fmt.Sprintf("%7.0f %6.2fms %6.2fms", r.rate, ms(r.p50), ms(r.p99))
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// measure runs call from n workers for period and returns the rate and latencies.
func measure(ctx context.Context, n int, period time.Duration, call func(context.Context, int) error) result {
	ctx, cancel := context.WithTimeout(ctx, period)
	defer cancel()
	var mu sync.Mutex
	var latencies []time.Duration
	var first error
	var wg sync.WaitGroup
	start := time.Now()
	for w := range n {
		wg.Go(func() {
			var mine []time.Duration
			for ctx.Err() == nil {
				t := time.Now()
				if err := call(context.WithoutCancel(ctx), w); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
				mine = append(mine, time.Since(t))
			}
			mu.Lock()
			latencies = append(latencies, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	if first != nil || len(latencies) == 0 {
		return result{err: fmt.Errorf("no calls completed: %v", first)}
	}
	slices.Sort(latencies)
	return result{rate: float64(len(latencies)) / elapsed.Seconds(),
		p50: latencies[len(latencies)/2], p99: latencies[len(latencies)*99/100]}
}
