package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/urfave/cli/v3"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/opbroker/opbroker/reconciler"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// benchReconcile measures how fast UNKNOWN operations are resolved by asking the
// target: every send of a backlog commits at the target and then loses its connection
// (so each is recorded UNKNOWN with its effect in place), then the reconciler alone
// looks each one up and records it SUCCEEDED.
func benchReconcile(ctx context.Context, cmd *cli.Command) error {
	url, stopCluster, err := cluster(ctx, cmd.String("database-url"))
	if err != nil {
		return err
	}
	defer stopCluster()
	run, err := newDispatchRun(ctx, url, runConfig{target: "http", rls: true, tenants: cmd.Int("tenants"), poolSize: 64, claimBatch: 64,
		sim: simtarget.Config{Fault: simtarget.FaultCommitThenReset}})
	if err != nil {
		return err
	}
	defer run.close()
	n := cmd.Int("ops")
	fmt.Fprintf(cmd.Root().ErrWriter, "making %d operations UNKNOWN (each sent, committed at the target, connection lost) ...\n", n)
	if err := run.backlog(ctx, n); err != nil {
		return err
	}
	if err := run.d.Start(ctx); err != nil {
		return err
	}
	if _, err := run.waitFor(ctx, store.StateUnknown, n, 10*time.Minute); err != nil {
		return err
	}
	run.d.Stop()

	rec, err := reconciler.New(reconciler.Config{Store: run.st, Targets: run.targets, Connector: target.NewConnector(), Deliverer: run.d,
		Logger: slog.New(slog.DiscardHandler), MeterProvider: noop.NewMeterProvider(), Concurrency: cmd.Int("concurrency")})
	if err != nil {
		return err
	}
	stopProfile, err := profile(cmd)
	if err != nil {
		return err
	}
	defer stopProfile()
	start := time.Now()
	if err := rec.Start(ctx); err != nil {
		return err
	}
	defer rec.Stop()
	end, err := run.waitFor(ctx, store.StateSucceeded, n, 10*time.Minute)
	if err != nil {
		return err
	}
	elapsed := end.Sub(start)
	out := cmd.Root().Writer
	fmt.Fprintf(out, "reconciliation: %d UNKNOWN -> SUCCEEDED by lookup in %s: %.0f resolved/s\n", n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds())
	fmt.Fprintf(out, "  every operation: a claim of the UNKNOWN operation, a lookup over loopback HTTP (the simulated target, in process), the decision, the outcome with its event; %d lookups at once, %d tenants\n",
		cmd.Int("concurrency"), cmd.Int("tenants"))
	fmt.Fprintf(out, "  %s\n", machine(ctx, run.pool))
	return nil
}
