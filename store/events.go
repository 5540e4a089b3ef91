package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// Event is one change of an operation, as the event log records it: the operation's
// changing fields as they were after the change.
type Event struct {
	TenantID     string
	ID           uuid.UUID
	Revision     int64
	From         *State
	State        State
	FenceToken   int64
	Actor        string
	Reason       string
	Observation  *Observation
	RemoteRef    string
	AttemptCount int32
	Escalation   *Escalation
	At           time.Time
}

// Apply returns op as it was after the event: its immutable fields with the event's.
func (e Event) Apply(op Operation) Operation {
	op.Revision, op.State, op.FenceToken = e.Revision, e.State, e.FenceToken
	op.LastObservation, op.RemoteRef, op.AttemptCount, op.Escalation = e.Observation, e.RemoteRef, e.AttemptCount, e.Escalation
	op.UpdatedAt = e.At
	if e.State != StateUnknown {
		op.NextCheckAt = nil
	}
	return op
}

// OperationKey names an operation.
type OperationKey struct {
	TenantID string
	ID       uuid.UUID
}

// eventColumns is the select list of operation_events e that eventDest reads, in order.
const eventColumns = `e.tenant_id, e.operation_id, e.revision, e.from_state, e.to_state, e.fence_token, e.actor,
	coalesce(e.reason, ''), e.observation, coalesce(e.remote_ref, ''), coalesce(e.attempt_count, 0), e.escalation,
	e.created_at`

// eventDest returns the scan destinations of eventColumns.
func eventDest(e *Event) []any {
	return []any{&e.TenantID, &e.ID, &e.Revision, &e.From, &e.State, &e.FenceToken, &e.Actor, &e.Reason,
		&e.Observation, &e.RemoteRef, &e.AttemptCount, &e.Escalation, &e.At}
}

// Events returns an operation's events after a revision, in order, at most limit.
func (q Scope) Events(ctx context.Context, tenantID string, id uuid.UUID, afterRevision int64, limit int) ([]Event, error) {
	rows := q.query(ctx, `SELECT `+eventColumns+` FROM operation_events e
		WHERE e.tenant_id = $1 AND e.operation_id = $2 AND e.revision > $3
		ORDER BY e.revision LIMIT $4`, tenantID, id, afterRevision, limit)
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Event, error) {
		var e Event
		err := row.Scan(eventDest(&e)...)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: events: %w", translate(err))
	}
	return events, nil
}

// Revisions returns the current revision of each operation that exists, in one query.
func (q Scope) Revisions(ctx context.Context, keys []OperationKey) (map[OperationKey]int64, error) {
	tenants := make([]string, len(keys))
	ids := make([][16]byte, len(keys))
	for i, k := range keys {
		tenants[i], ids[i] = k.TenantID, k.ID
	}
	rows := q.query(ctx, `SELECT o.tenant_id, o.operation_id, o.revision
		FROM `+keyedRows("operations", "unnest($1::text[], $2::uuid[]) AS k (tenant_id, operation_id)", operationKey)+` f
		JOIN operations o ON o.ctid = f.ctid`,
		tenants, ids)
	out := map[OperationKey]int64{}
	var k OperationKey
	var rev int64
	_, err := pgx.ForEachRow(rows, []any{&k.TenantID, &k.ID, &rev}, func() error {
		out[k] = rev
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: revisions: %w", translate(err))
	}
	return out, nil
}
