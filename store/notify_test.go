package store_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// TestWorkWakesSubscribersHereAndAtOtherReplicas: a new operation wakes this replica's
// subscribers at once and another replica's through LISTEN/NOTIFY.
func TestWorkWakesSubscribersHereAndAtOtherReplicas(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	here := store.New(storetest.Pool(t, url))
	there := store.New(storetest.Pool(t, url))
	startNotifiers(t, here, there)
	local, stopLocal := here.Subscribe()
	defer stopLocal()
	remote, stopRemote := there.Subscribe()
	defer stopRemote()
	drainWakeups := func(ch <-chan struct{}) {
		for {
			select {
			case <-ch:
			case <-time.After(100 * time.Millisecond):
				return
			}
		}
	}
	drainWakeups(local) // the wake-ups of the listeners starting
	drainWakeups(remote)

	_, _, err := here.Tenant("acme").Prepare(t.Context(), prepareParams("acme", "wake-1", `{}`))
	require.NoError(t, err)
	select {
	case <-local:
	case <-time.After(time.Second):
		t.Fatal("the local subscriber was not woken")
	}
	select {
	case <-remote:
	case <-time.After(5 * time.Second):
		t.Fatal("the other replica was not woken")
	}
}

// TestListenerLeavesAServerThatStoppedAnswering: when the listening connection's server
// stops answering while another one takes the connections (a primary stopped or cut off
// in a failover), the notifier checks it after a silence, listens again on a new
// connection, and so hears the next notification; without the check it would wait on
// the dead connection for good.
func TestListenerLeavesAServerThatStoppedAnswering(t *testing.T) {
	store.SetListenCheck(t, 200*time.Millisecond, 300*time.Millisecond)
	here, _, proxy := storetest.NewStoreBehindProxy(t)
	there := store.New(storetest.Pool(t, storetest.Schema(t)))
	startNotifiers(t, here, there)
	woken, stop := here.Subscribe()
	defer stop()
	drain := func() {
		for {
			select {
			case <-woken:
			case <-time.After(300 * time.Millisecond):
				return
			}
		}
	}
	drain()
	proxy.Strand()
	// The notifier finds the stranded connection silent and dead, and listens again on
	// a new one, which wakes the local subscribers once it listens; without the check
	// that wake-up never comes.
	select {
	case <-woken:
	case <-time.After(5 * time.Second):
		t.Fatal("the notifier did not listen again after its connection's server stopped answering")
	}
	drain()
	_, _, err := there.Tenant("acme").Prepare(t.Context(), prepareParams("acme", "after-strand", `{}`))
	require.NoError(t, err)
	select {
	case <-woken:
	case <-time.After(5 * time.Second):
		t.Fatal("the notification sent after the listening connection's server stopped answering was not heard")
	}
}

// startNotifiers starts a notifier for each store, stopped at the test's end.
func startNotifiers(t *testing.T, stores ...*store.Store) {
	t.Helper()
	for _, s := range stores {
		n := s.NewNotifier(slog.New(slog.DiscardHandler), 10*time.Millisecond)
		require.NoError(t, n.Start(t.Context()))
		t.Cleanup(n.Stop)
	}
}
