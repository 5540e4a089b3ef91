package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
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
// cost the server (the clients run in a child process), then measures the latency from
// a commit to its watcher.
func benchWatch(ctx context.Context, cmd *cli.Command) error {
	n := cmd.Int("watchers")
	pool, cleanup, err := openDatabase(ctx, cmd, true)
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

	op, err := prepareIntent(ctx, st, "tenant-0", "watched", benchBody)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("tenants/%s/operations/%s", op.TenantID, op.ID)

	// The server alone: the clients run in a child process.
	before := inUse()
	child, err := startWatchClients(addr, name, n)
	if err != nil {
		return err
	}
	serverOnly := inUse()
	if err := child(); err != nil {
		return err
	}
	out := cmd.Root().Writer
	fmt.Fprintf(out, "watch: %d idle WatchOperation streams: %.1f KB per watcher in the server (the clients run in another process)\n",
		n, perWatcher(before.total(), serverOnly.total(), n))
	// A stream's goroutine grows to 16 KB of stack as the stream starts; the collector
	// halves it only while the frames the idle stream waits in stay small (follow, in
	// server/watch.go, and the interceptors around it).
	fmt.Fprintf(out, "  goroutine stack per idle stream: %.1f KB (8 KB when the collector could halve it; more: the frames it waits in grew)\n",
		perWatcher(before.stacks, serverOnly.stacks, n))
	fmt.Fprintf(out, "  heap per idle stream: %.1f KB\n", perWatcher(before.heap, serverOnly.heap, n))

	latency, err := watchLatency(context.WithoutCancel(ctx), pool, st, addr, cmd.Int("latency-watchers"), cmd.Int("changes"))
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "watch: commit to watcher, %d changes written by another replica (LISTEN/NOTIFY), %d watchers of one operation each: p50 %.1fms, p99 %.1fms\n",
		cmd.Int("changes"), cmd.Int("latency-watchers"), ms(latency.p50), ms(latency.p99))
	fmt.Fprintf(out, "  machine: %d cores, %s/%s\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
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
		if ops[i], err = prepareIntent(ctx, st, "tenant-0", fmt.Sprintf("latency-%d", i), benchBody); err != nil {
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
		if _, err := writer.Tenant(op.TenantID).Cancel(ctx, store.CancelParams{TenantID: op.TenantID, ID: op.ID, Actor: "opbench"}); err != nil {
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

// perWatcher is the growth from before to after, in KB per watcher (negative when a
// collection freed more than the watchers took).
func perWatcher(before, after uint64, n int) float64 {
	return float64(int64(after)-int64(before)) / float64(n) / 1024
}

// memory is the bytes of heap and of goroutine stacks in use.
type memory struct{ heap, stacks uint64 }

func (m memory) total() uint64 { return m.heap + m.stacks }

// inUse returns the memory in use after two collections: as a server that has been
// running a while holds it (a collection halves a goroutine's stack at most once, when
// it uses under a quarter of it).
func inUse() memory {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return memory{heap: m.HeapInuse, stacks: m.StackInuse}
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
		srv.Stop(0)
		stopAll()
		return "", nil, err
	}
	go func() { _ = srv.GRPC.Serve(lis) }()
	return lis.Addr().String(), func() { srv.Stop(time.Second); stopAll() }, nil
}

// openWatchers opens n idle WatchOperation streams on the operation name and returns
// how to close them.
func openWatchers(ctx context.Context, addr, name string, n int) (func(), error) {
	ctx, cancel := context.WithCancel(ctx)
	var conns []*grpc.ClientConn
	closeAll := func() {
		cancel()
		for _, c := range conns {
			c.Close()
		}
	}
	for i := 0; i < n; i++ {
		if i%streamsPerConn == 0 {
			c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				closeAll()
				return nil, err
			}
			conns = append(conns, c)
		}
		stream, err := opbrokerv1.NewOperationServiceClient(conns[len(conns)-1]).WatchOperation(ctx, &opbrokerv1.WatchOperationRequest{Name: name})
		if err == nil {
			_, err = stream.Recv() // the snapshot: the stream is established and idle
		}
		if err != nil {
			closeAll()
			return nil, err
		}
	}
	return closeAll, nil
}

// asChild is set in the environment of the child process that holds the clients.
const asChild = "OPBENCH_WATCH_CLIENTS"

// startWatchClients runs this program again as the clients of n streams, waits until
// they are open, and returns how to end them.
func startWatchClients(addr, name string, n int) (func() error, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	child := exec.Command(self, "watch-clients", "--addr", addr, "--name", name, "--watchers", fmt.Sprint(n))
	child.Env = append(os.Environ(), asChild+"=1")
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := child.Start(); err != nil {
		return nil, err
	}
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		_ = child.Process.Kill()
		_ = child.Wait()
		return nil, fmt.Errorf("the watch clients did not start: %q %v", line, err)
	}
	return func() error { stdin.Close(); return child.Wait() }, nil
}

// watchClients is the child of startWatchClients: it opens the streams, says "ready",
// and holds them until its standard input closes.
func watchClients(ctx context.Context, cmd *cli.Command) error {
	closeAll, err := openWatchers(ctx, cmd.String("addr"), cmd.String("name"), cmd.Int("watchers"))
	if err != nil {
		return err
	}
	defer closeAll()
	fmt.Fprintln(cmd.Root().Writer, "ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}
