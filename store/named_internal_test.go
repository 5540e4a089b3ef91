package store

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// TestCompileNamed: a statement's named arguments become positional once, in the order
// of their first use, and a call binds its values by name; a name missing on either side
// is a programming error caught when the package loads or at the first call.
func TestCompileNamed(t *testing.T) {
	t.Parallel()
	s := compileNamed(`SELECT @b::int, @a::text, @b::int`, "a", "b")
	require.Equal(t, `SELECT $1::int, $2::text, $1::int`, s.sql)
	require.Equal(t, []any{2, "x"}, s.args(pgx.NamedArgs{"a": "x", "b": 2}))
	require.Panics(t, func() { compileNamed(`SELECT @a, @b`, "a") }, "an argument without a name given")
	require.Panics(t, func() { compileNamed(`SELECT @a`, "a", "b") }, "a name the statement does not use")
	require.Panics(t, func() { s.args(pgx.NamedArgs{"a": "x"}) }, "a value missing")
	require.Panics(t, func() { s.args(pgx.NamedArgs{"a": "x", "c": 2}) }, "a value under another name")
}
