package store_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

type testBundle struct {
	ctx   context.Context
	store *store.Store
	all   store.Scope   // every tenant's, as the broker's workers reach the ledger
	pool  *pgxpool.Pool // the administrator's
	app   *pgxpool.Pool // the broker's role, bound by row-level security
}

// recordOutcome records p and returns the operation as it left it.
func (b *testBundle) recordOutcome(t testing.TB, p store.OutcomeParams) store.Operation {
	t.Helper()
	_, err := b.all.RecordOutcome(b.ctx, p)
	require.NoError(t, err)
	op, err := b.all.Get(b.ctx, p.TenantID, p.ID)
	require.NoError(t, err)
	return op
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	url := storetest.Schema(t)
	app := storetest.Pool(t, url)
	s := store.New(app)
	return &testBundle{ctx: context.Background(), store: s, all: s.AllTenants(),
		pool: storetest.Pool(t, storetest.AdminURL(t, url)), app: app}
}

// prepareParams returns a valid intent; opts may change it.
func prepareParams(tenant, intent string, body string) store.PrepareParams {
	sum := sha256.Sum256([]byte(body))
	return store.PrepareParams{
		TenantID:      tenant,
		OperationType: "demo.charge",
		IntentRef:     intent,
		ContentType:   "application/json",
		Payload:       []byte(body),
		PayloadSHA256: sum[:],
		Actor:         "test",
	}
}

// waitedOn waits until another transaction waits for tx's locks: tx's transaction id,
// not a statement's text, names the wait, whatever other tests run meanwhile.
func (b *testBundle) waitedOn(t *testing.T, tx pgx.Tx) {
	t.Helper()
	var xid string
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT pg_current_xact_id()::xid::text`).Scan(&xid))
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted
			AND transactionid::text = $1`, xid) > 0
	}, 10*time.Second, 5*time.Millisecond)
}

func (b *testBundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(b.ctx, sql, args...).Scan(&n))
	return n
}

// execer is a pool or a transaction.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// insertRow writes row (its columns and their values) into table, as db's role.
func insertRow(db execer, table string, row map[string]any) error {
	columns := slices.Sorted(maps.Keys(row))
	args := make([]any, len(columns))
	params := make([]string, len(columns))
	for i, c := range columns {
		args[i], params[i] = row[c], fmt.Sprintf("$%d", i+1)
	}
	_, err := db.Exec(context.Background(), `INSERT INTO `+table+` (`+strings.Join(columns, ", ")+`)
		VALUES (`+strings.Join(params, ", ")+`)`, args...)
	return err
}

// staleOutcomeRow is a stale outcome of op under fence, as stale_outcomes' columns.
func staleOutcomeRow(op store.Operation, fence int64) map[string]any {
	return map[string]any{"tenant_id": op.TenantID, "operation_id": op.ID, "fence_token": fence, "actor": "test",
		"outcome": "UNKNOWN", "observation": "{}", "sent": true}
}

// insertStaleOutcome writes, as db's role, a stale outcome of op under fence.
func insertStaleOutcome(t *testing.T, db execer, op store.Operation, fence int64) {
	t.Helper()
	require.NoError(t, insertRow(db, "stale_outcomes", staleOutcomeRow(op, fence)))
}

// insertStaleSuccess writes, as db's role, a verified success of op's target under
// fence, with the reference ref ("" for none), kept as a stale outcome.
func insertStaleSuccess(t *testing.T, db execer, op store.Operation, fence int64, ref string) {
	t.Helper()
	row := staleOutcomeRow(op, fence)
	row["outcome"] = "VERIFIED_SUCCESS"
	if ref != "" {
		row["remote_ref"] = ref
	}
	require.NoError(t, insertRow(db, "stale_outcomes", row))
}

// evidenceRow is a target's event eventID matched to no operation (PENDING), as
// inbound_evidence's columns.
func evidenceRow(eventID string) map[string]any {
	return map[string]any{"target": "demo", "event_id": eventID, "source": "WEBHOOK", "event_type": "charge",
		"meaning": "SUCCEEDED", "reference": "r", "reference_kind": "remote_ref", "body_purge_at": time.Now(),
		"match_until": time.Now(), "disposition": "PENDING"}
}

// insertEvidence writes, as db's role, a target's event eventID matched to op
// (OBSERVED), or to no operation (PENDING) when op is nil.
func insertEvidence(t *testing.T, db execer, eventID string, op *store.Operation) {
	t.Helper()
	row := evidenceRow(eventID)
	if op != nil {
		row["disposition"], row["tenant_id"], row["operation_id"], row["decided_at"] = "OBSERVED", op.TenantID, op.ID, time.Now()
	}
	require.NoError(t, insertRow(db, "inbound_evidence", row))
}

func TestPrepareCreatesWithCreationEvent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	deadline := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	p := prepareParams("acme", "order-1", `{"amount":100}`)
	p.Labels = map[string]string{"team": "billing"}
	p.DispatchDeadline = &deadline

	op, created, err := b.all.Prepare(b.ctx, p)
	require.NoError(t, err)
	require.True(t, created)
	require.Equal(t, store.StatePrepared, op.State)
	require.Equal(t, int64(1), op.Revision)
	require.Equal(t, int64(0), op.FenceToken)
	require.Equal(t, p.PayloadSHA256, op.PayloadSHA256)
	require.Equal(t, map[string]string{"team": "billing"}, op.Labels)
	require.True(t, deadline.Equal(*op.DispatchDeadline))
	require.Equal(t, byte(7), op.ID[6]>>4, "operation ids are UUIDv7")

	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events
		WHERE tenant_id = 'acme' AND operation_id = $1 AND revision = 1 AND from_state IS NULL AND to_state = 'PREPARED'`, op.ID))
	var payload []byte
	var remoteKey uuid.UUID
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT payload, remote_key FROM operations WHERE operation_id = $1`, op.ID).Scan(&payload, &remoteKey))
	require.Equal(t, p.Payload, payload, "the approved bytes are stored as sent")
	require.Equal(t, uuid.Version(4), remoteKey.Version(), "the remote key is random")
}

func TestPrepareIdempotentUnderConcurrency(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const callers = 50
	p := prepareParams("acme", "order-concurrent", `{"amount":100}`)

	var wg sync.WaitGroup
	ids := make([]uuid.UUID, callers)
	created := make([]bool, callers)
	errs := make([]error, callers)
	start := make(chan struct{})
	for i := range callers {
		wg.Go(func() {
			<-start
			op, c, err := b.all.Prepare(b.ctx, p)
			ids[i], created[i], errs[i] = op.ID, c, err
		})
	}
	close(start)
	wg.Wait()

	creators := 0
	for i := range callers {
		require.NoError(t, errs[i])
		require.Equal(t, ids[0], ids[i], "every caller gets the same operation")
		if created[i] {
			creators++
		}
	}
	require.Equal(t, 1, creators)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events`))
}

func TestPreparePayloadMismatchChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{"amount":100}`))
	require.NoError(t, err)

	_, _, err = b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{"amount":40}`))
	var mismatch *store.PayloadMismatchError
	require.ErrorAs(t, err, &mismatch)
	require.Equal(t, first.ID, mismatch.Existing.ID)

	again, err := b.all.Get(b.ctx, "acme", first.ID)
	require.NoError(t, err)
	require.Equal(t, first, again)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operations`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events`))
}

func TestPrepareLegitimateRepeatIsNewOperation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, createdA, err := b.all.Prepare(b.ctx, prepareParams("acme", "purchase-1", `{"item":"tea"}`))
	require.NoError(t, err)
	c, createdC, err := b.all.Prepare(b.ctx, prepareParams("acme", "purchase-2", `{"item":"tea"}`))
	require.NoError(t, err)
	require.True(t, createdA)
	require.True(t, createdC)
	require.NotEqual(t, a.ID, c.ID)
	require.Equal(t, 2, b.count(t, `SELECT count(DISTINCT remote_key) FROM operations`), "each operation has its own remote key")
}

func TestPrepareScopesIntentByTenantAndType(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "x", `1`))
	require.NoError(t, err)
	other, created, err := b.all.Prepare(b.ctx, prepareParams("globex", "x", `2`))
	require.NoError(t, err)
	require.True(t, created)
	require.NotEqual(t, a.ID, other.ID)
	p := prepareParams("acme", "x", `3`)
	p.OperationType = "demo.notify"
	_, created, err = b.all.Prepare(b.ctx, p)
	require.NoError(t, err)
	require.True(t, created)
}

// TestPrepareSupersedes: an amendment of a PREPARED operation cancels it in the same
// statement; of an operation that was sent and is not settled it is refused and records
// nothing; of a terminal one it is recorded and leaves the original as it was.
func TestPrepareSupersedes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	amendment := func(intent string, of store.Operation) store.PrepareParams {
		p := prepareParams(of.TenantID, intent, `{"amount":40}`)
		p.SupersedesID = uuid.NullUUID{UUID: of.ID, Valid: true}
		return p
	}
	events := func(op store.Operation) []store.Event {
		t.Helper()
		evs, err := b.all.Events(b.ctx, op.TenantID, op.ID, 0, 100)
		require.NoError(t, err)
		return evs
	}

	prepared, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "credit-1", `{"amount":50}`))
	require.NoError(t, err)
	amended, created, err := b.all.Prepare(b.ctx, amendment("credit-1-amended", prepared))
	require.NoError(t, err)
	require.True(t, created)
	require.Equal(t, prepared.ID, amended.SupersedesID.UUID)
	original, err := b.all.Get(b.ctx, "acme", prepared.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateCancelled, original.State, "a PREPARED original is never sent once amended")
	require.Equal(t, "SUPERSEDED", events(original)[1].Reason)
	require.Equal(t, "SUPERSEDES_PREPARED", events(amended)[0].Reason)
	claimed, err := b.all.Claim(b.ctx, claimParams(10))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.Equal(t, amended.ID, claimed[0].ID, "only the amendment is sent")

	// claimed[0] (the amendment) is IN_FLIGHT now: amending it is refused.
	_, _, err = b.all.Prepare(b.ctx, amendment("credit-1-again", amended))
	var unresolved *store.SupersededUnresolvedError
	require.ErrorAs(t, err, &unresolved)
	require.Equal(t, store.StateInFlight, unresolved.Superseded.State)
	require.Equal(t, amended.ID, unresolved.Superseded.ID)
	require.Zero(t, b.count(t, `SELECT count(*) FROM operations WHERE intent_ref = 'credit-1-again'`), "nothing recorded")

	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: amended.ID, Fence: claimed[0].FenceToken,
		State: store.StateUnknown, Observation: store.Observation{Outcome: "TIMEOUT"}, Actor: "test"})
	require.NoError(t, err)
	_, _, err = b.all.Prepare(b.ctx, amendment("credit-1-again", amended))
	require.ErrorAs(t, err, &unresolved, "nor while UNKNOWN")
	require.Equal(t, store.StateUnknown, unresolved.Superseded.State)

	succeeded, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "credit-2", `{"amount":50}`))
	require.NoError(t, err)
	claimed, err = b.all.Claim(b.ctx, claimParams(10))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: succeeded.ID, Fence: claimed[0].FenceToken,
		State: store.StateSucceeded, RemoteRef: "ch_1", Observation: store.Observation{Outcome: "VERIFIED_SUCCESS"}, Actor: "test"})
	require.NoError(t, err)
	after, created, err := b.all.Prepare(b.ctx, amendment("credit-2-amended", succeeded))
	require.NoError(t, err)
	require.True(t, created, "a settled original can be amended")
	require.Equal(t, "SUPERSEDES_SUCCEEDED", events(after)[0].Reason)
	unchanged, err := b.all.Get(b.ctx, "acme", succeeded.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateSucceeded, unchanged.State, "an amendment never changes a settled original")
	again, created, err := b.all.Prepare(b.ctx, amendment("credit-2-amended", succeeded))
	require.NoError(t, err)
	require.False(t, created)
	require.Equal(t, after.ID, again.ID, "a retry of the amendment finds it")

	cross := prepareParams("globex", "credit-x", `{"amount":40}`)
	cross.SupersedesID = uuid.NullUUID{UUID: succeeded.ID, Valid: true}
	_, _, err = b.all.Prepare(b.ctx, cross)
	require.ErrorIs(t, err, store.ErrSupersededNotFound, "another tenant's operation cannot be superseded")
}

// TestAmendmentRacingAClaimNeverDoubles: amendments and claims of the same PREPARED
// operations at once. Each original is either claimed, and its amendment refused, or
// cancelled by its amendment and never claimed: never both sent.
func TestAmendmentRacingAClaimNeverDoubles(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const n = 40
	originals := b.prepareN(t, "acme", n)
	amendedBy := make([]error, n)
	var claimedIDs []uuid.UUID
	var wg sync.WaitGroup
	wg.Go(func() {
		for range n {
			claimed, err := b.all.Claim(b.ctx, claimParams(3))
			if !assert.NoError(t, err) {
				return
			}
			for _, c := range claimed {
				claimedIDs = append(claimedIDs, c.ID)
			}
		}
	})
	for i, id := range originals {
		wg.Go(func() {
			p := prepareParams("acme", fmt.Sprintf("amend-%d", i), `{"amount":1}`)
			p.SupersedesID = uuid.NullUUID{UUID: id, Valid: true}
			_, _, amendedBy[i] = b.all.Prepare(b.ctx, p)
		})
	}
	wg.Wait()
	var refused, cancelled int
	for i, id := range originals {
		original, err := b.all.Get(b.ctx, "acme", id)
		require.NoError(t, err)
		if amendedBy[i] != nil {
			var unresolved *store.SupersededUnresolvedError
			require.ErrorAs(t, amendedBy[i], &unresolved)
			require.Contains(t, claimedIDs, id, "refused only because the original was claimed")
			refused++
			continue
		}
		require.Equal(t, store.StateCancelled, original.State, "an amended original is cancelled")
		require.Zero(t, original.AttemptCount, "and was never claimed")
		require.NotContains(t, claimedIDs, id)
		cancelled++
	}
	t.Logf("%d originals claimed first (amendment refused), %d cancelled by their amendment", refused, cancelled)
}

func TestGetIsScopedByTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{}`))
	require.NoError(t, err)
	_, err = b.all.Get(b.ctx, "globex", op.ID)
	require.ErrorIs(t, err, store.ErrNotFound)
	_, err = b.all.Get(b.ctx, "acme", uuid.Must(uuid.NewV7()))
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestListPagesNewestFirstWithFilter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var ids []uuid.UUID
	for i := range 7 {
		op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", fmt.Sprintf("o-%d", i), `{}`))
		require.NoError(t, err)
		ids = append(ids, op.ID)
	}
	_, _, err := b.all.Prepare(b.ctx, prepareParams("globex", "o-0", `{}`))
	require.NoError(t, err)
	_, err = b.all.Cancel(b.ctx, store.CancelParams{TenantID: "acme", ID: ids[2], Actor: "test"})
	require.NoError(t, err)

	var seen []uuid.UUID
	var before uuid.NullUUID
	for {
		page, more, err := b.all.List(b.ctx, store.ListParams{TenantID: "acme", Before: before, Limit: 3})
		require.NoError(t, err)
		for _, op := range page {
			require.Equal(t, "acme", op.TenantID)
			seen = append(seen, op.ID)
		}
		if !more {
			break
		}
		before = uuid.NullUUID{UUID: page[len(page)-1].ID, Valid: true}
	}
	require.Len(t, seen, 7)
	for i := range seen {
		require.Equal(t, ids[len(ids)-1-i], seen[i], "newest first")
	}

	cancelled, more, err := b.all.List(b.ctx, store.ListParams{TenantID: "acme", States: []store.State{store.StateCancelled}, Limit: 10})
	require.NoError(t, err)
	require.False(t, more)
	require.Len(t, cancelled, 1)
	require.Equal(t, ids[2], cancelled[0].ID)
}

func TestCancelRules(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{}`))
	require.NoError(t, err)

	cancelled, err := b.all.Cancel(b.ctx, store.CancelParams{TenantID: "acme", ID: op.ID, Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, store.StateCancelled, cancelled.State)
	require.Equal(t, int64(2), cancelled.Revision)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events WHERE revision = 2 AND from_state = 'PREPARED' AND to_state = 'CANCELLED'`))

	again, err := b.all.Cancel(b.ctx, store.CancelParams{TenantID: "acme", ID: op.ID, Actor: "test"})
	require.NoError(t, err, "cancelling twice is idempotent")
	require.Equal(t, cancelled, again)

	_, err = b.all.Cancel(b.ctx, store.CancelParams{TenantID: "globex", ID: op.ID, Actor: "test"})
	require.ErrorIs(t, err, store.ErrNotFound)

	sent, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-2", `{}`))
	require.NoError(t, err)
	forceInFlight(t, b, sent.ID)
	_, err = b.all.Cancel(b.ctx, store.CancelParams{TenantID: "acme", ID: sent.ID, Actor: "test"})
	var stateErr *store.StateError
	require.ErrorAs(t, err, &stateErr)
	require.Equal(t, store.StateInFlight, stateErr.Operation.State)
}

// forceInFlight claims an operation by hand, as the dispatcher would.
func forceInFlight(t *testing.T, b *testBundle, id uuid.UUID) {
	t.Helper()
	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET state = 'IN_FLIGHT', revision = revision + 1,
		fence_token = fence_token + 1, attempt_count = attempt_count + 1, first_sent_at = now(),
		lease_owner = 'test', lease_expires_at = now() + interval '1 minute'
		WHERE operation_id = $1`, id)
	require.NoError(t, err)
}

// TestSchemaRefusesIllegalStates checks the defence in depth: even SQL that bypasses the
// store cannot record an illegal state or transition.
func TestSchemaRefusesIllegalStates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-1", `{}`))
	require.NoError(t, err)
	done, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "order-2", `{}`))
	require.NoError(t, err)
	forceInFlight(t, b, done.ID)
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'SUCCEEDED', revision = revision + 1, remote_ref = 'ch_1',
		lease_owner = NULL, lease_expires_at = NULL WHERE operation_id = $1`, done.ID)
	require.NoError(t, err)

	for name, sql := range map[string]string{
		"succeeded without remote reference": `UPDATE operations SET state = 'SUCCEEDED', revision = revision + 1 WHERE operation_id = $1`,
		"prepared to unknown":                `UPDATE operations SET state = 'UNKNOWN', revision = revision + 1, fence_token = 1, first_sent_at = now() WHERE operation_id = $1`,
		"state change without revision":      `UPDATE operations SET state = 'CANCELLED' WHERE operation_id = $1`,
		"payload replaced":                   `UPDATE operations SET payload = '\x00' WHERE operation_id = $1`,
		"payload purged before terminal":     `UPDATE operations SET payload = NULL WHERE operation_id = $1`,
		"intent changed":                     `UPDATE operations SET intent_ref = 'other' WHERE operation_id = $1`,
		"remote key changed":                 `UPDATE operations SET remote_key = gen_random_uuid() WHERE operation_id = $1`,
		"trace context changed":              `UPDATE operations SET trace_parent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' WHERE operation_id = $1`,
	} {
		_, err := b.pool.Exec(b.ctx, sql, op.ID)
		require.Error(t, err, name)
	}
	// A claim must take a lease (the CHECK), and the next fence with one attempt more
	// (the guard, which refuses before the CHECKs are reached).
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'IN_FLIGHT', revision = revision + 1, fence_token = 1,
		attempt_count = 1, first_sent_at = now() WHERE operation_id = $1`, op.ID)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "in flight without a lease")
	require.Equal(t, "operations_in_flight_leased", pgErr.ConstraintName)
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'IN_FLIGHT', revision = revision + 1, lease_owner = 'x',
		lease_expires_at = now(), first_sent_at = now() WHERE operation_id = $1`, op.ID)
	require.ErrorContains(t, err, "a move into IN_FLIGHT takes the next fence and counts one attempt more", "claimed without a fence")
	for name, sql := range map[string]string{
		"terminal back to prepared": `UPDATE operations SET state = 'PREPARED', revision = revision + 1, remote_ref = NULL WHERE operation_id = $1`,
		"terminal to unknown":       `UPDATE operations SET state = 'UNKNOWN', revision = revision + 1 WHERE operation_id = $1`,
		"fence goes back":           `UPDATE operations SET fence_token = 0 WHERE operation_id = $1`,
		"event rewritten":           `UPDATE operation_events SET actor = 'someone else' WHERE operation_id = $1`,
	} {
		_, err := b.pool.Exec(b.ctx, sql, done.ID)
		require.Error(t, err, name)
	}
	// The state machine itself, alone: a transition it does not list is refused on the
	// operation and in an event.
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET state = 'IN_FLIGHT', revision = revision + 1, fence_token = fence_token + 1,
		lease_owner = 'x', lease_expires_at = now() + interval '1 minute' WHERE operation_id = $1`, done.ID)
	require.ErrorContains(t, err, "transition SUCCEEDED -> IN_FLIGHT is not allowed")
	event := `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor)
		SELECT tenant_id, operation_id, revision + 1, $2, $3, fence_token, 'test' FROM operations WHERE operation_id = $1`
	_, err = b.pool.Exec(b.ctx, event, done.ID, "SUCCEEDED", "IN_FLIGHT")
	require.ErrorContains(t, err, "operation_events_transition")
	_, err = b.pool.Exec(b.ctx, event, op.ID, "PREPARED", "CANCELLED")
	require.NoError(t, err, "a transition it lists")
	unchanged, err := b.all.Get(b.ctx, "acme", op.ID)
	require.NoError(t, err)
	require.Equal(t, op, unchanged)
}

func TestMigrateIsIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			pool := storetest.Pool(t, url)
			errs <- errors.Join(store.Migrate(context.Background(), pool), store.CheckSchema(context.Background(), pool))
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// TestErrorsNameThePackageOnce: an error says "store:" and what was being done once,
// then why, and stays recognisable with errors.Is and errors.As.
func TestErrorsNameThePackageOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.all.Get(b.ctx, "acme", uuid.New())
	require.ErrorIs(t, err, store.ErrNotFound)
	require.Equal(t, "store: get: operation not found", err.Error())

	p := prepareParams("acme", "amends-nothing", `{"amount":1}`)
	p.SupersedesID = uuid.NullUUID{UUID: uuid.New(), Valid: true}
	_, _, err = b.all.Prepare(b.ctx, p)
	require.ErrorIs(t, err, store.ErrSupersededNotFound)
	require.Equal(t, "store: prepare: superseded operation not found", err.Error())

	_, _, err = b.all.Prepare(b.ctx, prepareParams("acme", "once", `{"amount":1}`))
	require.NoError(t, err)
	_, _, err = b.all.Prepare(b.ctx, prepareParams("acme", "once", `{"amount":2}`))
	var mismatch *store.PayloadMismatchError
	require.ErrorAs(t, err, &mismatch)
	require.Equal(t, 1, strings.Count(err.Error(), "store:"), err.Error())

	_, err = b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: "acme", ID: uuid.New(), Fence: 1,
		State: store.StateUnknown, Actor: "test"})
	require.ErrorIs(t, err, store.ErrFenceLost)
	require.Equal(t, "fence lost", err.Error())
}

// TestNotBeforeSchedules: a scheduled operation is not claimed before its time, can be
// cancelled until then, and its time is part of the intent.
func TestNotBeforeSchedules(t *testing.T) {
	t.Parallel()
	b := setup(t)
	later := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	p := prepareParams("acme", "scheduled", `{"amount":1}`)
	p.NotBefore = &later
	op, created, err := b.all.Prepare(b.ctx, p)
	require.NoError(t, err)
	require.True(t, created)
	require.True(t, op.NotBefore.Equal(later))
	require.True(t, op.NextCheckAt.Equal(later), "the next action is at its time")
	claimed, err := b.all.Claim(b.ctx, claimParams(10))
	require.NoError(t, err)
	require.Empty(t, claimed, "not claimed before its time")

	again, created, err := b.all.Prepare(b.ctx, p)
	require.NoError(t, err)
	require.False(t, created)
	require.Equal(t, op.ID, again.ID)
	other := p
	sooner := later.Add(-time.Minute)
	other.NotBefore = &sooner
	_, _, err = b.all.Prepare(b.ctx, other)
	var mismatch *store.PayloadMismatchError
	require.ErrorAs(t, err, &mismatch, "another time is another intent")
	unscheduled := p
	unscheduled.NotBefore = nil
	_, _, err = b.all.Prepare(b.ctx, unscheduled)
	require.ErrorAs(t, err, &mismatch)

	late := prepareParams("acme", "deadline-first", `{"amount":1}`)
	late.NotBefore, late.DispatchDeadline = &later, &sooner
	_, _, err = b.all.Prepare(b.ctx, late)
	require.ErrorContains(t, err, "operations_deadline_after_not_before")

	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET not_before = now() WHERE operation_id = $1`, op.ID)
	require.ErrorContains(t, err, "immutable column changed")
	cancelled, err := b.all.Cancel(b.ctx, store.CancelParams{TenantID: "acme", ID: op.ID, Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, store.StateCancelled, cancelled.State, "cancelled before its time")
	require.Nil(t, cancelled.NextCheckAt, "and nothing is next")

	due := prepareParams("acme", "due", `{"amount":1}`)
	past := time.Now().Add(-time.Second)
	due.NotBefore = &past
	dueOp, _, err := b.all.Prepare(b.ctx, due)
	require.NoError(t, err)
	claimed, err = b.all.Claim(b.ctx, claimParams(10))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	require.Equal(t, dueOp.ID, claimed[0].ID, "claimed once its time has come")
}
