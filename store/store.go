package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Store reads and writes the ledger. It is safe for concurrent use.
type Store struct {
	pool     *pgxpool.Pool
	wake     *wakeups // new work
	events   *wakeups // new events
	outcomes *outcomeCombiner
}

// New returns a Store over pool. The schema must be migrated (Migrate).
func New(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool, wake: newWakeups(workChannel), events: newWakeups(eventsChannel),
		outcomes: &outcomeCombiner{writers: make(chan struct{}, outcomeWriters)}}
}

// PrepareParams describes an intent to record.
type PrepareParams struct {
	TenantID         string
	OperationType    string
	IntentRef        string
	ContentType      string
	Payload          []byte
	PayloadSHA256    []byte // of the canonical payload (package payload)
	SupersedesID     uuid.NullUUID
	Labels           map[string]string
	DispatchDeadline *time.Time
	// Actor is recorded on the creation event.
	Actor string
	// RejectCreation, when set, is returned instead of creating an operation: an intent
	// already recorded is still returned (or refused for another payload), a new one is
	// not recorded. It lets a retry of a request that is no longer acceptable as new (a
	// dispatch deadline now past) still find its operation.
	RejectCreation error
}

// Prepare records an intent, or returns the operation that already records it.
//
// It is idempotent and safe under any number of concurrent identical calls: exactly one
// operation is created, the others wait for it on the unique index and return it with
// created=false. If the intent is recorded with another payload hash it returns a
// *PayloadMismatchError and changes nothing. A SupersedesID that does not exist in the
// tenant is ErrSupersededNotFound.
func (s *Store) Prepare(ctx context.Context, p PrepareParams) (op Operation, created bool, err error) {
	if p.RejectCreation != nil {
		existing, err := s.FindByIntent(ctx, p.TenantID, p.OperationType, p.IntentRef)
		if errors.Is(err, ErrNotFound) {
			return Operation{}, false, p.RejectCreation
		}
		if err != nil {
			return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
		}
		return replay(existing, p)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
	}
	labels := p.Labels
	if labels == nil {
		labels = map[string]string{}
	}
	rows := s.query(ctx, `
		WITH ins AS (
			INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, content_type,
				payload, payload_sha256, supersedes_id, labels, dispatch_deadline)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
			ON CONFLICT ON CONSTRAINT operations_intent_key DO NOTHING
			RETURNING *
		), ev AS (`+eventsFrom("ins", "NULL", "$11", "NULL", "NULL")+`)
		SELECT `+operationColumns+` FROM ins`,
		p.TenantID, id, p.OperationType, p.IntentRef, p.ContentType,
		p.Payload, p.PayloadSHA256, p.SupersedesID, labels, p.DispatchDeadline, p.Actor)
	op, err = pgx.CollectExactlyOneRow(rows, scanOperation)
	if err == nil {
		s.wake.signal()
		s.events.signal()
		return op, true, nil
	}
	if err = translate(err); !errors.Is(err, ErrNotFound) {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
	}

	// The intent was already recorded (the conflicting insert waited for it to commit).
	existing, err := s.FindByIntent(ctx, p.TenantID, p.OperationType, p.IntentRef)
	if err != nil {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
	}
	return replay(existing, p)
}

// replay answers a Prepare whose intent is already recorded.
func replay(existing Operation, p PrepareParams) (Operation, bool, error) {
	if !bytes.Equal(existing.PayloadSHA256, p.PayloadSHA256) {
		return Operation{}, false, &PayloadMismatchError{Existing: existing}
	}
	return existing, false, nil
}

// FindByIntent returns the operation recording an intent, or ErrNotFound.
func (s *Store) FindByIntent(ctx context.Context, tenantID, operationType, intentRef string) (Operation, error) {
	rows := s.query(ctx, `SELECT `+operationColumns+` FROM operations
		WHERE tenant_id = $1 AND operation_type = $2 AND intent_ref = $3`,
		tenantID, operationType, intentRef)
	op, err := pgx.CollectExactlyOneRow(rows, scanOperation)
	if err != nil {
		return Operation{}, fmt.Errorf("store: find by intent: %w", translate(err))
	}
	return op, nil
}

// Get returns one operation of a tenant, or ErrNotFound.
func (s *Store) Get(ctx context.Context, tenantID string, id uuid.UUID) (Operation, error) {
	rows := s.query(ctx, `SELECT `+operationColumns+` FROM operations
		WHERE tenant_id = $1 AND operation_id = $2`, tenantID, id)
	op, err := pgx.CollectExactlyOneRow(rows, scanOperation)
	if err != nil {
		return Operation{}, fmt.Errorf("store: get: %w", translate(err))
	}
	return op, nil
}

// ListParams selects a page of a tenant's operations, newest first.
type ListParams struct {
	TenantID string
	States   []State // empty: all
	// Before continues a listing after the last operation of the previous page.
	Before uuid.NullUUID
	Limit  int
}

// List returns up to Limit operations and whether more follow.
func (s *Store) List(ctx context.Context, p ListParams) (ops []Operation, more bool, err error) {
	states := stateNames(p.States)
	rows := s.query(ctx, `SELECT `+operationColumns+` FROM operations
		WHERE tenant_id = $1
		  AND (coalesce(cardinality($2::text[]), 0) = 0 OR state = ANY ($2::text[]::operation_state[]))
		  AND ($3::uuid IS NULL OR operation_id < $3)
		ORDER BY operation_id DESC
		LIMIT $4`, p.TenantID, states, p.Before, p.Limit+1)
	ops, err = pgx.CollectRows(rows, scanOperation)
	if err != nil {
		return nil, false, fmt.Errorf("store: list: %w", translate(err))
	}
	if len(ops) > p.Limit {
		return ops[:p.Limit], true, nil
	}
	return ops, false, nil
}

// CancelParams names the operation to cancel.
type CancelParams struct {
	TenantID string
	ID       uuid.UUID
	Actor    string
}

// Cancel moves a PREPARED operation to CANCELLED with one conditional update, so it can
// never race a claim. Cancelling a CANCELLED operation returns it unchanged; any other
// state is a *StateError.
func (s *Store) Cancel(ctx context.Context, p CancelParams) (Operation, error) {
	rows := s.query(ctx, `
		WITH upd AS (
			UPDATE operations SET state = 'CANCELLED', revision = revision + 1, updated_at = now()
			WHERE tenant_id = $1 AND operation_id = $2 AND state = 'PREPARED'
			RETURNING *
		), ev AS (`+eventsFrom("upd", "'PREPARED'", "$3", "NULL", "NULL")+`)
		SELECT `+operationColumns+` FROM upd`, p.TenantID, p.ID, p.Actor)
	op, err := pgx.CollectExactlyOneRow(rows, scanOperation)
	if err == nil {
		s.events.signal()
		return op, nil
	}
	if err = translate(err); !errors.Is(err, ErrNotFound) {
		return Operation{}, fmt.Errorf("store: cancel: %w", err)
	}
	current, err := s.Get(ctx, p.TenantID, p.ID)
	if err != nil {
		return Operation{}, err
	}
	if current.State == StateCancelled {
		return current, nil
	}
	return Operation{}, &StateError{Operation: current, Want: StatePrepared}
}

// CountByState returns how many operations of the context's scope are in each state.
func (s *Store) CountByState(ctx context.Context) (map[State]int64, error) {
	rows := s.query(ctx, `SELECT state, count(*) FROM operations GROUP BY state`)
	counts := map[State]int64{}
	var state State
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		counts[state] = n
		return nil
	}); err != nil {
		return nil, fmt.Errorf("store: count by state: %w", translate(err))
	}
	return counts, nil
}
