package dispatcher

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// TestLeaseKeeperOutlivesGapsAndStopsOnWait checks the keeper's life: it does not return
// when what is held empties between claims (it was started again for most operations of
// a burn-down), it returns at the first tick that finds nothing held, and once the
// dispatcher stopped, Stop's wait does not wait for that tick: it returns as soon as
// nothing is held (and stops the cut timer), until the dispatcher starts again.
func TestLeaseKeeperOutlivesGapsAndStopsOnWait(t *testing.T) {
	t.Parallel()
	newLeases := func(lease time.Duration) *leases {
		// No store: a tick that finds nothing held returns before it would extend.
		return testLeases(lease, nil)
	}
	claim := func(ls *leases) *lease {
		op := store.Claimed{Operation: store.Operation{TenantID: "t", ID: uuid.New(), FenceToken: 1}}
		return ls.hold(op, "target", time.Now().Add(time.Hour), func() {})
	}
	keeping := func(ls *leases) bool {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		return ls.done != nil
	}
	within := func(done <-chan struct{}, what string) {
		t.Helper()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal(what)
		}
	}
	waited := func(ls *leases) <-chan struct{} {
		done := make(chan struct{})
		go func() { ls.wait(); close(done) }()
		return done
	}

	ls := newLeases(time.Hour) // no tick during the test
	for range 3 {
		ls.drop(claim(ls))
		time.Sleep(20 * time.Millisecond) // time for a keeper that returns to do so
		require.True(t, keeping(ls), "the keeper stays when nothing is held between claims")
	}
	within(waited(ls), "wait waited for the keeper's tick with nothing held")
	require.False(t, keeping(ls))
	ls.mu.Lock()
	require.False(t, ls.cutsSet, "the cut timer is stopped once nothing is held")
	ls.mu.Unlock()

	held := claim(ls)
	done := waited(ls)
	select {
	case <-done:
		t.Fatal("wait returned while a claim was held")
	case <-time.After(50 * time.Millisecond):
	}
	ls.drop(held)
	within(done, "wait did not return once the last claim was dropped")
	require.False(t, keeping(ls))

	ls.drop(claim(ls)) // stopped, not started again: no keeper outlives the last claim
	require.Eventually(t, func() bool { return !keeping(ls) }, 5*time.Second, 10*time.Millisecond)
	ls.resume()
	ls.drop(claim(ls))
	time.Sleep(20 * time.Millisecond)
	require.True(t, keeping(ls), "started again, the keeper stays between claims")
	within(waited(ls), "wait waited for the keeper's tick with nothing held")

	ticking := newLeases(30 * time.Millisecond) // a tick every 10 ms
	ticking.drop(claim(ticking))
	require.Eventually(t, func() bool { return !keeping(ticking) }, 5*time.Second, 10*time.Millisecond,
		"the keeper returns at the first tick that finds nothing held")
}

// TestCallsAreCutBeforeTheirLeasesEndWithoutTheDatabase: while the database does not
// answer at all, every held claim is cut before its lease ends, whenever it was taken
// (another replica's sweeper may take the operation at the lease's end, and its
// reconciler ask the target while a call still runs). The second claim is taken half a
// period after the first, which started the keeper: a keeper that decided again only a
// whole period after a failed extension cut it half a period after its lease had
// ended. The third is taken while the keeper's first statement waits on the database,
// with an eighth of a lease left (its claim took long): a keeper that cut claims only
// between its statements cut it after its lease had ended.
func TestCallsAreCutBeforeTheirLeasesEndWithoutTheDatabase(t *testing.T) {
	t.Parallel()
	const length = 3 * time.Second
	st, _, proxy := storetest.NewStoreBehindProxy(t)
	proxy.Freeze()
	t.Cleanup(proxy.Thaw)
	ls := testLeases(length, st)
	var mu sync.Mutex
	cutAt := map[int]time.Time{}
	expires := map[int]time.Time{}
	var held []*lease
	hold := func(i int, left time.Duration) {
		op := store.Claimed{Operation: store.Operation{TenantID: "t", ID: uuid.New(), FenceToken: 1}}
		mu.Lock()
		expires[i] = time.Now().Add(left)
		mu.Unlock()
		held = append(held, ls.hold(op, "target", expires[i], func() {
			mu.Lock()
			defer mu.Unlock()
			if _, ok := cutAt[i]; !ok {
				cutAt[i] = time.Now()
			}
		}))
	}
	defer func() { // the keeper returns once nothing is held
		for _, l := range held {
			ls.drop(l)
		}
		ls.wait()
	}()
	hold(0, length)
	time.Sleep(length / 6) // half the keeper's period
	hold(1, length)
	time.Sleep(length/6 + 50*time.Millisecond) // the keeper's first statement is waiting
	hold(2, length/8)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(cutAt) == 3
	}, 3*length, 10*time.Millisecond, "every claim is cut")
	mu.Lock()
	defer mu.Unlock()
	for i := range 3 {
		require.True(t, cutAt[i].Before(expires[i]), "claim %d cut %s after its lease ended", i, cutAt[i].Sub(expires[i]))
	}
}

// TestAClaimReplacedAmongTheHeldIsStillCut: a claim whose operation was claimed again
// under a newer fence (the newer one takes its place among the held) is still cut near
// its lease's end, though the keeper no longer extends it, and though the dispatcher
// stopped meanwhile; so is a claim held after the stop.
func TestAClaimReplacedAmongTheHeldIsStillCut(t *testing.T) {
	t.Parallel()
	// A lease of 3 s: the keeper's first tick, which would need a store, comes after
	// the test has dropped both claims.
	ls := testLeases(3*time.Second, nil)
	id := uuid.New()
	cut := make(chan struct{})
	older := ls.hold(store.Claimed{Operation: store.Operation{TenantID: "t", ID: id, FenceToken: 1}}, "target",
		time.Now().Add(500*time.Millisecond), func() { close(cut) })
	newer := ls.hold(store.Claimed{Operation: store.Operation{TenantID: "t", ID: id, FenceToken: 2}}, "target",
		time.Now().Add(3*time.Second), func() {})
	ls.drop(newer)
	ls.wait() // the dispatcher stops while the older claim is still held
	select {
	case <-cut:
	case <-time.After(900 * time.Millisecond):
		t.Error("the older claim was not cut")
	}
	ls.drop(older)

	// A claim held after the stop (a reconciler's replay) is cut as well.
	lateCut := make(chan struct{})
	late := ls.hold(store.Claimed{Operation: store.Operation{TenantID: "t", ID: uuid.New(), FenceToken: 1}}, "target",
		time.Now().Add(600*time.Millisecond), func() { close(lateCut) })
	select {
	case <-lateCut:
	case <-time.After(900 * time.Millisecond):
		t.Error("a claim held after the stop was not cut")
	}
	ls.drop(late)
	ls.wait()
}

// TestABusyRowDelaysOnlyItsOwnExtension: while another transaction holds one held
// claim's row locked (its outcome being written, say), the keeper extends the other
// claims, and does not take the locked one for lost: the cut timer alone cuts it, near
// its lease's end. (A keeper whose statement waited for the row, or failed for it,
// extended nothing: every claim was cut.)
func TestABusyRowDelaysOnlyItsOwnExtension(t *testing.T) {
	t.Parallel()
	const length = 3 * time.Second // the keeper extends at 1 s
	st, admin := storetest.NewStore(t)
	ctx := context.Background()
	for i := range 2 {
		storetest.PrepareJSON(t, st, "t", "demo.charge", fmt.Sprintf("busy-%d", i), `{}`)
	}
	claimed, err := st.AllTenants().Claim(ctx, store.ClaimParams{FairClaim: store.FairClaim{OperationTypes: []string{"demo.charge"},
		Worker: "test", Lease: length, Limit: 2, PerTenant: 2, MaxTenants: 1}})
	require.NoError(t, err)
	require.Len(t, claimed, 2)
	tx, err := admin.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT 1 FROM operations WHERE operation_id = $1 FOR UPDATE`, claimed[0].ID)
	require.NoError(t, err)

	ls := testLeases(length, st)
	began := time.Now()
	cuts := make([]chan time.Time, 2)
	held := make([]*lease, 2)
	for i, c := range claimed {
		cuts[i] = make(chan time.Time, 1)
		held[i] = ls.hold(c, "target", began.Add(length), func() {
			select {
			case cuts[i] <- time.Now():
			default:
			}
		})
	}
	defer func() {
		for _, l := range held {
			ls.drop(l)
		}
		ls.wait()
	}()
	select {
	case at := <-cuts[0]:
		require.GreaterOrEqual(t, at.Sub(began), length-ls.d.margin()-50*time.Millisecond,
			"the locked claim was cut before its lease's end: taken for lost")
	case <-time.After(2 * length):
		t.Fatal("the locked claim was not cut near its lease's end")
	}
	select {
	case <-cuts[1]:
		t.Fatal("the other claim was cut: its lease was not extended")
	default:
	}
	require.True(t, ls.end(held[1]).After(began.Add(length)), "the other claim's lease was extended")
}

// TestExtendedClaims: what the keeper makes of an extension: an extended claim's lease
// ends later; a claim still held whose fence was lost is cut; a busy claim still held
// asks for the next statement soon, and is not cut; a claim dropped meanwhile (its
// outcome being written, which holds its row) is neither cut, nor logged as lost, nor a
// reason to come back soon.
func TestExtendedClaims(t *testing.T) {
	t.Parallel()
	ls := testLeases(time.Hour, nil) // the keeper's first tick comes after the test
	far := time.Now().Add(time.Hour)
	cuts := map[string]int{}
	hold := func(name string) *lease {
		op := store.Claimed{Operation: store.Operation{TenantID: "t", ID: uuid.New(), FenceToken: 1}}
		return ls.hold(op, "target", far, func() { cuts[name]++ })
	}
	extended, lost, busy, droppedBusy, droppedGone := hold("extended"), hold("lost"), hold("busy"), hold("droppedBusy"), hold("droppedGone")
	ls.drop(droppedBusy)
	ls.drop(droppedGone)
	defer func() {
		for _, l := range []*lease{extended, lost, busy} {
			ls.drop(l)
		}
		ls.wait()
	}()
	asked := time.Now()
	all := []*lease{extended, lost, busy, droppedBusy, droppedGone}
	got := store.Extended{Left: map[store.OperationKey]time.Duration{extended.op.OperationKey: 2 * time.Hour},
		Busy: map[store.OperationKey]bool{busy.op.OperationKey: true, droppedBusy.op.OperationKey: true}}
	require.True(t, ls.extended(all, got, asked), "a busy claim still held")
	require.Equal(t, asked.Add(2*time.Hour), ls.end(extended))
	require.Equal(t, map[string]int{"lost": 1}, cuts, "only the claim still held whose fence was lost is cut")
	require.True(t, lost.lost)
	require.False(t, droppedGone.lost)

	got.Busy = map[store.OperationKey]bool{droppedBusy.op.OperationKey: true}
	require.False(t, ls.extended(all, got, asked), "a dropped claim's busy row is no reason to come back soon")
}

// TestAnExtensionThatShortensALeaseBringsItsCutForward: a claim taken under a longer
// lease than the dispatcher's (a reconciler's replay) ends sooner once the keeper
// extends it by the dispatcher's lease, and is cut before that new end, not near the
// old one.
func TestAnExtensionThatShortensALeaseBringsItsCutForward(t *testing.T) {
	t.Parallel()
	// A lease of 3 s: a cut comes 300 ms before a lease's end, and the keeper's first
	// tick, which would need a store, after the test.
	ls := testLeases(3*time.Second, nil)
	cut := make(chan time.Time, 1)
	l := ls.hold(store.Claimed{Operation: store.Operation{TenantID: "t", ID: uuid.New(), FenceToken: 1}}, "target",
		time.Now().Add(time.Minute), func() { cut <- time.Now() })
	defer func() {
		ls.drop(l)
		ls.wait()
	}()
	asked := time.Now()
	ls.extended([]*lease{l}, store.Extended{Left: map[store.OperationKey]time.Duration{l.op.OperationKey: 500 * time.Millisecond}}, asked)
	select {
	case at := <-cut:
		require.True(t, at.Before(asked.Add(500*time.Millisecond)), "cut before the new end")
	case <-time.After(900 * time.Millisecond):
		t.Fatal("not cut before its shortened lease ended")
	}
}

// testLeases is the leases of a dispatcher with only a lease, the real clock, the store
// st (nil: a test whose keeper must not reach its first extension) and a silent log.
func testLeases(lease time.Duration, st *store.Store) *leases {
	return &leases{d: &Dispatcher{cfg: Config{Lease: lease, Clock: time.Now, Store: st}, log: slog.New(slog.DiscardHandler)}}
}
