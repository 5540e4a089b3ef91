package store

import (
	"context"
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
