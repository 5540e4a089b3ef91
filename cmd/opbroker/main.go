// Command opbroker is the operation broker: a gRPC service that records consequential
// outbound operations in a PostgreSQL ledger, sends each at most once per claim, and
// resolves unclear outcomes by asking the target before anything is retried.
//
//	opbroker dev      run on an embedded PostgreSQL, for trying it out
//	opbroker serve    run against --database-url
//	opbroker migrate  bring the database schema up to date
//	opbroker token    make bearer tokens for the principals file
//	opbroker version  print the version, commit and Go version (also --version)
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/urfave/cli/v3"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newApp().Run(ctx, os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "opbroker:", err)
		os.Exit(1)
	}
}

func newApp() *cli.Command {
	return &cli.Command{
		Name:    "opbroker",
		Usage:   "broker consequential outbound operations: at most one remote effect per intent",
		Version: currentBuild().String(),
		Commands: []*cli.Command{
			devCommand(),
			serveCommand(),
			migrateCommand(),
			targetsCommand(),
			tokenCommand(),
			versionCommand(),
		},
	}
}
