package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/urfave/cli/v3"
)

// TestConfigurationDocMatchesTheFlags: docs/configuration.md has a row for every flag of
// every command, naming its environment variable, its commands and its default as the
// binary has them, and no row for a flag that does not exist.
func TestConfigurationDocMatchesTheFlags(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/configuration.md")
	require.NoError(t, err)
	type row struct{ env, def, commands string }
	rows := map[string]row{}
	inTable := false
	for line := range strings.Lines(string(doc)) {
		switch {
		case strings.HasPrefix(line, "| flag | environment | default | commands |"):
			inTable = true
		case inTable && !strings.HasPrefix(line, "|"):
			inTable = false
		case inTable && !strings.HasPrefix(line, "|---"):
			cells := strings.Split(line, "|")
			require.GreaterOrEqual(t, len(cells), 6, line)
			name := strings.Trim(strings.TrimSpace(cells[1]), "`")
			rows[name] = row{env: strings.Trim(strings.TrimSpace(cells[2]), "`"), def: cells[3], commands: cells[4]}
		}
	}
	require.NotEmpty(t, rows, "the flag table of docs/configuration.md")

	seen := map[string]bool{}
	var walk func(path string, cmd *cli.Command)
	walk = func(path string, cmd *cli.Command) {
		for _, f := range cmd.Flags {
			name := "--" + f.Names()[0]
			seen[name] = true
			r, ok := rows[name]
			require.True(t, ok, "%s of %q has no row", name, path)
			if envs := f.(interface{ GetEnvVars() []string }).GetEnvVars(); len(envs) > 0 {
				require.Equal(t, envs[0], r.env, name)
			}
			require.Contains(t, r.commands, path, "%s: its row names the commands that take it", name)
			def := strings.Trim(f.(interface{ GetValue() string }).GetValue(), `"`)
			if def == "" {
				require.True(t, strings.HasPrefix(strings.TrimSpace(r.def), "none"), "%s: no default, so the row says none: %q", name, r.def)
			} else {
				require.Contains(t, r.def, "`"+def+"`", "%s of %q: the default", name, path)
			}
		}
		for _, sub := range cmd.Commands {
			walk(strings.TrimSpace(path+" "+sub.Name), sub)
		}
	}
	walk("", newApp())
	for name := range rows {
		require.True(t, seen[name], "the row of %s names no flag of the binary", name)
	}
}
