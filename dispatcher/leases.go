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
// A call must end before its lease does, though the database may not answer at all:
// another replica's sweeper makes the operation UNKNOWN once the lease is over, and its
// reconciler may then ask the target while this request is still there. So a claim is
// cut once its lease is within the send's margin of its end, and the keeper never waits
// on the database past that point (keep).
type leases struct {
	d *Dispatcher

	mu      sync.Mutex
	held    map[store.OperationKey]*lease
	stopped bool          // from wait to resume: the keeper returns as soon as nothing is held
	wake    chan struct{} // has the keeper look at once (one buffered)
	done    chan struct{} // the running keeper's, closed when it returns; nil while none runs
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
	if ls.done == nil {
		ls.done = make(chan struct{})
		if ls.wake == nil {
			ls.wake = make(chan struct{}, 1)
		}
		go ls.keep(ls.done)
	}
	if expires.Sub(ls.d.cfg.Clock()) < ls.d.cfg.Lease/3+ls.d.margin() {
		// Held with less than a lease (its claim took long): it may reach its margin
		// before the next tick, so the keeper extends the leases now.
		ls.wakeKeeper()
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
	if len(ls.held) == 0 && ls.stopped {
		ls.wakeKeeper()
	}
}

// wakeKeeper has the running keeper, if any, look at once: it returns if nothing is
// held, and extends what is; ls.mu is held.
func (ls *leases) wakeKeeper() {
	if ls.done == nil {
		return
	}
	select {
	case ls.wake <- struct{}{}:
	default: // already woken
	}
}

// keeperDone reports whether the keeper whose channel is done is to return, nothing
// being held, and if so closes done; ls.mu is held.
func (ls *leases) keeperDone(done chan struct{}) bool {
	if len(ls.held) > 0 {
		return false
	}
	ls.done = nil
	close(done)
	return true
}

// end returns when l's lease ends, by the dispatcher's clock.
func (ls *leases) end(l *lease) time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return l.expires
}

// wait returns once nothing is held and no keeper runs. Until resume, a keeper returns
// as soon as nothing is held.
func (ls *leases) wait() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.stopped = true
	for ls.done != nil {
		if len(ls.held) == 0 {
			ls.wakeKeeper()
		}
		done := ls.done
		ls.mu.Unlock()
		<-done
		ls.mu.Lock()
	}
}

// resume has a keeper stay when nothing is held again, until its tick (Start).
func (ls *leases) resume() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.stopped = false
}

// keep extends the held leases every third of a lease, until it finds none held; it
// closes done when it returns.
//
// Each claim is cut once its lease is within the send's margin of its end, however the
// database answers: the extension's statement is given until the earliest held lease
// reaches that point (a third of a lease at most), and after a failure the keeper tries
// again after a twelfth of a lease, or sooner when a lease reaches that point sooner.
func (ls *leases) keep(done chan struct{}) {
	d := ls.d
	every := d.cfg.Lease / 3
	retry := every / 4
	margin := d.margin()
	timer := time.NewTimer(every)
	defer timer.Stop()
	for {
		select {
		case <-ls.wake:
		case <-timer.C:
		}
		ls.mu.Lock()
		if ls.keeperDone(done) {
			ls.mu.Unlock()
			return
		}
		asked := d.cfg.Clock()
		answer := every // until the earliest lease of the batch reaches its margin
		batch := make([]*lease, 0, len(ls.held))
		held := make([]store.HeldLease, 0, len(ls.held))
		for _, l := range ls.held {
			switch left := l.expires.Sub(asked); {
			case l.lost:
			case left <= margin:
				d.opLog(l.target, l.op).Warn("lease cannot be renewed before it expires; cutting its call")
				l.lost = true
				l.cut()
			default:
				batch, held = append(batch, l), append(held, l.op)
				answer = min(answer, left-margin)
			}
		}
		ls.mu.Unlock()
		if len(batch) == 0 {
			timer.Reset(every)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), answer)
		left, err := d.cfg.Store.AllTenants().ExtendLeases(ctx, held, d.cfg.Lease)
		cancel()
		ls.mu.Lock()
		now, next := d.cfg.Clock(), every
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
			case l.expires.Sub(now) <= margin:
				d.opLog(l.target, l.op).Warn("lease cannot be renewed before it expires; cutting its call", "error", err)
				l.lost = true
				l.cut()
			default:
				retrying++
				next = min(next, retry, l.expires.Sub(now)-margin)
			}
		}
		ls.mu.Unlock()
		if retrying > 0 {
			d.log.Warn("leases not extended; retrying", "claims", retrying, "error", err)
		}
		timer.Reset(next)
	}
}
