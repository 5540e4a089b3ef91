package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// unknownOp prepares, claims and records an operation as UNKNOWN, as a timeout would.
func unknownOp(t *testing.T, b *testBundle, tenant, intent string) store.Operation {
	t.Helper()
	return unknownAfter(t, b, tenant, intent, store.OutcomeParams{Observation: store.Observation{Source: "DISPATCH", Outcome: "TIMEOUT"}})
}

// escalatedOp is unknownOp, then escalated by a reconciler to payments-oncall.
func escalatedOp(t *testing.T, b *testBundle, tenant, intent string) store.Operation {
	t.Helper()
	return storetest.ResolveUnknown(t, b.store, unknownOp(t, b, tenant, intent), store.ResolveParams{State: store.StateEscalated,
		Escalation:  &store.Escalation{Owner: "payments-oncall", Reason: "no lookup", EscalatedAt: time.Now()},
		Observation: store.Observation{Source: "BROKER", Outcome: "ESCALATED"}, Actor: "rec"})
}

// unknownAfter prepares and claims an operation, then records outcome (its state and
// key filled in) as its send's.
func unknownAfter(t *testing.T, b *testBundle, tenant, intent string, outcome store.OutcomeParams) store.Operation {
	t.Helper()
	op, _, err := b.all.Prepare(b.ctx, prepareParams(tenant, intent, `{"amount":1}`))
	require.NoError(t, err)
	claimed, err := b.all.Claim(b.ctx, claimParams(100))
	require.NoError(t, err)
	for _, c := range claimed {
		if c.ID == op.ID {
			outcome.TenantID, outcome.ID, outcome.Fence, outcome.State, outcome.Actor = tenant, op.ID, c.FenceToken, store.StateUnknown, "test"
			got := b.recordOutcome(t, outcome)
			require.NotNil(t, got.NextCheckAt, "entering UNKNOWN schedules a check")
			return got
		}
	}
	t.Fatal("not claimed")
	return store.Operation{}
}

func unknownParams() store.FairClaim {
	return store.FairClaim{OperationTypes: []string{"demo.charge"}, Worker: "rec", Lease: time.Minute,
		Limit: 10, PerTenant: 10, MaxTenants: 10}
}

func TestClaimUnknownIsExclusiveAndFenced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := unknownOp(t, b, "acme", "u-1")

	first, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, first, 1)
	require.Equal(t, op.FenceToken+1, first[0].FenceToken, "a reconciler's claim takes a new fence")
	require.Equal(t, store.StateUnknown, first[0].State, "without a change of state")
	require.Equal(t, op.Revision, first[0].Revision)

	second, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Empty(t, second, "two reconcilers never hold one operation")

	// The old fence (the dispatcher's) can no longer record.
	_, err = b.all.RecordCheck(b.ctx, store.CheckParams{TenantID: "acme", ID: op.ID, Fence: op.FenceToken,
		Actor: "stale"})
	require.ErrorIs(t, err, store.ErrFenceLost)

	checked, err := b.all.RecordCheck(b.ctx, store.CheckParams{TenantID: "acme", ID: op.ID, Fence: first[0].FenceToken,
		Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, CheckAfter: time.Hour, AcceptedUnfinished: true, Actor: "rec"})
	require.NoError(t, err)
	require.Equal(t, store.StateUnknown, checked.State)
	require.Equal(t, int32(1), checked.Checks)
	require.True(t, checked.AcceptedUnfinished)
	require.Equal(t, op.Revision+1, checked.Revision, "a check is an event")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations
		WHERE operation_id = $1 AND next_check_at - now() BETWEEN interval '59 minutes' AND interval '1 hour'`, op.ID),
		"the next check is scheduled by the database's clock")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events WHERE from_state = 'UNKNOWN' AND to_state = 'UNKNOWN' AND reason = 'NOT_FOUND'`))

	notDue, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Empty(t, notDue, "not before the next check is due")
}

func TestResolveUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ok := unknownOp(t, b, "acme", "u-ok")
	esc := unknownOp(t, b, "acme", "u-esc")
	claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claimed, 2)
	fence := map[string]int64{}
	for _, c := range claimed {
		fence[c.IntentRef] = c.FenceToken
	}

	done, err := b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: ok.ID, Fence: fence["u-ok"],
		State: store.StateSucceeded, RemoteRef: "ch_9", Observation: store.Observation{Source: "LOOKUP", Outcome: "FOUND"}, Actor: "rec"})
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, done.State)
	require.Equal(t, "ch_9", done.RemoteRef)

	_, err = b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: esc.ID, Fence: fence["u-esc"],
		State: store.StateEscalated, Actor: "rec"})
	require.Error(t, err, "an escalation needs an owner")
	escalated, err := b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: esc.ID, Fence: fence["u-esc"],
		State: store.StateEscalated, Escalation: &store.Escalation{Owner: "payments-oncall", Reason: "no lookup", EscalatedAt: time.Now()},
		Observation: store.Observation{Source: "BROKER", Outcome: "ESCALATED"}, Actor: "rec"})
	require.NoError(t, err)
	require.Equal(t, store.StateEscalated, escalated.State)
	require.Equal(t, "payments-oncall", escalated.Escalation.Owner)

	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET escalation = NULL WHERE operation_id = $1`, esc.ID)
	require.Error(t, err, "an ESCALATED operation always names its owner")
}

func TestBeginReplayIsAFencedTransition(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := unknownOp(t, b, "acme", "u-replay")
	claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claimed, 1)

	replay, err := b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		Worker: "rec", Lease: time.Minute})
	require.NoError(t, err)
	require.Equal(t, store.StateInFlight, replay.State)
	require.Equal(t, claimed[0].FenceToken+1, replay.FenceToken)
	require.Equal(t, int32(2), replay.AttemptCount)
	require.Equal(t, int32(1), replay.Replays)
	require.Equal(t, time.Minute, replay.LeaseLeft)
	require.Positive(t, replay.SinceFirstSend, "the first send was the dispatcher's")
	require.NotEmpty(t, replay.Payload, "the same bytes are sent again")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events WHERE operation_id = $1 AND from_state = 'UNKNOWN'
		AND to_state = 'IN_FLIGHT' AND fence_token = $2 AND actor = 'reconciler:rec' AND reason = 'SAME_KEY_REPLAY'`, op.ID, replay.FenceToken),
		"the replay's attempt is its event")

	_, err = b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		Worker: "rec", Lease: time.Minute})
	require.ErrorIs(t, err, store.ErrFenceLost, "a fence replays once")
}

// TestNoReplayAfterAStaleAcceptedAnswer: a stale outcome of one of the classes the
// caller names (an answer that said the target accepted the request, received after the
// worker lost its fence) refuses the replay, even one recorded after the reconciler's
// claim; the claim reports the stale outcomes' classes.
func TestNoReplayAfterAStaleAcceptedAnswer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := unknownOp(t, b, "acme", "u-stale-202")
	claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.Empty(t, claimed[0].StaleAnswers)
	_, err = b.pool.Exec(b.ctx, `INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, outcome, observation, sent)
		VALUES ('acme', $1, 1, 'w', 'ACCEPTED_NOT_CONFIRMED', '{}', true)`, op.ID)
	require.NoError(t, err)

	params := store.BeginReplayParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken, Worker: "rec", Lease: time.Minute,
		AcceptedClasses: []string{"IN_PROGRESS", "ACCEPTED_NOT_CONFIRMED"}}
	_, err = b.all.BeginReplay(b.ctx, params)
	require.ErrorIs(t, err, store.ErrFenceLost, "the target accepted the request")
	params.AcceptedClasses = []string{"IN_PROGRESS"} // a target where that answer means something else
	_, err = b.all.BeginReplay(b.ctx, params)
	require.NoError(t, err)

	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'UNKNOWN', revision = revision + 1, next_check_at = now(), lease_owner = NULL,
		lease_expires_at = NULL WHERE operation_id = $1`, op.ID)
	require.NoError(t, err)
	again, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, again, 1)
	require.Equal(t, []string{"ACCEPTED_NOT_CONFIRMED"}, again[0].StaleAnswers)
}

// TestNoReplayAfterThePreconditionFailed: once the target refused a send because its
// precondition failed (an earlier send made the effect), in time or after the lease,
// the claim says so and the ledger refuses a replay, whatever a lookup found since.
func TestNoReplayAfterThePreconditionFailed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	unknownAfter(t, b, "acme", "u-412", store.OutcomeParams{
		Observation: store.Observation{Source: "DISPATCH", Outcome: "PRECONDITION_FAILED", HTTPStatus: 412}})
	late := unknownOp(t, b, "acme", "u-412-late")
	_, err := b.pool.Exec(b.ctx, `INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, outcome, observation, sent)
		VALUES ('acme', $1, 1, 'w', 'PRECONDITION_FAILED', '{}', true)`, late.ID)
	require.NoError(t, err)
	plain := unknownOp(t, b, "acme", "u-timeout")
	claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claimed, 3)
	for _, c := range claimed {
		_, err := b.all.RecordCheck(b.ctx, store.CheckParams{TenantID: "acme", ID: c.ID, Fence: c.FenceToken,
			Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND", HTTPStatus: 404}, Actor: "rec"})
		require.NoError(t, err, "a look that finds nothing, recorded as the last observation")
	}
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET next_check_at = now() WHERE tenant_id = 'acme'`)
	require.NoError(t, err)
	claimed, err = b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claimed, 3)
	for _, c := range claimed {
		want := c.ID != plain.ID
		require.Equal(t, want, c.EffectExists, "%s", c.IntentRef)
		_, err := b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: c.ID, Fence: c.FenceToken,
			Worker: "rec", Lease: time.Minute})
		if want {
			require.ErrorIs(t, err, store.ErrFenceLost, "%s: never sent again", c.IntentRef)
		} else {
			require.NoError(t, err, "%s", c.IntentRef)
		}
	}
}

// TestWalkEndIsTheLastTenantWalked: a claim's walk over the tenants ends at the last of
// the MaxTenants tenants with work in its state after its cursor, or at none ("") when
// fewer were left.
func TestWalkEndIsTheLastTenantWalked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, tenant := range []string{"t1", "t2", "t3"} {
		unknownOp(t, b, tenant, "u-"+tenant)
	}
	for _, tc := range []struct{ after, want string }{{"", "t2"}, {"t1", "t3"}, {"t2", ""}, {"t3", ""}} {
		got, err := b.all.WalkEnd(b.ctx, store.StateUnknown, store.FairClaim{AfterTenant: tc.after, MaxTenants: 2})
		require.NoError(t, err)
		require.Equal(t, tc.want, got, "after %q", tc.after)
	}
	got, err := b.all.WalkEnd(b.ctx, store.StatePrepared, store.FairClaim{MaxTenants: 2})
	require.NoError(t, err)
	require.Empty(t, got, "no tenant has PREPARED work")
}

// TestCursorAfter: the next fair claim starts after the last tenant a claim took from
// only when its own walk filled it; after a short claim, or one topped up from the first
// tenants (rotate), it starts after that walk's end, so that busy or idle first
// tenants never hold the cursor.
func TestCursorAfter(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		after, walkEnd string
		limit          int
		claimed        []string
		want           string
	}{
		"full from its walk":                    {"a1", "a9", 2, []string{"a2", "a3"}, "a3"},
		"full from the first tenant":            {"", "a2", 2, []string{"a1", "a2"}, "a2"},
		"short":                                 {"", "a2", 3, []string{"a1"}, "a2"},
		"empty":                                 {"a2", "a4", 3, nil, "a4"},
		"short, the walk reached the last":      {"a2", "", 3, []string{"a3"}, ""},
		"topped up from the first tenants":      {"a2", "a4", 1, []string{"a1"}, "a4"},
		"its walk and the first tenants":        {"a2", "a4", 2, []string{"a3", "a1"}, "a4"},
		"topped up, the walk reached the last":  {"a2", "", 2, []string{"a3", "a1"}, ""},
		"the cursor's own tenant is a wrap too": {"a2", "a4", 1, []string{"a2"}, "a4"},
	} {
		got := store.CursorAfter(store.FairClaim{AfterTenant: tc.after, Limit: tc.limit}, tc.walkEnd, tc.claimed)
		require.Equal(t, tc.want, got, name)
	}
}

// TestNoFailureAfterAStaleVerifiedSuccess: once a worker that lost its fence received
// the target's verified success, the ledger refuses to record the operation as failed
// or to replay it, whatever a reconciler decided: it may have decided before that
// answer was kept.
func TestNoFailureAfterAStaleVerifiedSuccess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := unknownOp(t, b, "acme", "u-stale-200")
	claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	insertStaleSuccess(t, b.pool, op, 1, "ch_late")

	params := store.ResolveParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken, State: store.StateFailedTerminal,
		Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, Actor: "rec"}
	_, err = b.all.ResolveUnknown(b.ctx, params)
	require.ErrorIs(t, err, store.ErrFenceLost, "the target answered the operation's send with a success")
	_, err = b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: op.ID, Fence: claimed[0].FenceToken,
		Worker: "rec", Lease: time.Minute, AcceptedClasses: []string{"IN_PROGRESS"}})
	require.ErrorIs(t, err, store.ErrFenceLost, "nor is it sent again")
	ref, ok, err := b.all.StaleSuccess(b.ctx, "acme", op.ID)
	require.NoError(t, err)
	require.Equal(t, [2]any{"ch_late", true}, [2]any{ref, ok})
	// One without a reference (no answer of a target is classed so today) is found too:
	// the reconciler must know what the ledger refuses for.
	insertStaleSuccess(t, b.pool, op, 2, "")
	ref, ok, err = b.all.StaleSuccess(b.ctx, "acme", op.ID)
	require.NoError(t, err)
	require.Equal(t, [2]any{"", true}, [2]any{ref, ok})

	params.State, params.RemoteRef = store.StateSucceeded, "ch_late"
	done, err := b.all.ResolveUnknown(b.ctx, params)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, done.State)
}

// TestARefusalSeesASuccessKeptMeanwhile: a verified success being kept while a failure
// or a replay is recorded is seen by the refusal, not missed because it had not
// committed when the refusal began: the refusal waits for the row, which the keeping
// transaction holds (key share) until it commits, and then reads the history again.
func TestARefusalSeesASuccessKeptMeanwhile(t *testing.T) {
	t.Parallel()
	b := setup(t)
	type refusal func(op store.Operation, fence int64) error
	refusals := map[string]refusal{
		"a reconciler's failure": func(op store.Operation, fence int64) error {
			_, err := b.all.ResolveUnknown(b.ctx, store.ResolveParams{TenantID: "acme", ID: op.ID, Fence: fence,
				State: store.StateFailedTerminal, Observation: store.Observation{Source: "LOOKUP", Outcome: "NOT_FOUND"}, Actor: "rec"})
			return err
		},
		"a same-key replay": func(op store.Operation, fence int64) error {
			_, err := b.all.BeginReplay(b.ctx, store.BeginReplayParams{TenantID: "acme", ID: op.ID, Fence: fence,
				Worker: "rec", Lease: time.Minute, AcceptedClasses: []string{"IN_PROGRESS"}})
			return err
		},
		"an operator's failure": func(op store.Operation, _ int64) error {
			if _, err := b.pool.Exec(b.ctx, `UPDATE operations SET lease_expires_at = now() - interval '1 second'
				WHERE operation_id = $1`, op.ID); err != nil { // the reconciler's lease over
				return err
			}
			now, err := b.all.Get(b.ctx, "acme", op.ID)
			if err != nil {
				return err
			}
			_, err = b.all.ResolveManually(b.ctx, store.ManualResolution{TenantID: "acme", ID: op.ID, Revision: now.Revision,
				State: store.StateFailedTerminal, Reason: "not found at the target", Actor: "ops@example.com"})
			return err
		},
		"a target's failure event": func(op store.Operation, _ int64) error {
			now, err := b.all.Get(b.ctx, "acme", op.ID)
			if err != nil {
				return err
			}
			return b.all.SettleEvidence(b.ctx, store.EvidenceSettlement{EvidenceKey: store.EvidenceKey{Target: "demo-payments", EventID: "evt_1"},
				From: store.EvidencePending, To: store.EvidenceApplied, TenantID: "acme", ID: op.ID,
				Change: &store.EvidenceChange{Revision: now.Revision, From: store.StateUnknown, To: store.StateFailedTerminal,
					Observation: store.Observation{Source: "EVIDENCE", Outcome: "EVIDENCE_FAILED"}, Actor: "webhook:test", Reason: "EVIDENCE"}})
		},
	}
	_, _, err := b.all.ReceiveEvidence(b.ctx, webhookEvent("evt_1", ""), time.Hour, time.Minute)
	require.NoError(t, err)
	for what, refuse := range refusals {
		op := unknownOp(t, b, "acme", "u-"+strings.ReplaceAll(what, " ", "-"))
		claimed, err := b.all.ClaimUnknown(b.ctx, unknownParams())
		require.NoError(t, err)
		require.Len(t, claimed, 1)
		keeping, err := b.pool.Begin(b.ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = keeping.Rollback(context.Background()) }) // on a failure
		insertStaleSuccess(t, keeping, op, 1, "ch_late")
		done := make(chan error, 1)
		go func() { done <- refuse(op, claimed[0].FenceToken) }()
		b.waitedOn(t, keeping)
		require.NoError(t, keeping.Commit(b.ctx))
		err = <-done
		require.True(t, errors.Is(err, store.ErrFenceLost) || errors.Is(err, store.ErrEvidenceChanged) ||
			errors.Is(err, store.ErrTargetConfirmed), "%s: %v", what, err)
		got, err := b.all.Get(b.ctx, "acme", op.ID)
		require.NoError(t, err)
		require.Equal(t, store.StateUnknown, got.State, what)
		_, err = b.pool.Exec(b.ctx, `UPDATE operations SET lease_owner = NULL, lease_expires_at = NULL, next_check_at = NULL
			WHERE operation_id = $1`, op.ID) // out of the next claim's way
		require.NoError(t, err)
	}
}

// TestClaimUnknownReportsTheSends: a reconciler's claim says whether an attempt may have
// reached the target (only one recorded as never sent did not) and how long ago, by the
// database's clock, the broker stopped waiting for the last send, a stale worker's late
// record included.
func TestClaimUnknownReportsTheSends(t *testing.T) {
	t.Parallel()
	b := setup(t)
	timedOut := unknownOp(t, b, "acme", "u-timeout")
	neverSent := unknownAfter(t, b, "acme", "u-never-sent", store.OutcomeParams{NotSent: true,
		Observation: store.Observation{Source: "DISPATCH", Outcome: "CONNECT_FAILED"}})

	// A send whose lease expired, whose stale worker records its answer later.
	stale, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "u-stale", `{"amount":1}`))
	require.NoError(t, err)
	claimed, err := b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	swept, err := b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(2 * time.Minute), Limit: 10})
	require.NoError(t, err)
	require.Equal(t, store.Swept{"demo.charge": 1}, swept, "counted by type")
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: stale.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, NotSent: true, Observation: store.Observation{Source: "DISPATCH", Outcome: "CONNECT_FAILED"}, Actor: "stale"})
	require.ErrorIs(t, err, store.ErrFenceLost)

	claims, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claims, 3)
	byID := map[uuid.UUID]store.UnknownClaim{}
	for _, c := range claims {
		byID[c.ID] = c
	}
	require.True(t, byID[timedOut.ID].MayHaveExecuted, "a timeout may have executed")
	require.False(t, byID[neverSent.ID].MayHaveExecuted, "a send that never left cannot have")
	require.False(t, byID[stale.ID].MayHaveExecuted, "the stale worker's own record says it never sent")

	for id, c := range byID {
		var lastEnded time.Time
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT greatest(
				(SELECT max(created_at) FROM operation_events WHERE operation_id = $1 AND from_state = 'IN_FLIGHT'),
				(SELECT max(recorded_at) FROM stale_outcomes WHERE operation_id = $1))`, id).Scan(&lastEnded))
		var claimedAt time.Time
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT lease_expires_at - interval '1 minute' FROM operations WHERE operation_id = $1`, id).Scan(&claimedAt))
		require.InDelta(t, claimedAt.Sub(lastEnded), c.SinceLastSend, float64(time.Microsecond), c.IntentRef)
		require.Positive(t, c.SinceLastSend, c.IntentRef)
	}
	var sweptAt, staleRecordedAt time.Time
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT (SELECT created_at FROM operation_events WHERE operation_id = $1 AND from_state = 'IN_FLIGHT'),
		(SELECT recorded_at FROM stale_outcomes WHERE operation_id = $1)`, stale.ID).Scan(&sweptAt, &staleRecordedAt))
	require.True(t, staleRecordedAt.After(sweptAt), "the stale worker's record, later than the sweep, is the end of its send")
}

// TestClaimUnknownCountsAnUnfinishedAttemptAsSent: an attempt nobody finished (a crash,
// an expired lease) may have reached the target.
func TestClaimUnknownCountsAnUnfinishedAttemptAsSent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "u-crashed", `{"amount":1}`))
	require.NoError(t, err)
	_, err = b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	_, err = b.all.SweepExpiredLeases(b.ctx, store.SweepParams{Now: time.Now().Add(2 * time.Minute), Limit: 10})
	require.NoError(t, err)
	claims, err := b.all.ClaimUnknown(b.ctx, unknownParams())
	require.NoError(t, err)
	require.Len(t, claims, 1)
	require.True(t, claims[0].MayHaveExecuted)
}
