package dispatcher_test

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/clocktest"
	"github.com/opbroker/opbroker/dispatcher"
	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/target"
	"github.com/opbroker/opbroker/targettest"
)

// TestNotExecutedIsSentAgain: a 429 the contract documents as not executed puts the
// operation back to PREPARED, and it is sent again, with the same key, after the
// target's Retry-After; once the target accepts, it succeeds with one effect.
func TestNotExecutedIsSentAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{Fault: simtarget.FaultThrottle})
	op := b.prepare(t, "acme", simtarget.DemoCharge, "throttled", `{"amount":5}`)
	d := b.dispatcher(t, dispatcher.Config{})
	_, _, err := d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return b.get(t, op).NotExecuted == 1 }, 10*time.Second, 10*time.Millisecond)
	got := b.get(t, op)
	require.Equal(t, store.StatePrepared, got.State)
	require.Equal(t, "NOT_EXECUTED", got.LastObservation.Outcome)
	require.NotNil(t, got.NextCheckAt)
	require.GreaterOrEqual(t, got.NextCheckAt.Sub(got.UpdatedAt), time.Second, "the target's Retry-After is obeyed")

	b.sim.Heal()
	require.NoError(t, d.Start(b.ctx))
	require.Eventually(t, func() bool { return b.get(t, op).State == store.StateSucceeded }, 10*time.Second, 10*time.Millisecond)
	truth := b.sim.Snapshot().Keys[b.remoteKey(t, op)]
	require.Equal(t, 1, truth.Effects)
	require.Equal(t, 2, truth.Attempts, "the same key, sent twice")
	require.EqualValues(t, 2, b.get(t, op).AttemptCount)
}

// TestNotExecutedBudget: once the resend budget is spent the operation fails, truthfully:
// nothing was executed.
func TestNotExecutedBudget(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{Fault: simtarget.FaultThrottle})
	op := b.prepare(t, "acme", simtarget.DemoCharge, "always-throttled", `{"amount":5}`)
	d := b.dispatcher(t, dispatcher.Config{MaxResends: 2, PollInterval: 20 * time.Millisecond})
	require.NoError(t, d.Start(b.ctx))
	require.Eventually(t, func() bool { return b.get(t, op).State == store.StateFailedTerminal }, 15*time.Second, 20*time.Millisecond)
	got := b.get(t, op)
	require.EqualValues(t, 2, got.AttemptCount)
	require.EqualValues(t, 2, got.NotExecuted)
	require.Contains(t, got.LastObservation.Summary, "resend budget")
	require.Zero(t, b.sim.Snapshot().Keys[b.remoteKey(t, op)].Effects)
}

// refusedSetup returns a dispatcher whose target refuses the credential it reads from
// secret (old-token; the target wants rotated-token), with n operations sent, refused
// once, and due again.
func refusedSetup(t *testing.T, n int) (*testBundle, *dispatcher.Dispatcher, *clocktest.Clock, string, []store.Operation) {
	t.Helper()
	auth, secret := targettest.BearerFile(t, "old-token")
	b := setup(t, simtarget.Config{Auth: auth, Credential: "rotated-token"})
	ops := make([]store.Operation, n)
	for i := range ops {
		ops[i] = b.prepare(t, "acme", simtarget.DemoCharge, fmt.Sprint("refused-", i), `{"amount":5}`)
	}
	clock := clocktest.New(0)
	d := b.dispatcher(t, dispatcher.Config{Clock: clock.Now})
	claimed, _, err := d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Equal(t, n, claimed)
	b.refusedTimes(t, ops, n)
	require.Equal(t, "CREDENTIAL_REFUSED", b.get(t, ops[0]).LastObservation.Outcome)
	return b, d, clock, secret, ops
}

// refusedTimes waits until ops were answered as not executed n times in all, and makes
// them due again.
func (b *testBundle) refusedTimes(t *testing.T, ops []store.Operation, n int) {
	t.Helper()
	ids := make([]uuid.UUID, len(ops))
	for i, op := range ops {
		ids[i] = op.ID
	}
	require.Eventually(t, func() bool {
		var sum int
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT coalesce(sum(not_executed), 0) FROM operations WHERE operation_id = ANY($1)`,
			ids).Scan(&sum))
		return sum == n
	}, 10*time.Second, 10*time.Millisecond)
	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET next_check_at = now() WHERE operation_id = ANY($1)`, ids)
	require.NoError(t, err)
}

// claimUntil runs the dispatcher until it has claimed n operations in all.
func claimUntil(t *testing.T, b *testBundle, d *dispatcher.Dispatcher, n int, why string) {
	t.Helper()
	total := 0
	require.Eventually(t, func() bool {
		claimed, _, err := d.RunOnce(b.ctx)
		require.NoError(t, err)
		total += claimed
		return total >= n
	}, 10*time.Second, 10*time.Millisecond, why)
	require.Equal(t, n, total, why)
}

// TestRefusedCredentialWaitsForANewOne: a 401 the contract documents as a refused
// credential is not executed; the target's sends then wait, even when due, until the
// credential changes, and go on with the new one. Every five minutes one send tries
// the refused credential again, not a claim's worth.
func TestRefusedCredentialWaitsForANewOne(t *testing.T) {
	t.Parallel()
	b, d, clock, secret, ops := refusedSetup(t, 3)
	claimed, _, err := d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Zero(t, claimed, "due, but the target refused the credential it still has")

	// Five minutes on, one send tries the same credential again (the vendor may have
	// fixed its side), and is refused again.
	clock.Advance(6 * time.Minute)
	claimed, _, err = d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, claimed, "one send tries it again")
	b.refusedTimes(t, ops, 4)
	claimed, _, err = d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Zero(t, claimed, "and waits again")

	// Mid-swap, the secret cannot be read: not a new credential.
	require.NoError(t, os.Remove(secret))
	claimed, _, err = d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Zero(t, claimed, "a credential that cannot be read is no change")
	require.NoError(t, os.WriteFile(secret, []byte("rotated-token"), 0o600))
	claimUntil(t, b, d, len(ops), "the new credential is noticed without a restart")
	for _, op := range ops {
		require.Eventually(t, func() bool { return b.get(t, op).State == store.StateSucceeded }, 10*time.Second, 10*time.Millisecond)
		require.Equal(t, 1, b.sim.Snapshot().Keys[b.remoteKey(t, op)].Effects)
	}
}

// TestARefusalEndsWhenTheTargetAnswers: the vendor fixed its side (the same credential
// is accepted again): the send that tries it again is answered, and the target's other
// operations go at once, not five minutes later.
func TestARefusalEndsWhenTheTargetAnswers(t *testing.T) {
	t.Parallel()
	b, d, clock, _, ops := refusedSetup(t, 3)
	b.sim.SetCredential("old-token")
	clock.Advance(6 * time.Minute)
	claimed, _, err := d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, claimed, "one send tries it again")
	require.Eventually(t, func() bool {
		var done int
		for _, op := range ops {
			if b.get(t, op).State == store.StateSucceeded {
				done++
			}
		}
		return done == 1
	}, 10*time.Second, 10*time.Millisecond)
	claimUntil(t, b, d, len(ops)-1, "the others go once the target answered")
}

// TestTheTryOfARefusedCredentialIsNotSpentOnNothing: the chance to try a refused
// credential again is taken by a send, not by a claim that found nothing due; one not
// answered (never sent, say) comes back a minute later.
func TestTheTryOfARefusedCredentialIsNotSpentOnNothing(t *testing.T) {
	t.Parallel()
	b, d, clock, _, ops := refusedSetup(t, 1)
	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET next_check_at = now() + interval '1 hour' WHERE operation_id = $1`, ops[0].ID)
	require.NoError(t, err)
	contract, ok := b.targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)
	require.True(t, d.AwaitingCredential(contract))

	clock.Advance(6 * time.Minute)
	claimed, _, err := d.RunOnce(b.ctx)
	require.NoError(t, err)
	require.Zero(t, claimed, "nothing due")
	require.False(t, d.AwaitingCredential(contract), "a replay may take the try the empty claim left")
	require.True(t, d.AwaitingCredential(contract), "one try at a time")
	clock.Advance(time.Minute)
	require.False(t, d.AwaitingCredential(contract), "a try that got no answer comes back")
	require.True(t, d.AwaitingCredential(contract))

	// Ten minutes with nothing tried: the refusal lapses, so that a replica with nothing
	// to send does not report it long after the vendor fixed its side.
	clock.Advance(10 * time.Minute)
	require.False(t, d.AwaitingCredential(contract))
	require.False(t, d.AwaitingCredential(contract), "lapsed, not a try")
}

// TestOnlyAnswersToLaterSendsMoveARefusal: an answer to a send begun before the refusal
// says nothing of it (a late 401 does not put the next try off, a late 200 does not end
// it), and only an answer that passed authentication ends it.
func TestOnlyAnswersToLaterSendsMoveARefusal(t *testing.T) {
	t.Parallel()
	b, d, clock, _, _ := refusedSetup(t, 1)
	contract, ok := b.targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)
	refusedAt := clock.Now()
	before := refusedAt.Add(-time.Second)
	d.CredentialAnswer(contract, target.Result{HTTPStatus: 200, Class: target.ClassVerifiedSuccess}, before)
	require.True(t, d.AwaitingCredential(contract), "a late success of an earlier send")

	clock.Advance(6 * time.Minute)
	d.CredentialAnswer(contract, target.Result{HTTPStatus: 401, Class: target.ClassCredentialRefused}, before)
	require.False(t, d.AwaitingCredential(contract), "a late refusal of an earlier send does not put the try off")

	for _, res := range []target.Result{
		{HTTPStatus: 503, Class: target.ClassServerError}, {HTTPStatus: 429, Class: target.ClassThrottled},
		{HTTPStatus: 302, Class: target.ClassRedirect}, {HTTPStatus: 400, Class: target.ClassUnlistedStatus},
		{HTTPStatus: 503, Class: target.ClassNotExecuted},
	} {
		d.CredentialAnswer(contract, res, clock.Now())
		require.True(t, d.AwaitingCredential(contract), "a %d (%s) says nothing of the credential", res.HTTPStatus, res.Class)
	}
	d.CredentialAnswer(contract, target.Result{HTTPStatus: 404, Class: target.ClassDocumentedRejection}, clock.Now())
	require.False(t, d.AwaitingCredential(contract))
	require.False(t, d.AwaitingCredential(contract), "the refusal ended")

	// A refusal of a send begun before the one that ended it starts no new one.
	d.CredentialAnswer(contract, target.Result{HTTPStatus: 401, Class: target.ClassCredentialRefused}, before)
	require.False(t, d.AwaitingCredential(contract), "a late refusal of an earlier send")
}

// TestAClaimTakenBeforeARefusalIsNotSent: the target refused the credential after a
// claim was taken and before its send: the send is not made into the refusal (it
// would be refused too), and the operation goes back to PREPARED unsent.
func TestAClaimTakenBeforeARefusalIsNotSent(t *testing.T) {
	t.Parallel()
	auth, _ := targettest.BearerFile(t, "token")
	b := setup(t, simtarget.Config{Auth: auth, Credential: "token"})
	op := b.prepare(t, "acme", simtarget.DemoCharge, "claimed-before", `{"amount":5}`)
	clock := clocktest.New(0)
	d := b.dispatcher(t, dispatcher.Config{Clock: clock.Now})
	asOf := clock.Now()
	claimed := b.claimOne(t, "w", time.Minute)
	contract, ok := b.targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)
	clock.Advance(time.Second)
	d.CredentialAnswer(contract, target.Result{HTTPStatus: 401, Class: target.ClassCredentialRefused}, clock.Now())

	d.Deliver(contract, claimed, asOf)
	got := b.get(t, op)
	require.Equal(t, store.StatePrepared, got.State)
	require.Equal(t, "NOT_STARTED", got.LastObservation.Outcome)
	require.Contains(t, got.LastObservation.Summary, "refused the broker's credential")
	require.Nil(t, b.sim.Snapshot().Keys[b.remoteKey(t, op)], "nothing was sent")
}

// TestNotExecutedReplayStaysUnknown: a replay's answer documented as not executed says
// nothing of the attempts before it, which may have executed: the operation stays
// UNKNOWN for the reconciler, never PREPARED.
func TestNotExecutedReplayStaysUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{Fault: simtarget.FaultThrottle})
	op := b.prepare(t, "acme", simtarget.DemoCharge, "replayed", `{"amount":5}`)
	replay, asOf := b.replayClaim(t, op)
	contract, ok := b.targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)
	b.dispatcher(t, dispatcher.Config{}).Deliver(contract, replay, asOf)
	got := b.get(t, op)
	require.Equal(t, store.StateUnknown, got.State)
	require.Equal(t, "NOT_EXECUTED", got.LastObservation.Outcome)
	require.EqualValues(t, 1, got.NotExecuted)
	require.Contains(t, got.LastObservation.Summary, "an earlier attempt may have executed")
}

// TestReplayChecksTheKeysScopeAtTheSend: a replay decided under one contract is not
// sent under an edited one: the scope the key was first sent in is checked at the
// moment of the send.
func TestReplayChecksTheKeysScopeAtTheSend(t *testing.T) {
	t.Parallel()
	b := setup(t, simtarget.Config{})
	op := b.prepare(t, "acme", simtarget.DemoCharge, "edited", `{"amount":5}`)
	replay, asOf := b.replayClaim(t, op)
	contract, ok := b.targets.ForType(simtarget.DemoCharge)
	require.True(t, ok)
	edited := *contract
	edited.Endpoint.URL += "?api=v2"
	b.dispatcher(t, dispatcher.Config{}).Deliver(&edited, replay, asOf)
	got := b.get(t, op)
	require.Equal(t, store.StateUnknown, got.State)
	require.Equal(t, "KEY_SCOPE_CHANGED", got.LastObservation.Outcome)
	require.Nil(t, b.sim.Snapshot().Keys[b.remoteKey(t, op)], "nothing was sent")
}
