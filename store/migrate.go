package store

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// versionTable is unqualified on purpose: it lives in the first schema of the
// connection's search_path, like every other table of the ledger.
const versionTable = "opbroker_schema_version"

func newMigrator(ctx context.Context, conn *pgx.Conn) (*migrate.Migrator, error) {
	m, err := migrate.NewMigrator(ctx, conn, versionTable)
	if err != nil {
		return nil, fmt.Errorf("store: migrator: %w", err)
	}
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	if err := m.LoadMigrations(sub); err != nil {
		return nil, fmt.Errorf("store: load migrations: %w", err)
	}
	return m, nil
}

// Migrate brings the schema up to date. It is safe to run from several processes at
// once: the migrator holds an advisory lock while it works.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	return migrateWith(ctx, pool, func(m *migrate.Migrator) error { return m.Migrate(ctx) })
}

// migrateWith runs migrate with the ledger's migrations, on a connection of its own
// (migrationConn).
func migrateWith(ctx context.Context, pool *pgxpool.Pool, migrate func(*migrate.Migrator) error) error {
	conn, err := migrationConn(ctx, pool)
	if err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	m, err := newMigrator(ctx, conn)
	if err != nil {
		return err
	}
	if err := migrate(m); err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	return nil
}

// migrationConn opens a connection like pool's, but with pg_temp last in its search path
// from its start. PostgreSQL searches a session's temporary tables before any schema of
// the path unless the path names pg_temp, so a function that a migration pins with SET
// search_path FROM CURRENT then reads the ledger's tables, never a temporary table of
// the same name (migration 030). From its start, because the migrator resets the session
// (RESET ALL) after each migration, to the values it started with.
func migrationConn(ctx context.Context, pool *pgxpool.Pool) (*pgx.Conn, error) {
	var path string
	if err := pool.QueryRow(ctx, `SELECT current_setting('search_path')`).Scan(&path); err != nil {
		return nil, err
	}
	cfg := pool.Config().ConnConfig.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["search_path"] = path + ", pg_temp"
	return pgx.ConnectConfig(ctx, cfg)
}

// CheckSchema returns an error unless the schema is at the version this binary expects,
// so that a server never runs against a schema it does not know.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("store: check schema: %w", err)
	}
	defer conn.Release()
	m, err := newMigrator(ctx, conn.Conn())
	if err != nil {
		return err
	}
	have, err := m.GetCurrentVersion(ctx)
	if err != nil {
		return fmt.Errorf("store: check schema: %w", err)
	}
	want := int32(len(m.Migrations))
	if have != want {
		return fmt.Errorf("store: schema is at version %d, this binary needs %d: run `opbroker migrate`", have, want)
	}
	return checkIsolation(ctx, conn)
}

// checkIsolation fails unless row-level security binds the connection's role: it is
// neither a superuser nor BYPASSRLS, and every tenant table enforces RLS on its owner.
func checkIsolation(ctx context.Context, conn *pgxpool.Conn) error {
	var role string
	var bypass bool
	if err := conn.QueryRow(ctx, `SELECT current_user, rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = current_user`).
		Scan(&role, &bypass); err != nil {
		return fmt.Errorf("store: check isolation: %w", err)
	}
	if bypass {
		return fmt.Errorf("store: the database role %q is a superuser or has BYPASSRLS, so row-level security would not "+
			"bind it: serve as an ordinary role that owns the schema (docs/security.md)", role)
	}
	rows, _ := conn.Query(ctx, `SELECT relname FROM pg_class
		WHERE oid IN ('operations'::regclass, 'operation_keys'::regclass, 'operation_events'::regclass, 'stale_outcomes'::regclass,
			'payload_mismatches'::regclass, 'inbound_evidence'::regclass)
		  AND NOT (relrowsecurity AND relforcerowsecurity) ORDER BY relname`)
	unforced, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("store: check isolation: %w", err)
	}
	if len(unforced) > 0 {
		return fmt.Errorf("store: row-level security is not forced on %v: run `opbroker migrate`", unforced)
	}
	return nil
}

// MigrateURL is Migrate on a pool of its own over the database at url.
func MigrateURL(ctx context.Context, url string) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	defer pool.Close()
	return Migrate(ctx, pool)
}
