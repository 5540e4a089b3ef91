package store

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

func nullIfZeroTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// EscalationsParams select escalated operations.
type EscalationsParams struct {
	TenantID       string   // "" for every tenant of the scope
	OperationTypes []string // nil for every type
	Owner          string   // "" for every owner; else a part of the owner
	Limit          int
	// After, when set, continues after that escalation, in the queue's order.
	After *EscalationPosition
}

// EscalationPosition is a place in the escalation queue: when an operation was
// escalated (by the database's reading of it), then its tenant and id.
type EscalationPosition struct {
	At       time.Time
	TenantID string
	ID       uuid.UUID
}

// Escalated is an ESCALATED operation and how long it has waited, by the database's
// clock.
type Escalated struct {
	Operation
	Waited time.Duration
	// Position is its place in the queue, to continue after it.
	Position EscalationPosition
}

// Escalations returns ESCALATED operations, oldest escalation first, at most p.Limit,
// and whether more wait. Through the partial index on ESCALATED operations.
func (q Scope) Escalations(ctx context.Context, p EscalationsParams) ([]Escalated, bool, error) {
	var after EscalationPosition
	if p.After != nil {
		after = *p.After
	}
	rows := q.query(ctx, `SELECT `+operationColumns+`, `+micros(`now() - (escalation->>'escalated_at')::timestamptz`)+`,
			(escalation->>'escalated_at')::timestamptz
		FROM operations
		WHERE state = 'ESCALATED' AND ($1 = '' OR tenant_id = $1) AND ($2::text[] IS NULL OR operation_type = ANY ($2))
			AND ($3 = '' OR strpos(escalation->>'owner', $3) > 0)
			AND ($5::timestamptz IS NULL OR ((escalation->>'escalated_at')::timestamptz, tenant_id, operation_id) > ($5, $6, $7))
		ORDER BY (escalation->>'escalated_at')::timestamptz, tenant_id, operation_id
		LIMIT $4`, p.TenantID, p.OperationTypes, p.Owner, p.Limit+1, nullIfZeroTime(after.At), after.TenantID, after.ID)
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Escalated, error) {
		var e Escalated
		var waited int64
		err := row.Scan(operationDest(&e.Operation, &waited, &e.Position.At)...)
		e.Waited, e.Position.TenantID, e.Position.ID = duration(waited), e.TenantID, e.ID
		return e, err
	})
	if err != nil {
		return nil, false, fmt.Errorf("store: escalations: %w", translate(err))
	}
	if len(out) > p.Limit {
		return out[:p.Limit], true, nil
	}
	return out, false, nil
}
