package store

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Store reads and writes the ledger. It is safe for concurrent use.
type Store struct {
	pool     *pgxpool.Pool
	wake     *wakeups // new work
	events   *wakeups // new events
	outcomes *combiner[OutcomeParams, recordedOutcomes]
	prepares *combiner[prepareCall, []prepared]
}

// New returns a Store over pool. The schema must be migrated (Migrate).
func New(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool, wake: newWakeups(workChannel), events: newWakeups(eventsChannel),
		outcomes: newCombiner[OutcomeParams, recordedOutcomes](maxOutcomeBatch, outcomeWriters, 0),
		prepares: newCombiner[prepareCall, []prepared](maxPrepareBatch, prepareWriters, prepareStall)}
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
	// NotBefore, when set, schedules the operation: it is not sent earlier, and may be
	// cancelled until then. It is part of the intent: a repeat with another NotBefore is
	// a *PayloadMismatchError.
	NotBefore *time.Time
	// Actor is recorded on the creation event.
	Actor string
	// TraceParent is the W3C traceparent of the call that prepared the intent (package
	// tracing), or "": its sends and lookups link back to that trace.
	TraceParent string
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
// tenant is ErrSupersededNotFound. An amendment (SupersedesID) of a PREPARED operation
// cancels it in the statement that records the amendment, so that it is never sent; of
// an operation that is IN_FLIGHT, UNKNOWN or ESCALATED it is a
// *SupersededUnresolvedError and records nothing; of a terminal one it is recorded.
//
// Intents prepared at the same time are written together, in one statement and one
// commit (see combiner; at most maxPrepareBatch per statement): across tenants, in the
// scope of exactly the tenants of the calls in the statement. Each intent keeps its own
// answer, as if it had been prepared alone.
func (q Scope) Prepare(ctx context.Context, p PrepareParams) (op Operation, created bool, err error) {
	if p.RejectCreation != nil {
		existing, err := q.findByIntent(ctx, p.TenantID, p.OperationType, p.IntentRef)
		if errors.Is(err, ErrNotFound) {
			return Operation{}, false, p.RejectCreation
		}
		if err != nil {
			return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
		}
		return q.replay(ctx, existing, p)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
	}
	scope := q.tenants
	if scope == "" {
		return Operation{}, false, ErrNoScope
	}
	if scope != allTenants && scope != p.TenantID {
		// Alone, row-level security would refuse it; in a statement combined with that
		// tenant's own calls, it would not.
		return Operation{}, false, fmt.Errorf("store: prepare: an intent of tenant %q in the scope of tenant %q", p.TenantID, scope)
	}
	// Calls in one tenant's scope are combined with other tenants' (the statement then
	// runs in the scope of exactly its callers' tenants); calls in every tenant's scope
	// (the broker's own) only with each other.
	lane := "tenants"
	if scope == allTenants {
		lane = allTenants
	}
	call := prepareCall{PrepareParams: p, id: id, scope: scope}
	results, i, err := q.s.prepares.do(ctx, lane, call, q.s.insertEach)
	var result prepared
	if err == nil {
		if result = results[i]; result.alone {
			result = q.s.prepareAlone(ctx, call)
		}
		err = result.err
	}
	var unresolved *SupersededUnresolvedError
	if errors.As(err, &unresolved) {
		// A retry of an amendment recorded earlier still gets its operation.
		if existing, findErr := q.findByIntent(ctx, p.TenantID, p.OperationType, p.IntentRef); findErr == nil {
			return q.replay(ctx, existing, p)
		}
	}
	if err != nil {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
	}
	if result.created {
		return result.op, true, nil
	}

	// The intent was already recorded (the conflicting insert waited for it to commit).
	existing, err := q.findByIntent(ctx, p.TenantID, p.OperationType, p.IntentRef)
	if err != nil {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", err)
	}
	return q.replay(ctx, existing, p)
}

// replay is replay, counting a payload mismatch in the ledger (payload_mismatches) for
// its statistics. The refusal stands whether or not it is counted.
func (q Scope) replay(ctx context.Context, existing Operation, p PrepareParams) (Operation, bool, error) {
	op, created, err := replay(existing, p)
	var mismatch *PayloadMismatchError
	if errors.As(err, &mismatch) {
		if _, countErr := q.exec(ctx, `INSERT INTO payload_mismatches (tenant_id, operation_id, payload_sha256) VALUES ($1, $2, $3)`,
			existing.TenantID, existing.ID, p.PayloadSHA256); countErr != nil {
			return op, created, errors.Join(err, fmt.Errorf("store: prepare: counting the refusal: %w", translate(countErr)))
		}
	}
	return op, created, err
}

// At most maxPrepareBatch intents per statement, and prepareWriters statements at once:
// the second only for a batch that is full or that finds the statement on the first
// running for prepareStall (combiner). One at a time, the batches are larger: fewer statements and commits per
// intent (docs/benchmarks.md). The second writer is for a statement that waits, up to
// combinedLockWait, on another transaction's lock.
const (
	maxPrepareBatch = 64
	prepareWriters  = 2
	prepareStall    = 10 * time.Millisecond
)

// prepareCall is one Prepare in a combined insert: the intent, its new operation's id,
// and its caller's scope.
type prepareCall struct {
	PrepareParams
	id    uuid.UUID
	scope string
}

// prepared is one call's answer from a combined insert: the operation it created, or
// none (the intent was already recorded), or its own error; or alone: the call is to be
// recorded on its own (insertEach).
type prepared struct {
	op      Operation
	created bool
	err     error
	alone   bool
}

// insertEach records intents together, in the scope of their callers' tenants, and
// answers each. When the combined statement fails for anything but the database being
// unreachable (one intent breaks a constraint, say), each intent is answered alone:
// its caller records it on its own, in its own scope (prepareAlone), so each gets its
// own answer.
//
// The statement waits for a lock at most combinedLockWait: an intent whose duplicate is
// still being written by a transaction that does not finish (its client stalled between
// the statement and the commit) must hold up neither the intents written with it nor,
// since the statement holds one of the lane's few writers, every other caller's. Alone,
// on its caller's goroutine and off the lane's writers, it waits as long as its caller
// does.
func (s *Store) insertEach(ctx context.Context, calls []prepareCall) ([]prepared, error) {
	answers, err := s.scopeOfCalls(calls).insertOperations(withLockTimeout(ctx, combinedLockWait), calls)
	if err != nil && !errors.Is(err, ErrUnavailable) && (len(calls) > 1 || isLockTimeout(err)) {
		results := make([]prepared, len(calls))
		for i := range results {
			results[i].alone = true
		}
		return results, nil
	}
	if err != nil {
		return nil, err
	}
	results := make([]prepared, len(calls))
	for i, c := range calls {
		results[i] = answers[c.id]
	}
	return results, nil
}

// combinedLockWait bounds a combined insert's wait for a lock (see insertEach).
const combinedLockWait = time.Second

// aloneTimeout bounds an intent recorded on its own (prepareAlone); a variable for the
// tests.
var aloneTimeout = combineTimeout

// isLockTimeout reports whether err is a statement's lock wait ending at lock_timeout.
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" // lock_not_available
}

// prepareAlone records c on its own, in its caller's scope: for a call that insertEach
// answered alone. It waits at most aloneTimeout, as a combined statement does
// (combineTimeout), so that callers with no deadline of their own, waiting on a
// duplicate whose writer stalls, do not hold the pool's connections for good.
func (s *Store) prepareAlone(ctx context.Context, c prepareCall) prepared {
	ctx, cancel := context.WithTimeout(ctx, aloneTimeout)
	defer cancel()
	answers, err := s.scopeOfCalls([]prepareCall{c}).insertOperations(ctx, []prepareCall{c})
	if err != nil {
		return prepared{err: err}
	}
	return answers[c.id]
}

// scopeOfCalls returns the scope of the callers of calls: exactly their tenants, or
// every tenant when that is what they all had.
func (s *Store) scopeOfCalls(calls []prepareCall) Scope {
	scopes := make([]string, len(calls))
	for i, c := range calls {
		scopes[i] = c.scope
	}
	return s.tenantsOf(scopes)
}

// insertOperationsSQL inserts intents together (insertOperations). Its CTE sup locks
// the operations the intents supersede, in one order, and reads their current state,
// each looked up on its own: a subquery that locks is never merged into a join, and a
// semi-join here was planned, from a small ledger, as a hash join over every operation.
// Without sequential scans (setScope): from statistics of a one-page ledger, the
// cancellation below joined every operation. The plans kept from a small ledger are
// checked on a grown one in plans_test.go. An amendment of one that may still cause or
// have caused its effect is refused; one of a PREPARED operation cancels it in this
// statement, so that it is never sent; one of a terminal operation is recorded as it
// is. An amendment's creation event says what it found (reason SUPERSEDES_<state>),
// the cancellation's reason is SUPERSEDED.
var insertOperationsSQL = compileNamed(`
		WITH u AS (
			SELECT * FROM unnest(@tenant_ids::text[], @operation_ids::uuid[], @operation_types::text[], @intent_refs::text[],
				@content_types::text[], @payloads::bytea[], @payload_sha256s::bytea[], @supersedes_ids::uuid[],
				@labels::text[]::jsonb[], @dispatch_deadlines::timestamptz[], @actors::text[], @not_befores::timestamptz[],
				@trace_parents::text[])
				AS u (tenant_id, operation_id, operation_type, intent_ref,
					content_type, payload, payload_sha256, supersedes_id,
					labels, dispatch_deadline, actor, not_before,
					trace_parent)
		), sup AS (
			SELECT o.tenant_id, o.operation_id, o.state
			FROM (SELECT DISTINCT tenant_id, supersedes_id FROM u WHERE supersedes_id IS NOT NULL
				ORDER BY tenant_id, supersedes_id) s
			CROSS JOIN LATERAL (SELECT tenant_id, operation_id, state FROM operations
				WHERE tenant_id = s.tenant_id AND operation_id = s.supersedes_id FOR UPDATE) o
		), refused AS (
			SELECT u.operation_id AS call_id, sup.tenant_id, sup.operation_id, sup.state
			FROM u JOIN sup ON sup.tenant_id = u.tenant_id AND sup.operation_id = u.supersedes_id
			WHERE sup.state IN `+unresolvedStates+`
		), keyed AS (
			INSERT INTO operation_keys (tenant_id, operation_id, operation_type, intent_ref)
			SELECT tenant_id, operation_id, operation_type, intent_ref
			FROM u WHERE operation_id NOT IN (SELECT call_id FROM refused)
			ORDER BY tenant_id, operation_type, intent_ref
			ON CONFLICT ON CONSTRAINT operation_keys_intent DO NOTHING
			RETURNING operation_id, remote_key
		), ins AS (
			INSERT INTO operations (tenant_id, operation_id, operation_type, intent_ref, remote_key, content_type,
				payload, payload_sha256, supersedes_id, labels, dispatch_deadline, not_before, next_check_at, trace_parent)
			SELECT tenant_id, operation_id, operation_type, intent_ref, remote_key, content_type,
				payload, payload_sha256, supersedes_id, labels, dispatch_deadline, not_before, not_before, trace_parent
			FROM u JOIN keyed USING (operation_id)
			RETURNING *
		), ev AS (`+eventsFrom(`ins JOIN (SELECT operation_id, actor FROM u) a USING (operation_id)
			LEFT JOIN (SELECT tenant_id AS sup_tenant, operation_id AS sup_id, state AS sup_state FROM sup) s
				ON s.sup_tenant = ins.tenant_id AND s.sup_id = ins.supersedes_id`,
	"NULL", "actor", "'SUPERSEDES_' || sup_state", "NULL")+`
		), cancelled AS (
			UPDATE operations o SET state = 'CANCELLED', revision = o.revision + 1, next_check_at = NULL, updated_at = now()
			FROM ins JOIN u USING (operation_id), sup
			WHERE o.tenant_id = ins.tenant_id AND o.operation_id = ins.supersedes_id
				AND sup.tenant_id = o.tenant_id AND sup.operation_id = o.operation_id AND sup.state = 'PREPARED'
			RETURNING o.*, u.actor AS amendment_actor
		), cancel_ev AS (`+eventsFrom("cancelled", "'PREPARED'", "amendment_actor", "'SUPERSEDED'", "NULL")+`)
		SELECT NULL::uuid, NULL::operation_state, `+operationColumns+` FROM ins
		UNION ALL
		SELECT r.call_id, r.state, x.* FROM refused r CROSS JOIN LATERAL (
			SELECT `+operationColumns+` FROM operations
			WHERE tenant_id = r.tenant_id AND operation_id = r.operation_id) x`,
	"tenant_ids", "operation_ids", "operation_types", "intent_refs", "content_types", "payloads", "payload_sha256s",
	"supersedes_ids", "labels", "dispatch_deadlines", "actors", "not_befores", "trace_parents")

// insertOperations inserts the intents not yet recorded, each with its creation event,
// in one statement, and answers each call by its operation's id: the operation it
// created, a *SupersededUnresolvedError, or nothing (the intent was already recorded).
// Rows go in in intent order, and superseded operations are locked in id order, so two
// statements with common intents wait for each other in one order and never deadlock.
func (q Scope) insertOperations(ctx context.Context, calls []prepareCall) (map[uuid.UUID]prepared, error) {
	n := len(calls)
	tenants, ids, types, intents := make([]string, n), make([][16]byte, n), make([]string, n), make([]string, n)
	contentTypes, payloads, digests := make([]string, n), make([][]byte, n), make([][]byte, n)
	supersedes, labels, deadlines, actors := make([]pgtype.UUID, n), make([]string, n), make([]*time.Time, n), make([]string, n)
	notBefore, traceParents := make([]*time.Time, n), make([]*string, n)
	for i, c := range calls {
		tenants[i], ids[i], types[i], intents[i] = c.TenantID, c.id, c.OperationType, c.IntentRef
		contentTypes[i], payloads[i], digests[i] = c.ContentType, c.Payload, c.PayloadSHA256
		supersedes[i] = pgtype.UUID{Bytes: c.SupersedesID.UUID, Valid: c.SupersedesID.Valid}
		deadlines[i], actors[i] = c.DispatchDeadline, c.Actor
		notBefore[i], traceParents[i] = c.NotBefore, nullIfEmpty(c.TraceParent)
		l := c.Labels
		if l == nil {
			l = map[string]string{}
		}
		js, err := json.Marshal(l)
		if err != nil {
			return nil, err
		}
		labels[i] = string(js)
	}
	rows := q.query(ctx, insertOperationsSQL.sql, insertOperationsSQL.args(pgx.NamedArgs{
		"tenant_ids": tenants, "operation_ids": ids, "operation_types": types, "intent_refs": intents,
		"content_types": contentTypes, "payloads": payloads, "payload_sha256s": digests, "supersedes_ids": supersedes,
		"labels": labels, "dispatch_deadlines": deadlines, "actors": actors, "not_befores": notBefore,
		"trace_parents": traceParents})...)
	answers := make(map[uuid.UUID]prepared, n)
	var created bool
	for rows.Next() {
		var op Operation
		var refusedCall uuid.NullUUID
		var supersededState *State
		if err := rows.Scan(append([]any{&refusedCall, &supersededState}, operationDest(&op)...)...); err != nil {
			rows.Close()
			return nil, translate(err)
		}
		if refusedCall.Valid {
			op.State = *supersededState // as locked, not as the statement's snapshot saw it
			answers[refusedCall.UUID] = prepared{err: &SupersededUnresolvedError{Superseded: op}}
			continue
		}
		answers[op.ID] = prepared{op: op, created: true}
		created = true
	}
	if err := rows.Err(); err != nil {
		return nil, translate(err)
	}
	if created {
		q.s.wake.signal()
		q.s.events.signal()
	}
	return answers, nil
}

// replay answers a Prepare whose intent is already recorded.
func replay(existing Operation, p PrepareParams) (Operation, bool, error) {
	if !bytes.Equal(existing.PayloadSHA256, p.PayloadSHA256) || !sameTime(existing.NotBefore, p.NotBefore) {
		return Operation{}, false, fmt.Errorf("store: prepare: %w", &PayloadMismatchError{Existing: existing})
	}
	return existing, false, nil
}

// sameTime reports whether two optional times are the same instant (the ledger keeps
// microseconds).
func sameTime(a, b *time.Time) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.Truncate(time.Microsecond).Equal(b.Truncate(time.Microsecond))
}

// findByIntent returns the operation recording an intent, or ErrNotFound.
func (q Scope) findByIntent(ctx context.Context, tenantID, operationType, intentRef string) (Operation, error) {
	rows := q.query(ctx, `SELECT `+operationColumns+` FROM operations
		WHERE tenant_id = $1 AND operation_id = (SELECT operation_id FROM operation_keys
			WHERE operation_type = $2 AND intent_ref = $3 AND tenant_id = $1)`,
		tenantID, operationType, intentRef)
	op, err := pgx.CollectExactlyOneRow(rows, scanOperation)
	return op, translate(err)
}

// Get returns one operation of a tenant, with its Contradiction if any, or ErrNotFound.
func (q Scope) Get(ctx context.Context, tenantID string, id uuid.UUID) (Operation, error) {
	rows := q.query(ctx, `SELECT `+contradictedColumns+` FROM `+contradicted+`
		WHERE o.tenant_id = $1 AND o.operation_id = $2`, tenantID, id)
	op, err := pgx.CollectExactlyOneRow(rows, scanContradicted)
	if err != nil {
		return Operation{}, fmt.Errorf("store: get: %w", translate(err))
	}
	return op, nil
}

// ListParams selects a page of a tenant's operations, newest first.
type ListParams struct {
	TenantID string
	States   []State // empty: all
	// IntentRef, when set, selects the operations of this intent reference whose type
	// is one of OperationTypes (the intent key leads with the type).
	IntentRef      string
	OperationTypes []string
	// RemoteRef, when set, selects the operations the target knows by this reference.
	RemoteRef string
	// Before continues a listing after the last operation of the previous page.
	Before uuid.NullUUID
	Limit  int
}

// List returns up to Limit operations, each with its Contradiction if any, and whether
// more follow.
func (q Scope) List(ctx context.Context, p ListParams) (ops []Operation, more bool, err error) {
	args := []any{p.TenantID, stateNames(p.States), p.Before, p.Limit + 1}
	var search string // each filter its own statement text, planned on its own index
	if p.IntentRef != "" {
		args = append(args, p.IntentRef, p.OperationTypes)
		search += ` AND o.operation_id IN (SELECT operation_id FROM operation_keys
			WHERE operation_type = ANY ($6::text[]) AND intent_ref = $5 AND tenant_id = $1)`
	}
	if p.RemoteRef != "" {
		args = append(args, p.RemoteRef)
		search += fmt.Sprintf(` AND o.remote_ref = $%d`, len(args))
	}
	rows := q.query(ctx, `SELECT `+contradictedColumns+` FROM `+contradicted+`
		WHERE o.tenant_id = $1
		  AND (coalesce(cardinality($2::text[]), 0) = 0 OR o.state = ANY ($2::text[]::operation_state[]))
		  AND ($3::uuid IS NULL OR o.operation_id < $3)`+search+`
		ORDER BY o.operation_id DESC
		LIMIT $4`, args...)
	ops, err = pgx.CollectRows(rows, scanContradicted)
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
func (q Scope) Cancel(ctx context.Context, p CancelParams) (Operation, error) {
	rows := q.query(ctx, `
		WITH upd AS (
			UPDATE operations SET state = 'CANCELLED', revision = revision + 1, next_check_at = NULL, updated_at = now()
			WHERE tenant_id = $1 AND operation_id = $2 AND state = 'PREPARED'
			RETURNING *
		), ev AS (`+eventsFrom("upd", "'PREPARED'", "$3", "NULL", "NULL")+`)
		SELECT `+operationColumns+` FROM upd`, p.TenantID, p.ID, p.Actor)
	op, err := pgx.CollectExactlyOneRow(rows, scanOperation)
	if err == nil {
		q.s.events.signal()
		return op, nil
	}
	if err = translate(err); !errors.Is(err, ErrNotFound) {
		return Operation{}, fmt.Errorf("store: cancel: %w", err)
	}
	current, err := q.Get(ctx, p.TenantID, p.ID)
	if err != nil {
		return Operation{}, err
	}
	if current.State == StateCancelled {
		return current, nil
	}
	return Operation{}, &StateError{Operation: current, Want: StatePrepared}
}
