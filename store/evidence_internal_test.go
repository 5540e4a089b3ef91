package store

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// TestClipKeepsCharactersWhole: a long detail is cut to the column's limit, never in the
// middle of a character.
func TestClipKeepsCharactersWhole(t *testing.T) {
	t.Parallel()
	require.Equal(t, "short", clip("short"))
	for _, long := range []string{strings.Repeat("é", 700), strings.Repeat("x", 1023) + "€€", strings.Repeat("😀", 300)} {
		got := clip(long)
		require.LessOrEqual(t, len(got), maxDetail)
		require.True(t, utf8.ValidString(got), got)
		require.True(t, strings.HasSuffix(got, "…"))
	}
}
