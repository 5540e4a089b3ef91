package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/opbroker/opbroker/startstop"
)

// The PostgreSQL notification channels: new work (PREPARED operations) and new events
// (any change, for watchers). Notifications only wake; the ledger is the truth, so a lost
// one costs a poll interval, never an operation or an event.
const (
	workChannel   = "opbroker_work"
	eventsChannel = "opbroker_events"
)

// wakeups fans one kind of signal out to local subscribers without ever blocking.
type wakeups struct {
	channel string
	mu      sync.Mutex
	subs    map[chan struct{}]struct{}
	// remote asks the notifier to tell other replicas; capacity 1 coalesces.
	remote chan struct{}
}

func newWakeups(channel string) *wakeups {
	return &wakeups{channel: channel, subs: map[chan struct{}]struct{}{}, remote: make(chan struct{}, 1)}
}

func (w *wakeups) subscribe() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	w.subs[ch] = struct{}{}
	w.mu.Unlock()
	return ch, func() {
		w.mu.Lock()
		delete(w.subs, ch)
		w.mu.Unlock()
	}
}

func (w *wakeups) wakeLocal() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.subs {
		select {
		case ch <- struct{}{}:
		default: // already pending
		}
	}
}

// signal wakes local subscribers now and other replicas soon.
func (w *wakeups) signal() {
	w.wakeLocal()
	select {
	case w.remote <- struct{}{}:
	default:
	}
}

// Subscribe returns a channel that receives a value (coalesced) whenever work may have
// arrived, here or at another replica, and a function that ends the subscription.
func (s *Store) Subscribe() (<-chan struct{}, func()) { return s.wake.subscribe() }

// SubscribeEvents is Subscribe for new events of any operation (for watchers).
func (s *Store) SubscribeEvents() (<-chan struct{}, func()) { return s.events.subscribe() }

// Notifier carries work and event signals between replicas through LISTEN/NOTIFY: it
// sends at most one notification of each kind per interval however many changes happen
// (a NOTIFY in every commit serialises commits cluster-wide), and wakes local subscribers
// when another replica notifies or when its listening connection is re-established
// (notifications sent meanwhile are lost).
type Notifier struct {
	startstop.Base
	store    *Store
	log      *slog.Logger
	interval time.Duration
}

// NewNotifier returns a stopped notifier; interval is the coalescing window.
func (s *Store) NewNotifier(log *slog.Logger, interval time.Duration) *Notifier {
	return &Notifier{store: s, log: log, interval: interval}
}

// Start runs the notifier until Stop (package startstop: Stop ends it and waits). It
// returns at once.
func (n *Notifier) Start(ctx context.Context) error {
	n.Base.Start(ctx, func(ctx context.Context) {
		var wg sync.WaitGroup
		wg.Go(func() { n.listen(ctx) })
		wg.Go(func() { n.send(ctx, n.store.wake) })
		wg.Go(func() { n.send(ctx, n.store.events) })
		wg.Wait()
	})
	return nil
}

func (n *Notifier) send(ctx context.Context, w *wakeups) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.remote:
		}
		if _, err := n.store.pool.Exec(ctx, "SELECT pg_notify($1, '')", w.channel); err != nil && ctx.Err() == nil {
			n.log.Warn("notify failed; other replicas will poll", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(n.interval):
		}
	}
}

func (n *Notifier) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := n.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		n.log.Warn("listening for work notifications failed; retrying", "error", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

func (n *Notifier) listenOnce(ctx context.Context) error {
	pooled, err := n.store.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := pooled.Hijack() // a listening connection must never go back to the pool
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+workChannel+"; LISTEN "+eventsChannel); err != nil {
		return err
	}
	// Anything sent while we were not listening.
	n.store.wake.wakeLocal()
	n.store.events.wakeLocal()
	for {
		note, err := waitForNotification(ctx, conn)
		if err != nil {
			return err
		}
		if note == nil {
			continue
		}
		if note.Channel == eventsChannel {
			n.store.events.wakeLocal()
		} else {
			n.store.wake.wakeLocal()
		}
	}
}

// listenCheckEvery is how long a listening connection waits in silence before it checks
// that its server still answers: a primary that was stopped or cut off by a partition
// keeps the connection open and sends nothing, while the notifications go to the new
// primary. listenCheckTimeout is how long the check may take.
var (
	listenCheckEvery   = 5 * time.Second
	listenCheckTimeout = 2 * time.Second
)

// waitForNotification waits for a notification on conn. After listenCheckEvery without
// one it checks that the server answers and returns (nil, nil) if it does; it fails if
// the server does not answer within listenCheckTimeout, or is no longer the primary.
func waitForNotification(ctx context.Context, conn *pgx.Conn) (*pgconn.Notification, error) {
	waitCtx, cancel := context.WithTimeout(ctx, listenCheckEvery)
	note, err := conn.WaitForNotification(waitCtx)
	cancel()
	if err == nil || ctx.Err() != nil || !pgconn.Timeout(err) {
		return note, err
	}
	checkCtx, cancel := context.WithTimeout(ctx, listenCheckTimeout)
	defer cancel()
	var standby bool
	if err := conn.QueryRow(checkCtx, "SELECT pg_is_in_recovery()").Scan(&standby); err != nil {
		return nil, fmt.Errorf("the listening connection's server does not answer: %w", err)
	}
	if standby {
		return nil, errors.New("the listening connection's server is a standby")
	}
	return nil, nil
}
