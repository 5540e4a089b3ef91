// Package provision prepares a PostgreSQL database for the broker where nobody else
// does: for opbroker dev, the tests, the chaos run and the benchmarks. It creates an
// ordinary role owning a schema from an administrator's connection, and drops the schema
// afterwards. In production the role and the schema are created by whoever runs the
// database (docs/security.md), and the broker only migrates (package store).
package provision

import (
	"context"
	"fmt"
	"maps"
	neturl "net/url"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Schema prepares a database for the broker from an administrator's connection
// string: an ordinary role (NOLOGIN, no superuser, no BYPASSRLS) owning a schema, both
// created when missing. It returns the connection string that connects with the
// administrator's credentials as that role (the role startup parameter) with the schema
// on the search path, for migrations and the broker alike. For opbroker dev and tests;
// in production the role is created by whoever runs the database (docs/security.md).
func Schema(ctx context.Context, adminURL, role, schema string) (string, error) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", fmt.Errorf("provision: %w", err)
	}
	defer conn.Close(ctx)
	ident := pgx.Identifier{role}.Sanitize()
	// Concurrent provisioning (parallel test binaries) may race to create the role.
	if _, err := conn.Exec(ctx, `DO $$ BEGIN
			CREATE ROLE `+ident+` NOLOGIN NOSUPERUSER NOBYPASSRLS;
		EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
		END $$`); err != nil {
		return "", fmt.Errorf("provision: role: %w", err)
	}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{schema}.Sanitize()+` AUTHORIZATION `+ident); err != nil {
		return "", fmt.Errorf("provision: schema: %w", err)
	}
	return WithParams(adminURL, map[string]string{"search_path": schema, "role": role})
}

// DropSchema removes a schema made by Schema, with everything in it, from an
// administrator's connection string.
func DropSchema(ctx context.Context, adminURL, schema string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("provision: drop schema: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("provision: drop schema: %w", err)
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
