package store

import (
	"context"
	"sync"
	"time"
)

// A combiner writes calls made at the same time together, in one statement and one
// commit: a caller waits while the statements before it run, and the calls that arrive
// meanwhile join its batch. On a busy broker this is what keeps the ledger's cost per
// call low (a commit and a statement's fixed costs are shared by up to max calls);
// a call that finds nothing running is written at once.
//
// Calls are kept apart by key, each key with its own writers: the calls of one batch
// share a tenant scope, so the statement runs under row-level security exactly as each
// call alone would, and one tenant's batches never wait for another's.
//
// A key's statements run one at a time while they are quick, so that the calls arriving
// meanwhile make large batches; a batch that is full, or that finds the statement on the
// first writer running for stall (one waiting for a lock, say), takes another writer, up
// to writers at once.
type combiner[P, R any] struct {
	max, writers int
	stall        time.Duration

	mu    sync.Mutex
	lanes map[string]*lane[P, R]
	last  int // the size of the batch closed last, any lane's: a new batch's capacity
}

// lane is one key's batches.
type lane[P, R any] struct {
	open       *batch[P, R]  // the batch still taking calls
	first      chan struct{} // the writer a batch takes when it is free
	firstSince time.Time     // when the first writer was last taken (under c.mu)
	more       chan struct{} // the others, taken for a full batch or after stall
	calls      int           // calls in the lane; it is dropped when none are left
}

// batch is the calls one statement writes, and its answer.
type batch[P, R any] struct {
	params []P
	result R
	err    error
	full   chan struct{} // closed when it holds max calls
	done   chan struct{}
}

// combineTimeout bounds one combined statement: it runs for every caller in it, so no
// single caller's cancellation stops it.
const combineTimeout = 30 * time.Second

func newCombiner[P, R any](max, writers int, stall time.Duration) *combiner[P, R] {
	return &combiner[P, R]{max: max, writers: writers, stall: stall, lanes: map[string]*lane[P, R]{}}
}

// do adds p to the batch open under key (opening one if there is none), waits until
// write has written the batch, and returns write's answer with p's index in the batch.
// write runs once per batch, with the first caller's context values but not its
// cancellation. A caller whose context ends first returns its context's error; its
// call may still be written.
func (c *combiner[P, R]) do(ctx context.Context, key string, p P, write func(context.Context, []P) (R, error)) (R, int, error) {
	c.mu.Lock()
	l := c.lanes[key]
	if l == nil {
		l = &lane[P, R]{first: make(chan struct{}, 1), more: make(chan struct{}, c.writers-1)}
		c.lanes[key] = l
	}
	l.calls++
	b := l.open
	first := b == nil
	if first {
		b = &batch[P, R]{params: make([]P, 0, c.last), full: make(chan struct{}), done: make(chan struct{})}
		l.open = b
	}
	i := len(b.params)
	b.params = append(b.params, p)
	if len(b.params) == c.max {
		l.open = nil // full: no one else joins
		close(b.full)
	}
	c.mu.Unlock()
	defer c.leave(key, l)

	if first {
		go c.write(ctx, l, b, write)
	}
	select {
	case <-b.done:
		return b.result, i, b.err
	case <-ctx.Done():
		var zero R
		return zero, i, ctx.Err()
	}
}

func (c *combiner[P, R]) leave(key string, l *lane[P, R]) {
	c.mu.Lock()
	if l.calls--; l.calls == 0 {
		delete(c.lanes, key)
	}
	c.mu.Unlock()
}

func (c *combiner[P, R]) write(ctx context.Context, l *lane[P, R], b *batch[P, R], write func(context.Context, []P) (R, error)) {
	release := c.acquire(l, b) // meanwhile, others join
	c.mu.Lock()
	if l.open == b {
		l.open = nil
	}
	c.last = len(b.params) // no one joins b any more
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), combineTimeout)
	b.result, b.err = write(ctx, b.params)
	cancel()
	release()
	close(b.done)
}

// acquire takes one of l's writers for b and returns how to give it back: the first
// writer when it is free; else the first writer to come free, or any other once b is
// full or the statement on the first writer has run for stall.
func (c *combiner[P, R]) acquire(l *lane[P, R], b *batch[P, R]) (release func()) {
	// A batch that reads firstSince just before a waiting batch updates it may take a
	// second writer early: that costs only batch size.
	releaseFirst := func() { <-l.first }
	fromFirst := func() func() {
		c.mu.Lock()
		l.firstSince = time.Now()
		c.mu.Unlock()
		return releaseFirst
	}
	c.mu.Lock()
	select {
	case l.first <- struct{}{}:
		l.firstSince = time.Now()
		c.mu.Unlock()
		return releaseFirst
	default:
	}
	wait := c.stall - time.Since(l.firstSince)
	c.mu.Unlock()
	if wait > 0 {
		stalled := time.NewTimer(wait)
		defer stalled.Stop()
		select {
		case l.first <- struct{}{}:
			return fromFirst()
		case <-stalled.C:
		case <-b.full:
		}
	}
	select {
	case l.first <- struct{}{}:
		return fromFirst()
	case l.more <- struct{}{}:
		return func() { <-l.more }
	}
}
