package target

import (
	"context"
	"sync"
)

// Limiter holds each target's concurrency slots: its contract's concurrency, or a
// default. A first send, a same-key replay and a lookup each hold one while their
// request is out, so a target never receives more requests at once from this process
// than its contract allows, whichever component makes them. It is safe for concurrent
// use: the slots of the targets it was built with are found without a lock, since every
// send takes and frees one.
type Limiter struct {
	def   int
	known map[string]chan struct{} // the targets it was built with: never written after NewLimiter
	mu    sync.Mutex
	other map[string]chan struct{} // any other target's, made at its first use
}

// NewLimiter returns the slots of targets: a contract's concurrency, or def where the
// contract sets none or more than def.
func NewLimiter(targets *Targets, def int) *Limiter {
	l := &Limiter{def: def, known: map[string]chan struct{}{}, other: map[string]chan struct{}{}}
	for _, c := range targets.All() {
		n := c.Concurrency
		if n <= 0 || n > def {
			n = def
		}
		l.known[c.Name] = make(chan struct{}, n)
	}
	return l
}

func (l *Limiter) of(name string) chan struct{} {
	if s, ok := l.known[name]; ok {
		return s
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	s, ok := l.other[name]
	if !ok { // a target the limiter was not built with gets the default
		s = make(chan struct{}, l.def)
		l.other[name] = s
	}
	return s
}

// Free returns how many of the target's slots are free now.
func (l *Limiter) Free(name string) int {
	s := l.of(name)
	return cap(s) - len(s)
}

// Acquire takes one of the target's slots, waiting until one is free or ctx ends.
func (l *Limiter) Acquire(ctx context.Context, name string) error {
	select {
	case l.of(name) <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TryAcquire takes one of the target's slots if one is free now, and reports whether it
// did.
func (l *Limiter) TryAcquire(name string) bool {
	select {
	case l.of(name) <- struct{}{}:
		return true
	default:
		return false
	}
}

// Release frees n slots that Acquire or TryAcquire took.
func (l *Limiter) Release(name string, n int) {
	s := l.of(name)
	for range n {
		<-s
	}
}
