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
// not yet started, it is never sent. A claim is held until its call returns. Nothing
// runs while nothing is held.
type leases struct {
	d *Dispatcher

	mu      sync.Mutex
	held    map[store.OperationKey]*lease
	stop    chan struct{} // closed when the last lease is dropped: the keeper returns
	keepers sync.WaitGroup
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
	if ls.stop == nil {
		ls.stop = make(chan struct{})
		ls.keepers.Add(1)
		go ls.keep(ls.stop)
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
	if len(ls.held) == 0 && ls.stop != nil {
		close(ls.stop)
		ls.stop = nil
	}
}

// end returns when l's lease ends, by the dispatcher's clock.
func (ls *leases) end(l *lease) time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return l.expires
}

// wait returns once every keeper has returned.
func (ls *leases) wait() { ls.keepers.Wait() }

// keep extends the held leases every third of a lease until stop is closed.
func (ls *leases) keep(stop <-chan struct{}) {
	defer ls.keepers.Done()
	d := ls.d
	every := d.cfg.Lease / 3
	timer := time.NewTimer(every)
	defer timer.Stop()
	for {
		select {
		case <-stop:
			return
		case <-timer.C:
		}
		ls.mu.Lock()
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
