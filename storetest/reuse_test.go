package storetest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

func TestMain(m *testing.M) { Main(m) }

// schemaOf returns the schema a connection string of Schema selects.
func schemaOf(t *testing.T, conn string) string {
	t.Helper()
	u, err := url.Parse(conn)
	require.NoError(t, err)
	return u.Query().Get("search_path")
}

func exists(t *testing.T, schema string) bool {
	t.Helper()
	var found bool
	require.NoError(t, Pool(t, URL(t)).QueryRow(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&found))
	return found
}

// use runs a test body on a schema of Schema, as its own subtest, and returns the
// schema's name once the subtest and its cleanup are over.
func use(t *testing.T, name string, body func(t *testing.T, conn string)) string {
	t.Helper()
	var schema string
	t.Run(name, func(t *testing.T) {
		conn := Schema(t)
		schema = schemaOf(t, conn)
		body(t, conn)
	})
	return schema
}

// schemaStatistics counts the statistics of the current schema's tables.
const schemaStatistics = `(SELECT count(*) FROM pg_statistic
	WHERE starelid IN (SELECT oid FROM pg_class WHERE relnamespace = current_schema()::regnamespace))`

// These tests do not run in parallel: each expects the schema the previous one left.

func TestAResetSchemaIsAFreshOne(t *testing.T) {
	ctx := context.Background()
	var transitions int
	first := use(t, "writes", func(t *testing.T, conn string) {
		st := store.New(Pool(t, conn))
		admin := Pool(t, AdminURL(t, conn))
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM operation_transitions`).Scan(&transitions))
		require.Positive(t, transitions, "the migrations' own rows")
		for _, intent := range []string{"a", "b", "c"} {
			PrepareJSON(t, st, "t1", "charge", intent, `{}`)
		}
		// The schema's tables by name: a bare ANALYZE takes every table of the database,
		// other tests' schemas too, and deadlocks with their resets.
		_, err := admin.Exec(ctx, `DELETE FROM operation_transitions WHERE to_state = 'CANCELLED';
			ANALYZE operations, operation_events, operation_keys, operation_transitions`)
		require.NoError(t, err)
		var stats int
		require.NoError(t, admin.QueryRow(ctx, `SELECT `+schemaStatistics).Scan(&stats))
		require.Positive(t, stats, "statistics for the reset to clear")
	})
	second := use(t, "reads", func(t *testing.T, conn string) {
		admin := Pool(t, AdminURL(t, conn))
		var operations, events, keys, stats, have int
		require.NoError(t, admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM operations), (SELECT count(*) FROM operation_events),
			(SELECT count(*) FROM operation_keys), (SELECT count(*) FROM operation_transitions),
			`+schemaStatistics).
			Scan(&operations, &events, &keys, &have, &stats))
		require.Zero(t, operations+events+keys, "the last test's rows are gone")
		require.Equal(t, transitions, have, "the migrations' rows are back")
		require.Zero(t, stats, "no statistics, as after the migrations")
		var inserted, modified int
		require.NoError(t, admin.QueryRow(ctx, `SELECT n_tup_ins, n_mod_since_analyze FROM pg_stat_user_tables
			WHERE relid = 'operations'::regclass`).Scan(&inserted, &modified))
		require.Zero(t, inserted+modified, "no activity counted, as after the migrations")
		st := store.New(Pool(t, conn))
		op := PrepareJSON(t, st, "t1", "charge", "a", `{}`)
		require.EqualValues(t, 1, op.Revision, "an intent of the last test's is new here")
		var seq int64
		require.NoError(t, admin.QueryRow(ctx, `SELECT max(seq) FROM operation_events`).Scan(&seq))
		require.EqualValues(t, 1, seq, "the events' sequence starts again")
	})
	require.Equal(t, first, second, "the schema was handed on")
}

// changes are what a test could do to its schema beyond its rows: each must keep the
// schema from being handed on.
var changes = []string{
	`ALTER TABLE operations DISABLE TRIGGER operations_guard`,
	`ALTER TABLE operations DISABLE TRIGGER ALL`,
	`DROP TRIGGER operation_events_append_only ON operation_events`,
	`ALTER FUNCTION operations_formats() STABLE`,
	`ALTER FUNCTION operations_formats() COST 1000`,
	`ALTER TABLE operations DROP CONSTRAINT operations_sent`,
	`CREATE INDEX ON operations (updated_at)`,
	`DROP INDEX operations_lease_idx`,
	`ALTER TABLE operations ALTER COLUMN labels SET DEFAULT '{"x": 1}'`,
	`ALTER TABLE operations ALTER COLUMN labels SET STATISTICS 5`,
	`ALTER TABLE operations ALTER COLUMN labels SET STORAGE MAIN`,
	`ALTER TABLE operation_keys ALTER COLUMN intent_ref TYPE text COLLATE "C"`,
	`ALTER TABLE operations SET (fillfactor = 50)`,
	`ALTER TABLE operations SET (toast.autovacuum_enabled = false)`,
	`ALTER TABLE operations NO FORCE ROW LEVEL SECURITY`,
	`DROP POLICY tenant_isolation ON operations`,
	`GRANT SELECT ON operations TO PUBLIC`,
	`ALTER SEQUENCE operation_events_seq_seq CACHE 10`,
	`CREATE TABLE scratch (x int)`,
	`CREATE COLLATION scratch (provider = icu, locale = 'und', deterministic = false)`,
	`ALTER TYPE operation_state ADD VALUE 'PAUSED'`,
	`CREATE STATISTICS operations_pair ON tenant_id, operation_type FROM operations`,
	`COMMENT ON TABLE operations IS 'changed'`,
	`CREATE PUBLICATION scratch FOR TABLE payload_mismatches`,
}

// Each change, made in a transaction that is then rolled back, changes the fingerprint
// (one schema for all: DDL is transactional).
func TestTheFingerprintSeesEachChange(t *testing.T) {
	use(t, "changes", func(t *testing.T, conn string) {
		ctx := context.Background()
		schema := schemaOf(t, conn)
		admin, err := adminPool(ctx, URL(t))
		require.NoError(t, err)
		fresh := func(change string) bool {
			var same bool
			errRollback := errors.New("rolled back")
			err := inSchema(ctx, admin, schema, func(tx pgx.Tx) error {
				if change != "" {
					if _, err := tx.Exec(ctx, change); err != nil {
						return err
					}
				}
				got, err := fingerprint(ctx, tx, schema)
				spares.mu.Lock()
				same = got == spares.pristine.fingerprint
				spares.mu.Unlock()
				if err != nil {
					return err
				}
				return errRollback
			})
			require.ErrorIs(t, err, errRollback, change)
			return same
		}
		require.True(t, fresh(""), "an unchanged schema fingerprints as a fresh one")
		for _, change := range changes {
			require.False(t, fresh(change), "%s: seen", change)
		}
		require.True(t, fresh(""), "every change was rolled back")
	})
}

// A changed schema fails its reset as a change, and is dropped.
func TestAChangedSchemaIsDropped(t *testing.T) {
	for _, change := range []string{changes[0], changes[len(changes)-1]} {
		changed := use(t, change, func(t *testing.T, conn string) {
			ctx := context.Background()
			_, err := Pool(t, AdminURL(t, conn)).Exec(ctx, change)
			require.NoError(t, err)
			require.ErrorIs(t, reset(ctx, URL(t), schemaOf(t, conn)), errChanged, "the reset sees the change")
		})
		require.False(t, exists(t, changed), "%s: the schema is dropped", change)
		if strings.HasPrefix(change, "CREATE PUBLICATION") {
			_, err := Pool(t, URL(t)).Exec(context.Background(), `DROP PUBLICATION scratch`)
			require.NoError(t, err)
		}
	}
}

// A session left connected (a killed process's) is ended before the reset, so that
// nothing it still sends lands in the next test's schema.
func TestALingeringSessionIsEnded(t *testing.T) {
	ctx := context.Background()
	var lingering *pgx.Conn
	first := use(t, "leaves a session", func(t *testing.T, conn string) {
		var err error
		lingering, err = pgx.Connect(ctx, AdminURL(t, conn))
		require.NoError(t, err)
	})
	defer lingering.Close(ctx)
	_, err := lingering.Exec(ctx, `INSERT INTO operation_transitions VALUES ('PREPARED', 'SUCCEEDED', 'late')`)
	require.Error(t, err, "the session was ended")
	second := use(t, "next", func(t *testing.T, conn string) {
		var late int
		require.NoError(t, Pool(t, AdminURL(t, conn)).QueryRow(ctx,
			`SELECT count(*) FROM operation_transitions WHERE who = 'late'`).Scan(&late))
		require.Zero(t, late)
	})
	require.Equal(t, first, second, "the schema was handed on")
}

// kept runs an empty test on a schema of Schema and takes the schema it gave back out of
// the spares, for a test to give back itself.
func kept(t *testing.T) spare {
	t.Helper()
	schema := use(t, "spare", func(*testing.T, string) {})
	s, ok := takeSpare()
	require.True(t, ok)
	require.Equal(t, schema, s.schema, "the schema was kept")
	return s
}

func TestASchemaInUseIsDropped(t *testing.T) {
	ctx := context.Background()
	s := kept(t)
	conn, err := pgx.Connect(ctx, URL(t))
	require.NoError(t, err)
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `LOCK TABLE `+pgx.Identifier{s.schema, "operations"}.Sanitize()+` IN ACCESS SHARE MODE`)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() { done <- giveBack(ctx, URL(t), s, false, t.Logf) }()
	// The reset gives up at its lock timeout, and the drop then waits for the lock too.
	admin := Pool(t, URL(t))
	require.Eventually(t, func() bool {
		var waiting bool
		require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE query LIKE 'DROP SCHEMA%' AND wait_event_type = 'Lock')`).Scan(&waiting))
		return waiting
	}, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, <-done)
	require.False(t, exists(t, s.schema), "a reset that could not take its locks drops the schema")
}

// failing is a test that has failed, as its cleanups see it.
type failing struct{ *testing.T }

func (failing) Failed() bool { return true }

func TestAFailedTestsSchemaIsDropped(t *testing.T) {
	var schema string
	t.Run("fails", func(t *testing.T) {
		schema = schemaOf(t, Schema(failing{t}))
	})
	require.False(t, exists(t, schema))
}

func TestSchemasHandedOnInParallel(t *testing.T) {
	for i := range 8 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			for range 3 {
				use(t, "writes", func(t *testing.T, conn string) {
					PrepareJSON(t, store.New(Pool(t, conn)), "t1", "charge", "a", `{}`)
				})
			}
		})
	}
}
