package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// An operation written straight into the table in any state, with every column the
// schema's checks ask of some state, so that an update's state is judged by the guard.
const anyStateOperation = `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type,
		payload, payload_sha256, state, revision, fence_token, attempt_count, not_executed, remote_ref, first_sent_at,
		key_window_end, key_scope, lookup_scope, escalation, lease_owner, lease_expires_at)
	VALUES ('acme', gen_random_uuid(), 'demo.charge', $1, 'application/json', '{}', sha256('{}'), $2::operation_state,
		5, 2, 2, 2, 'r', now(), now() + interval '1 day', 'scope', 'lookup', '{"owner": "o", "reason": "r"}',
		CASE WHEN $2::operation_state = 'IN_FLIGHT' THEN 'w' END,
		CASE WHEN $2::operation_state = 'IN_FLIGHT' THEN now() + interval '1 minute' END)
	RETURNING operation_id`

// isGuardRefusal reports whether err is the guard of table naming a broken rule.
func isGuardRefusal(err error, table string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23000" && strings.Contains(pgErr.Where, table+"_guard")
}

// The guard allows exactly the moves of operation_transitions.
func TestGuardFollowsTheTransitions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, m := range b.moves(t) {
		if m.From == m.To {
			continue // no change of state: the guard's transition rule does not apply
		}
		var id string
		require.NoError(t, b.pool.QueryRow(b.ctx, anyStateOperation, m.From+"-"+m.To, m.From).Scan(&id))
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET state = $2::operation_state, revision = revision + 1,
				fence_token = fence_token + CASE WHEN $2::operation_state = 'IN_FLIGHT' THEN 1 ELSE 0 END,
				attempt_count = attempt_count + CASE WHEN $2::operation_state = 'IN_FLIGHT' THEN 1 ELSE 0 END,
				lease_owner = CASE WHEN $2::operation_state = 'IN_FLIGHT' THEN 'w' END,
				lease_expires_at = CASE WHEN $2::operation_state = 'IN_FLIGHT' THEN now() + interval '1 minute' END
			WHERE operation_id = $1`, id, m.To)
		if m.Allowed {
			require.NoError(t, err, "%s -> %s", m.From, m.To)
		} else {
			require.True(t, isGuardRefusal(err, "operations"), "%s -> %s is not a transition: %v", m.From, m.To, err)
		}
	}
}

// Every other rule of the guards: what never changes, what never decreases, what is
// fixed once set, a payload only purged, a change of state that bumps the revision by
// one, a not-executed count that rises by one as an attempt ends and at no other time,
// a move into IN_FLIGHT with the next fence and one attempt more; and an attempt never
// changes once finished, nor its identity.
func TestGuardRefusesEachChange(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i, set := range []string{
		"tenant_id = 'other'", "operation_id = gen_random_uuid()", "operation_type = 'other'", "intent_ref = 'other'",
		"content_type = 'text/plain'", "payload_sha256 = sha256('other')", "remote_key = gen_random_uuid()",
		"created_at = created_at - interval '1 second'", "supersedes_id = gen_random_uuid()",
		"dispatch_deadline = now() + interval '1 hour'", "not_before = now() - interval '1 hour'",
		"trace_parent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'", `labels = '{"a": "b"}'`,
		"first_sent_at = first_sent_at + interval '1 second'", "key_window_end = key_window_end + interval '1 second'",
		"key_scope = 'other'", "payload = 'other'", "fence_token = fence_token - 1", "revision = revision - 1",
		"attempt_count = attempt_count - 1", "not_executed = not_executed - 1",
		"state = 'ESCALATED'", "state = 'ESCALATED', revision = revision + 2",
		"first_sent_at = NULL", "key_window_end = NULL", "key_scope = NULL", "lookup_scope = 'other'", "lookup_scope = NULL",
		// A move into IN_FLIGHT takes the next fence and counts one attempt more.
		"state = 'IN_FLIGHT', revision = revision + 1, fence_token = fence_token + 2, attempt_count = attempt_count + 1",
		"state = 'IN_FLIGHT', revision = revision + 1, fence_token = fence_token + 1",
	} {
		var id string
		require.NoError(t, b.pool.QueryRow(b.ctx, anyStateOperation, fmt.Sprintf("rule-%d", i), "UNKNOWN").Scan(&id))
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET `+set+` WHERE operation_id = $1`, id)
		require.True(t, isGuardRefusal(err, "operations"), "%s: %v", set, err)
	}
	// The not-executed count rises by one at most, as an attempt ends: an attempt that
	// may have executed cannot be counted away, to send the operation as new from
	// PREPARED (which operations_unsent would then allow). Two attempts, neither of
	// them answered as not executed:
	mayHaveExecuted := strings.Replace(anyStateOperation, "5, 2, 2, 2, 'r'", "5, 2, 2, 0, 'r'", 1)
	require.NotEqual(t, anyStateOperation, mayHaveExecuted)
	for i, change := range []struct{ from, set string }{
		{"UNKNOWN", "not_executed = not_executed + 1"},
		{"IN_FLIGHT", "state = 'PREPARED', revision = revision + 1, not_executed = not_executed + 2, lease_owner = NULL, lease_expires_at = NULL"},
		{"IN_FLIGHT", "state = 'UNKNOWN', revision = revision + 1, not_executed = not_executed + 2, lease_owner = NULL, lease_expires_at = NULL"},
	} {
		var id string
		require.NoError(t, b.pool.QueryRow(b.ctx, mayHaveExecuted, fmt.Sprintf("counted-%d", i), change.from).Scan(&id))
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET `+change.set+` WHERE operation_id = $1`, id)
		require.True(t, isGuardRefusal(err, "operations"), "%s: %v", change.set, err)
	}
	// Set at creation, never cleared; a purged payload never comes back.
	var first string
	require.NoError(t, b.pool.QueryRow(b.ctx, anyStateOperation, "superseded", "UNKNOWN").Scan(&first))
	for i, set := range []string{"dispatch_deadline = NULL", "not_before = NULL", "supersedes_id = NULL", "payload = '{}'"} {
		var id string
		require.NoError(t, b.pool.QueryRow(b.ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref,
				content_type, payload_sha256, state, revision, fence_token, attempt_count, remote_ref, first_sent_at,
				dispatch_deadline, not_before, supersedes_id)
			VALUES ('acme', gen_random_uuid(), 'demo.charge', $1, 'application/json', sha256('{}'), 'SUCCEEDED', 3, 1, 1,
				'r', now(), now() + interval '1 hour', now() - interval '1 hour', $2)
			RETURNING operation_id`, fmt.Sprintf("set-%d", i), first).Scan(&id))
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET `+set+` WHERE operation_id = $1`, id)
		require.True(t, isGuardRefusal(err, "operations"), "%s: %v", set, err)
	}
	var id string
	require.NoError(t, b.pool.QueryRow(b.ctx, anyStateOperation, "allowed", "UNKNOWN").Scan(&id))
	_, err := b.pool.Exec(b.ctx, `UPDATE operations SET checks = checks + 1, fence_token = fence_token + 1,
		revision = revision + 1, state = 'ESCALATED', payload = NULL WHERE operation_id = $1`, id)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "a payload is purged only after a terminal state (its own check)")
	require.Equal(t, "operations_payload_kept_until_terminal", pgErr.ConstraintName)
	_, err = b.pool.Exec(b.ctx, `UPDATE operations SET checks = checks + 1, fence_token = fence_token + 1,
		revision = revision + 1, state = 'ESCALATED' WHERE operation_id = $1`, id)
	require.NoError(t, err, "what the rules allow")

	// The history is never rewritten: neither events nor stale outcomes.
	_, err = b.pool.Exec(b.ctx, `INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, outcome, observation, sent)
		VALUES ('acme', $1, 3, 'w', 'TIMEOUT', '{}', true)`, id)
	require.NoError(t, err)
	_, err = b.pool.Exec(b.ctx, `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state,
		fence_token, actor) VALUES ('acme', $1, 80, 'UNKNOWN', 'UNKNOWN', 3, 'w')`, id)
	require.NoError(t, err)
	for table, set := range map[string]string{"operation_events": "reason = 'rewritten'", "stale_outcomes": "outcome = 'rewritten'"} {
		_, err := b.pool.Exec(b.ctx, `UPDATE `+table+` SET `+set+` WHERE operation_id = $1`, id)
		require.ErrorContains(t, err, table+" is append-only")
	}
	// Only the outcome of a send says whether its request left.
	_, err = b.pool.Exec(b.ctx, `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state,
		fence_token, actor, sent) VALUES ('acme', $1, 90, 'UNKNOWN', 'UNKNOWN', 3, 'w', false)`, id)
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "operation_events_sent_on_outcomes", pgErr.ConstraintName)
}

// The formats of a tenant id and a trace context are checked when an operation is
// inserted, with the error a CHECK gives; neither column changes afterwards.
func TestFormatsAreCheckedOnInsert(t *testing.T) {
	t.Parallel()
	b := setup(t)
	insert := func(tenant string, traceParent *string) error {
		_, err := b.pool.Exec(b.ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref,
			content_type, payload, payload_sha256, trace_parent)
			VALUES ($1, gen_random_uuid(), 'demo.charge', gen_random_uuid()::text, 'application/json', '{}', sha256('{}'), $2)`,
			tenant, traceParent)
		return err
	}
	good := "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01"
	for _, tenant := range []string{"a", "acme", "acme-2", "a" + strings.Repeat("b", 62)} {
		require.NoError(t, insert(tenant, nil), tenant)
		require.NoError(t, insert(tenant, &good), tenant)
	}
	for tenant, traceParent := range map[string]string{
		"Acme": "", "acme,globex": "", "-acme": "", "acme-": "", "2acme": "", "a" + strings.Repeat("b", 63): "",
		"acme ": "", "acme\n": "",
		"acme": "00-0123456789abcdef0123456789abcdef-0123456789abcdef", // the trace context's, below
		"Bad":  "not a trace context",                                  // both: the tenant's is named
	} {
		constraint := "operations_tenant_id_format"
		var tp *string
		if traceParent != "" {
			tp = &traceParent
			if tenant == "acme" {
				constraint = "operations_trace_parent_format"
			}
		}
		var pgErr *pgconn.PgError
		require.ErrorAs(t, insert(tenant, tp), &pgErr, "%q %v", tenant, tp)
		require.Equal(t, "23514", pgErr.Code) // check_violation
		require.Equal(t, constraint, pgErr.ConstraintName)
		require.Contains(t, pgErr.Message, constraint)
	}
	var id string
	require.NoError(t, b.pool.QueryRow(b.ctx, anyStateOperation, "formats", "PREPARED").Scan(&id))
	for _, set := range []string{"tenant_id = 'Bad,tenant'", "trace_parent = 'not one'"} {
		_, err := b.pool.Exec(b.ctx, `UPDATE operations SET `+set+` WHERE operation_id = $1`, id)
		require.True(t, isGuardRefusal(err, "operations"), "%s: %v", set, err)
	}
}

// The guards' functions run only to name a broken rule: claims, outcomes and lease
// extensions, every update of the hot paths, never call them. (A WHEN condition that
// fired on them would keep every rule but lose what 019 gained.)
func TestGuardFunctionsRunOnlyOnRefusals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.Schema(t)
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["track_functions"] = "pl"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	all := store.New(pool).AllTenants()
	admin := storetest.Pool(t, storetest.AdminURL(t, url))

	b := &testBundle{ctx: ctx, all: all, pool: admin}
	b.prepareN(t, "acme", 4)
	claimed, err := all.Claim(ctx, claimParams(4))
	require.NoError(t, err)
	held := []store.HeldLease{{OperationKey: store.OperationKey{TenantID: "acme", ID: claimed[3].ID}, Fence: claimed[3].FenceToken}}
	_, err = all.ExtendLeases(ctx, held, time.Minute)
	require.NoError(t, err)
	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS"}
	for i, c := range claimed[:3] {
		p := store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateSucceeded,
			RemoteRef: "ch", Observation: obs, Actor: "dispatcher:test"}
		if i == 1 {
			p.State, p.RemoteRef = store.StateUnknown, ""
		}
		_, err := all.RecordOutcome(ctx, p)
		require.NoError(t, err)
	}
	pool.Close() // the backends' statistics are flushed when they end
	calls := func(function string) int64 {
		var n int64
		require.NoError(t, admin.QueryRow(ctx, `SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions
			WHERE schemaname = current_schema() AND funcname = $1`, function).Scan(&n))
		return n
	}
	// The check that events have their operations ran for every statement that wrote
	// events: function calls are counted, so the zeros below can tell.
	require.Eventually(t, func() bool { return calls("history_has_operations") > 0 }, 5*time.Second, 20*time.Millisecond)
	require.Zero(t, calls("operations_guard"), "the hot paths' updates never called the operations' guard")
	require.Zero(t, calls("operations_formats"), "the intents' inserts never called the formats' check")
}
