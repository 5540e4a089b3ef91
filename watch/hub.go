// Package watch tells watchers when the operations they watch change.
//
// The event log is the truth; the hub only nudges. It wakes when this process writes an
// event, when another replica notifies (LISTEN/NOTIFY, coalesced), and on a polling
// interval (a notification can be lost). On each wake it asks the ledger, in one query,
// for the current revision of every watched operation, and nudges the watchers of those
// that moved; it nudges every tenant-wide watcher, which reads its tenant's feed. A
// watcher then reads its own missing events from the log. A nudge is a
// latest-value mailbox (capacity one): a slow watcher never slows the hub or others, and
// loses nothing, because it reads everything after the last revision it sent.
package watch

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/opbroker/opbroker/startstop"
	"github.com/opbroker/opbroker/store"
)

// Hub fans change nudges out to watchers. Start and Stop follow the lifecycle of
// package startstop; Subscribe works whether or not it runs.
type Hub struct {
	startstop.Base
	store *store.Store
	log   *slog.Logger
	poll  time.Duration

	mu      sync.Mutex
	subs    map[store.OperationKey]map[*Subscription]struct{}
	known   map[store.OperationKey]int64 // the latest revision the hub has seen
	tenants map[*Subscription]struct{}   // tenant-wide watchers
}

// New returns a stopped hub that polls every poll (default 1s) besides its wake-ups.
func New(st *store.Store, log *slog.Logger, poll time.Duration) *Hub {
	if poll <= 0 {
		poll = time.Second
	}
	return &Hub{store: st, log: log.With("component", "watch"), poll: poll,
		subs: map[store.OperationKey]map[*Subscription]struct{}{}, known: map[store.OperationKey]int64{},
		tenants: map[*Subscription]struct{}{}}
}

// Subscription receives a nudge on C whenever what it watches may have changed.
type Subscription struct {
	C   <-chan struct{}
	c   chan struct{}
	key store.OperationKey // the operation; the zero key for a tenant-wide watcher
	hub *Hub
}

// nudge leaves a nudge in the mailbox unless one is waiting.
func (s *Subscription) nudge() {
	select {
	case s.c <- struct{}{}:
	default:
	}
}

// Subscribe watches one operation until Close. Subscribe before reading the operation, so
// that no change between the read and the subscription is missed.
func (h *Hub) Subscribe(key store.OperationKey) *Subscription {
	c := make(chan struct{}, 1)
	s := &Subscription{C: c, c: c, key: key, hub: h}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.subs[key] == nil {
		h.subs[key] = map[*Subscription]struct{}{}
	}
	h.subs[key][s] = struct{}{}
	return s
}

// SubscribeAll is nudged on every wake until Close, for a tenant-wide watcher: a
// notification does not say which tenant changed.
func (h *Hub) SubscribeAll() *Subscription {
	c := make(chan struct{}, 1)
	s := &Subscription{C: c, c: c, hub: h}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.tenants[s] = struct{}{}
	return s
}

// Close ends the subscription. It is idempotent.
func (s *Subscription) Close() {
	h := s.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.tenants, s)
	delete(h.subs[s.key], s)
	if len(h.subs[s.key]) == 0 {
		delete(h.subs, s.key)
		delete(h.known, s.key)
	}
}

// Start runs the hub until Stop, and returns at once.
func (h *Hub) Start(ctx context.Context) error {
	events, unsubscribe := h.store.SubscribeEvents()
	if !h.Base.Start(ctx, func(ctx context.Context) {
		defer unsubscribe()
		ticker := time.NewTicker(h.poll)
		defer ticker.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-events:
			case <-ticker.C:
			}
			if err := h.runOnce(ctx); err != nil && ctx.Err() == nil {
				h.log.Warn("reading revisions failed; watchers wait for the next wake", "error", err)
			}
		}
	}) {
		unsubscribe() // running already
	}
	return nil
}

// runOnce nudges the tenant-wide watchers, reads the revisions of every watched
// operation and nudges the watchers of those that moved since the hub last looked.
func (h *Hub) runOnce(ctx context.Context) error {
	h.mu.Lock()
	for s := range h.tenants {
		s.nudge()
	}
	keys := make([]store.OperationKey, 0, len(h.subs))
	for k := range h.subs {
		keys = append(keys, k)
	}
	h.mu.Unlock()
	if len(keys) == 0 {
		return nil
	}
	revs, err := h.store.AllTenants().Revisions(ctx, keys)
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, rev := range revs {
		if rev <= h.known[k] {
			continue
		}
		if _, watched := h.subs[k]; !watched {
			continue
		}
		h.known[k] = rev
		for s := range h.subs[k] {
			s.nudge()
		}
	}
	return nil
}
