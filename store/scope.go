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

// Every statement on a tenant's data runs in the scope its context carries: one tenant
// (an API call, after authorisation) or every tenant (the broker's own workers). The
// scope is set for the statement's transaction only (set_config(…, true), sent in the
// same round trip), never for a pooled session, and PostgreSQL's row-level security
// (migration 006) limits the statement to it. A context without a scope is refused.

type scopeKey struct{}

// allTenants is the scope of the broker's own workers.
const allTenants = "*"

// WithTenant returns ctx limited to one tenant's data.
func WithTenant(ctx context.Context, tenantID string) context.Context {
	return context.WithValue(ctx, scopeKey{}, tenantID)
}

// WithAllTenants returns ctx that reaches every tenant's data: for the dispatcher, the
// reconciler, the sweeper and the watch hub, never for a call on behalf of a client.
func WithAllTenants(ctx context.Context) context.Context {
	return context.WithValue(ctx, scopeKey{}, allTenants)
}

// tenantList is the scope of a statement written for the callers of several tenants at
// once (a combined Prepare): those tenants, comma-separated, and no others.
type tenantList string

// withTenants returns ctx limited to the data of the tenants of scopes, each a single
// tenant's scope.
func withTenants(ctx context.Context, scopes []string) context.Context {
	tenants := slices.Compact(slices.Sorted(slices.Values(scopes)))
	return context.WithValue(ctx, scopeKey{}, tenantList(strings.Join(tenants, ",")))
}

// ErrNoScope means a context reached the ledger without a tenant scope: a bug.
var ErrNoScope = errors.New("no tenant scope in the context (store.WithTenant or store.WithAllTenants)")

// The statements sent ahead of each statement, in its transaction: its scope, and when
// the context asks for one, its lock timeout.
const (
	setScope            = `SELECT set_config('opbroker.tenant', $1, true)`
	setScopeLockTimeout = `SELECT set_config('opbroker.tenant', $1, true), set_config('lock_timeout', $2, true)`
)

// scopeOf returns the scope of ctx as the setting spells it. A single tenant's scope
// holding a comma would name several tenants: it is refused (tenant ids never hold one).
func scopeOf(ctx context.Context) (string, error) {
	switch scope := ctx.Value(scopeKey{}).(type) {
	case tenantList:
		return string(scope), nil
	case string:
		if scope != "" && !strings.Contains(scope, ",") {
			return scope, nil
		}
	}
	return "", ErrNoScope
}

type lockTimeoutKey struct{}

// withLockTimeout returns ctx whose statements give up waiting for a lock after d
// (PostgreSQL's lock_timeout, for the statement's transaction only).
func withLockTimeout(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, lockTimeoutKey{}, d)
}

// query runs one statement in the context's scope, in one round trip.
func (s *Store) query(ctx context.Context, sql string, args ...any) pgx.Rows {
	scope, err := scopeOf(ctx)
	if err != nil {
		return &failedRows{err: err}
	}
	batch := &pgx.Batch{}
	if d, ok := ctx.Value(lockTimeoutKey{}).(time.Duration); ok {
		batch.Queue(setScopeLockTimeout, scope, fmt.Sprintf("%dms", max(1, d.Milliseconds())))
	} else {
		batch.Queue(setScope, scope)
	}
	batch.Queue(sql, args...)
	results := s.pool.SendBatch(ctx, batch)
	if _, err := results.Exec(); err != nil {
		results.Close()
		return &failedRows{err: err}
	}
	rows, _ := results.Query()
	return &batchRows{Rows: rows, results: results}
}

// queryRow is query for one row: pgx.ErrNoRows when there is none.
func (s *Store) queryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return &firstRow{rows: s.query(ctx, sql, args...)}
}

// exec runs one statement that returns no rows in the context's scope.
func (s *Store) exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	rows := s.query(ctx, sql, args...)
	rows.Close()
	return rows.CommandTag(), rows.Err()
}

// inTx runs fn in a transaction in the context's scope.
func (s *Store) inTx(ctx context.Context, opts pgx.TxOptions, fn func(pgx.Tx) error) error {
	scope, err := scopeOf(ctx)
	if err != nil {
		return err
	}
	return pgx.BeginTxFunc(ctx, s.pool, opts, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, setScope, scope); err != nil {
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
