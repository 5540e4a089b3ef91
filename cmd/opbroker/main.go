// Command opbroker is the operation broker: a gRPC service that records consequential
// outbound operations in a PostgreSQL ledger, sends each at most once per claim, and
// resolves unclear outcomes by asking the target before anything is retried.
//
//	opbroker dev      run on an embedded PostgreSQL, for trying it out
//	opbroker serve    run against --database-url
//	opbroker migrate  bring the database schema up to date
//	opbroker targets  check the recorded target contracts
//	opbroker token    make bearer tokens for the principals file
//	opbroker version  print the version, commit and Go version (also --version)
//	opbroker help     list the commands, or show the help of one (also --help)
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"syscall"

	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/gcpace"
)

func main() {
	if err := gcpace.Default(); err != nil {
		fmt.Fprintln(os.Stderr, "opbroker: warning: no soft memory limit set:", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs opbroker with args (args[0] is the program's name), writing to stdout and
// stderr, and returns its exit status: 0, that of a cli.Exit error, or 1 for any other
// error. It prints the error.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	app := newApp()
	app.Writer, app.ErrWriter = stdout, stderr
	// The status is decided here rather than by urfave/cli calling os.Exit, so that
	// tests can run the app in their own process.
	app.ExitErrHandler = func(context.Context, *cli.Command, error) {}
	err := app.Run(ctx, args)
	if err == nil {
		return 0
	}
	if msg := err.Error(); msg != "" {
		fmt.Fprintln(stderr, "opbroker:", msg)
	}
	if exit, ok := errors.AsType[cli.ExitCoder](err); ok {
		return exit.ExitCode()
	}
	return 1
}

func newApp() *cli.Command {
	app := &cli.Command{
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
	_ = app.Walk(func(cmd *cli.Command) error {
		cmd.Suggest = true // a mistyped flag: `Did you mean "--targets"?`
		showBoolDefaults(cmd)
		if len(cmd.Commands) > 0 {
			// A command that groups others takes no arguments: its first names one of its
			// commands, and the rest are that command's even when the first names none
			// (`opbroker serv --targets t.yaml` is a mistyped command, not a mistyped flag).
			cmd.StopOnNthArg = new(1)
			if cmd.Command("help") == nil {
				cmd.Commands = append(cmd.Commands, helpCommand())
			}
		}
		return nil
	})
	return app
}

func init() {
	// urfave/cli answers a word that names no command with its help action, which fails
	// with "No help topic for 'serv'" (with Suggest, "No help topic for 'serv'. serve"),
	// or, when the command has a CommandNotFound, calls it and exits 0. Every way there
	// (`opbroker serv`, `opbroker serv --help`, `opbroker help serv`) goes through
	// ShowCommandHelp.
	showCommandHelp := cli.ShowCommandHelp
	cli.ShowCommandHelp = func(ctx context.Context, cmd *cli.Command, name string) error {
		if cmd.Command(name) == nil {
			return unknownCommand(cmd, name)
		}
		return showCommandHelp(ctx, cmd, name)
	}
}

// unknownCommand is the error for a word after parent that names none of its commands;
// it names the closest one, chosen as urfave/cli's Suggest chooses.
func unknownCommand(parent *cli.Command, name string) error {
	if suggestion := cli.SuggestCommand(parent.Commands, name); suggestion != "" {
		return fmt.Errorf("%q is not a command of %q. "+cli.SuggestDidYouMeanTemplate, name, parent.FullName(), suggestion)
	}
	return fmt.Errorf("%q is not a command of %q; %q lists them", name, parent.FullName(), parent.FullName()+" --help")
}

// helpCommand stands in for urfave/cli's help command, which takes no flags (so
// `opbroker help --help` failed) and looks one level down only.
func helpCommand() *cli.Command {
	return &cli.Command{
		Name:      "help",
		Aliases:   []string{"h"},
		Usage:     "list the commands, or show the help of one",
		ArgsUsage: "[command [subcommand]]",
		// --help asks for the help of help only when it names nothing else:
		// `opbroker help serve --help` is the help of serve.
		SkipFlagParsing: true,
		Action: func(ctx context.Context, help *cli.Command) error {
			args := help.Args().Slice()
			names := slices.DeleteFunc(slices.Clone(args), func(arg string) bool { return arg == "--help" || arg == "-h" })
			if len(names) == 0 && len(args) > 0 {
				names = []string{help.Name}
			}
			cmd := help.Lineage()[1] // the command whose help this is
			if len(names) == 0 {
				if cmd == cmd.Root() {
					return cli.ShowRootCommandHelp(cmd)
				}
				return cli.ShowSubcommandHelp(cmd)
			}
			for _, name := range names[:len(names)-1] {
				sub := cmd.Command(name)
				if sub == nil {
					return unknownCommand(cmd, name)
				}
				cmd = sub
			}
			return cli.ShowCommandHelp(ctx, cmd, names[len(names)-1])
		},
	}
}

// showBoolDefaults makes help print the default of cmd's bool flags, as it does for
// every other kind: urfave/cli prints a bool's from DefaultText only. It sets it on
// copies, since commands share some flags and newApp may run concurrently in tests.
func showBoolDefaults(cmd *cli.Command) {
	cmd.Flags = slices.Clone(cmd.Flags)
	for i, f := range cmd.Flags {
		if b, ok := f.(*cli.BoolFlag); ok && b.DefaultText == "" && !b.HideDefault {
			shown := *b
			shown.DefaultText = strconv.FormatBool(b.Value)
			cmd.Flags[i] = &shown
		}
	}
}
