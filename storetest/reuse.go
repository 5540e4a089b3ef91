package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/opbroker/opbroker/provision"
)

// Migrating a schema is most of what PostgreSQL does for a typical test (26 migrations,
// about a quarter of a second of its CPU with the cleanup). So a test's schema is handed
// to a later test of the same binary once it has been put back as the migrations left
// it, in one transaction of the administrator's: the sessions still connected to it
// ended, every table emptied, the migrations' own rows restored, statistics, activity
// counters and the catalogue's sizes put back; committed only if a fingerprint of the
// schema's catalogue (fingerprintSQL says what it compares) equals a freshly migrated
// schema's. A schema whose test failed, whose reset could not take its locks within a
// second, or whose fingerprint differs (the test changed the schema, not only its rows)
// is dropped as before. The reset needs a superuser: with any other administrator, every
// schema is new and dropped.
//
// A schema's sessions are handed on with it. A new session costs PostgreSQL 17 ms of
// CPU on a small machine (docs/testing.md), and builds again the catalogue entries and
// plans an old one has; a run of every package opened about a thousand. So the pools a
// test opens with Pool on its schema's two connection strings are not closed at its end
// but kept with the schema: each idle session is put back as it began (resetSession),
// and the reset then ends every other session connected to the schema. A pool with a
// session still in use, none idle (a test closed it), or one that could not be put back
// is closed as before, and so are pools past the budget of kept sessions.

// maxSpare is how many reset schemas one test binary keeps for its next tests.
const maxSpare = 8

// spares holds the reset schemas of this test binary and what a fresh one looks like.
var spares struct {
	mu       sync.Mutex
	admin    *pgxpool.Pool     // the administrator's pool on the test database, opened on first use
	off      bool              // the administrator is no superuser: no schema is reused
	pristine *pristine         // nil until the first schema is migrated
	free     []spare           // ready for a test
	lent     map[string]*pools // the pools of the schemas tests hold, by connection string
}

// spare is a reset schema, the connection string Schema gave for it, and the pools tests
// opened on it.
type spare struct {
	schema, url string
	pools       *pools
}

// pools are the pools that tests opened with Pool on a schema's connection strings,
// Schema's and AdminURL's of it (urls): those kept for the next test's Pool, by
// connection string, and those the test that holds the schema has handed back.
type pools struct {
	urls   [2]string
	mu     sync.Mutex
	idle   map[string][]keptPool
	handed []handed
}

// keptPool is a kept pool and how many sessions it has.
type keptPool struct {
	pool     *pgxpool.Pool
	sessions int64
}

// handed is a pool a test handed back, and the connection string it was opened on.
type handed struct {
	url  string
	pool *pgxpool.Pool
}

// keptSessions counts the sessions of every kept pool of this test binary;
// sessionBudget bounds it (adminPool sets it).
var keptSessions, sessionBudget atomic.Int64

// keep counts n more kept sessions if the budget allows it.
func keep(n int64) bool {
	for {
		kept := keptSessions.Load()
		if kept+n > sessionBudget.Load() {
			return false
		}
		if keptSessions.CompareAndSwap(kept, kept+n) {
			return true
		}
	}
}

// lend makes p's pools available to Pool while a test holds their schema.
func lend(p *pools) {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	if spares.lent == nil {
		spares.lent = map[string]*pools{}
	}
	for _, url := range p.urls {
		spares.lent[url] = p
	}
}

// lentFor returns the pools lent for url, or nil.
func lentFor(url string) *pools {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	return spares.lent[url]
}

// unlend ends the loan of p's pools.
func unlend(p *pools) {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	for _, url := range p.urls {
		delete(spares.lent, url)
	}
}

// take returns a kept pool on url, or nil if there is none or p is nil (the one method
// of pools that takes a nil p: Pool calls it for any connection string).
func (p *pools) take(url string) *pgxpool.Pool {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.idle[url])
	if n == 0 {
		return nil
	}
	k := p.idle[url][n-1]
	p.idle[url] = p.idle[url][:n-1]
	keptSessions.Add(-k.sessions)
	return k.pool
}

// handBack takes a pool on url back from a finished test; settle decides whether it is
// kept.
func (p *pools) handBack(url string, pool *pgxpool.Pool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.handed = append(p.handed, handed{url, pool})
}

// resetSession puts an idle session back as it began, as DISCARD ALL does, except that
// it keeps the statements pgx prepared (and caches by name): no cursor, role, setting,
// LISTEN, advisory lock, temporary table or sequence value of the last test remains.
// It also has the session flush its activity counters when the statement ends, so that
// the reset, which clears the schema's, comes after them. What it leaves: statements
// prepared with SQL's PREPARE, placeholder settings a test created (empty, no longer
// missing) and the plan cache's record of custom plans, as a session of the broker's
// pool keeps them from one request to the next; no test relies on their absence.
const resetSession = `CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; UNLISTEN *;
	SELECT pg_advisory_unlock_all(); DISCARD TEMP; DISCARD SEQUENCES; SELECT pg_stat_force_next_flush()`

// settle puts the sessions of the pools handed back as they began, and returns the
// process IDs of the sessions of every pool it keeps, which the reset leaves connected.
// It closes a pool with a session in use, none idle or one that could not be put back,
// and those past the budget of kept sessions.
func (p *pools) settle(ctx context.Context) []uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.idle == nil {
		p.idle = map[string][]keptPool{}
	}
	used := map[*pgxpool.Pool]bool{}
	for _, h := range p.handed {
		p.idle[h.url] = append(p.idle[h.url], keptPool{pool: h.pool})
		used[h.pool] = true
	}
	p.handed = nil
	var pids []uint32
	for url, kept := range p.idle {
		p.idle[url] = nil
		for _, k := range kept {
			keptSessions.Add(-k.sessions)
			var these []uint32
			ok := eachIdle(ctx, k.pool, func(c *pgxpool.Conn) error {
				if used[k.pool] {
					if err := putBack(ctx, c); err != nil {
						return err
					}
				}
				these = append(these, c.Conn().PgConn().PID())
				return nil
			})
			n := int64(len(these))
			if !ok || !makeRoom(n) {
				k.pool.Close()
				continue
			}
			p.idle[url] = append(p.idle[url], keptPool{k.pool, n})
			pids = append(pids, these...)
		}
	}
	return pids
}

// makeRoom counts n more kept sessions, closing the pools of the spares kept longest
// while the budget has no room for them (the schema in use comes first); it reports
// false if there is still none.
func makeRoom(n int64) bool {
	for !keep(n) {
		if !evictOldest() {
			return false
		}
	}
	return true
}

// evictOldest closes the kept pools of the spare kept longest that has any, and
// reports whether there was one.
func evictOldest() bool {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	for _, s := range spares.free {
		if s.pools.keeps() {
			s.pools.close()
			return true
		}
	}
	return false
}

// keeps reports whether p keeps a pool.
func (p *pools) keeps() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, kept := range p.idle {
		if len(kept) > 0 {
			return true
		}
	}
	return false
}

// eachIdle calls fn on each of pool's sessions, which must all be idle, and reports
// whether there was one, none was in use and fn succeeded on every one.
func eachIdle(ctx context.Context, pool *pgxpool.Pool, fn func(*pgxpool.Conn) error) bool {
	conns := pool.AcquireAllIdle(ctx)
	ok := len(conns) > 0 && int(pool.Stat().TotalConns()) == len(conns)
	for _, c := range conns {
		if ok {
			ok = fn(c) == nil
		}
		c.Release()
	}
	return ok
}

// putBack puts a session back as it began (resetSession), and drops the notifications
// pgx received for it and still holds.
func putBack(ctx context.Context, c *pgxpool.Conn) error {
	if _, err := c.Exec(ctx, resetSession); err != nil {
		return err
	}
	done, cancel := context.WithCancel(ctx)
	cancel() // the buffered notifications come first, then the context ends the wait
	for {
		if n, _ := c.Conn().WaitForNotification(done); n == nil {
			return nil
		}
	}
}

// close closes every pool p holds.
func (p *pools) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range p.handed {
		h.pool.Close()
	}
	for _, kept := range p.idle {
		for _, k := range kept {
			keptSessions.Add(-k.sessions)
			k.pool.Close()
		}
	}
	p.handed, p.idle = nil, nil
}

// pristine is what a freshly migrated schema holds: its fingerprint, the rows the
// migrations wrote, per table, in COPY's text format, and the sizes the catalogue gives
// its tables and indexes (which TRUNCATE changes, and the planner reads).
type pristine struct {
	fingerprint string
	rows        map[string][]byte // by table name
	sizes       relSizes
}

// relSizes are pg_class's relpages, reltuples and relallvisible of a schema's relations.
type relSizes struct {
	names      []string
	pages      []int32
	tuples     []float32
	allVisible []int32
}

// adminPool opens the administrator's pool the first time, and finds out whether the
// administrator can reset schemas.
func adminPool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	if spares.admin == nil {
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			return nil, err
		}
		var super bool
		if err := pool.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
			pool.Close()
			return nil, err
		}
		var connections int64
		if err := pool.QueryRow(ctx, `SELECT current_setting('max_connections')::int`).Scan(&connections); err != nil {
			pool.Close()
			return nil, err
		}
		// go test runs a test binary per CPU at once: together their kept sessions take a
		// quarter of the server's connections at most.
		sessionBudget.Store(connections / int64(4*runtime.GOMAXPROCS(0)))
		spares.admin, spares.off = pool, !super
	}
	return spares.admin, nil
}

// takeSpare returns a reset schema, if there is one.
func takeSpare() (spare, bool) {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	n := len(spares.free)
	if n == 0 {
		return spare{}, false
	}
	s := spares.free[n-1]
	spares.free = spares.free[:n-1]
	return s, true
}

// record keeps what the freshly migrated schema holds, the first time one is made.
func record(ctx context.Context, url, schema string) error {
	admin, err := adminPool(ctx, url)
	if err != nil {
		return err
	}
	spares.mu.Lock()
	done := spares.pristine != nil || spares.off
	spares.mu.Unlock()
	if done {
		return nil
	}
	p := &pristine{rows: map[string][]byte{}}
	err = inSchema(ctx, admin, schema, func(tx pgx.Tx) error {
		tables, err := tablesOf(ctx, tx, schema)
		if err != nil {
			return err
		}
		for _, table := range tables {
			var buf bytes.Buffer
			tag, err := tx.Conn().PgConn().CopyTo(ctx, &buf, "COPY "+pgx.Identifier{schema, table}.Sanitize()+" TO STDOUT")
			if err != nil {
				return err
			}
			if tag.RowsAffected() > 0 {
				p.rows[table] = buf.Bytes()
			}
		}
		if err := tx.QueryRow(ctx, `SELECT array_agg(relname), array_agg(relpages), array_agg(reltuples), array_agg(relallvisible)
			FROM pg_class WHERE relnamespace = $1::regnamespace`, schema).
			Scan(&p.sizes.names, &p.sizes.pages, &p.sizes.tuples, &p.sizes.allVisible); err != nil {
			return err
		}
		p.fingerprint, err = fingerprint(ctx, tx, schema)
		return err
	})
	if err != nil {
		return fmt.Errorf("record the fresh schema: %w", err)
	}
	spares.mu.Lock()
	if spares.pristine == nil {
		spares.pristine = p
	}
	spares.mu.Unlock()
	return nil
}

// errChanged says that a schema's catalogue is not a fresh schema's after the reset.
var errChanged = errors.New("the schema differs from a freshly migrated one")

// giveBack resets s for a later test and keeps it, or drops it when its test failed or
// it cannot be reset exactly (or enough are kept already); url is the administrator's.
// logf says why a schema was not kept.
func giveBack(ctx context.Context, url string, s spare, failed bool, logf func(string, ...any)) error {
	schema := s.schema
	unlend(s.pools)
	if failed {
		logf("storetest: schema %s dropped: its test failed", schema)
		return drop(ctx, url, s)
	}
	kept := s.pools.settle(ctx)
	if err := reset(ctx, url, schema, kept); err != nil {
		logf("storetest: schema %s dropped: %v", schema, err)
		return drop(ctx, url, s)
	}
	if putAside(s) {
		return nil
	}
	return drop(ctx, url, s)
}

// putAside keeps s for a later test, unless enough are kept already.
func putAside(s spare) bool {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	if len(spares.free) < maxSpare {
		spares.free = append(spares.free, s)
		return true
	}
	return false
}

// drop closes the pools kept for s and drops its schema.
func drop(ctx context.Context, url string, s spare) error {
	s.pools.close()
	return provision.DropSchema(ctx, url, s.schema)
}

// reset ends the sessions still connected to schema but those of kept (settle's),
// empties it and restores the migrations' rows, the catalogue's sizes and the activity
// counters, in one transaction committed only if the schema then fingerprints as a
// fresh one.
func reset(ctx context.Context, url, schema string, kept []uint32) error {
	admin, err := adminPool(ctx, url)
	if err != nil {
		return err
	}
	spares.mu.Lock()
	p, off := spares.pristine, spares.off
	spares.mu.Unlock()
	switch {
	case off:
		return errors.New("the administrator is no superuser")
	case p == nil:
		return errors.New("no fresh schema recorded")
	}
	// A session left connected (a killed process's, whose last statements may still be
	// in its socket) could write after the reset, into the next test's schema. Schema's
	// connection strings name the schema as their application_name.
	// coalesce: pgx sends a nil kept as NULL, and pid <> ALL(NULL) is never true.
	const lingering = `FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid() AND pid <> ALL(coalesce($2::int4[], '{}'))`
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid, 5000) `+lingering, schema, kept); err != nil {
		return err
	}
	return inSchema(ctx, admin, schema, func(tx pgx.Tx) error {
		// session_replication_role = replica: the ledger's guards (no TRUNCATE of the keys
		// on their own, history never deleted) do not fire for the reset.
		for _, set := range []string{"SET LOCAL lock_timeout = '1s'", "SET LOCAL session_replication_role = replica"} {
			if _, err := tx.Exec(ctx, set); err != nil {
				return err
			}
		}
		tables, err := tablesOf(ctx, tx, schema)
		if err != nil {
			return err
		}
		if len(tables) > 0 {
			quoted := make([]string, len(tables))
			for i, table := range tables {
				quoted[i] = pgx.Identifier{schema, table}.Sanitize()
			}
			if _, err := tx.Exec(ctx, "TRUNCATE "+strings.Join(quoted, ", ")+" RESTART IDENTITY"); err != nil {
				return err
			}
		}
		// Statistics and activity counters steer plans and autovacuum, and tests read
		// function counters: a fresh schema has none.
		for _, statement := range []string{
			`DELETE FROM pg_statistic WHERE starelid IN (SELECT oid FROM pg_class WHERE relnamespace = $1::regnamespace)`,
			`SELECT pg_stat_reset_single_table_counters(oid) FROM pg_class WHERE relnamespace = $1::regnamespace`,
			`SELECT pg_stat_reset_single_function_counters(oid) FROM pg_proc WHERE pronamespace = $1::regnamespace`,
		} {
			if _, err := tx.Exec(ctx, statement, schema); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `UPDATE pg_class c SET relpages = s.pages, reltuples = s.tuples, relallvisible = s.allvisible
			FROM unnest($2::name[], $3::int[], $4::real[], $5::int[]) AS s(name, pages, tuples, allvisible)
			WHERE c.relnamespace = $1::regnamespace AND c.relname = s.name`,
			schema, p.sizes.names, p.sizes.pages, p.sizes.tuples, p.sizes.allVisible); err != nil {
			return err
		}
		for table, rows := range p.rows {
			if _, err := tx.Conn().PgConn().CopyFrom(ctx, bytes.NewReader(rows), "COPY "+pgx.Identifier{schema, table}.Sanitize()+" FROM STDIN"); err != nil {
				return err
			}
		}
		var connected bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 `+lingering+`)`, schema, kept).Scan(&connected); err != nil {
			return err
		}
		if connected {
			return errors.New("a session connected to it again")
		}
		got, err := fingerprint(ctx, tx, schema)
		if err != nil {
			return err
		}
		if got != p.fingerprint {
			return errChanged
		}
		return nil
	})
}

// inSchema runs fn in a transaction on admin, the administrator's pool, with search_path
// set to schema.
func inSchema(ctx context.Context, admin *pgxpool.Pool, schema string, fn func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, admin, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL search_path = "+pgx.Identifier{schema}.Sanitize()); err != nil {
			return err
		}
		return fn(tx)
	})
}

// finish drops the schemas kept at the end of the test binary, vacuums the system
// catalogues if the database outlives the binary (shared), and closes the
// administrator's pool.
func finish(url string, shared bool) error {
	spares.mu.Lock()
	defer spares.mu.Unlock()
	ctx := context.Background()
	var errs []error
	for _, s := range spares.free {
		errs = append(errs, drop(ctx, url, s))
	}
	spares.free = nil
	if spares.admin != nil {
		if shared && !spares.off {
			errs = append(errs, vacuumCatalogue(ctx, spares.admin))
		}
		spares.admin.Close()
		spares.admin = nil
	}
	return errors.Join(errs...)
}

// vacuumCatalogue vacuums the system catalogues that hold dead rows, skipping any that
// another session has locked. Creating, resetting and dropping schemas leaves dead rows
// in them (about 20,000 in pg_class alone in a run of every package), which catalogue
// reads then step over. A server whose autovacuum is off keeps them all: each run left
// the next about 5% slower, and a day of runs made one take twice as long
// (docs/testing.md).
func vacuumCatalogue(ctx context.Context, admin *pgxpool.Pool) error {
	rows, _ := admin.Query(ctx, `SELECT format('%I.%I', schemaname, relname) FROM pg_stat_sys_tables
		WHERE schemaname = 'pg_catalog' AND n_dead_tup > 0 ORDER BY relname`)
	catalogues, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(catalogues) == 0 {
		return err
	}
	_, err = admin.Exec(ctx, "VACUUM (SKIP_LOCKED) "+strings.Join(catalogues, ", "))
	return err
}

// tablesOf lists the names of schema's tables.
func tablesOf(ctx context.Context, tx pgx.Tx, schema string) ([]string, error) {
	rows, _ := tx.Query(ctx, `SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY c.relname`, schema)
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// fingerprint digests what a test could change in schema's catalogue and a later test
// could notice: the schema's owner and privileges; each relation's kind, persistence,
// access method, storage options (its TOAST table's too), row-level security, replica
// identity, privileges, owner and sizes; each column's type, collation, storage,
// compression, nullability, identity, default, statistics target, options and
// privileges; constraints, indexes and triggers as defined, with whether each is valid
// or fires; functions (body, cost, volatility, settings, security, owner, privileges);
// policies; types and enum labels; rules; sequences and their state; inheritance;
// default privileges; every object that belongs to the schema by name; comments;
// publications; statistics. The caller sets search_path to schema, so that names print
// unqualified and two schemas compare equal when only their names differ. Some builds of
// PostgreSQL give every column an option of their own (pg_attver) that differs from one
// schema to the next: it is left out.
func fingerprint(ctx context.Context, tx pgx.Tx, schema string) (string, error) {
	var digest string
	err := tx.QueryRow(ctx, fingerprintSQL, schema).Scan(&digest)
	return digest, err
}

const fingerprintSQL = `
WITH ns AS (SELECT oid, nspowner, nspacl FROM pg_namespace WHERE nspname = $1),
rels AS (SELECT c.* FROM pg_class c, ns WHERE c.relnamespace = ns.oid),
owned AS (SELECT d.classid, d.objid, d.objsubid FROM pg_depend d, ns
  WHERE d.refclassid = 'pg_namespace'::regclass AND d.refobjid = ns.oid),
described AS (SELECT oid FROM ns UNION SELECT objid FROM owned UNION SELECT oid FROM rels
  UNION SELECT c.oid FROM pg_constraint c, ns WHERE c.connamespace = ns.oid
  UNION SELECT t.oid FROM pg_trigger t JOIN rels r ON r.oid = t.tgrelid
  UNION SELECT p.oid FROM pg_policy p JOIN rels r ON r.oid = p.polrelid)
SELECT md5(concat_ws(E'\n',
  (SELECT format('%s %s', nspowner::regrole, nspacl) FROM ns),
  (SELECT string_agg(format('%s %s %s %s %s %s %s %s %s %s %s %s %s %s', relname, relkind, relpersistence, reloptions,
      relrowsecurity, relforcerowsecurity, relreplident, relacl, relowner::regrole, relpages, reltuples, relallvisible,
      (SELECT a.amname FROM pg_am a WHERE a.oid = r.relam), (SELECT t.reloptions FROM pg_class t WHERE t.oid = r.reltoastrelid)),
      E'\n' ORDER BY relname) FROM rels r),
  (SELECT string_agg(format('%s.%s %s %s %s %s %s %s %s %s %s %s %s %s %s', r.relname, a.attname,
      format_type(a.atttypid, a.atttypmod), a.attcollation::regcollation, a.attstorage, a.attcompression, a.attnum, a.attnotnull, a.attidentity, a.attgenerated, a.attisdropped, a.attstattarget,
      array(SELECT o FROM unnest(a.attoptions) o WHERE o NOT LIKE 'pg_attver=%' ORDER BY o), a.attacl,
      pg_get_expr(d.adbin, d.adrelid)), E'\n' ORDER BY r.relname, a.attnum)
     FROM rels r JOIN pg_attribute a ON a.attrelid = r.oid
     LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
     WHERE a.attnum > 0),
  (SELECT string_agg(format('%s %s %s %s %s %s %s', conrelid::regclass, contypid::regtype, conname,
      pg_get_constraintdef(c.oid), convalidated, condeferrable, condeferred), E'\n' ORDER BY conrelid::regclass::text, conname)
     FROM pg_constraint c, ns WHERE c.connamespace = ns.oid),
  (SELECT string_agg(format('%s %s %s %s %s', replace(pg_get_indexdef(i.indexrelid), ' ON ' || quote_ident($1) || '.', ' ON '),
      indisvalid, indisready, indislive, indisclustered), E'\n' ORDER BY i.indexrelid::regclass::text)
     FROM pg_index i JOIN rels r ON r.oid = i.indrelid),
  (SELECT string_agg(format('%s %s %s %s %s %s', r.relname, CASE WHEN t.tgisinternal THEN ''
      ELSE replace(pg_get_triggerdef(t.oid), ' ON ' || quote_ident($1) || '.', ' ON ') END,
      (SELECT conname FROM pg_constraint WHERE oid = t.tgconstraint), t.tgtype, t.tgfoid::regprocedure, t.tgenabled),
      E'\n' ORDER BY r.relname, t.tgname) FROM pg_trigger t JOIN rels r ON r.oid = t.tgrelid),
  (SELECT string_agg(format('%s %s %s %s %s %s %s %s %s %s %s %s %s %s', p.oid::regprocedure, p.prokind, p.prorettype::regtype,
      p.prosrc, p.procost, p.prorows, p.proparallel,
      replace(p.proconfig::text, $1, '<schema>'), p.provolatile, p.proisstrict, p.prosecdef, p.proleakproof, p.proowner::regrole, p.proacl),
      E'\n' ORDER BY p.oid::regprocedure::text) FROM pg_proc p, ns WHERE p.pronamespace = ns.oid),
  (SELECT string_agg(format('%s %s %s %s %s %s %s', p.polrelid::regclass, p.polname, p.polcmd, p.polpermissive,
      p.polroles::regrole[], pg_get_expr(p.polqual, p.polrelid), pg_get_expr(p.polwithcheck, p.polrelid)), E'\n' ORDER BY r.relname, p.polname)
     FROM pg_policy p JOIN rels r ON r.oid = p.polrelid),
  (SELECT string_agg(format('%s %s %s %s %s', t.oid::regtype, t.typtype, t.typowner::regrole, t.typacl,
      (SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder) FROM pg_enum e WHERE e.enumtypid = t.oid)),
      E'\n' ORDER BY t.typname) FROM pg_type t, ns WHERE t.typnamespace = ns.oid),
  (SELECT string_agg(pg_get_ruledef(w.oid), E'\n' ORDER BY r.relname, w.rulename) FROM pg_rewrite w JOIN rels r ON r.oid = w.ev_class),
  (SELECT string_agg(format('%s %s %s %s %s %s %s %s %s', s.seqrelid::regclass, s.seqtypid::regtype, s.seqstart, s.seqincrement,
      s.seqmax, s.seqmin, s.seqcache, s.seqcycle, pg_sequence_last_value(s.seqrelid)), E'\n' ORDER BY r.relname)
     FROM pg_sequence s JOIN rels r ON r.oid = s.seqrelid),
  (SELECT string_agg(format('%s %s', inhrelid::regclass, inhparent::regclass), E'\n' ORDER BY r.relname, inhseqno)
     FROM pg_inherits JOIN rels r ON r.oid = inhrelid),
  (SELECT format('default privileges %s', array_agg(defaclacl ORDER BY defaclobjtype)) FROM pg_default_acl, ns
     WHERE defaclnamespace = ns.oid),
  (SELECT string_agg(pg_describe_object(classid, objid, objsubid), E'\n' ORDER BY pg_describe_object(classid, objid, objsubid))
     FROM owned),
  (SELECT string_agg(format('%s %s', pg_describe_object(d.classoid, d.objoid, d.objsubid), d.description),
      E'\n' ORDER BY pg_describe_object(d.classoid, d.objoid, d.objsubid)) FROM pg_description d JOIN described ON described.oid = d.objoid),
  (SELECT string_agg(format('publication %s %s', p.pubname, r.relname), E'\n' ORDER BY p.pubname, r.relname)
     FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid JOIN rels r ON r.oid = pr.prrelid),
  (SELECT string_agg(format('publication %s', p.pubname), E'\n' ORDER BY p.pubname)
     FROM pg_publication_namespace pn JOIN pg_publication p ON p.oid = pn.pnpubid, ns WHERE pn.pnnspid = ns.oid),
  (SELECT format('statistics %s', count(*)) FROM pg_statistic JOIN rels r ON r.oid = starelid),
  (SELECT format('extended statistics %s', count(*)) FROM pg_statistic_ext, ns WHERE stxnamespace = ns.oid)
))`
