package store

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"maps"
	neturl "net/url"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// versionTable is unqualified on purpose: it lives in the first schema of the
// connection's search_path, like every other table of the ledger.
const versionTable = "opbroker_schema_version"

func newMigrator(ctx context.Context, conn *pgxpool.Conn) (*migrate.Migrator, error) {
	m, err := migrate.NewMigrator(ctx, conn.Conn(), versionTable)
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
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	defer conn.Release()
	m, err := newMigrator(ctx, conn)
	if err != nil {
		return err
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	return nil
}

// CheckSchema returns an error unless the schema is at the version this binary expects,
// so that a server never runs against a schema it does not know.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("store: check schema: %w", err)
	}
	defer conn.Release()
	m, err := newMigrator(ctx, conn)
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
		WHERE oid IN ('operations'::regclass, 'operation_events'::regclass, 'operation_attempts'::regclass)
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

// Provision prepares a database for the broker from an administrator's connection
// string: an ordinary role (NOLOGIN, no superuser, no BYPASSRLS) owning a schema, both
// created when missing. It returns the connection string that connects with the
// administrator's credentials as that role (the role startup parameter) with the schema
// on the search path, for migrations and the broker alike. For opbroker dev and tests;
// in production the role is created by whoever runs the database (docs/security.md).
func Provision(ctx context.Context, adminURL, role, schema string) (string, error) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", fmt.Errorf("store: provision: %w", err)
	}
	defer conn.Close(ctx)
	ident := pgx.Identifier{role}.Sanitize()
	// Concurrent provisioning (parallel test binaries) may race to create the role.
	if _, err := conn.Exec(ctx, `DO $$ BEGIN
			CREATE ROLE `+ident+` NOLOGIN NOSUPERUSER NOBYPASSRLS;
		EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
		END $$`); err != nil {
		return "", fmt.Errorf("store: provision role: %w", err)
	}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{schema}.Sanitize()+` AUTHORIZATION `+ident); err != nil {
		return "", fmt.Errorf("store: provision schema: %w", err)
	}
	return WithParams(adminURL, map[string]string{"search_path": schema, "role": role})
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

// DropSchema removes a schema made by Provision, with everything in it, from an
// administrator's connection string.
func DropSchema(ctx context.Context, adminURL, schema string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("store: drop schema: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("store: drop schema: %w", err)
	}
	return nil
}

// WithParams sets connection parameters in a connection string of either form.
func WithParams(conn string, params map[string]string) (string, error) {
	keys := slices.Sorted(maps.Keys(params))
	if !strings.Contains(conn, "://") {
		for _, k := range keys {
			conn += " " + k + "=" + params[k]
		}
		return conn, nil
	}
	u, err := neturl.Parse(conn)
	if err != nil {
		return "", err
	}
	q := u.Query()
	for _, k := range keys {
		q.Set(k, params[k])
	}
	u.RawQuery = q.Encode()
	return u.String(), nil
}
