package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// ledgerDigest is a digest of every row of the ledger's tables, as text.
func ledgerDigest(t *testing.T, b *testBundle) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, table := range []string{"operations", "operation_events", "operation_attempts", "payload_mismatches"} {
		var digest string
		require.NoError(t, b.pool.QueryRow(b.ctx, fmt.Sprintf(
			`SELECT count(*) || ':' || coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '') FROM %s t`, table)).Scan(&digest))
		out[table] = digest
	}
	return out
}

// A ledger in use at the version before the latest migrations, with operations in
// every state a send leaves, comes through them unchanged and keeps its guarantees.
func TestMigrationsCarryAPopulatedLedger(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := storetest.EmptySchema(t)
	const from = 15 // the version before this change's migrations
	require.NoError(t, store.MigrateTo(ctx, storetest.Pool(t, url), from))
	b := &testBundle{ctx: ctx, store: store.New(storetest.Pool(t, url)), pool: storetest.Pool(t, storetest.AdminURL(t, url))}
	b.all = b.store.AllTenants()

	for _, tenant := range []string{"acme", "globex"} {
		b.prepareN(t, tenant, 6)
	}
	claimed, err := b.all.Claim(ctx, claimParams(8))
	require.NoError(t, err)
	obs := store.Observation{ObservedAt: time.Now(), Source: "DISPATCH", Outcome: "VERIFIED_SUCCESS", HTTPStatus: 200}
	for i, c := range claimed[:6] {
		p := store.OutcomeParams{TenantID: c.TenantID, ID: c.ID, Fence: c.FenceToken, State: store.StateSucceeded,
			RemoteRef: fmt.Sprintf("ch_%d", i), Observation: obs, Actor: "dispatcher:test"}
		if i%2 == 1 {
			p.State, p.RemoteRef = store.StateUnknown, ""
		}
		_, err := b.all.RecordOutcome(ctx, p)
		require.NoError(t, err)
	}
	mismatch := prepareParams("acme", "acme-0", `{"n":"other"}`)
	_, _, err = b.all.Prepare(ctx, mismatch)
	var mismatchErr *store.PayloadMismatchError
	require.ErrorAs(t, err, &mismatchErr)
	before := ledgerDigest(t, b)

	// As docs/operations.md says to on a large ledger: 016's index built beforehand,
	// without holding off writes, by the broker's role.
	app := storetest.Pool(t, url)
	_, err = app.Exec(ctx, `CREATE UNIQUE INDEX CONCURRENTLY operations_intent_key_new
		ON operations (operation_type, intent_ref, tenant_id)`)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, app))
	require.NoError(t, store.CheckSchema(ctx, app))
	rows, _ := b.pool.Query(ctx, `SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = 'operations'::regclass
		AND indisunique AND NOT indisprimary`)
	indexes, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"operations_intent_key"}, indexes, "the index built beforehand is the intent key")
	var validated bool
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT convalidated FROM pg_constraint
		WHERE conname = 'operation_events_transition'`).Scan(&validated))
	require.True(t, validated, "018 validated the events written before 017")
	require.Equal(t, before, ledgerDigest(t, b), "no row changed")

	// The intent key still holds, for the tenant and type only.
	again, created, err := b.all.Prepare(ctx, prepareParams("acme", "acme-1", `{"n":1}`))
	require.NoError(t, err)
	require.False(t, created)
	require.Equal(t, "acme-1", again.IntentRef)
	_, err = b.pool.Exec(ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type,
		payload, payload_sha256) SELECT tenant_id, gen_random_uuid(), operation_type, intent_ref, content_type, payload,
		payload_sha256 FROM operations LIMIT 1`)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "a second operation for one intent is refused by the schema")
	require.Equal(t, "23505", pgErr.Code) // unique_violation
	require.Equal(t, "operations_intent_key", pgErr.ConstraintName)
	_, created, err = b.all.Prepare(ctx, prepareParams("initech", "acme-1", `{"n":1}`))
	require.NoError(t, err)
	require.True(t, created, "another tenant's intent of the same reference is its own")
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
