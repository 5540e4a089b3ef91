package store_test

import (
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// keysMatch counts the operations whose row in operation_keys has their own keys, and
// the rows of operation_keys.
func (b *testBundle) keysMatch(t *testing.T) (matching, keys int) {
	t.Helper()
	return b.count(t, `SELECT count(*) FROM operations JOIN operation_keys
			USING (tenant_id, operation_id, operation_type, intent_ref, remote_key)`),
		b.count(t, `SELECT count(*) FROM operation_keys`)
}

// pgCode returns the SQLSTATE and constraint of err, or "" when it is not PostgreSQL's.
func pgCode(err error) (code, constraint string) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code, pgErr.ConstraintName
	}
	return "", ""
}

// Every operation has exactly its own keys in operation_keys, however it was inserted,
// and the intent key holds there: a second operation for one intent, or one with
// another's remote key, is refused by the schema.
func TestEveryOperationHasItsKeys(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, created, err := b.all.Prepare(b.ctx, prepareParams("acme", "k-1", `{}`))
	require.NoError(t, err)
	require.True(t, created)
	var key string
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT remote_key::text FROM operation_keys
		WHERE tenant_id = 'acme' AND operation_id = $1 AND operation_type = 'demo.charge' AND intent_ref = 'k-1'`, op.ID).Scan(&key))
	require.Equal(t, op.RemoteKey.String(), key, "Prepare writes the keys the operation has")

	// Straight into operations, as an older broker or a hand-written repair would.
	insert := func(intent, remoteKey string) error {
		_, err := b.pool.Exec(b.ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref,
			remote_key, content_type, payload, payload_sha256)
			VALUES ('acme', gen_random_uuid(), 'demo.charge', $1, coalesce(nullif($2, '')::uuid, gen_random_uuid()),
				'application/json', '{}', sha256('{}'))`, intent, remoteKey)
		return err
	}
	require.NoError(t, insert("k-2", ""))
	matching, keys := b.keysMatch(t)
	require.Equal(t, [2]int{2, 2}, [2]int{matching, keys}, "an operation inserted without its keys gets them")

	code, constraint := pgCode(insert("k-1", ""))
	require.Equal(t, [2]string{"23505", "operation_keys_intent"}, [2]string{code, constraint},
		"a second operation for one intent is refused")
	code, constraint = pgCode(insert("k-3", key))
	require.Equal(t, [2]string{"23505", "operation_keys_pkey"}, [2]string{code, constraint},
		"an operation with another's remote key is refused")
	require.Equal(t, 2, b.count(t, `SELECT count(*) FROM operations`), "and nothing of either is written")
}

// The keys never change, and go only with their operation: deleting or truncating
// operations takes them, and then the intent can be recorded again.
func TestKeysGoOnlyWithTheirOperation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	op, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "k-1", `{}`))
	require.NoError(t, err)
	for change, why := range map[string]string{
		`UPDATE operation_keys SET intent_ref = 'other'`:           "its keys never change",
		`UPDATE operation_keys SET remote_key = gen_random_uuid()`: "its keys never change",
		`DELETE FROM operation_keys`:                               "its keys are deleted with it",
		`TRUNCATE operation_keys`:                                  "keys are truncated with operations",
	} {
		_, err := b.pool.Exec(b.ctx, change)
		code, _ := pgCode(err)
		require.Equal(t, "23000", code, "%s: %v", change, err)
		require.ErrorContains(t, err, why, change)
	}
	matching, keys := b.keysMatch(t)
	require.Equal(t, [2]int{1, 1}, [2]int{matching, keys})

	// TRUNCATE ignores row-level security: the broker's own role, with no tenant set,
	// sees no operation and still may not truncate the keys of every tenant's.
	_, err = b.app.Exec(b.ctx, `TRUNCATE operation_keys`)
	code, _ := pgCode(err)
	require.Equal(t, "23000", code, "the broker's role, no tenant set: %v", err)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_keys`))

	b.cancel(t, op)
	deleted, err := b.all.DeleteTenant(b.ctx, "acme")
	require.NoError(t, err)
	require.EqualValues(t, 1, deleted)
	require.Zero(t, b.count(t, `SELECT count(*) FROM operation_keys`), "deleting an operation deletes its keys")
	_, created, err := b.all.Prepare(b.ctx, prepareParams("acme", "k-1", `{}`))
	require.NoError(t, err)
	require.True(t, created, "a deleted operation's intent is free again")

	again, _, err := b.all.Prepare(b.ctx, prepareParams("acme", "k-1", `{}`))
	require.NoError(t, err)
	b.cancel(t, again) // only terminal operations are truncated
	_, err = b.pool.Exec(b.ctx, `TRUNCATE operations CASCADE`)
	require.NoError(t, err)
	require.Zero(t, b.count(t, `SELECT count(*) FROM operation_keys`), "truncating operations truncates their keys")
	_, created, err = b.all.Prepare(b.ctx, prepareParams("acme", "k-1", `{}`))
	require.NoError(t, err)
	require.True(t, created)
}
