package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

// move is a pair of states and whether operation_transitions allows it.
type move struct {
	From, To string
	Allowed  bool
}

// moves returns every pair of states, each with whether operation_transitions allows it.
func (b *testBundle) moves(t *testing.T) []move {
	t.Helper()
	rows, _ := b.pool.Query(b.ctx, `SELECT f::text, t::text,
			EXISTS (SELECT 1 FROM operation_transitions WHERE from_state = f AND to_state = t)
		FROM unnest(enum_range(NULL::operation_state)) f, unnest(enum_range(NULL::operation_state)) t`)
	moves, err := pgx.CollectRows(rows, pgx.RowToStructByPos[move])
	require.NoError(t, err)
	return moves
}

// Every event is an allowed move: the events' CHECK accepts exactly the pairs of
// operation_transitions, which the operations' guard follows.
func TestEventsFollowTheTransitions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := b.prepareN(t, "acme", 1)[0]
	moves := b.moves(t)
	require.Len(t, moves, 49)
	for i, m := range moves {
		_, err := b.pool.Exec(b.ctx, `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state,
				fence_token, actor) VALUES ('acme', $1, $2, $3, $4, 0, 'test')`, op, 100+i, m.From, m.To)
		if m.Allowed {
			require.NoError(t, err, "%s -> %s", m.From, m.To)
			continue
		}
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, "%s -> %s is not a transition", m.From, m.To)
		require.Equal(t, "23514", pgErr.Code, "%s -> %s", m.From, m.To) // check_violation
		require.Equal(t, "operation_events_transition", pgErr.ConstraintName)
	}
}

// TestHistoryGoesOnlyWithItsOperations: an operation's events and stale outcomes, and
// the targets' events matched to it, are never deleted or truncated by a statement of
// their own (as the broker's role, whose TRUNCATE row-level security does not bind, or
// as the administrator): only deleting or truncating operations takes them
// (TestHistoryBelongsToOperations, TestDeleteTenant). A target's event matched to no
// operation may still be deleted by hand.
func TestHistoryGoesOnlyWithItsOperations(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op := store.Operation{TenantID: "acme", ID: b.prepareN(t, "acme", 1)[0]}
	insertStaleOutcome(t, b.pool, op, 1)
	insertEvidence(t, b.pool, "evt_kept", &op)
	insertEvidence(t, b.pool, "evt_unmatched", nil)
	for _, table := range []string{"operation_events", "stale_outcomes", "inbound_evidence"} {
		for _, db := range []*pgxpool.Pool{b.pool, b.app} {
			for _, statement := range []string{"DELETE FROM " + table, "TRUNCATE " + table} {
				// The broker's role sees the tenant's rows, as the store sets it.
				err := b.execAs(db, "acme", statement)
				code, _ := pgCode(err)
				require.Equal(t, "23000", code, "%s: %v", statement, err)
				require.ErrorContains(t, err, table+": deleted with its operations, never on its own")
			}
		}
		require.Positive(t, b.count(t, `SELECT count(*) FROM `+table), table)
	}
	tag, err := b.pool.Exec(b.ctx, `DELETE FROM inbound_evidence WHERE operation_id IS NULL`)
	require.NoError(t, err, "an unmatched event, by hand")
	require.EqualValues(t, 1, tag.RowsAffected())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM inbound_evidence`), "the matched one is kept")
}

// Every event and attempt belongs to an operation, and an operation's deletion takes its
// history with it.
func TestHistoryBelongsToOperations(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.prepareN(t, "acme", 2)
	claimed, err := b.all.Claim(b.ctx, claimParams(2))
	require.NoError(t, err)
	isForeignKeyViolation := func(err error) bool {
		var pgErr *pgconn.PgError
		return errors.As(err, &pgErr) && pgErr.Code == "23503"
	}

	stranger := uuid.New()
	for what, sql := range map[string]string{
		"an event": `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor)
			VALUES ('acme', $1, 9, 'PREPARED', 'IN_FLIGHT', 1, 'test'), ('acme', $2, 9, 'PREPARED', 'IN_FLIGHT', 1, 'test')`,
		"a stale outcome": `INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, outcome, observation, sent)
			VALUES ('acme', $1, 9, 'test', 'TIMEOUT', '{}', true), ('acme', $2, 9, 'test', 'TIMEOUT', '{}', true)`,
	} {
		_, err := b.pool.Exec(b.ctx, sql, ids[0], stranger)
		require.True(t, isForeignKeyViolation(err), "%s of an operation that does not exist: %v", what, err)
		_, err = b.pool.Exec(b.ctx, sql, ids[0], ids[1])
		require.NoError(t, err, what)
	}

	// Only a terminal operation is deleted (TestOnlyTerminalOperationsAreDeleted).
	for _, c := range claimed {
		b.reject(t, c)
	}
	_, err = b.pool.Exec(b.ctx, `DELETE FROM operations WHERE operation_id = $1`, ids[0])
	require.NoError(t, err)
	for _, table := range []string{"operation_events", "stale_outcomes"} {
		require.Zero(t, b.count(t, fmt.Sprintf(`SELECT count(*) FROM %s WHERE operation_id = $1`, table), ids[0]), table)
		require.Positive(t, b.count(t, fmt.Sprintf(`SELECT count(*) FROM %s WHERE operation_id = $1`, table), ids[1]), table)
	}

	// An event written while its operation is being deleted: the deletion waits for the
	// event's transaction, or the event sees the deletion and is refused.
	deletion, err := b.pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = deletion.Rollback(b.ctx) }()
	_, err = deletion.Exec(b.ctx, `DELETE FROM operations WHERE operation_id = $1`, ids[1])
	require.NoError(t, err)
	written := make(chan error, 1)
	go func() {
		_, err := b.pool.Exec(b.ctx, `INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state,
			fence_token, actor) VALUES ('acme', $1, 10, 'IN_FLIGHT', 'UNKNOWN', 1, 'test')`, ids[1])
		written <- err
	}()
	b.waitedOn(t, deletion) // the event waits for the deletion's row lock
	require.NoError(t, deletion.Commit(b.ctx))
	require.True(t, isForeignKeyViolation(<-written), "an event of an operation deleted meanwhile")
	require.Zero(t, b.count(t, `SELECT count(*) FROM operation_events WHERE operation_id = $1`, ids[1]))

	// Truncating operations truncates the history, and the targets' events.
	beta := store.Operation{TenantID: "beta", ID: b.prepareN(t, "beta", 1)[0]}
	insertStaleOutcome(t, b.pool, beta, 1)
	insertEvidence(t, b.pool, "evt_beta", &beta)
	b.cancel(t, beta)
	_, err = b.pool.Exec(b.ctx, `TRUNCATE operations CASCADE`)
	require.NoError(t, err)
	for _, table := range []string{"operation_events", "stale_outcomes", "inbound_evidence"} {
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+table), table)
	}
}

// reject records the claimed send as rejected: FAILED_TERMINAL.
func (b *testBundle) reject(t *testing.T, c store.Claimed) {
	t.Helper()
	_, err := b.all.RecordOutcome(b.ctx, store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken,
		State: store.StateFailedTerminal, Observation: store.Observation{Outcome: "DOCUMENTED_REJECTION"}, Actor: "test"})
	require.NoError(t, err)
}

// execAs runs statement on db in a transaction whose tenant scope is tenant, as the
// store sets it.
func (b *testBundle) execAs(db interface {
	Begin(context.Context) (pgx.Tx, error)
}, tenant, statement string, args ...any) error {
	return pgx.BeginFunc(b.ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(b.ctx, `SELECT set_config('opbroker.tenant', $1, true)`, tenant); err != nil {
			return err
		}
		_, err := tx.Exec(b.ctx, statement, args...)
		return err
	})
}

// TestOnlyTerminalOperationsAreDeleted: an operation that is not terminal is never
// deleted, nor are operations truncated while any tenant has one, by any role: its
// history and keys would go with it, and its intent (acknowledged, or sent and not
// resolved) could be recorded and sent again. TRUNCATE ignores row-level security, so a
// session that sees only a tenant whose operations are all terminal is refused too.
func TestOnlyTerminalOperationsAreDeleted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	prepared := b.prepareN(t, "acme", 2)
	claimed, err := b.all.Claim(b.ctx, claimParams(1))
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	done := store.Operation{TenantID: "beta", ID: b.prepareN(t, "beta", 1)[0]}
	b.cancel(t, done)

	for _, db := range []*pgxpool.Pool{b.pool, b.app} {
		for _, id := range prepared { // one PREPARED, one IN_FLIGHT
			err := b.execAs(db, "acme", `DELETE FROM operations WHERE operation_id = $1`, id)
			code, _ := pgCode(err)
			require.Equal(t, "23000", code, "%v", err)
			require.ErrorContains(t, err, "is not terminal; an operation is deleted only once")
		}
		for _, tenant := range []string{"acme", "beta"} {
			err := b.execAs(db, tenant, `TRUNCATE operations CASCADE`)
			code, _ := pgCode(err)
			require.Equal(t, "23000", code, "as %s: %v", tenant, err)
			require.ErrorContains(t, err, "operations are truncated only once every one is")
		}
	}
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM operations`))
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM operation_keys`))

	require.NoError(t, b.execAs(b.app, "beta", `DELETE FROM operations WHERE operation_id = $1`, done.ID), "a terminal one")
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM operations`))

	// Once every operation is terminal they are truncated, and the check leaves the
	// caller's tenant scope as it found it.
	b.reject(t, claimed[0])
	for _, id := range prepared {
		if id != claimed[0].ID {
			b.cancel(t, store.Operation{TenantID: "acme", ID: id})
		}
	}
	var scope string
	require.NoError(t, pgx.BeginFunc(b.ctx, b.app, func(tx pgx.Tx) error {
		if _, err := tx.Exec(b.ctx, `SELECT set_config('opbroker.tenant', 'beta', true)`); err != nil {
			return err
		}
		if _, err := tx.Exec(b.ctx, `TRUNCATE operations CASCADE`); err != nil {
			return err
		}
		return tx.QueryRow(b.ctx, `SELECT current_setting('opbroker.tenant')`).Scan(&scope)
	}))
	require.Equal(t, "beta", scope, "the truncation's check gave the caller every tenant's scope")
	require.Zero(t, b.count(t, `SELECT count(*) FROM operations`))
}

// TestTemporaryTablesDoNotShadowTheLedger: a session of the broker's role may create
// temporary tables, which PostgreSQL searches before any schema unless the search path
// names pg_temp. None can stand in for a table the ledger's guards read: a temporary
// operation_transitions does not let a CANCELLED operation back to PREPARED, and an
// empty temporary operations lets neither the keys of an operation be deleted nor the
// operations be truncated while one is open.
func TestTemporaryTablesDoNotShadowTheLedger(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ids := b.prepareN(t, "acme", 2)
	cancelled := store.Operation{TenantID: "acme", ID: ids[0]}
	b.cancel(t, cancelled)
	conn, err := b.app.Acquire(b.ctx)
	require.NoError(t, err)
	defer conn.Release()
	var schema string
	require.NoError(t, conn.QueryRow(b.ctx, `SELECT current_schema()`).Scan(&schema))
	ledger := func(table string) string { return pgx.Identifier{schema, table}.Sanitize() }
	for _, statement := range []string{
		`CREATE TEMP TABLE operation_transitions (from_state text, to_state text)`,
		`INSERT INTO operation_transitions VALUES ('CANCELLED', 'PREPARED')`,
		`CREATE TEMP TABLE operations (tenant_id text, operation_id uuid, state text)`,
	} {
		_, err := conn.Exec(b.ctx, statement)
		require.NoError(t, err, statement)
	}
	for statement, why := range map[string]string{
		`UPDATE ` + ledger("operations") + ` SET state = 'PREPARED', revision = revision + 1 WHERE operation_id = '` + ids[0].String() + `'`: "transition CANCELLED -> PREPARED is not allowed",
		`DELETE FROM ` + ledger("operation_keys"):       "its keys are deleted with it",
		`TRUNCATE ` + ledger("operations") + ` CASCADE`: "operations are truncated only once every one is",
	} {
		err := b.execAs(conn, "acme", statement)
		code, _ := pgCode(err)
		require.Equal(t, "23000", code, "%s: %v", statement, err)
		require.ErrorContains(t, err, why)
	}
	got, err := b.all.Get(b.ctx, "acme", cancelled.ID)
	require.NoError(t, err)
	require.Equal(t, store.StateCancelled, got.State)
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM operation_keys`))
}
