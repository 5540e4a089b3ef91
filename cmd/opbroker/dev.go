package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/embeddedpg"
	"github.com/opbroker/opbroker/provision"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

func devCommand() *cli.Command {
	return &cli.Command{
		Name:  "dev",
		Usage: "run the broker on an embedded PostgreSQL in a data folder, with reflection, no credentials",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "data-dir", Value: ".opbroker-dev", Usage: "folder for the embedded PostgreSQL; reused across restarts", Sources: cli.EnvVars("OPBROKER_DATA_DIR")},
			&cli.StringFlag{Name: "pg-bin-dir", Usage: "a PostgreSQL installation (containing bin/pg_ctl); default: found on the machine, else downloaded", Sources: cli.EnvVars("OPBROKER_PG_BIN_DIR")},
		}, serverFlags("127.0.0.1:50051", "127.0.0.1:9090", "127.0.0.1:9091", "127.0.0.1:8080", "text")...),
		Action: runDev,
	}
}

func runDev(ctx context.Context, cmd *cli.Command) error {
	log, err := newLogger(cmd)
	if err != nil {
		return err
	}
	dataDir, err := filepath.Abs(cmd.String("data-dir"))
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return fmt.Errorf("--data-dir: %w", err)
	}
	pgLog, err := os.OpenFile(filepath.Join(dataDir, "postgres.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer pgLog.Close()

	fmt.Fprintf(os.Stderr, "opbroker dev: starting PostgreSQL in %s ...\n", dataDir)
	pg, err := embeddedpg.Start(ctx, embeddedpg.Config{DataDir: dataDir, BinDir: cmd.String("pg-bin-dir"), Logger: pgLog})
	if err != nil {
		return err
	}
	defer func() {
		if err := pg.Stop(); err != nil {
			log.Error("stopping PostgreSQL", "error", err)
		}
	}()
	// The broker connects as an ordinary role, bound by row-level security as in
	// production; the printed PostgreSQL address is the administrator's.
	appURL, err := provision.Schema(ctx, pg.URL(), "opbroker", "opbroker")
	if err != nil {
		return err
	}
	if err := store.MigrateURL(ctx, appURL); err != nil {
		return err
	}

	// The demo target reports its charges by webhook to the broker's listener, signed
	// with a secret made for this start and kept in the data folder.
	var simCfg simtarget.Config
	if addr := cmd.String("webhook-addr"); addr != "" {
		// The target must know the listener's address before the broker listens: a
		// port 0 is chosen now.
		if addr, err = freeAddr(addr); err != nil {
			return fmt.Errorf("--webhook-addr: %w", err)
		}
		if err := cmd.Set("webhook-addr", addr); err != nil {
			return err
		}
		secretFile := filepath.Join(dataDir, "webhook-secret")
		secret := rand.Text()
		if err := os.WriteFile(secretFile, []byte(secret+"\n"), 0o600); err != nil {
			return err
		}
		simCfg.Webhooks = &simtarget.WebhookConfig{URLs: []string{"http://" + addr + simtarget.WebhookPath},
			Secret: secret, SecretSource: target.Secret{File: secretFile}}
	}
	sim, err := simtarget.Start(simCfg)
	if err != nil {
		return err
	}
	defer sim.Close()
	targets, err := sim.Targets()
	if err != nil {
		return err
	}

	b, err := startBroker(ctx, cmd, log, appURL, targets, security{reflection: true})
	if err != nil {
		return err
	}
	b.mux.Handle("GET /sim/truth", sim.TruthHandler())
	fmt.Fprintf(os.Stderr, `
opbroker dev is ready.
  gRPC (reflection on):  %s      try: grpcurl -plaintext %s list
  metrics:               http://%s/metrics
  demo target:           %s  (demo.charge: idempotency key and lookup; demo.notify: neither; demo.object: conditional create and lookup)
  demo ground truth:     http://%s/sim/truth
  webhooks:              %s  (the demo target reports its charges here, signed)
  support view:          %s  (sign in with any token: dev has no authentication)
  PostgreSQL:            %s  (the ledger is in schema opbroker)
  data folder:           %s (kept across restarts; delete it to start afresh)

  WARNING: dev mode has no authentication and no TLS. Never expose it beyond this machine.
  Stop with Ctrl-C.

  A JSON payload may ask the demo target for a fault: {"amount": 100, "sim": {"fault": "commit_then_reset"}}

`, b.grpcLis.Addr(), b.grpcLis.Addr(), b.httpLis.Addr(), sim.URL, b.httpLis.Addr(), webhooks(b), b.uiURL, pg.URL(), dataDir)
	return b.run(ctx)
}

// freeAddr returns addr with its port chosen, if it was 0, by listening on it a moment.
func freeAddr(addr string) (string, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	defer lis.Close()
	return lis.Addr().String(), nil
}

// webhooks says where the broker receives webhooks, if it does.
func webhooks(b *broker) string {
	if b.webhookLis == nil {
		return "none (--webhook-addr is empty)"
	}
	return "http://" + b.webhookLis.Addr().String() + simtarget.WebhookPath
}
