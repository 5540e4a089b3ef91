package dispatcher

import (
	"context"
	"sync"
	"time"

	"github.com/opbroker/opbroker/store"
)

// leases keeps the leases of the claims a dispatcher holds, waiting for a slot or being
// sent, ahead of their expiry: every third of a lease, one statement extends them all.
// A claim whose fence was lost, or whose lease cannot be renewed before it runs out,
// is cut: its call ends (its outcome, a connection error, is recorded as evidence), or,
// not yet started, it is never sent. A claim is held until its call returns.
//
// The keeper, a goroutine, starts with the first claim held and returns at the first
// tick that finds none held, or as soon as none is held once wait was called: during a
// burn-down what is held empties between claims again and again, and a keeper that
// returned each time was started again for most operations (81,225 times for 100,000,
// each a goroutine, a timer and a channel).
type leases struct {
	d *Dispatcher

	mu       sync.Mutex
	held     map[store.OperationKey]*lease
	keeping  bool          // a keeper runs
	stopping bool          // wait was called: the keeper returns once nothing is held
	wake     chan struct{} // has the keeper look at once (one buffered)
	keepers  sync.WaitGroup
}

// lease is one held claim's.
type lease struct {
	op      store.HeldLease
	target  string
	expires time.Time // by the dispatcher's clock; guarded by leases.mu
	cut     context.CancelFunc
	lost    bool // cut already; guarded by leases.mu
}

// hold keeps the claim's lease, which ends at expires on the dispatcher's clock, until
// drop; cut ends the claim's call, or its wait for one.
func (ls *leases) hold(op store.Claimed, target string, expires time.Time, cut context.CancelFunc) *lease {
	l := &lease{op: store.HeldLease{OperationKey: store.OperationKey{TenantID: op.TenantID, ID: op.ID}, Fence: op.FenceToken},
		target: target, expires: expires, cut: cut}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.held == nil {
		ls.held = map[store.OperationKey]*lease{}
	}
	ls.held[l.op.OperationKey] = l
	if !ls.keeping {
		ls.keeping = true
		if ls.wake == nil {
			ls.wake = make(chan struct{}, 1)
		}
		ls.keepers.Add(1)
		go ls.keep()
	}
	return l
}

// drop stops keeping l; dropping it again does nothing.
func (ls *leases) drop(l *lease) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.held[l.op.OperationKey] == l {
		delete(ls.held, l.op.OperationKey)
	}
	if len(ls.held) == 0 && ls.stopping {
		ls.wakeKeeper()
	}
}

// wakeKeeper has the keeper look at once whether anything is held; ls.mu is held.
func (ls *leases) wakeKeeper() {
	select {
	case ls.wake <- struct{}{}:
	default: // already woken
	}
}

// keeperDone reports whether the keeper is to return, nothing being held, and if so
// says it returned; ls.mu is held.
func (ls *leases) keeperDone() bool {
	if len(ls.held) > 0 {
		return false
	}
	ls.keeping = false
	return true
}

// end returns when l's lease ends, by the dispatcher's clock.
func (ls *leases) end(l *lease) time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return l.expires
}

// wait returns once nothing is held and the keeper has returned.
func (ls *leases) wait() {
	ls.mu.Lock()
	ls.stopping = true
	if ls.keeping && len(ls.held) == 0 {
		ls.wakeKeeper()
	}
	ls.mu.Unlock()
	ls.keepers.Wait()
	ls.mu.Lock()
	ls.stopping = false
	ls.mu.Unlock()
}

// keep extends the held leases every third of a lease, until it finds none held.
func (ls *leases) keep() {
	defer ls.keepers.Done()
	d := ls.d
	every := d.cfg.Lease / 3
	timer := time.NewTimer(every)
	defer timer.Stop()
	for {
		var tick bool
		select {
		case <-ls.wake:
		case <-timer.C:
			tick = true
		}
		ls.mu.Lock()
		if ls.keeperDone() {
			ls.mu.Unlock()
			return
		}
		if !tick { // woken while something is still held: it is dropped later
			ls.mu.Unlock()
			continue
		}
		batch := make([]*lease, 0, len(ls.held))
		held := make([]store.HeldLease, 0, len(ls.held))
		for _, l := range ls.held {
			if !l.lost {
				batch, held = append(batch, l), append(held, l.op)
			}
		}
		ls.mu.Unlock()
		asked := d.cfg.Clock()
		ctx, cancel := context.WithTimeout(context.Background(), every)
		left, err := d.cfg.Store.AllTenants().ExtendLeases(ctx, held, d.cfg.Lease)
		cancel()
		ls.mu.Lock()
		var retrying int
		for _, l := range batch {
			extended, ok := left[l.op.OperationKey]
			switch {
			case err == nil && ok:
				l.expires = asked.Add(extended)
			case err == nil:
				d.opLog(l.target, l.op).Warn("fence lost while the claim was held; cutting its call")
				l.lost = true
				l.cut()
			case l.expires.Sub(d.cfg.Clock()) < every:
				d.opLog(l.target, l.op).Warn("lease cannot be renewed before it expires; cutting its call", "error", err)
				l.lost = true
				l.cut()
			default:
				retrying++
			}
		}
		ls.mu.Unlock()
		if retrying > 0 {
			d.log.Warn("leases not extended; retrying", "claims", retrying, "error", err)
		}
		timer.Reset(every)
	}
}
