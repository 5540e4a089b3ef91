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
	log := slog.New(slog.DiscardHandler)
	for _, s := range []*store.Store{here, there} {
		n := s.NewNotifier(log, 10*time.Millisecond)
		require.NoError(t, n.Start(t.Context()))
		t.Cleanup(n.Stop)
	}
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
