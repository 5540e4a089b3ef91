// Command simtarget runs the simulated remote target on its own: a vendor-like HTTP API
// with ground truth at /sim/truth and injectable faults (package simtarget). It is what
// the chaos run and manual experiments point opbroker at. With --webhook-url it also
// sends signed events about its charges to the broker's webhook listener, the secret
// read from the environment variable --webhook-secret-env names.
//
//	simtarget --addr 127.0.0.1:8081 --fault-rate commit_then_reset=0.1 --seed 7
//	SIMTARGET_WEBHOOK_SECRET=whsec_demo_0123456789 simtarget --webhook-url http://127.0.0.1:8080/demo-payments --webhook-fault-rate duplicate=0.1
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cmd := &cli.Command{
		Name:  "simtarget",
		Usage: "a simulated remote target with ground truth and injectable faults",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "addr", Value: "127.0.0.1:8081", Usage: "listen address (loopback only in tests)"},
			&cli.StringFlag{Name: "fault", Usage: "a fault applied to every create that names none"},
			&cli.StringSliceFlag{Name: "fault-rate", Usage: "fault=probability, repeatable: random faults"},
			&cli.Uint64Flag{Name: "seed", Usage: "seed of the random faults"},
			&cli.BoolFlag{Name: "save-only-successes", Usage: "a saved error is not replayed: the same key executes again"},
			&cli.DurationFlag{Name: "retention", Usage: "forget idempotency keys after this long (0: never)"},
			&cli.DurationFlag{Name: "lookup-lag", Usage: "hide new effects from lookups for this long"},
			&cli.DurationFlag{Name: "slow-delay", Value: 2 * time.Second, Usage: "how long slow_commit waits"},
			&cli.DurationFlag{Name: "latency", Usage: "processing time of every create"},
			&cli.StringSliceFlag{Name: "webhook-url", Usage: "where to send signed events about charges, e.g. http://127.0.0.1:8080/demo-payments; repeatable: a failed delivery is tried at the next"},
			&cli.StringFlag{Name: "webhook-secret-env", Value: "SIMTARGET_WEBHOOK_SECRET", Usage: "the environment variable that holds the webhook signing secret"},
			&cli.StringSliceFlag{Name: "webhook-fault-rate", Usage: "webhook fault=probability, repeatable: random webhook faults"},
			&cli.BoolFlag{Name: "webhook-account", Usage: "events carry the request's account, read as the tenant"},
		},
		Action: run,
	}
	if err := cmd.Run(ctx, os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "simtarget:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cmd *cli.Command) error {
	fault, err := simtarget.ParseFault(cmd.String("fault"))
	if err != nil {
		return fmt.Errorf("--fault: %w", err)
	}
	cfg := simtarget.Config{
		Fault:             fault,
		Seed:              cmd.Uint64("seed"),
		SaveOnlySuccesses: cmd.Bool("save-only-successes"),
		Retention:         cmd.Duration("retention"),
		LookupLag:         cmd.Duration("lookup-lag"),
		SlowDelay:         cmd.Duration("slow-delay"),
		Latency:           cmd.Duration("latency"),
	}
	if cfg.FaultRates, err = parseRates(cmd.StringSlice("fault-rate"), simtarget.ParseFault); err != nil {
		return fmt.Errorf("--fault-rate: %w", err)
	}
	if urls := cmd.StringSlice("webhook-url"); len(urls) > 0 {
		env := cmd.String("webhook-secret-env")
		secret := strings.TrimSpace(os.Getenv(env))
		if secret == "" {
			return fmt.Errorf("--webhook-url: the signing secret must be in the environment variable %s", env)
		}
		cfg.Webhooks = &simtarget.WebhookConfig{URLs: urls, Secret: secret, SecretSource: target.Secret{Env: env},
			Account: cmd.Bool("webhook-account")}
		if cfg.Webhooks.FaultRates, err = parseRates(cmd.StringSlice("webhook-fault-rate"), simtarget.ParseWebhookFault); err != nil {
			return fmt.Errorf("--webhook-fault-rate: %w", err)
		}
	}
	sim := simtarget.New(cfg)
	lis, err := net.Listen("tcp", cmd.String("addr"))
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: sim, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(os.Stderr, "simtarget listening on http://%s (ground truth at /sim/truth)\n", lis.Addr())
	go func() {
		<-ctx.Done()
		sim.Close()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// parseRates reads fault=probability specs into rates, nil for none.
func parseRates[F ~string](specs []string, parse func(string) (F, error)) (map[F]float64, error) {
	var rates map[F]float64
	for _, spec := range specs {
		name, p, ok := strings.Cut(spec, "=")
		rate, err := strconv.ParseFloat(p, 64)
		if !ok || err != nil || rate < 0 || rate > 1 {
			return nil, fmt.Errorf("%q: want fault=probability", spec)
		}
		f, err := parse(name)
		if err != nil {
			return nil, err
		}
		if rates == nil {
			rates = map[F]float64{}
		}
		rates[f] = rate
	}
	return rates, nil
}
