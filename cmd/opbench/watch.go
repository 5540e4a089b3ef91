package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v3"
	"go.opentelemetry.io/otel/metric/noop"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/server"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/watch"
)

// streamsPerConn stays under the server's MaxConcurrentStreams.
const streamsPerConn = 900

// benchWatch opens N idle watch streams on one operation and reports the memory they
// cost. Client and server share this process, so the figure bounds the server's share
// from above.
func benchWatch(ctx context.Context, cmd *cli.Command) error {
	n := cmd.Int("watchers")
	pool, cleanup, err := database(ctx, cmd.String("database-url"), true)
	if err != nil {
		return err
	}
	defer cleanup()
	st := store.New(pool)
	addr, stop, err := serveAPI(ctx, st)
	if err != nil {
		return err
	}
	defer stop()

	op, err := prepareOne(ctx, st, "watched", `{"amount":1}`)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("tenants/%s/operations/%s", op.TenantID, op.ID)

	before := heap()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var conns []*grpc.ClientConn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < n; i++ {
		if i%streamsPerConn == 0 {
			c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return err
			}
			conns = append(conns, c)
		}
		stream, err := opbrokerv1.NewOperationServiceClient(conns[len(conns)-1]).WatchOperation(ctx, &opbrokerv1.WatchOperationRequest{Name: name})
		if err != nil {
			return err
		}
		if _, err := stream.Recv(); err != nil { // the snapshot: the stream is established and idle
			return err
		}
	}
	after := heap()
	fmt.Fprintf(cmd.Root().Writer, "watch: %d idle WatchOperation streams over %d loopback connections: %.1f KB per watcher (heap and stacks, client and server together)\n",
		n, len(conns), float64(after-before)/float64(n)/1024)
	cancel()

	latency, err := watchLatency(context.WithoutCancel(ctx), pool, st, addr, cmd.Int("latency-watchers"), cmd.Int("changes"))
	if err != nil {
		return err
	}
	fmt.Fprintf(cmd.Root().Writer, "watch: commit to watcher, %d changes written by another replica (LISTEN/NOTIFY), %d watchers of one operation each: p50 %.1fms, p99 %.1fms\n",
		cmd.Int("changes"), cmd.Int("latency-watchers"), ms(latency.p50), ms(latency.p99))
	fmt.Fprintf(cmd.Root().Writer, "  machine: %d cores, %s/%s\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
	return nil
}

// watchLatency opens a WatchOperation on each of n operations, changes `changes` of them
// one after another from another Store (another replica: the change reaches the server
// through LISTEN/NOTIFY), and measures from each commit to its watcher's receipt.
func watchLatency(ctx context.Context, pool *pgxpool.Pool, st *store.Store, addr string, n, changes int) (result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	writer := store.New(pool)
	notifier := writer.NewNotifier(slog.New(slog.DiscardHandler), 10*time.Millisecond)
	if err := notifier.Start(ctx); err != nil {
		return result{}, err
	}
	defer notifier.Stop()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return result{}, err
	}
	defer conn.Close()

	ops := make([]store.Operation, n)
	received := make([]chan time.Time, n)
	for i := range ops {
		if ops[i], err = prepareOne(ctx, st, fmt.Sprintf("latency-%d", i), `{"amount":1}`); err != nil {
			return result{}, err
		}
		stream, err := opbrokerv1.NewOperationServiceClient(conn).WatchOperation(ctx,
			&opbrokerv1.WatchOperationRequest{Name: fmt.Sprintf("tenants/%s/operations/%s", ops[i].TenantID, ops[i].ID)})
		if err != nil {
			return result{}, err
		}
		if _, err := stream.Recv(); err != nil {
			return result{}, err
		}
		received[i] = make(chan time.Time, 1)
		go func() {
			for {
				msg, err := stream.Recv()
				if err != nil {
					return
				}
				if msg.GetChange() != nil {
					received[i] <- time.Now()
					return
				}
			}
		}()
	}
	var latencies []time.Duration
	for i := range min(changes, n) {
		op := ops[i*n/min(changes, n)]
		if _, err := writer.Cancel(store.WithTenant(ctx, op.TenantID), store.CancelParams{TenantID: op.TenantID, ID: op.ID, Actor: "opbench"}); err != nil {
			return result{}, err
		}
		committed := time.Now()
		select {
		case at := <-received[i*n/min(changes, n)]:
			latencies = append(latencies, at.Sub(committed))
		case <-time.After(10 * time.Second):
			return result{}, fmt.Errorf("a watcher never saw its change")
		}
	}
	slices.Sort(latencies)
	return result{p50: latencies[len(latencies)/2], p99: latencies[len(latencies)*99/100]}, nil
}

// heap returns the bytes of heap and goroutine stacks in use after a collection.
func heap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse + m.StackInuse
}

// serveAPI runs the broker's gRPC API (no dispatcher, no credentials) over st on a
// loopback port, with a watch hub woken by other replicas' notifications as in
// production, and returns its address and how to stop it.
func serveAPI(ctx context.Context, st *store.Store) (string, func(), error) {
	log := slog.New(slog.DiscardHandler)
	notifier := st.NewNotifier(log, 10*time.Millisecond)
	if err := notifier.Start(ctx); err != nil {
		return "", nil, err
	}
	hub := watch.New(st, log, time.Second)
	if err := hub.Start(ctx); err != nil {
		notifier.Stop()
		return "", nil, err
	}
	stopAll := func() { hub.Stop(); notifier.Stop() }
	targets, err := target.New(simtarget.DemoContracts("http://127.0.0.1:1")...)
	if err != nil {
		stopAll()
		return "", nil, err
	}
	srv, err := server.New(server.Options{Store: st, Targets: targets, Logger: log, MeterProvider: noop.NewMeterProvider(),
		Hub: hub, Limits: server.Limits{TenantRate: 1e9, TenantBurst: 1e9, WatchesPerPrincipal: 1 << 20}})
	if err != nil {
		stopAll()
		return "", nil, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		stopAll()
		return "", nil, err
	}
	go func() { _ = srv.GRPC.Serve(lis) }()
	return lis.Addr().String(), func() { srv.Stop(time.Second); stopAll() }, nil
}
