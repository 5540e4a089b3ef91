package target

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestLimiterHoldsEachTargetToItsConcurrency: a contract's concurrency, or the default
// where it sets none or more; a target the limiter was not built with gets the default
// too, the same slots at every use; Acquire waits for a slot until its context ends,
// and a Release lets the next in.
func TestLimiterHoldsEachTargetToItsConcurrency(t *testing.T) {
	l := NewLimiter(newTargets([]*Contract{{Name: "two", Concurrency: 2}, {Name: "unset"}, {Name: "many", Concurrency: 50}}), 4)
	for name, want := range map[string]int{"two": 2, "unset": 4, "many": 4, "unknown": 4} {
		require.Equal(t, want, l.Free(name), name)
		for range want {
			require.NoError(t, l.Acquire(context.Background(), name), name)
		}
		require.Zero(t, l.Free(name), name)

		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		require.ErrorIs(t, l.Acquire(ctx, name), context.DeadlineExceeded, "%s: one more than its slots waits", name)
		cancel()

		acquired := make(chan error, 1)
		go func() { acquired <- l.Acquire(context.Background(), name) }()
		l.Release(name, 1)
		require.NoError(t, <-acquired, name)
		l.Release(name, want)
		require.Equal(t, want, l.Free(name), name)
	}
}
