package storetest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/opbroker/opbroker/store"
)

func TestMain(m *testing.M) { Main(m) }

// TestTheEmbeddedServerRunsWithoutFsync: the server Main starts when no database is
// named has fsync off, so that commits and the resets' TRUNCATEs wait for no disk. A
// database named by EnvDatabaseURL is left as its owner set it.
func TestTheEmbeddedServerRunsWithoutFsync(t *testing.T) {
	if os.Getenv(EnvDatabaseURL) != "" {
		t.Skip("a database of its owner's: its settings are not ours")
	}
	var fsync string
	require.NoError(t, Pool(t, URL(t)).QueryRow(context.Background(), `SHOW fsync`).Scan(&fsync))
	require.Equal(t, "off", fsync)
}

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
			require.ErrorIs(t, reset(ctx, URL(t), schemaOf(t, conn), nil), errChanged, "the reset sees the change")
		})
		require.False(t, exists(t, changed), "%s: the schema is dropped", change)
		if strings.HasPrefix(change, "CREATE PUBLICATION") {
			_, err := Pool(t, URL(t)).Exec(context.Background(), `DROP PUBLICATION scratch`)
			require.NoError(t, err)
		}
	}
}

// A session left connected (a killed process's) is ended before the reset, so that
// nothing it still sends lands in the next test's schema: whether or not the schema
// keeps sessions of its own.
func TestALingeringSessionIsEnded(t *testing.T) {
	ctx := context.Background()
	for _, keeps := range []bool{false, true} {
		s := kept(t, opensAPool)
		if !keeps {
			s.pools.close()
		}
		lingering, err := pgx.Connect(ctx, AdminURL(t, s.url))
		require.NoError(t, err)
		defer lingering.Close(ctx)
		require.NoError(t, giveBack(ctx, URL(t), s, false, t.Logf))
		_, err = lingering.Exec(ctx, `INSERT INTO operation_transitions VALUES ('PREPARED', 'SUCCEEDED', 'late')`)
		require.Error(t, err, "keeps sessions %v: the session was ended", keeps)
		require.True(t, exists(t, s.schema), "keeps sessions %v: the schema was kept", keeps)
	}
}

// opensAPool is a test body that opens a pool on its schema and uses a session of it.
func opensAPool(t *testing.T, conn string) {
	require.NoError(t, Pool(t, conn).Ping(context.Background()))
}

// doesNothing is a test body that leaves its schema as it got it.
func doesNothing(*testing.T, string) {}

// kept runs body as a test on a schema of Schema and takes the schema it gave back out
// of the spares, for a test to give back itself.
func kept(t *testing.T, body func(t *testing.T, conn string)) spare {
	t.Helper()
	schema := use(t, "spare", body)
	s, ok := takeSpare()
	require.True(t, ok)
	require.Equal(t, schema, s.schema, "the schema was kept")
	return s
}

func TestASchemaInUseIsDropped(t *testing.T) {
	ctx := context.Background()
	s := kept(t, doesNothing)
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

// A session is handed on with its schema as it began: nothing the last test set in it
// remains, and what it counted in the schema's activity counters was cleared with them.
func TestASessionIsHandedOnAsItBegan(t *testing.T) {
	ctx := context.Background()
	var pid uint32
	// A spare first: its one pool on the connection string is the migration's.
	use(t, "spare", doesNothing)
	first := use(t, "dirties its session", func(t *testing.T, conn string) {
		c, err := Pool(t, conn).Acquire(ctx)
		require.NoError(t, err)
		defer c.Release()
		pid = c.Conn().PgConn().PID()
		// The delete's count stays in the session: it flushed them a moment ago, and
		// flushes again only a second later.
		_, err = c.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
		_, err = c.Exec(ctx, `INSERT INTO operation_transitions VALUES ('PREPARED', 'SUCCEEDED', 'counted');
			DELETE FROM operation_transitions WHERE who = 'counted'`)
		require.NoError(t, err)
		_, err = c.Exec(ctx, `SET ROLE NONE; SET statement_timeout = '1min'; LISTEN scratch; NOTIFY scratch;
			SELECT pg_advisory_lock(42); CREATE TEMPORARY TABLE scratch (i int);
			BEGIN; DECLARE scratch CURSOR WITH HOLD FOR SELECT 1; COMMIT`)
		require.NoError(t, err)
	})
	second := use(t, "takes it over", func(t *testing.T, conn string) {
		var c *pgxpool.Conn
		for _, idle := range Pool(t, conn).AcquireAllIdle(ctx) {
			if idle.Conn().PgConn().PID() == pid {
				c = idle
			} else {
				idle.Release()
			}
		}
		require.NotNil(t, c, "the session was handed on")
		defer c.Release()
		var role, timeout string
		var channels, locks, cursors int
		var temporary bool
		require.NoError(t, c.QueryRow(ctx, `SELECT current_user, current_setting('statement_timeout'),
			(SELECT count(*) FROM pg_listening_channels()),
			(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),
			(SELECT count(*) FROM pg_cursors WHERE name = 'scratch'), to_regclass('pg_temp.scratch') IS NOT NULL`).
			Scan(&role, &timeout, &channels, &locks, &cursors, &temporary))
		require.Equal(t, AppRole, role, "the role the connection string gives")
		require.Equal(t, "0", timeout)
		require.Zero(t, channels, "no LISTEN")
		require.Zero(t, locks, "no advisory lock")
		require.Zero(t, cursors)
		require.False(t, temporary, "no temporary table")
		done, cancel := context.WithCancel(ctx)
		cancel()
		n, _ := c.Conn().WaitForNotification(done)
		require.Nil(t, n, "no notification the last test's LISTEN received")
		// Whatever the session still holds of its counts arrives now.
		_, err := c.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
		var deleted int64
		require.NoError(t, c.QueryRow(ctx, `SELECT n_tup_del FROM pg_stat_user_tables
			WHERE relid = 'operation_transitions'::regclass`).Scan(&deleted))
		require.Zero(t, deleted, "the last test's delete was counted before the reset cleared the counters")
	})
	require.Equal(t, first, second, "the schema was handed on")
}

// A pool its test closed is not handed on: the next test gets a pool that works.
func TestAClosedPoolIsNotHandedOn(t *testing.T) {
	ctx := context.Background()
	var closed *pgxpool.Pool
	// A spare first: its one pool on the connection string is the migration's.
	use(t, "spare", doesNothing)
	first := use(t, "closes its pool", func(t *testing.T, conn string) {
		closed = Pool(t, conn)
		require.NoError(t, closed.Ping(ctx))
		closed.Close()
	})
	second := use(t, "opens one", func(t *testing.T, conn string) {
		pool := Pool(t, conn)
		require.NotSame(t, closed, pool)
		require.NoError(t, pool.Ping(ctx))
	})
	require.Equal(t, first, second, "the schema was handed on")
}

// A pool with a session still in use when its test ends is closed once the session is
// released, though another is idle.
func TestAPoolInUseIsNotKept(t *testing.T) {
	ctx := context.Background()
	s := kept(t, doesNothing)
	s.pools.close() // no other kept pool
	pool, err := pgxpool.New(ctx, s.url)
	require.NoError(t, err)
	c, err := pool.Acquire(ctx)
	require.NoError(t, err)
	idle, err := pool.Acquire(ctx)
	require.NoError(t, err)
	idle.Release() // one session idle, one in use
	s.pools.handBack(s.url, pool)
	released := make(chan struct{})
	go func() {
		time.Sleep(100 * time.Millisecond)
		close(released)
		c.Release()
	}()
	require.Empty(t, s.pools.settle(ctx), "no session is kept")
	select {
	case <-released:
	default:
		t.Fatal("settle did not wait for the session in use")
	}
	require.Empty(t, s.pools.idle[s.url], "the pool is not kept")
	require.NoError(t, giveBack(ctx, URL(t), s, false, t.Logf))
}

// The pools a schema keeps that its last test did not use keep their sessions through
// the reset too.
func TestAnUnusedPoolKeepsItsSessions(t *testing.T) {
	ctx := context.Background()
	s := kept(t, opensAPool)
	var pids []uint32
	for _, k := range s.pools.idle[s.url] {
		for _, c := range k.pool.AcquireAllIdle(ctx) {
			pids = append(pids, c.Conn().PgConn().PID())
			c.Release()
		}
	}
	require.NotEmpty(t, pids, "the spare keeps a pool with a session")
	require.NoError(t, giveBack(ctx, URL(t), s, false, t.Logf))
	var connected int
	require.NoError(t, Pool(t, URL(t)).QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)`,
		pids).Scan(&connected))
	require.Equal(t, len(pids), connected, "no kept session was ended")
}

// No pool is kept past the budget of kept sessions: its sessions are ended.
func TestKeptSessionsStayWithinTheBudget(t *testing.T) {
	ctx := context.Background()
	s := kept(t, opensAPool)
	require.NotEmpty(t, s.pools.idle[s.url])
	budget := sessionBudget.Load()
	sessionBudget.Store(0)
	defer sessionBudget.Store(budget)
	s.pools.handBack(s.url, s.pools.take(s.url)) // as a test that used it
	require.Empty(t, s.pools.settle(ctx), "no session is kept")
	require.Empty(t, s.pools.idle[s.url], "the pool is closed")
	require.NoError(t, giveBack(ctx, URL(t), s, false, t.Logf))
}

// A budget full of the sessions of spares kept longer makes room for the schema in use:
// the oldest spare's pools are closed rather than the ones a test just used.
func TestTheOldestSparesSessionsMakeRoom(t *testing.T) {
	ctx := context.Background()
	s := kept(t, opensAPool)
	older := kept(t, opensAPool)
	require.True(t, older.pools.keeps())
	require.True(t, putAside(older))
	pool := s.pools.take(s.url)
	require.NotNil(t, pool)
	budget := sessionBudget.Load()
	sessionBudget.Store(keptSessions.Load()) // full
	defer sessionBudget.Store(budget)
	s.pools.handBack(s.url, pool)
	require.NotEmpty(t, s.pools.settle(ctx), "the schema in use keeps its sessions")
	require.LessOrEqual(t, keptSessions.Load(), sessionBudget.Load())
	require.NoError(t, giveBack(ctx, URL(t), s, false, t.Logf))
}
