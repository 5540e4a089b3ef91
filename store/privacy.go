package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// terminalStates is the SQL list of the states nothing moves an operation out of.
const terminalStates = `('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED')`

// ErrTenantHasOpenOperations means a tenant's data cannot be deleted yet: some of its
// operations may still cause, or have caused without confirmation, a remote effect.
var ErrTenantHasOpenOperations = errors.New("the tenant has operations that are not terminal")

// DeleteTenant deletes every operation of a tenant with its events and attempts, and
// returns how many operations it deleted. While any operation of the tenant is not
// terminal it deletes nothing and returns ErrTenantHasOpenOperations.
func (q Scope) DeleteTenant(ctx context.Context, tenantID string) (int64, error) {
	var deleted int64
	err := q.inTx(ctx, pgx.TxOptions{}, func(tx pgx.Tx) error {
		var open bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM operations
			WHERE tenant_id = $1 AND state NOT IN `+terminalStates+`)`, tenantID).Scan(&open); err != nil {
			return err
		}
		if open {
			return ErrTenantHasOpenOperations
		}
		tag, err := tx.Exec(ctx, `DELETE FROM operations WHERE tenant_id = $1 AND state IN `+terminalStates, tenantID)
		deleted = tag.RowsAffected()
		return err
	})
	if err != nil && !errors.Is(err, ErrTenantHasOpenOperations) {
		err = fmt.Errorf("store: delete tenant: %w", translate(err))
	}
	return deleted, err
}

// PurgeParams selects the payloads to purge.
type PurgeParams struct {
	// Retention is how long a terminal operation keeps its payload bytes.
	Retention time.Duration
	Limit     int
}

// PurgePayloads removes the payload bytes of up to Limit operations that have been
// terminal for longer than Retention, keeping their hash and events, and returns how
// many it purged. Nothing can send a terminal operation again, so the bytes have no use
// left; the schema refuses to purge any other.
func (q Scope) PurgePayloads(ctx context.Context, p PurgeParams) (int, error) {
	tag, err := q.exec(ctx, `UPDATE operations o SET payload = NULL
		FROM (SELECT tenant_id, operation_id FROM operations
			WHERE payload IS NOT NULL AND state IN `+terminalStates+` AND updated_at < now() - $1::interval
			LIMIT $2 FOR UPDATE SKIP LOCKED) due
		WHERE o.tenant_id = due.tenant_id AND o.operation_id = due.operation_id`, p.Retention, p.Limit)
	if err != nil {
		return 0, fmt.Errorf("store: purge payloads: %w", translate(err))
	}
	return int(tag.RowsAffected()), nil
}
