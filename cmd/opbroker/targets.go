package main

import (
	"context"
	"fmt"
	"os"

	"github.com/urfave/cli/v3"

	"github.com/opbroker/opbroker/target"
)

func targetsCommand() *cli.Command {
	return &cli.Command{
		Name:  "targets",
		Usage: "work with recorded target contracts",
		Commands: []*cli.Command{{
			Name:  "check",
			Usage: "print the credentials and go/no-go controls of every target, each with its state or reason; exit 1 if any control fails",
			Flags: []cli.Flag{targetsFlag},
			Action: func(_ context.Context, cmd *cli.Command) error {
				path := cmd.String("targets")
				data, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				file, err := target.Decode(path, data)
				if err != nil {
					return err
				}
				out := cmd.Root().Writer
				failed := 0
				for _, c := range file.Targets {
					fmt.Fprintf(out, "target %s (%v)\n  capabilities: %s\n", c.Name, c.OperationTypes, c.Capabilities())
					if e := c.Evidence; e != nil {
						fmt.Fprintf(out, "  events: %s\n", e)
					}
					// A credential is said to be present, missing or unreadable, never shown;
					// one that is not present fails control 1.
					for _, cred := range c.Credentials() {
						if cred.Problem != "" { // it names the variable or the file
							fmt.Fprintf(out, "  credential %s: %s: %s\n", cred.Field, cred.State, cred.Problem)
						} else {
							fmt.Fprintf(out, "  credential %s (%s): %s\n", cred.Field, cred.Source, cred.State)
						}
					}
					for _, r := range c.Controls() {
						verdict := "PASS"
						if !r.Pass {
							verdict = "FAIL"
							failed++
						}
						fmt.Fprintf(out, "  %s  %2d %-30s %s\n", verdict, r.Number, r.Name, r.Reason)
					}
				}
				if failed > 0 {
					return cli.Exit(fmt.Sprintf("%d control(s) fail: a failing target is not used", failed), 1)
				}
				fmt.Fprintln(out, "every control passes")
				return nil
			},
		}},
	}
}
