package store

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// TestByOneOutcome: a combined outcome statement is written again in halves only for
// an error one outcome in it can cause; not for one every half would meet again (a
// timeout, the server out of memory), which would cost about two statements per
// outcome, each meeting it again, nor for a deadlock, which no one outcome causes (its
// victim is run again instead).
func TestByOneOutcome(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return fmt.Errorf("store: record outcome: %w", &pgconn.PgError{Code: code}) }
	for err, want := range map[error]bool{
		pg("22021"): true,  // a NUL in a text
		pg("23514"): true,  // a CHECK
		pg("23000"): true,  // the schema's guards
		pg("54000"): true,  // an index entry too large
		pg("57014"): false, // statement timeout, cancelled
		pg("53200"): false, // out of memory
		pg("40P01"): false, // deadlock
		fmt.Errorf("%w: %w", ErrUnavailable, errors.New("connection reset")): false,
		fmt.Errorf("store: %w", context.DeadlineExceeded):                    false,
		errors.New("unable to encode"):                                       true,
	} {
		require.Equal(t, want, byOneOutcome(err), "%v", err)
	}
}
