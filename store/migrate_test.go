package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// ledgerDigest is a digest of every row of the ledger's tables, as text, without the
// columns later migrations add: the events' sent (020) and the operations'
// lookup_scope (031).
func ledgerDigest(t *testing.T, b *testBundle) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, table := range []string{"operations", "operation_events", "payload_mismatches"} {
		var digest string
		require.NoError(t, b.pool.QueryRow(b.ctx, fmt.Sprintf(`SELECT count(*) || ':' ||
			coalesce(md5(string_agg((to_jsonb(t) - 'sent' - 'lookup_scope')::text, '|'
				ORDER BY (to_jsonb(t) - 'sent' - 'lookup_scope')::text)), '') FROM %s t`,
			table)).Scan(&digest))
		out[table] = digest
	}
	return out
}

// ledgerAt15 is a ledger in use at version 15, as the broker of then wrote it: each
// operation with its events and attempts, in every state a send leaves.
//
//	acme/a-prepared   PREPARED, never sent (and a payload mismatch refused against it)
//	acme/a-succeeded  SUCCEEDED by its holder's outcome: attempt 1 applied, sent
//	acme/a-never-sent UNKNOWN by its holder's outcome: attempt 1 applied, provably never sent
//	globex/g-swept    UNKNOWN by the sweeper; attempt 1 recorded late by its stale worker
//	globex/g-sending  IN_FLIGHT: attempt 1 unfinished
const ledgerAt15 = `
INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type, payload, payload_sha256,
		state, revision, fence_token, attempt_count, lease_owner, lease_expires_at, remote_ref, first_sent_at, next_check_at)
	VALUES
	('acme', '00000000-0000-0000-0000-000000000001', 'demo.charge', 'a-prepared', 'application/json', '{}', sha256('{}'),
		'PREPARED', 1, 0, 0, NULL, NULL, NULL, NULL, NULL),
	('acme', '00000000-0000-0000-0000-000000000002', 'demo.charge', 'a-succeeded', 'application/json', '{}', sha256('{}'),
		'SUCCEEDED', 3, 1, 1, NULL, NULL, 'ch_1', now() - interval '1 minute', NULL),
	('acme', '00000000-0000-0000-0000-000000000003', 'demo.charge', 'a-never-sent', 'application/json', '{}', sha256('{}'),
		'UNKNOWN', 3, 1, 1, NULL, NULL, NULL, now() - interval '1 minute', now() - interval '1 second'),
	('globex', '00000000-0000-0000-0000-000000000004', 'demo.charge', 'g-swept', 'application/json', '{}', sha256('{}'),
		'UNKNOWN', 3, 1, 1, NULL, NULL, NULL, now() - interval '1 minute', now() - interval '1 second'),
	('globex', '00000000-0000-0000-0000-000000000005', 'demo.charge', 'g-sending', 'application/json', '{}', sha256('{}'),
		'IN_FLIGHT', 2, 1, 1, 'dispatcher:w', now() + interval '1 hour', NULL, now() - interval '1 minute', NULL);
INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token, actor, reason,
		observation, remote_ref, attempt_count)
	SELECT tenant_id, operation_id, 1, NULL::operation_state, 'PREPARED'::operation_state, 0, 'client', NULL, NULL::jsonb, NULL, 0
		FROM operations
	UNION ALL
	SELECT tenant_id, operation_id, 2, 'PREPARED', 'IN_FLIGHT', 1, 'dispatcher:w', NULL, NULL, NULL, 1
		FROM operations WHERE state <> 'PREPARED'
	UNION ALL
	SELECT tenant_id, operation_id, 3, 'IN_FLIGHT', state, 1, v.actor, v.outcome,
		jsonb_build_object('source', 'DISPATCH', 'outcome', v.outcome), remote_ref, 1
		FROM operations JOIN (VALUES ('a-succeeded', 'dispatcher:w', 'VERIFIED_SUCCESS'),
			('a-never-sent', 'dispatcher:w', 'CONNECT_FAILED'), ('g-swept', 'sweeper', 'LEASE_EXPIRED'))
			AS v (intent_ref, actor, outcome) USING (intent_ref);
INSERT INTO operation_attempts (tenant_id, operation_id, fence_token, target, worker, finished_at, outcome,
		http_status, remote_ref, summary, applied, sent)
	SELECT tenant_id, operation_id, 1, 'demo', 'w', v.finished_at, v.outcome, v.http_status, v.remote_ref, v.summary,
		v.applied, v.sent
		FROM operations JOIN (VALUES
			('a-succeeded', now(), 'VERIFIED_SUCCESS', 200, 'ch_1', NULL, true, true),
			('a-never-sent', now(), 'CONNECT_FAILED', NULL, NULL, 'nothing was sent', true, false),
			('g-swept', now(), 'VERIFIED_SUCCESS', 201, 'ch_late', 'created', false, true),
			('g-sending', NULL, NULL, NULL, NULL, NULL, NULL, NULL))
			AS v (intent_ref, finished_at, outcome, http_status, remote_ref, summary, applied, sent) USING (intent_ref);
INSERT INTO payload_mismatches (tenant_id, operation_id, payload_sha256)
	VALUES ('acme', '00000000-0000-0000-0000-000000000001', sha256('{"other":1}'));
`

// A ledger in use at the version before the latest migrations, with operations in
// every state a send leaves, comes through them with its history and keeps its
// guarantees.
func TestMigrationsCarryAPopulatedLedger(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.EmptySchema(t)
	const from = 15 // the version before the migrations that reshaped the ledger for speed
	require.NoError(t, store.MigrateTo(ctx, storetest.Pool(t, url), from))
	b := &testBundle{ctx: ctx, store: store.New(storetest.Pool(t, url)), pool: storetest.Pool(t, storetest.AdminURL(t, url))}
	b.all = b.store.AllTenants()
	_, err := b.pool.Exec(ctx, ledgerAt15)
	require.NoError(t, err)
	before := ledgerDigest(t, b)

	// As docs/operations.md says to on a large ledger: 016's index built beforehand,
	// without holding off writes, by the broker's role.
	app := storetest.Pool(t, url)
	_, err = app.Exec(ctx, `CREATE UNIQUE INDEX CONCURRENTLY operations_intent_key_new
		ON operations (operation_type, intent_ref, tenant_id)`)
	require.NoError(t, err)
	require.NoError(t, store.MigrateTo(ctx, app, 24))
	rows, _ := b.pool.Query(ctx, `SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = 'operations'::regclass
		AND indisunique AND NOT indisprimary`)
	indexes, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"operations_intent_key"}, indexes, "the index built beforehand is the intent key")
	require.NoError(t, store.Migrate(ctx, app))
	require.NoError(t, store.CheckSchema(ctx, app))
	for migration, check := range map[string]string{"018": "operation_events_transition", "021": "operation_events_sent_on_outcomes"} {
		var validated bool
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT convalidated FROM pg_constraint WHERE conname = $1`, check).Scan(&validated))
		require.True(t, validated, "%s validated %s over the events written before it", migration, check)
	}
	require.Equal(t, before, ledgerDigest(t, b), "no operation, event or mismatch changed")

	// 020: what only the attempts held is in the events and stale_outcomes.
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events WHERE sent IS NOT NULL`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM operation_events e JOIN operations o USING (tenant_id, operation_id)
		WHERE o.intent_ref = 'a-never-sent' AND e.from_state = 'IN_FLIGHT' AND NOT e.sent`), "the attempt that never left says so")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM stale_outcomes`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM stale_outcomes WHERE tenant_id = 'globex'
		AND operation_id = '00000000-0000-0000-0000-000000000004' AND fence_token = 1 AND actor = 'dispatcher:w'
		AND outcome = 'VERIFIED_SUCCESS' AND remote_ref = 'ch_late' AND sent
		AND observation @> '{"http_status": 201, "summary": "created", "source": "DISPATCH"}'`), "the stale attempt is a stale outcome")
	// to_regclass looks in this test's schema only: other tests' schemas, migrated to an
	// earlier version at the same time, have the table.
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_class WHERE oid = to_regclass('operation_attempts')`))

	// 025: the keys are in a table of their own, and no longer indexed on operations.
	matching, keys := b.keysMatch(t)
	require.Equal(t, [2]int{5, 5}, [2]int{matching, keys}, "every operation's keys came forward")
	require.Zero(t, b.count(t, `SELECT count(*) FROM pg_index WHERE indrelid = 'operations'::regclass AND NOT indisprimary
		AND (SELECT array_agg(attname::text) FROM pg_attribute WHERE attrelid = indrelid AND attnum = ANY (indkey))
			&& ARRAY['intent_ref', 'remote_key']`), "no index of operations holds a key")

	// The broker of now reads them as the broker of then did.
	unknown, err := b.all.ClaimUnknown(ctx, store.FairClaim{OperationTypes: []string{"demo.charge"}, Worker: "rec",
		Lease: time.Minute, Limit: 10, PerTenant: 10, MaxTenants: 10})
	require.NoError(t, err)
	require.Len(t, unknown, 2)
	for _, u := range unknown {
		require.Equal(t, u.IntentRef == "g-swept", u.MayHaveExecuted, "%s: only the attempt that never left cannot have", u.IntentRef)
	}
	ref, found, err := b.all.StaleSuccess(ctx, "globex", uuid.MustParse("00000000-0000-0000-0000-000000000004"))
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, "ch_late", ref)

	// The intent key still holds, for the tenant and type only.
	again, created, err := b.all.Prepare(ctx, prepareParams("acme", "a-succeeded", `{}`))
	require.NoError(t, err)
	require.False(t, created)
	require.Equal(t, "a-succeeded", again.IntentRef)
	_, err = b.pool.Exec(ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type,
		payload, payload_sha256) SELECT tenant_id, gen_random_uuid(), operation_type, intent_ref, content_type, payload,
		payload_sha256 FROM operations LIMIT 1`)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "a second operation for one intent is refused by the schema")
	require.Equal(t, "23505", pgErr.Code) // unique_violation
	require.Equal(t, "operation_keys_intent", pgErr.ConstraintName)
	_, created, err = b.all.Prepare(ctx, prepareParams("initech", "a-succeeded", `{}`))
	require.NoError(t, err)
	require.True(t, created, "another tenant's intent of the same reference is its own")
}

// TestEveryFunctionSearchesTemporaryTablesLast: every function of the ledger's schema
// names its search path, with pg_temp last, so that no session's temporary table stands
// in for a table it reads (migration 030). A migration that creates a function pins it
// with SET search_path FROM CURRENT, which takes the migrator's path: its connection has
// pg_temp last from its start, so the path stays so after the migrator's RESET ALL
// between migrations.
func TestEveryFunctionSearchesTemporaryTablesLast(t *testing.T) {
	t.Parallel()
	b := setup(t)
	rows, _ := b.pool.Query(b.ctx, `SELECT p.proname::text || ' ' || coalesce(array_to_string(p.proconfig, ' '), '(none)')
		FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = current_schema() AND p.prokind = 'f'
			AND NOT coalesce(p.proconfig @> ARRAY['search_path=' || quote_ident(current_schema()) || ', pg_temp'], false)`)
	unpinned, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Empty(t, unpinned, "functions whose search path does not end with pg_temp")

	var before, during string
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT current_setting('search_path')`).Scan(&before))
	conn, err := store.MigrationConn(b.ctx, b.pool)
	require.NoError(t, err)
	defer conn.Close(b.ctx)
	_, err = conn.Exec(b.ctx, `RESET ALL`) // as the migrator does after each migration
	require.NoError(t, err)
	require.NoError(t, conn.QueryRow(b.ctx, `SELECT current_setting('search_path')`).Scan(&during))
	require.Equal(t, before+", pg_temp", during)
}

// An index built beforehand for migration 016 that is not the intent key it needs is
// refused, not swapped in: the migration stops and says how to build it again.
func TestIntentKeyBuiltBeforehandMustBeTheRightOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.EmptySchema(t)
	app := storetest.Pool(t, url)
	require.NoError(t, store.MigrateTo(ctx, app, 15))
	_, err := app.Exec(ctx, `CREATE UNIQUE INDEX operations_intent_key_new ON operations (tenant_id, intent_ref, operation_type)`)
	require.NoError(t, err)
	require.ErrorContains(t, store.Migrate(ctx, app), "DROP INDEX CONCURRENTLY operations_intent_key_new")
	_, err = app.Exec(ctx, `DROP INDEX operations_intent_key_new`)
	require.NoError(t, err)
	_, err = app.Exec(ctx, `CREATE UNIQUE INDEX operations_intent_key_new ON operations (operation_type, intent_ref, tenant_id)`)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, app))
}
