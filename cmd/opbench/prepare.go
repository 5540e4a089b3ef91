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

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
)

// benchPrepare measures PrepareOperation over gRPC at each concurrency, next to the same
// PostgreSQL's plain single-row INSERT at the same concurrency: the physical limit of a
// durable write per call.
func benchPrepare(ctx context.Context, cmd *cli.Command) error {
	pool, cleanup, err := openDatabase(ctx, cmd, true)
	if err != nil {
		return err
	}
	defer cleanup()
	if _, err := pool.Exec(ctx, `CREATE TABLE bench_insert (id bigserial PRIMARY KEY, tenant_id text NOT NULL, payload bytea NOT NULL)`); err != nil {
		return err
	}
	st := store.New(pool)
	addr, stop, err := serveAPI(ctx, st)
	if err != nil {
		return err
	}
	defer stop()
	var conns []*grpc.ClientConn
	for range 4 {
		c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer c.Close()
		conns = append(conns, c)
	}

	stopProfile, err := profile(cmd)
	if err != nil {
		return err
	}
	defer stopProfile()
	out := cmd.Root().Writer
	period := cmd.Duration("period")
	fmt.Fprintf(out, "PrepareOperation over gRPC vs a plain single-row INSERT, %s per measurement, durable commits\n", period)
	fmt.Fprintf(out, "%-11s  %-30s  %-30s  %-30s  %s\n", "concurrency", "PrepareOperation ops/s p50 p99", "store.Prepare ops/s p50 p99", "INSERT ops/s p50 p99", "ratio")
	var seq atomic.Int64
	for _, n := range cmd.IntSlice("concurrency") {
		prepare := measure(ctx, n, period, func(ctx context.Context, worker int) error {
			i := seq.Add(1)
			_, err := opbrokerv1.NewOperationServiceClient(conns[worker%len(conns)]).PrepareOperation(ctx,
				&opbrokerv1.PrepareOperationRequest{Tenant: fmt.Sprintf("tenant-%d", i%8), OperationType: simtarget.DemoCharge,
					IntentRef: fmt.Sprintf("bench-%d", i), Payload: benchBody, ContentType: "application/json"})
			return err
		})
		direct := measure(ctx, n, period, func(ctx context.Context, worker int) error {
			_, err := prepareIntent(ctx, st, "tenant-0", fmt.Sprintf("direct-%d", seq.Add(1)), benchBody)
			return err
		})
		insert := measure(ctx, n, period, plainInsert(pool))
		if err := errors.Join(prepare.err, direct.err, insert.err); err != nil {
			return fmt.Errorf("concurrency %d: %w", n, err)
		}
		fmt.Fprintf(out, "%-11d  %-30s  %-30s  %-30s  %.0f%%\n", n, prepare, direct, insert, 100*prepare.rate/insert.rate)
	}
	fmt.Fprintf(out, "  %s; client, server and PostgreSQL share it\n", machine(ctx, pool))
	return nil
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
