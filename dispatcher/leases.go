package dispatcher

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/opbroker/opbroker/store"
)

// leases keeps the leases of the claims a dispatcher holds, waiting for a slot or being
// sent, ahead of their expiry: every third of a lease, one statement extends them all
// (a twelfth after a statement that failed, or that skipped a claim still held whose
// row another transaction held locked).
// A claim whose fence was lost, or whose lease was not renewed in time, is cut: its call
// ends (its outcome, a connection error, is recorded as evidence), or, not yet started,
// it is never sent. A claim is held until its call returns.
//
// A call must end before its lease does, though the database may not answer at all:
// another replica's sweeper makes the operation UNKNOWN once the lease is over, and its
// reconciler may then ask the target while this request is still there. So one timer
// fires at the earliest end, less the send's margin, of the leases held, and cuts every
// claim whose lease the keeper has not extended past that meanwhile; then it waits for
// the next earliest. The keeper's statement, however long it takes, never delays a cut.
// (A timer per claim did the same, and cost a burn-down's sends a timer started and
// stopped each.)
//
// The keeper, a goroutine, starts with the first claim held and returns at the first
// tick that finds none held; once the dispatcher stopped (wait), as soon as none is
// held. During a burn-down what is held empties between claims again and again, and a
// keeper that returned each time was started again for most operations (81,225 times
// for 100,000, each a goroutine, a timer and a channel).
type leases struct {
	d *Dispatcher

	mu      sync.Mutex
	held    map[store.OperationKey]*lease
	stopped bool          // from wait to resume: the keeper returns as soon as nothing is held
	wake    chan struct{} // has the keeper look at once (one buffered)
	done    chan struct{} // the running keeper's, closed when it returns; nil while none runs

	// replaced holds the claims whose operation another held claim took the place of in
	// held (claimed again under a newer fence): they are cut all the same. The timer
	// removes those dropped or cut since.
	replaced []*lease
	cuts     *time.Timer // runs cutDue; made at the first hold
	cutsSet  bool        // cuts is set to fire at cutsAt
	cutsAt   time.Time   // by the dispatcher's clock
}

// lease is one held claim's.
type lease struct {
	op      store.HeldLease
	target  string
	expires time.Time // by the dispatcher's clock; guarded by leases.mu
	cut     context.CancelFunc
	lost    bool // cut already; guarded by leases.mu
	dropped bool // no longer held; guarded by leases.mu
}

// live reports whether l is still held and not cut yet: it is to be cut if its lease
// is not extended in time; guarded by leases.mu.
func (l *lease) live() bool { return !l.dropped && !l.lost }

// hold keeps the claim's lease, which ends at expires on the dispatcher's clock, until
// drop; cut ends the claim's call, or its wait for one.
func (ls *leases) hold(op store.Claimed, target string, expires time.Time, cut context.CancelFunc) *lease {
	l := &lease{op: store.HeldLease{OperationKey: store.OperationKey{TenantID: op.TenantID, ID: op.ID}, Fence: op.FenceToken},
		target: target, cut: cut}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.held == nil {
		ls.held = map[store.OperationKey]*lease{}
	}
	if old := ls.held[l.op.OperationKey]; old != nil {
		ls.replaced = append(ls.replaced, old)
	}
	ls.held[l.op.OperationKey] = l
	ls.endsAt(l, expires)
	if ls.done == nil {
		ls.done = make(chan struct{})
		if ls.wake == nil {
			ls.wake = make(chan struct{}, 1)
		}
		go ls.keep(ls.done)
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
	l.dropped = true
	if len(ls.held) == 0 && ls.stopped {
		ls.wakeKeeper()
	}
}

// endsAt makes expires the end of l's lease, and brings the timer forward if l is to be
// cut before it fires: a lease's end and its cut always move together; ls.mu is held.
func (ls *leases) endsAt(l *lease, expires time.Time) {
	l.expires = expires
	ls.cutBy(ls.cutAt(l))
}

// cutAt is when l is cut, unless its lease is extended: its lease's end less the send's
// margin, by the dispatcher's clock; ls.mu is held.
func (ls *leases) cutAt(l *lease) time.Time {
	return l.expires.Add(-ls.d.margin())
}

// cutBy sets the timer to fire at at, unless it is set to fire at or before it; ls.mu
// is held. (A test's clock moved forward while the timer waits makes it fire late by as
// much; the clocks the broker runs on move with real time.)
func (ls *leases) cutBy(at time.Time) {
	if ls.cutsSet && !at.Before(ls.cutsAt) {
		return
	}
	ls.cutsSet, ls.cutsAt = true, at
	if wait := at.Sub(ls.d.cfg.Clock()); ls.cuts == nil {
		ls.cuts = time.AfterFunc(wait, ls.cutDue)
	} else {
		ls.cuts.Reset(wait)
	}
}

// cutDue is the timer's: it cuts every claim held that is due (cutAt), and sets the
// timer for the earliest of the others. A lease extended since the timer was set is
// due later, so the timer may find nothing to cut.
func (ls *leases) cutDue() {
	ls.mu.Lock()
	ls.cutsSet = false
	now := ls.d.cfg.Clock()
	var due []*lease
	var next time.Time
	left := func(l *lease) bool { // whether l is still to be cut later
		if !l.live() {
			return false
		}
		at := ls.cutAt(l)
		if !at.After(now) {
			l.lost = true
			l.cut()
			due = append(due, l)
			return false
		}
		if next.IsZero() || at.Before(next) {
			next = at
		}
		return true
	}
	for _, l := range ls.held {
		left(l)
	}
	ls.replaced = slices.DeleteFunc(ls.replaced, func(l *lease) bool { return !left(l) })
	if !next.IsZero() {
		ls.cutBy(next)
	}
	ls.mu.Unlock() // logged after: in an outage every held claim comes here
	for _, l := range due {
		ls.d.opLog(l.target, l.op).Warn("lease not renewed before it nears its end; cutting its call")
	}
}

// wakeKeeper has the running keeper, if any, look at once whether anything is held;
// ls.mu is held.
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

// wait returns once nothing is held and no keeper runs; the cut timer is stopped if no
// replaced claim is still held either. Until resume, a keeper returns as soon as
// nothing is held.
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
	if ls.cutsSet && !slices.ContainsFunc(ls.replaced, (*lease).live) {
		ls.cuts.Stop()
		ls.cutsSet, ls.replaced = false, nil
	}
}

// resume has a keeper stay when nothing is held again, until its tick (Start).
func (ls *leases) resume() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.stopped = false
}

// extended applies what an extension of batch, asked for at asked, did: an extended
// claim is cut only near its lease's new end; a claim whose fence was lost is cut; a
// claim dropped meanwhile is left alone (its call returned, and its outcome, which
// holds its row, is being written or was). It reports whether a claim still held was
// busy (its row locked by another transaction: an amendment, a webhook's settlement):
// it is still cut near its lease's old end, and the next statement is to come soon.
func (ls *leases) extended(batch []*lease, got store.Extended, asked time.Time) (busy bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, l := range batch {
		extended, ok := got.Left[l.op.OperationKey]
		switch {
		case !l.live():
		case ok:
			// Mostly later, and the timer finds it not due; but a claim taken under a
			// longer lease (a reconciler's replay, under --reconcile-lease) ends sooner
			// once the keeper extends it by the dispatcher's, and endsAt brings the
			// timer forward.
			ls.endsAt(l, asked.Add(extended))
		case got.Busy[l.op.OperationKey]:
			busy = true
		default:
			ls.d.opLog(l.target, l.op).Warn("fence lost while the claim was held; cutting its call")
			l.lost = true
			l.cut()
		}
	}
	return busy
}

// keep extends the held leases every third of a lease, until it finds none held; it
// closes done when it returns.
func (ls *leases) keep(done chan struct{}) {
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
		if ls.keeperDone(done) {
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
		asked, started := d.cfg.Clock(), time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), every)
		got, err := d.cfg.Store.AllTenants().ExtendLeases(ctx, held, d.cfg.Lease)
		cancel()
		if err != nil {
			// The cut timer cuts each claim if no extension comes in time; try again soon.
			d.log.Warn("leases not extended; retrying", "claims", len(batch), "error", err)
			timer.Reset(every / 4)
			continue
		}
		if ls.extended(batch, got, asked) { // a busy claim is still due: try again soon
			timer.Reset(every / 4)
			continue
		}
		// The next a period after this one began, so a slow statement does not push back
		// the claims it did not carry, which come due meanwhile.
		timer.Reset(max(every-time.Since(started), 0))
	}
}
