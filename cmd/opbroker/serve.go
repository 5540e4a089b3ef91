package main

import (
	"context"
	"fmt"

	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

func serveCommand() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "run the broker against a PostgreSQL database migrated with `opbroker migrate`",
		Flags: append(append([]cli.Flag{databaseURLFlag, targetsFlag, requireSyncFlag}, securityFlags...), serverFlags("127.0.0.1:50051", "127.0.0.1:9090", "", "", "json")...),
		Action: func(ctx context.Context, cmd *cli.Command) error {
			log, err := newLogger(cmd)
			if err != nil {
				return err
			}
			targets, err := target.LoadFile(cmd.String("targets"))
			if err != nil {
				return err
			}
			sec, err := securityFromFlags(cmd, log)
			if err != nil {
				return err
			}
			b, err := startBroker(ctx, cmd, log, cmd.String("database-url"), targets, sec)
			if err != nil {
				return err
			}
			return b.run(ctx)
		},
	}
}

func migrateCommand() *cli.Command {
	return &cli.Command{
		Name:  "migrate",
		Usage: "bring the database schema up to date (safe to run from several processes at once)",
		Flags: []cli.Flag{databaseURLFlag},
		Action: func(ctx context.Context, cmd *cli.Command) error {
			if err := store.MigrateURL(ctx, cmd.String("database-url")); err != nil {
				return err
			}
			fmt.Fprintln(cmd.Root().Writer, "schema is up to date")
			return nil
		},
	}
}
