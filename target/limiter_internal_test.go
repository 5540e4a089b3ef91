package target

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestLimiterHoldsEachTargetToItsConcurrency: a contract's concurrency, or the default
// where it sets none or more; a target the limiter was not built with gets the default
// too, the same slots at every use, however many ask for them first at once; Acquire
// waits for a slot until its context ends, and a Release lets a waiting one in.
func TestLimiterHoldsEachTargetToItsConcurrency(t *testing.T) {
	t.Parallel()
	l := NewLimiter(newTargets([]*Contract{{Name: "two", Concurrency: 2}, {Name: "unset"}, {Name: "many", Concurrency: 50}}), 4)
	var first sync.WaitGroup
	for range 8 { // the first uses of a target it was not built with, at once
		first.Go(func() { l.Free("unknown") })
	}
	first.Wait()
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
		select {
		case err := <-acquired:
			t.Fatalf("%s: a slot was taken while none was free: %v", name, err)
		case <-time.After(20 * time.Millisecond):
		}
		l.Release(name, 1)
		select {
		case err := <-acquired:
			require.NoError(t, err, name)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: a release did not let the waiting one in", name)
		}
		l.Release(name, want)
		require.Equal(t, want, l.Free(name), name)
	}
}

// TestTryAcquireTakesOnlyAFreeSlot: TryAcquire takes a slot while one is free and never
// waits; a Release makes one free again.
func TestTryAcquireTakesOnlyAFreeSlot(t *testing.T) {
	t.Parallel()
	l := NewLimiter(newTargets([]*Contract{{Name: "two", Concurrency: 2}}), 4)
	require.True(t, l.TryAcquire("two"))
	require.True(t, l.TryAcquire("two"))
	require.False(t, l.TryAcquire("two"), "no slot is free")
	require.Zero(t, l.Free("two"))
	l.Release("two", 1)
	require.True(t, l.TryAcquire("two"))
	l.Release("two", 2)
	require.Equal(t, 2, l.Free("two"))
}
