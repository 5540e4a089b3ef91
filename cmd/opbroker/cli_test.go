package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/urfave/cli/v3"
)

// The tests of this file run opbroker in this process and do not call t.Parallel: the
// flags that several commands share are package variables, and a run writes its parse
// state into them.

type result struct {
	stdout, stderr string
	code           int
}

// opbroker runs the command line `opbroker args...` in this process.
func opbroker(t *testing.T, args ...string) result {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), append([]string{"opbroker"}, args...), &stdout, &stderr)
	return result{stdout: stdout.String(), stderr: stderr.String(), code: code}
}

// command is one command of the binary and the words that name it after `opbroker`.
type command struct {
	path []string
	cmd  *cli.Command
}

// commands lists every command of the binary, the root (path nil) first, the help
// commands included.
func commands() []command {
	var all []command
	var walk func(path []string, cmd *cli.Command)
	walk = func(path []string, cmd *cli.Command) {
		all = append(all, command{path, cmd})
		for _, sub := range cmd.Commands {
			walk(append(path[:len(path):len(path)], sub.Name), sub)
		}
	}
	walk(nil, newApp())
	return all
}

// TestHelp: every command, the help command included, answers --help and -h with its
// help on stdout and status 0, and `opbroker help <command>` prints the same.
func TestHelp(t *testing.T) {
	var paths [][]string
	for _, c := range commands() {
		paths = append(paths, c.path)
	}
	require.Contains(t, paths, []string{"targets", "check"})
	require.Contains(t, paths, []string{"help"})
	require.Contains(t, paths, []string{"targets", "help"})
	for _, path := range paths {
		name := strings.Join(append([]string{"opbroker"}, path...), " ")
		help := opbroker(t, append(path, "--help")...)
		require.Equal(t, 0, help.code, "%s --help: %s", name, help.stderr)
		require.Empty(t, help.stderr, "%s --help", name)
		require.True(t, strings.HasPrefix(help.stdout, "NAME:\n   "+name+" - "), "%s --help:\n%s", name, help.stdout)
		require.Contains(t, help.stdout, "--help, -h", "%s --help lists --help", name)

		require.Equal(t, help, opbroker(t, append(path, "-h")...), "%s -h", name)
		require.Equal(t, help, opbroker(t, append([]string{"help"}, path...)...), "opbroker help %s", strings.Join(path, " "))
		require.Equal(t, help, opbroker(t, append([]string{"h"}, path...)...), "opbroker h %s", strings.Join(path, " "))
	}

	root := opbroker(t)
	require.Equal(t, opbroker(t, "--help"), root, "opbroker alone prints its help")
	for _, command := range []string{"dev", "serve", "migrate", "targets", "token", "version", "help"} {
		require.Regexp(t, `(?m)^   `+command+`\b.*  \S`, root.stdout, "the root help lists %s with its usage", command)
	}

	helpHelp := opbroker(t, "help", "--help")
	require.Equal(t, 0, helpHelp.code, helpHelp.stderr)
	require.Contains(t, helpHelp.stdout, "opbroker help - list the commands, or show the help of one")

	require.Equal(t, opbroker(t, "serve", "--help"), opbroker(t, "help", "serve", "--help"), "help serve --help is the help of serve")
	require.Equal(t, opbroker(t, "targets", "check", "--help"), opbroker(t, "targets", "help", "check"))
	require.Equal(t, opbroker(t, "targets", "--help"), opbroker(t, "targets"), "a command that only groups others prints its help")
}

// TestVersionCommandAndFlag: `opbroker version`, --version and -v print the same line.
func TestVersionCommandAndFlag(t *testing.T) {
	want := "opbroker version " + currentBuild().String() + "\n"
	for _, args := range [][]string{{"version"}, {"--version"}, {"-v"}} {
		got := opbroker(t, args...)
		require.Equal(t, result{stdout: want}, got, "opbroker %s", args[0])
	}
	require.Contains(t, opbroker(t, "--help").stdout, "--version, -v")
}

// TestMistypedCommand: a word that names no command fails, names the closest command,
// and prints no help, however it is reached.
func TestMistypedCommand(t *testing.T) {
	for _, tc := range []struct {
		args              []string
		word, under, best string
	}{
		{[]string{"serv"}, "serv", "opbroker", "serve"},
		{[]string{"serv", "--help"}, "serv", "opbroker", "serve"},
		{[]string{"help", "serv"}, "serv", "opbroker", "serve"},
		{[]string{"migrat", "--database-url", "postgres://127.0.0.1:1/x"}, "migrat", "opbroker", "migrate"},
		{[]string{"--help", "serv"}, "serv", "opbroker", "serve"},
		{[]string{"verison"}, "verison", "opbroker", "version"},
		{[]string{"targets", "chek"}, "chek", "opbroker targets", "check"},
		{[]string{"targets", "chek", "--targets", "targets.yaml"}, "chek", "opbroker targets", "check"},
		{[]string{"targets", "help", "chek"}, "chek", "opbroker targets", "check"},
		{[]string{"help", "targets", "chek"}, "chek", "opbroker targets", "check"},
		{[]string{"token", "neww"}, "neww", "opbroker token", "new"},
	} {
		got := opbroker(t, tc.args...)
		require.Equal(t, result{code: 1, stderr: fmt.Sprintf("opbroker: %q is not a command of %q. Did you mean %q?\n",
			tc.word, tc.under, tc.best)}, got, "opbroker %v", tc.args)
	}
	require.Equal(t, result{code: 1, stderr: `opbroker: "xyz" is not a command of "opbroker"; "opbroker --help" lists them` + "\n"}, opbroker(t, "xyz"))

	flag := opbroker(t, "serve", "--plaintxt")
	require.Equal(t, 1, flag.code)
	require.Contains(t, flag.stderr, "flag provided but not defined: -plaintxt")
	require.Contains(t, flag.stderr, `Did you mean "--plaintext"?`)
}

// TestBoolFlagsShowTheirDefault: help prints the default of every bool flag, as it does
// for the other kinds (urfave/cli alone prints none for a bool).
func TestBoolFlagsShowTheirDefault(t *testing.T) {
	bools := 0
	for _, c := range commands() {
		help := opbroker(t, append(c.path, "--help")...).stdout
		for _, f := range c.cmd.Flags {
			b, ok := f.(*cli.BoolFlag)
			if !ok {
				continue
			}
			bools++
			line := flagLine(help, b.Name)
			require.NotEmpty(t, line, "opbroker %v --help shows --%s", c.path, b.Name)
			require.Contains(t, line, "(default: "+strconv.FormatBool(b.Value)+")", "opbroker %v --help", c.path)
		}
	}
	require.Positive(t, bools)

	serve := opbroker(t, "serve", "--help").stdout
	require.Contains(t, flagLine(serve, "dispatch"), "(default: true)")
	require.Contains(t, flagLine(serve, "plaintext"), "(default: false)")
	require.NotContains(t, flagLine(serve, "help"), "(default:", "--help is not a setting")
}

// flagLine is the line of help that describes --name.
func flagLine(help, name string) string {
	for line := range strings.Lines(help) {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "--"+name+" ") || strings.HasPrefix(line, "--"+name+",") {
			return line
		}
	}
	return ""
}

// TestExitStatus: an error a command ends with cli.Exit gives its status, printed once;
// urfave/cli does not exit the process itself.
func TestExitStatus(t *testing.T) {
	good, err := os.ReadFile("../../target/testdata/targets.yaml")
	require.NoError(t, err)
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte(strings.Replace(string(good), "team: messaging", `team: ""`, 1)), 0o644))

	got := opbroker(t, "targets", "check", "--targets", bad)
	require.Equal(t, 1, got.code)
	require.Contains(t, got.stdout, "FAIL   9 escalation path")
	require.Equal(t, "opbroker: 1 control(s) fail: a failing target is not used\n", got.stderr)

	missing := opbroker(t, "targets", "check", "--targets", filepath.Join(t.TempDir(), "none.yaml"))
	require.Equal(t, 1, missing.code)
	require.Contains(t, missing.stderr, "opbroker: open ")
}
