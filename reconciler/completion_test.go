package reconciler_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/clocktest"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
)

// TestPendingIsNeverSucceeded: a charge the target accepts but has not finished
// ("processing") is never SUCCEEDED: the operation stays UNKNOWN, is looked up again,
// and is SUCCEEDED only once the target says the charge succeeded. One that ends
// "failed", which the contract documents as final and without effect, is
// FAILED_TERMINAL. Neither is ever sent again.
func TestPendingIsNeverSucceeded(t *testing.T) {
	t.Parallel()
	simClock := clocktest.New(0) // the target's clock: charges finish when the test says
	b := setup(t, simtarget.Config{Completion: time.Hour, Now: simClock.Now})
	succeeds := b.prepare(t, simtarget.DemoCharge, "pays", `{"amount":100}`)
	fails := b.prepare(t, simtarget.DemoCharge, "declined-later", `{"amount":100,"sim":{"completes":"failed"}}`)
	require.NoError(t, b.dispatcher.Start(b.ctx))
	for _, op := range []store.Operation{succeeds, fails} {
		got := b.waitState(t, op, store.StateUnknown)
		require.Equal(t, "PENDING", got.LastObservation.Outcome, "accepted, visible as pending")
		require.NotEmpty(t, got.RemoteRef, "the target's reference is kept")
	}

	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	require.Eventually(t, func() bool {
		a, f := b.get(t, succeeds), b.get(t, fails)
		return a.Checks >= 1 && f.Checks >= 1
	}, 30*time.Second, 10*time.Millisecond, "looked up while processing")
	for _, op := range []store.Operation{succeeds, fails} {
		got := b.get(t, op)
		require.Equal(t, store.StateUnknown, got.State, "processing is not SUCCEEDED")
		require.Equal(t, "FOUND_PENDING", got.LastObservation.Outcome)
	}

	simClock.Advance(2 * time.Hour) // the target finishes both charges
	b.waitState(t, succeeds, store.StateSucceeded)
	b.waitState(t, fails, store.StateFailedTerminal)
	require.Equal(t, 1, b.truth(t, succeeds).Attempts, "never sent again")
	require.Equal(t, 1, b.truth(t, fails).Attempts)
	require.Equal(t, 1, b.truth(t, fails).Failed, "the target moved no money")
}

// TestKeyInUseIsReplayedAfterBackoff: a 409 "a request with this key is in progress"
// from a target whose key saves every answer, and that offers no lookup, is replayed
// with the same key once the earlier request had time to finish, instead of being
// escalated for good.
func TestKeyInUseIsReplayedAfterBackoff(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{Fault: simtarget.FaultInProgress}, func(c *target.Contract) { c.Lookup = nil })
	op := b.prepare(t, simtarget.DemoCharge, "busy-key", `{"amount":100}`)
	require.NoError(t, b.dispatcher.Start(b.ctx))
	got := b.waitState(t, op, store.StateUnknown)
	require.Equal(t, target.ClassInProgress, got.LastObservation.Outcome)

	b.sim.Heal() // the earlier request is done
	require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
	b.waitState(t, op, store.StateSucceeded)
	require.Equal(t, 1, b.truth(t, op).Effects)
	require.Equal(t, 2, b.truth(t, op).Attempts, "one 409, one replay with the same key")
}

// TestConditionalResend: at a target with a precondition (capability C) and no
// idempotency key, an UNKNOWN operation is sent again under the precondition. If the
// first send made the effect, the target refuses the resend (412) and nothing is
// doubled; without a lookup to confirm the effect, it goes to a person. If the first
// made nothing, the resend makes the one effect.
func TestConditionalResend(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		fault simtarget.Fault
		want  store.State
	}{
		"the first send made the effect": {simtarget.FaultCommitThenReset, store.StateEscalated},
		"the first send made nothing":    {simtarget.FaultResetBeforeCommit, store.StateSucceeded},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, simtarget.Config{Fault: tc.fault}, func(c *target.Contract) {
				if c.Conditional != nil {
					c.Lookup = nil // capability C alone
				}
			})
			op := b.prepare(t, simtarget.DemoObject, "object", `{"amount":7}`)
			require.NoError(t, b.dispatcher.Start(b.ctx))
			b.waitState(t, op, store.StateUnknown)
			b.sim.Heal()
			require.NoError(t, b.reconciler(t, "r1").Start(b.ctx))
			got := b.waitState(t, op, tc.want)
			require.Equal(t, 1, b.truth(t, op).Effects, "never a second object")
			require.Equal(t, int32(1), got.Replays, "sent again once, under the precondition")
			if tc.want == store.StateEscalated {
				require.Contains(t, got.Escalation.Reason, "precondition failed")
			}
		})
	}
}
