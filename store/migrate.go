package store

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

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
	return nil
}
