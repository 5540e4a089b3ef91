package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// Scope is the ledger as one caller may reach it: one tenant's data (an API call, after
// authorisation: Store.Tenant) or every tenant's (the broker's own workers:
// Store.AllTenants). Every statement on a tenant's data is a method of Scope, so a call
// without a scope does not compile. The scope is set for the statement's transaction
// only (set_config(…, true), sent in the same round trip), never for a pooled session,
// and PostgreSQL's row-level security (migration 006) limits the statement to it: the
// scope bounds what a statement may reach, its arguments choose the rows.
//
// The zero Scope reaches nothing: its statements fail.
type Scope struct {
	s *Store
	// tenants is the setting opbroker.tenant: one tenant id, allTenants, or for a
	// statement written for the callers of several tenants, their ids comma-separated.
	tenants string
}

// allTenants is the setting of the broker's own workers.
const allTenants = "*"

// Tenant returns the scope of one tenant's data. An id that is empty or could name
// several tenants ("*", or one holding a comma; tenant ids hold neither) gives a scope
// whose statements fail.
func (s *Store) Tenant(tenantID string) Scope {
	if tenantID == "" || tenantID == allTenants || strings.Contains(tenantID, ",") {
		return Scope{s: s}
	}
	return Scope{s: s, tenants: tenantID}
}

// AllTenants returns the scope of every tenant's data: for the dispatcher, the
// reconciler, the sweeper and the watch hub, never for a call on behalf of a client.
func (s *Store) AllTenants() Scope { return Scope{s: s, tenants: allTenants} }

// tenantsOf returns the scope of exactly the tenants of scopes (each a Tenant's
// setting), or of every tenant when every scope is allTenants.
func (s *Store) tenantsOf(scopes []string) Scope {
	tenants := slices.DeleteFunc(slices.Sorted(slices.Values(scopes)), func(t string) bool { return t == allTenants })
	if len(tenants) == 0 {
		return s.AllTenants()
	}
	return Scope{s: s, tenants: strings.Join(slices.Compact(tenants), ",")}
}

// ErrNoScope is the error of every statement of a scope that reaches nothing: the zero
// Scope, or Store.Tenant of an id that names no single tenant. It is a bug.
var ErrNoScope = errors.New("a scope that names no single tenant (use Store.Tenant or Store.AllTenants)")

// setScope sets a transaction's tenant scope, which row-level security reads, and has
// its statements scan a table sequentially only where no index applies (PostgreSQL's
// enable_seqscan off), never compiled just in time (jit off).
//
// Every statement of the package but a period's statistics (serverScans) reads by a
// key or by an index of what it wants, and a connection keeps a statement's plan until
// the table is analyzed again. Made from statistics of a one-page ledger (autovacuum's
// first ANALYZE of a new one), a plan reads that page rather than an index, and once
// the ledger has grown it reads the whole ledger: a claim scanned it three times, an
// update of one operation by its key once. And under row-level security the planner
// cannot use the state column's statistics (enum equality is not leakproof): a
// statement that finds the rows of one state through its partial index takes every row
// for one of that state, and at a million rows prefers a scan of the table to that
// index.
//
// A scan that runs anyway (no index applies, or a part of the plan that a false
// condition never runs) still counts the penalty of ten billion that enable_seqscan
// off adds to its cost (up to PostgreSQL 17), and a plan that costly is compiled just
// in time: a settlement of a target's event took 0.4 to 3 seconds compiling 41
// functions. No statement that runs with this setting reads enough rows for
// compilation to pay.
const setScope = `SELECT set_config('opbroker.tenant', $1, true), set_config('enable_seqscan', 'off', true),
	set_config('jit', 'off', true)`

// serverScans gives a transaction that reads tables whole by design (a period's
// statistics) the server's own settings back, after setScope.
const serverScans = `SELECT set_config(name, reset_val, true) FROM pg_settings WHERE name IN ('enable_seqscan', 'jit')`

type (
	lockTimeoutKey struct{}
	customPlanKey  struct{}
	indexOrderKey  struct{}
	lockedKey      struct{}
)

// withOperationLocked returns ctx whose statement first locks the operation's row
// against every other lock (FOR UPDATE), in its transaction, and then runs with a
// snapshot taken after it got the lock. A writer that adds to the operation's history
// (an event, a stale outcome) holds a key-share lock on the row until it commits, which
// an UPDATE alone does not wait for: the statement then sees what such a writer had
// added, not only what had committed when it began.
func withOperationLocked(ctx context.Context, key OperationKey) context.Context {
	return context.WithValue(ctx, lockedKey{}, key)
}

// withLockTimeout returns ctx whose statements give up waiting for a lock after d
// (PostgreSQL's lock_timeout, for the statement's transaction only).
func withLockTimeout(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, lockTimeoutKey{}, d)
}

// withCustomPlan returns ctx whose statements are planned for their arguments at each
// run (PostgreSQL's plan_cache_mode, for the statement's transaction only), never from
// a generic plan cached while the tables were small. It is for the batch statements,
// where one planning is shared by hundreds of rows.
func withCustomPlan(ctx context.Context) context.Context {
	return context.WithValue(ctx, customPlanKey{}, true)
}

// withIndexOrder returns ctx whose statements sort only where no index gives the order
// (PostgreSQL's enable_sort off, for the statement's transaction only). It is for the
// dispatcher's claim (fairPick), whose walk over the tenants and whose shares are
// ordered so that only the claim index serves them: from statistics of a one-page
// ledger, the planner could otherwise read the primary key for a range of tenants and
// sort what it found, every operation of those tenants once the ledger has grown. (The
// reconciler's claim is planned for each call instead, for its reads of the events.)
func withIndexOrder(ctx context.Context) context.Context {
	return context.WithValue(ctx, indexOrderKey{}, true)
}

// namedSQL is a statement written with named arguments (@tenant_ids, not $1), rewritten
// to positional ones by pgx once, when the package loads, rather than at every call (pgx
// lexes the whole text each time: a twentieth of the broker's CPU in a burn-down, for
// the outcomes' and the intents' statements).
type namedSQL struct {
	sql   string
	names []string // the arguments' names, in their positional order
}

// compileNamed rewrites sql, whose arguments must be exactly names; it panics otherwise
// (its callers are package variables: every test would fail).
func compileNamed(sql string, names ...string) namedSQL {
	probe := pgx.StrictNamedArgs{}
	for _, n := range names {
		probe[n] = n
	}
	positional, order, err := probe.RewriteQuery(context.Background(), nil, sql, nil)
	if err != nil {
		panic("store: " + err.Error())
	}
	s := namedSQL{sql: positional, names: make([]string, len(order))}
	for i, n := range order {
		s.names[i] = n.(string)
	}
	return s
}

// args returns values in the statement's order; it panics when one is missing.
func (s namedSQL) args(values pgx.NamedArgs) []any {
	if len(values) != len(s.names) {
		panic(fmt.Sprintf("store: %d values for %d arguments", len(values), len(s.names)))
	}
	out := make([]any, len(s.names))
	for i, n := range s.names {
		v, ok := values[n]
		if !ok {
			panic("store: no value for @" + n)
		}
		out[i] = v
	}
	return out
}

// query runs one statement in the scope, in one round trip: sent ahead of it, in its
// transaction, are its scope and the settings ctx asks for.
func (q Scope) query(ctx context.Context, sql string, args ...any) pgx.Rows {
	if q.tenants == "" {
		return &failedRows{err: ErrNoScope}
	}
	set, setArgs := setScope, []any{q.tenants}
	if d, ok := ctx.Value(lockTimeoutKey{}).(time.Duration); ok {
		set, setArgs = set+`, set_config('lock_timeout', $2, true)`, append(setArgs, fmt.Sprintf("%dms", max(1, d.Milliseconds())))
	}
	if ctx.Value(customPlanKey{}) != nil {
		set += `, set_config('plan_cache_mode', 'force_custom_plan', true)`
	}
	if ctx.Value(indexOrderKey{}) != nil {
		set += `, set_config('enable_sort', 'off', true)`
	}
	batch := &pgx.Batch{}
	batch.Queue(set, setArgs...)
	if locked, ok := ctx.Value(lockedKey{}).(OperationKey); ok {
		batch.Queue(`SELECT FROM operations WHERE tenant_id = $1 AND operation_id = $2 FOR UPDATE`, locked.TenantID, locked.ID)
	}
	batch.Queue(sql, args...)
	results := q.s.pool.SendBatch(ctx, batch)
	for range batch.Len() - 1 { // the statements before sql: the settings, and the lock
		if _, err := results.Exec(); err != nil {
			results.Close()
			return &failedRows{err: err}
		}
	}
	rows, _ := results.Query()
	return &batchRows{Rows: rows, results: results}
}

// queryRow is query for one row: pgx.ErrNoRows when there is none.
func (q Scope) queryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return &firstRow{rows: q.query(ctx, sql, args...)}
}

// exec runs one statement that returns no rows in the scope.
func (q Scope) exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	rows := q.query(ctx, sql, args...)
	rows.Close()
	return rows.CommandTag(), rows.Err()
}

// inTx runs fn in a transaction in the scope.
func (q Scope) inTx(ctx context.Context, opts pgx.TxOptions, fn func(pgx.Tx) error) error {
	if q.tenants == "" {
		return ErrNoScope
	}
	return pgx.BeginTxFunc(ctx, q.s.pool, opts, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setScope, q.tenants); err != nil {
			return err
		}
		return fn(tx)
	})
}

// batchRows are the rows of a batch's statement. When they are read to the end or
// closed, the batch is closed: its implicit transaction has committed, and Err reports
// a failure to.
type batchRows struct {
	pgx.Rows
	results  pgx.BatchResults
	closed   bool
	closeErr error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	r.closeErr = r.results.Close()
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.closeErr
}

type firstRow struct{ rows pgx.Rows }

func (r *firstRow) Scan(dest ...any) error {
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// failedRows are rows that never were: their error is err.
type failedRows struct{ err error }

func (r *failedRows) Close()                                       {}
func (r *failedRows) Err() error                                   { return r.err }
func (r *failedRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r *failedRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r *failedRows) Next() bool                                   { return false }
func (r *failedRows) Scan(...any) error                            { return r.err }
func (r *failedRows) Values() ([]any, error)                       { return nil, r.err }
func (r *failedRows) RawValues() [][]byte                          { return nil }
func (r *failedRows) Conn() *pgx.Conn                              { return nil }
func (r *failedRows) TypeMap() *pgtype.Map                         { return nil }
