package store

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCombinerJoinsCallsWhileAStatementRuns: with its one writer busy, the calls that
// arrive are written together, at most max at a time, each with its own index; a
// caller that gives up returns at once, and neither it nor the first caller giving up
// stops the statement the others wait for.
func TestCombinerJoinsCallsWhileAStatementRuns(t *testing.T) {
	t.Parallel()
	c := newCombiner[int, []int](3, 1, 0)
	release := make(chan struct{})
	var mu sync.Mutex
	var batches [][]int
	write := func(ctx context.Context, ps []int) ([]int, error) {
		if ps[0] == 0 {
			<-release
		}
		require.NoError(t, ctx.Err(), "no caller's cancellation reaches the statement")
		mu.Lock()
		batches = append(batches, slices.Clone(ps))
		mu.Unlock()
		out := make([]int, len(ps))
		for i, p := range ps {
			out[i] = p * 10
		}
		return out, nil
	}

	leaderCtx, cancelLeader := context.WithCancel(context.Background())
	leader := make(chan error, 1)
	go func() { _, _, err := c.do(leaderCtx, "k", 0, write); leader <- err }()
	require.Eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); l := c.lanes["k"]; return l != nil && l.open == nil }, time.Second, time.Millisecond,
		"the first call is being written")

	var wg sync.WaitGroup
	got := make([]int, 7)
	for p := 1; p <= 6; p++ {
		wg.Go(func() {
			r, i, err := c.do(context.Background(), "k", p, write)
			if assert.NoError(t, err) { // not require: this is not the test's goroutine
				got[p] = r[i]
			}
		})
	}
	require.Eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.lanes["k"].calls == 7 }, time.Second, time.Millisecond)
	gaveUp, cancel := context.WithCancel(context.Background())
	cancel()
	_, _, err := c.do(gaveUp, "k", 7, write)
	require.ErrorIs(t, err, context.Canceled, "a caller that gives up returns")

	other := make(chan error, 1)
	go func() { _, _, err := c.do(context.Background(), "other", 100, write); other <- err }()
	require.NoError(t, <-other, "another key does not wait for this one")

	cancelLeader()
	require.ErrorIs(t, <-leader, context.Canceled)
	close(release)
	wg.Wait()
	require.Equal(t, []int{0, 10, 20, 30, 40, 50, 60}, got)
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(batches) == 5 }, time.Second, time.Millisecond,
		"the call that gave up is still written")
	mu.Lock()
	defer mu.Unlock()
	var sizes []int
	for _, b := range batches {
		sizes = append(sizes, len(b))
	}
	slices.Sort(sizes)
	require.Equal(t, []int{1, 1, 1, 3, 3}, sizes, "the other key, the first call and the one that gave up alone; the calls that waited, three at a time")
	c.mu.Lock()
	defer c.mu.Unlock()
	require.Empty(t, c.lanes, "idle lanes are dropped")
}

// TestCombinerTakesASecondWriterOnlyWhenItPays: while a key's statement runs, the next
// batch waits for it, gathering calls, unless it is full or the running statement has
// run for stall (it is stuck, say on a lock); then it takes the second writer.
func TestCombinerTakesASecondWriterOnlyWhenItPays(t *testing.T) {
	t.Parallel()
	// run starts a statement for call 0, waits for it to have run for ran, then makes
	// the calls in more at once; every statement runs until release is called (at the
	// latest at cleanup). started returns the batches started.
	run := func(t *testing.T, stall, ran time.Duration, more []int) (started func() [][]int, release, wait func()) {
		c := newCombiner[int, []int](3, 2, stall)
		released := make(chan struct{})
		release = sync.OnceFunc(func() { close(released) })
		t.Cleanup(release)
		var mu sync.Mutex
		var batches [][]int
		write := func(_ context.Context, ps []int) ([]int, error) {
			mu.Lock()
			batches = append(batches, slices.Clone(ps))
			mu.Unlock()
			<-released
			return make([]int, len(ps)), nil
		}
		started = func() [][]int { mu.Lock(); defer mu.Unlock(); return slices.Clone(batches) }
		var wg sync.WaitGroup
		wg.Go(func() { _, _, err := c.do(context.Background(), "k", 0, write); assert.NoError(t, err) })
		require.Eventually(t, func() bool { return len(started()) == 1 }, 5*time.Second, time.Millisecond)
		time.Sleep(ran)
		for _, p := range more {
			wg.Go(func() { _, _, err := c.do(context.Background(), "k", p, write); assert.NoError(t, err) })
		}
		require.Eventually(t, func() bool { c.mu.Lock(); defer c.mu.Unlock(); return c.lanes["k"].calls == 1+len(more) }, 5*time.Second, time.Millisecond)
		wait = func() {
			wg.Wait()
			c.mu.Lock()
			defer c.mu.Unlock()
			require.Empty(t, c.lanes, "idle lanes are dropped")
		}
		return started, release, wait
	}

	t.Run("quick", func(t *testing.T) {
		t.Parallel()
		started, release, wait := run(t, time.Hour, 0, []int{1, 2})
		time.Sleep(100 * time.Millisecond)
		require.Len(t, started(), 1, "a batch that is not full waits for the running statement")
		release()
		wait()
		require.ElementsMatch(t, []int{1, 2}, started()[1], "the calls that waited, in one batch")
	})
	t.Run("full", func(t *testing.T) {
		t.Parallel()
		started, release, wait := run(t, time.Hour, 0, []int{1, 2, 3})
		require.Eventually(t, func() bool { return len(started()) == 2 }, 5*time.Second, time.Millisecond,
			"a full batch does not wait")
		require.ElementsMatch(t, []int{1, 2, 3}, started()[1])
		release()
		wait()
	})
	t.Run("stalled", func(t *testing.T) {
		t.Parallel()
		started, release, wait := run(t, 20*time.Millisecond, 0, []int{1})
		require.Eventually(t, func() bool { return len(started()) == 2 }, 5*time.Second, time.Millisecond,
			"a batch takes the second writer once the running statement has run for stall")
		release()
		wait()
	})
	t.Run("stalled before the batch came", func(t *testing.T) {
		t.Parallel()
		const stall = 2 * time.Second
		started, release, wait := run(t, stall, stall+100*time.Millisecond, []int{1})
		require.Eventually(t, func() bool { return len(started()) == 2 }, stall/2, time.Millisecond,
			"a batch that finds the running statement stuck for stall does not wait another stall")
		release()
		wait()
	})
}
