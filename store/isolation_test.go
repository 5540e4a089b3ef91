package store_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
	"github.com/opbroker/opbroker/storetest"
)

// TestRowLevelSecurity: the broker's role sees and writes only the rows of the tenant
// set for the transaction; with none set it sees nothing.
func TestRowLevelSecurity(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	app := storetest.Pool(t, url)
	st := store.New(app)
	ctx := context.Background()
	acme := storetest.PrepareJSON(t, st, "acme", "demo.charge", "a", `{}`)
	globex := storetest.PrepareJSON(t, st, "globex", "demo.charge", "g", `{}`)
	// A stale outcome and a matched event of each tenant, and an event matched to none,
	// written by the administrator (past row-level security).
	admin := storetest.Pool(t, storetest.AdminURL(t, url))
	for _, op := range []store.Operation{acme, globex} {
		insertStaleOutcome(t, admin, op, 1)
		insertEvidence(t, admin, "evt_"+op.TenantID, &op)
	}
	insertEvidence(t, admin, "evt_none", nil)

	var n int
	require.NoError(t, app.QueryRow(ctx, `SELECT count(*) FROM operations`).Scan(&n))
	require.Zero(t, n, "without a tenant set, nothing")
	for _, table := range []string{"operation_events", "operation_keys", "stale_outcomes", "inbound_evidence"} {
		require.NoError(t, app.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
		require.Zero(t, n, table)
	}

	inTenant := func(tenant string, fn func(pgx.Tx) error) error {
		return pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT set_config('opbroker.tenant', $1, true)`, tenant); err != nil {
				return err
			}
			return fn(tx)
		})
	}
	require.NoError(t, inTenant("acme", func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, `SELECT tenant_id FROM operations UNION ALL SELECT tenant_id FROM operation_keys
			UNION ALL SELECT tenant_id FROM stale_outcomes UNION ALL SELECT tenant_id FROM inbound_evidence`)
		tenants, err := pgx.CollectRows(rows, pgx.RowTo[*string])
		for _, tenant := range tenants {
			require.NotNil(t, tenant, "an event matched to no operation is the broker's alone")
			require.Equal(t, "acme", *tenant, "a query without a tenant predicate sees its tenant only")
		}
		require.Len(t, tenants, 4)
		return err
	}))
	storetest.PrepareJSON(t, st, "initech", "demo.charge", "i", `{}`)
	require.NoError(t, inTenant("acme,globex", func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, `SELECT DISTINCT tenant_id FROM operations ORDER BY 1`)
		tenants, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.Equal(t, []string{"acme", "globex"}, tenants, "a list of tenants sees those tenants only")
		return err
	}))
	err := inTenant("acme", func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type, payload, payload_sha256)
			VALUES ('globex', gen_random_uuid(), 'demo.charge', 'smuggled', 'application/json', '{}', sha256('{}'))`)
		return err
	})
	require.ErrorContains(t, err, "row-level security", "nothing is written into another tenant")
	require.NoError(t, app.QueryRow(ctx, `SELECT count(*) FROM operations`).Scan(&n))
	require.Zero(t, n, "the setting ended with its transaction: the pooled session keeps nothing")

	for name, scope := range map[string]store.Scope{"the zero scope": {}, "an empty tenant": st.Tenant(""),
		"a tenant id that is the workers' setting": st.Tenant("*"), "a tenant id naming two": st.Tenant("acme,globex")} {
		_, err = scope.Get(ctx, "acme", acme.ID)
		require.ErrorIs(t, err, store.ErrNoScope, "%s reaches nothing", name)
		_, _, err = scope.Prepare(ctx, prepareParams("acme", "scopeless", `{}`))
		require.ErrorIs(t, err, store.ErrNoScope, "%s writes nothing", name)
	}
	_, err = st.Tenant("globex").Get(ctx, "acme", acme.ID)
	require.ErrorIs(t, err, store.ErrNotFound, "nor does a wrong scope reach another tenant")
}

// TestCheckSchemaRefusesARoleThatBypassesIsolation: the broker does not start as a
// superuser, nor when a table does not force row-level security.
func TestCheckSchemaRefusesARoleThatBypassesIsolation(t *testing.T) {
	t.Parallel()
	url := storetest.Schema(t)
	app, admin := storetest.Pool(t, url), storetest.Pool(t, storetest.AdminURL(t, url))
	ctx := context.Background()
	require.NoError(t, store.CheckSchema(ctx, app))
	require.ErrorContains(t, store.CheckSchema(ctx, admin), "is a superuser or has BYPASSRLS")

	_, err := admin.Exec(ctx, `ALTER TABLE operation_events NO FORCE ROW LEVEL SECURITY`)
	require.NoError(t, err)
	require.ErrorContains(t, store.CheckSchema(ctx, app), "row-level security is not forced on [operation_events]")
	_, err = admin.Exec(ctx, `ALTER TABLE inbound_evidence NO FORCE ROW LEVEL SECURITY`)
	require.NoError(t, err)
	require.ErrorContains(t, store.CheckSchema(ctx, app), "row-level security is not forced on [inbound_evidence operation_events]")
	_, err = admin.Exec(ctx, `ALTER TABLE operation_keys NO FORCE ROW LEVEL SECURITY`)
	require.NoError(t, err)
	require.ErrorContains(t, store.CheckSchema(ctx, app),
		"row-level security is not forced on [inbound_evidence operation_events operation_keys]")
}
