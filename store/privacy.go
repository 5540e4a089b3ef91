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

// DeleteTenant deletes every operation of a tenant with its events, stale outcomes and
// keys, and returns how many operations it deleted. While any operation of the tenant
// is not terminal it deletes nothing and returns ErrTenantHasOpenOperations.
func (q Scope) DeleteTenant(ctx context.Context, tenantID string) (int64, error) {
	var deleted int64
	// Read committed: the deletion's trigger then deletes the history as it is when the
	// operations are deleted, including events committed since the transaction began.
	err := q.inTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
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
	// Retentions is how long a terminal operation of each operation type keeps its payload
	// bytes; each must be positive.
	Retentions map[string]time.Duration
	// Default is the retention of every operation type Retentions does not list; 0 keeps
	// their payloads.
	Default time.Duration
	Limit   int
}

// PurgePayloads removes the payload bytes of up to Limit operations that have been
// terminal for longer than their type's retention, keeping their hash and events, and
// returns how many it purged. Nothing can send a terminal operation again, so the bytes
// have no use left; the schema refuses to purge any other.
func (q Scope) PurgePayloads(ctx context.Context, p PurgeParams) (int, error) {
	var unlisted *time.Duration // NULL: the payloads of the types Retentions does not list are kept
	if p.Default > 0 {
		unlisted = &p.Default
	}
	shortest := unlisted // NULL: no payload is due
	types, retentions := make([]string, 0, len(p.Retentions)), make([]time.Duration, 0, len(p.Retentions))
	for typ, r := range p.Retentions {
		if r <= 0 {
			return 0, fmt.Errorf("store: purge payloads: the retention of %q must be positive, not %s", typ, r)
		}
		types, retentions = append(types, typ), append(retentions, r)
		if shortest == nil || r < *shortest {
			shortest = &r
		}
	}
	// The bound on the shortest retention is implied by the per-type one; it lets the
	// purge index skip the operations terminal for less than any retention.
	tag, err := q.exec(ctx, `UPDATE operations o SET payload = NULL
		FROM (SELECT op.tenant_id, op.operation_id FROM operations op
			LEFT JOIN unnest(@operation_types::text[], @retentions::interval[]) AS r (operation_type, retention)
				ON r.operation_type = op.operation_type
			WHERE op.payload IS NOT NULL AND op.state IN `+terminalStates+`
				AND op.updated_at < now() - @shortest::interval
				AND op.updated_at < now() - coalesce(r.retention, @unlisted_retention::interval)
			LIMIT @limit FOR UPDATE OF op SKIP LOCKED) due
		WHERE o.tenant_id = due.tenant_id AND o.operation_id = due.operation_id`,
		pgx.NamedArgs{"operation_types": types, "retentions": retentions, "shortest": shortest,
			"unlisted_retention": unlisted, "limit": p.Limit})
	if err != nil {
		return 0, fmt.Errorf("store: purge payloads: %w", translate(err))
	}
	return int(tag.RowsAffected()), nil
}
