package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"time"

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
	log := slog.New(slog.DiscardHandler)
	hub := watch.New(st, log, time.Second)
	if err := hub.Start(ctx); err != nil {
		return err
	}
	defer hub.Stop()
	targets, err := target.New(simtarget.DemoContracts("http://127.0.0.1:1")...)
	if err != nil {
		return err
	}
	srv, err := server.New(server.Options{Store: st, Targets: targets, Logger: log, MeterProvider: noop.NewMeterProvider(), Hub: hub})
	if err != nil {
		return err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { _ = srv.GRPC.Serve(lis) }()
	defer srv.Stop(time.Second)

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
			c, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
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
	fmt.Fprintf(cmd.Root().Writer, "  machine: %d cores, %s/%s\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
	return nil
}

// heap returns the bytes of heap and goroutine stacks in use after a collection.
func heap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse + m.StackInuse
}
