package store

import (
	"context"
	"errors"
	"fmt"
)

// Ping runs one trivial statement through the store's pool: it fails when no
// connection answers before ctx ends, with ErrUnavailable when the database could not
// be reached. It reads nothing of the ledger and needs no tenant scope.
func (s *Store) Ping(ctx context.Context) error {
	if _, err := s.pool.Exec(ctx, "SELECT 1"); err != nil {
		return fmt.Errorf("store: ping: %w", translate(err))
	}
	return nil
}

// ErrNotReplicated is returned by CheckSynchronousReplication when a commit the broker
// acknowledges would not wait for a standby, so that a failover could lose it.
var ErrNotReplicated = errors.New("commits do not wait for a synchronous standby")

// CheckSynchronousReplication pings the database as Ping does and checks, on the
// broker's own connection (so with every per-role or per-database setting applied),
// that a commit waits until a standby has it: the server is a primary,
// synchronous_standby_names names a standby and synchronous_commit is on or
// remote_apply (remote_write and local would acknowledge a commit a standby may not
// have written to disk). It fails with ErrNotReplicated, saying which setting is wrong.
func (s *Store) CheckSynchronousReplication(ctx context.Context) error {
	var commit, standbys string
	var standby bool
	err := s.pool.QueryRow(ctx, `SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
		pg_is_in_recovery()`).Scan(&commit, &standbys, &standby)
	if err != nil {
		return fmt.Errorf("store: checking replication: %w", translate(err))
	}
	switch {
	case standby:
		return fmt.Errorf("%w: the server is a standby", ErrNotReplicated)
	case standbys == "":
		return fmt.Errorf("%w: synchronous_standby_names is empty", ErrNotReplicated)
	case commit != "on" && commit != "remote_apply":
		return fmt.Errorf("%w: synchronous_commit is %s (on or remote_apply needed)", ErrNotReplicated, commit)
	}
	return nil
}
