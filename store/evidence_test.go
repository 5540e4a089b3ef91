package store_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

// webhookEvent is a kept webhook event about no operation yet; reporter makes it a
// reported one.
func webhookEvent(id, reporter string) store.InboundEvidence {
	e := store.InboundEvidence{Target: "demo-payments", EventID: id, Source: store.SourceWebhook, EventType: "charge.succeeded",
		Meaning: "SUCCEEDED", Reference: "ref", ReferenceKind: "remote_ref", Body: []byte(`{"id":"` + id + `"}`)}
	if reporter != "" {
		e.Source, e.Reporter, e.ClaimedTenant = store.SourceReported, reporter, "acme"
	}
	return e
}

// TestEvidenceBodiesArePurgedPerSender: a body is purged at its own retention, never
// with another sender's event of the same id.
func TestEvidenceBodiesArePurgedPerSender(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, _, err := b.all.ReceiveEvidence(b.ctx, webhookEvent("evt_1", "svc"), time.Microsecond, time.Minute)
	require.NoError(t, err)
	_, _, err = b.all.ReceiveEvidence(b.ctx, webhookEvent("evt_1", ""), time.Hour, time.Minute)
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond)
	n, err := b.all.PurgeEvidenceBodies(b.ctx, 10)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	hook, err := b.all.Evidence(b.ctx, store.EvidenceKey{Target: "demo-payments", EventID: "evt_1"})
	require.NoError(t, err)
	require.NotNil(t, hook.Body, "the webhook's body is kept until its own retention")
	reported, err := b.all.Evidence(b.ctx, store.EvidenceKey{Target: "demo-payments", EventID: "evt_1", Reporter: "svc"})
	require.NoError(t, err)
	require.Nil(t, reported.Body)
}

// TestObservationHoldsAtItsRevision: an observation recorded for the revision it read
// is refused once the operation moved on (then it is decided again), and holds the
// operation at that revision until it commits.
func TestObservationHoldsAtItsRevision(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{}`))
	require.NoError(t, err)
	_, _, err = b.all.ReceiveEvidence(b.ctx, webhookEvent("evt_1", ""), time.Hour, time.Minute)
	require.NoError(t, err)
	observe := func(revision int64) error {
		return b.all.SettleEvidence(b.ctx, store.EvidenceSettlement{EvidenceKey: store.EvidenceKey{Target: "demo-payments", EventID: "evt_1"},
			From: store.EvidencePending, To: store.EvidenceObserved, TenantID: "acme", ID: op.ID, Revision: revision})
	}
	require.ErrorIs(t, observe(op.Revision+1), store.ErrEvidenceChanged)
	e, err := b.all.Evidence(b.ctx, store.EvidenceKey{Target: "demo-payments", EventID: "evt_1"})
	require.NoError(t, err)
	require.Equal(t, store.EvidencePending, e.Disposition)
	require.NoError(t, observe(op.Revision))
}

// TestNoFailureByEvidenceAfterAStaleVerifiedSuccess: an event's failure is not recorded
// on an operation whose send the target answered with a verified success, kept after
// the event was decided: the event is decided again.
func TestNoFailureByEvidenceAfterAStaleVerifiedSuccess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := unknownOp(t, b, "acme", "order-1")
	_, _, err := b.all.ReceiveEvidence(b.ctx, webhookEvent("evt_1", ""), time.Hour, time.Minute)
	require.NoError(t, err)
	insertStaleSuccess(t, b.pool, op, 1, "ch_1")
	settle := func(to store.State) error {
		return b.all.SettleEvidence(b.ctx, store.EvidenceSettlement{EvidenceKey: store.EvidenceKey{Target: "demo-payments", EventID: "evt_1"},
			From: store.EvidencePending, To: store.EvidenceApplied, TenantID: "acme", ID: op.ID,
			Change: &store.EvidenceChange{Revision: op.Revision, From: store.StateUnknown, To: to, RemoteRef: "ch_1",
				Observation: store.Observation{Source: "EVIDENCE", Outcome: "EVIDENCE_" + string(to)}, Actor: "webhook:test", Reason: "EVIDENCE"}})
	}
	require.ErrorIs(t, settle(store.StateFailedTerminal), store.ErrEvidenceChanged)
	require.NoError(t, settle(store.StateSucceeded))
}

// TestNoOperatorFailureAfterTheTargetsSuccessEvent: on an ESCALATED operation an event
// of the target's saying it succeeded is recorded for the owner to judge, and the
// owner can no longer record a failure (nor propose one): the effect exists. An event
// quarantined, never matched through the checks, refuses nothing.
func TestNoOperatorFailureAfterTheTargetsSuccessEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := escalatedOp(t, b, "acme", "order-1")
	for _, id := range []string{"evt_quarantined", "evt_1"} {
		e := webhookEvent(id, "")
		e.RemoteRef = "ch_1"
		_, _, err := b.all.ReceiveEvidence(b.ctx, e, time.Hour, time.Minute)
		require.NoError(t, err)
	}
	require.NoError(t, b.all.SettleEvidence(b.ctx, store.EvidenceSettlement{
		EvidenceKey: store.EvidenceKey{Target: "demo-payments", EventID: "evt_quarantined"}, From: store.EvidencePending,
		To: store.EvidenceQuarantined, Reason: "PAYLOAD_MISMATCH", Detail: "the amount differs", TenantID: "acme", ID: op.ID}))
	failure := store.ManualResolution{TenantID: "acme", ID: op.ID, Revision: op.Revision,
		State: store.StateFailedTerminal, Reason: "not found at the provider", Actor: "ops@example.com"}
	_, err := b.all.ProposeResolution(b.ctx, failure, time.Hour)
	require.NoError(t, err, "a quarantined event confirms nothing")
	now, err := b.all.Get(b.ctx, "acme", op.ID)
	require.NoError(t, err)

	require.NoError(t, b.all.SettleEvidence(b.ctx, store.EvidenceSettlement{EvidenceKey: store.EvidenceKey{Target: "demo-payments", EventID: "evt_1"},
		From: store.EvidencePending, To: store.EvidenceApplied, TenantID: "acme", ID: op.ID,
		Change: &store.EvidenceChange{Revision: now.Revision, From: store.StateEscalated, To: store.StateEscalated,
			Observation: store.Observation{Source: "EVIDENCE", Outcome: "EVIDENCE_SUCCEEDED", EventID: "evt_1"}, Actor: "webhook:test",
			Reason: "EVIDENCE_SUCCEEDED"}}))
	now, err = b.all.Get(b.ctx, "acme", op.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateEscalated, now.State)
	failure.Revision = now.Revision
	var confirmed *store.TargetConfirmedError
	_, err = b.all.ResolveManually(b.ctx, failure)
	require.ErrorAs(t, err, &confirmed)
	require.Equal(t, store.TargetConfirmedError{RemoteRef: "ch_1", EventID: "evt_1"}, *confirmed)
	_, err = b.all.ProposeResolution(b.ctx, failure, time.Hour)
	require.ErrorAs(t, err, &confirmed, "nor proposed")
	failure.State, failure.RemoteRef = store.StateSucceeded, "ch_1"
	done, err := b.all.ResolveManually(b.ctx, failure)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, done.State)
}

// TestPostponedEvidenceWaitsItsTurn: an event whose decision could not be recorded
// leaves the matchers' queue until its new turn, a second after the first failure and
// twice as long after each next one, never more than a minute.
func TestPostponedEvidenceWaitsItsTurn(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, _, err := b.all.ReceiveEvidence(b.ctx, webhookEvent("evt_1", ""), time.Hour, time.Minute)
	require.NoError(t, err)
	due, err := b.all.DueEvidence(b.ctx, 10)
	require.NoError(t, err)
	require.Len(t, due, 1)
	key := due[0].Key()
	// postpone postpones the event and checks the wait the postponement set: between the
	// time left now and that plus the time since the call began (a loaded machine, or
	// the race detector, may take a while between the two).
	postpone := func(want time.Duration, msg string) {
		t.Helper()
		start := time.Now()
		require.NoError(t, b.all.PostponeEvidence(b.ctx, key))
		var left time.Duration
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT next_match_at - now() FROM inbound_evidence WHERE event_id = $1`,
			key.EventID).Scan(&left))
		const slack = 100 * time.Millisecond
		require.True(t, left-slack <= want && want <= left+time.Since(start)+slack, "%s: %s left", msg, left)
	}
	postpone(time.Second, "a second after the first failure")
	due, err = b.all.DueEvidence(b.ctx, 10)
	require.NoError(t, err)
	require.Empty(t, due)
	postpone(2*time.Second, "then twice as long")
	for range 7 {
		require.NoError(t, b.all.PostponeEvidence(b.ctx, key))
	}
	postpone(time.Minute, "never more than a minute")
}

// TestEvidenceSchemaRefusesIllegalRows: each CHECK of a target's events and of the
// stale outcomes refuses a row that breaks it, whatever wrote it.
func TestEvidenceSchemaRefusesIllegalRows(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{}`))
	require.NoError(t, err)
	evidence := func(column string, value any) map[string]any {
		row := evidenceRow("evt_1")
		row[column] = value
		return row
	}
	for constraint, c := range map[string]struct {
		table string
		row   map[string]any
	}{
		"inbound_evidence_sizes":          {"inbound_evidence", evidence("event_id", "")},
		"inbound_evidence_source":         {"inbound_evidence", evidence("source", "EMAIL")},
		"inbound_evidence_meaning":        {"inbound_evidence", evidence("meaning", "MAYBE")},
		"inbound_evidence_reference_kind": {"inbound_evidence", evidence("reference_kind", "name")},
		"inbound_evidence_disposition":    {"inbound_evidence", evidence("reason", "UNMATCHED")},
		"inbound_evidence_operation":      {"inbound_evidence", evidence("tenant_id", "acme")},
		"stale_outcomes_fence_positive":   {"stale_outcomes", staleOutcomeRow(op, 0)},
	} {
		err := insertRow(b.pool, c.table, c.row)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, constraint)
		require.Equal(t, constraint, pgErr.ConstraintName, pgErr.Message)
	}
	require.NoError(t, insertRow(b.pool, "inbound_evidence", evidenceRow("evt_1"))) // the row the cases break
}
