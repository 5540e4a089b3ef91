package reconciler_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
)

// TestStartsAgainAfterStop: a stopped reconciler starts again and resolves what became
// UNKNOWN meanwhile.
func TestStartsAgainAfterStop(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	r := b.reconciler(t, "r1")
	require.NoError(t, b.dispatcher.Start(b.ctx))
	for i := range 2 {
		op := b.prepare(t, simtarget.DemoCharge, fmt.Sprint("again-", i), fault(simtarget.FaultCommitThenReset))
		b.waitState(t, op, store.StateUnknown)
		require.NoError(t, r.Start(b.ctx))
		require.NoError(t, r.Start(b.ctx), "starting a running reconciler does nothing")
		b.waitState(t, op, store.StateSucceeded)
		r.Stop()
		r.Stop()
	}
}
