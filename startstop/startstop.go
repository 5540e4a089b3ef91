// Package startstop is the lifecycle every background service of the broker shares
// (the notifier, the watch hub, the dispatcher, the reconciler):
//
//   - Start returns once the service runs; starting a running service does nothing;
//   - Stop ends it and returns once it has ended; it is idempotent and safe without
//     Start;
//   - a stopped service starts again.
//
// A service embeds Base and hands Start the body that runs it.
package startstop

import (
	"context"
	"sync"
)

// Base runs one service body at a time. Its zero value is a stopped service.
type Base struct {
	mu      sync.Mutex
	cancel  context.CancelFunc
	stopped chan struct{} // closed when the running body returned; nil when not running
}

// Start runs body on its own goroutine with a context that Stop cancels, unless the
// service is running already, and returns at once. It reports whether it started it.
func (b *Base) Start(ctx context.Context, body func(context.Context)) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped != nil {
		return false
	}
	ctx, cancel := context.WithCancel(ctx)
	stopped := make(chan struct{})
	b.cancel, b.stopped = cancel, stopped
	go func() {
		defer close(stopped)
		body(ctx)
	}()
	return true
}

// Stop cancels the running body's context and waits until it returns. It is idempotent
// and safe without Start.
func (b *Base) Stop() {
	b.mu.Lock()
	cancel, stopped := b.cancel, b.stopped
	b.mu.Unlock()
	if stopped == nil {
		return
	}
	cancel()
	<-stopped
	b.mu.Lock()
	if b.stopped == stopped { // not started again meanwhile
		b.cancel, b.stopped = nil, nil
	}
	b.mu.Unlock()
}

// Running reports whether a body is running (or stopping).
func (b *Base) Running() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stopped != nil
}
