// Command opchaos runs the chaos run (package chaos) and prints its report; it exits 1
// when an invariant was broken, 2 when the run could not be carried out.
//
//	opchaos --broker bin/opbroker-chaos --seed 7 --duration 10m --json report.json
//
// The broker must be built with its crash points (make build-chaos); opchaos refuses
// one built without them.
package main

import (
	"context"
	"debug/buildinfo"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/chaos"
	"github.com/opbroker/opbroker/crashpoint"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newApp().Run(ctx, os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "opchaos:", err)
		os.Exit(2)
	}
}

func newApp() *cli.Command {
	return &cli.Command{
		Name:  "opchaos",
		Usage: "run the broker through faults and audit its promise (invariants I1-I16)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "broker", Value: "bin/opbroker-chaos", Usage: "the opbroker binary the replicas run, built with -tags " + crashpoint.BuildTag},
			&cli.StringFlag{Name: "database-url", Sources: cli.EnvVars("DATABASE_URL"), Usage: "an administrator's connection string; default: an embedded PostgreSQL (then also restarted as a fault)"},
			&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "the seed of the workload, the fault schedule and the targets' faults"},
			&cli.IntFlag{Name: "replicas", Value: 3},
			&cli.IntFlag{Name: "tenants", Value: 4},
			&cli.IntFlag{Name: "intents", Value: 150, Usage: "intents per round"},
			&cli.IntFlag{Name: "clients", Value: 8, Usage: "concurrent clients"},
			&cli.DurationFlag{Name: "duration", Usage: "keep the faults and the workload going at least this long (0: one round)"},
			&cli.DurationFlag{Name: "fault-interval", Value: chaos.DefaultFaultInterval, Usage: "mean time between process and database faults"},
			&cli.Float64Flag{Name: "fault-rate", Value: chaos.DefaultFaultRate, Usage: "share of the targets' requests that get a fault"},
			&cli.BoolFlag{Name: "failover", Usage: "run the ledger on a replicated PostgreSQL (Patroni, etcd, three nodes, strict synchronous mode) whose primary is killed and stopped (needs Debian's patroni and etcd-server)"},
			&cli.DurationFlag{Name: "failover-interval", Value: chaos.DefaultFailoverInterval, Usage: "mean time between failovers, with --failover"},
			&cli.DurationFlag{Name: "settle-bound", Value: chaos.DefaultSettleBound, Usage: "how long the work may take to settle after healing"},
			&cli.StringFlag{Name: "json", Usage: "also write the report as JSON to this file"},
			&cli.BoolFlag{Name: "verbose", Usage: "print the replicas' logs"},
		},
		Action: run,
	}
}

func run(ctx context.Context, cmd *cli.Command) error {
	if err := requireCrashPoints(cmd.String("broker")); err != nil {
		return err
	}
	cfg := chaos.Config{
		Seed: cmd.Uint64("seed"), Broker: cmd.String("broker"), DatabaseURL: cmd.String("database-url"),
		Replicas: cmd.Int("replicas"), Tenants: cmd.Int("tenants"), Intents: cmd.Int("intents"), Clients: cmd.Int("clients"),
		Duration: cmd.Duration("duration"), FaultInterval: cmd.Duration("fault-interval"), FaultRate: cmd.Float64("fault-rate"),
		SettleBound: cmd.Duration("settle-bound"), Failover: cmd.Bool("failover"), FailoverInterval: cmd.Duration("failover-interval"),
		Log: os.Stderr,
	}
	if cmd.Bool("verbose") {
		cfg.ReplicaLogs = os.Stderr
	}
	report, err := chaos.Run(ctx, cfg)
	if err != nil {
		return err
	}
	report.WriteText(cmd.Root().Writer)
	if path := cmd.String("json"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := report.WriteJSON(f); err != nil {
			return err
		}
	}
	if !report.Passed() {
		os.Exit(1)
	}
	return nil
}

// requireCrashPoints refuses a broker built without its crash points: they would do
// nothing, and the run would test less than its report says.
func requireCrashPoints(broker string) error {
	info, err := buildinfo.ReadFile(broker)
	if err != nil {
		return fmt.Errorf("--broker: %w", err)
	}
	for _, s := range info.Settings {
		if s.Key == "-tags" && slices.Contains(strings.Split(s.Value, ","), crashpoint.BuildTag) {
			return nil
		}
	}
	return fmt.Errorf("--broker %s was built without -tags %s, so its crash points do nothing (make build-chaos builds bin/opbroker-chaos)",
		broker, crashpoint.BuildTag)
}
