package dispatcher

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

// TestLeaseKeeperOutlivesGapsAndStopsOnWait checks the keeper's life: it does not return
// when what is held empties between claims (it was started again for most operations of
// a burn-down), yet Stop's wait does not wait for its next tick, a third of a lease away:
// it returns as soon as nothing is held.
func TestLeaseKeeperOutlivesGapsAndStopsOnWait(t *testing.T) {
	t.Parallel()
	ls := &leases{d: &Dispatcher{cfg: Config{Lease: time.Hour, Clock: time.Now}}} // no tick during the test
	claim := func() *lease {
		op := store.Claimed{Operation: store.Operation{TenantID: "t", ID: uuid.New(), FenceToken: 1}}
		return ls.hold(op, "target", time.Now().Add(time.Hour), func() {})
	}
	keeping := func() bool {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		return ls.keeping
	}
	waited := func() <-chan struct{} {
		done := make(chan struct{})
		go func() { ls.wait(); close(done) }()
		return done
	}

	for range 3 {
		ls.drop(claim())
		time.Sleep(20 * time.Millisecond) // time for a keeper that returns to do so
		require.True(t, keeping(), "the keeper stays when nothing is held between claims")
	}
	select {
	case <-waited():
	case <-time.After(5 * time.Second):
		t.Fatal("wait waited for the keeper's tick with nothing held")
	}
	require.False(t, keeping())

	held := claim()
	done := waited()
	select {
	case <-done:
		t.Fatal("wait returned while a claim was held")
	case <-time.After(50 * time.Millisecond):
	}
	ls.drop(held)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("wait did not return once the last claim was dropped")
	}
	require.False(t, keeping())

	ls.drop(claim())
	require.True(t, keeping(), "a keeper starts again after a wait")
	<-waited()
}
