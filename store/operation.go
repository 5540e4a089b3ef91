package store

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// State is an operation's state, spelled as in the schema's enum.
type State string

// The states of an operation; docs/state-machine.md draws the transitions.
const (
	StatePrepared       State = "PREPARED"
	StateInFlight       State = "IN_FLIGHT"
	StateSucceeded      State = "SUCCEEDED"
	StateFailedTerminal State = "FAILED_TERMINAL"
	StateUnknown        State = "UNKNOWN"
	StateEscalated      State = "ESCALATED"
	StateCancelled      State = "CANCELLED"
)

// stateNames spells states as the schema's enum does, for a text[] parameter (never
// nil: an empty filter is an empty array).
func stateNames(states []State) []string {
	names := make([]string, len(states))
	for i, s := range states {
		names[i] = string(s)
	}
	return names
}

// Terminal reports whether only an operator could move an operation out of s.
func (s State) Terminal() bool {
	return s == StateSucceeded || s == StateFailedTerminal || s == StateCancelled
}

// Observation is what the broker last learned about an operation's remote effect. It
// never holds payload bytes.
type Observation struct {
	ObservedAt time.Time `json:"observed_at"`
	Source     string    `json:"source"`
	Outcome    string    `json:"outcome"`
	HTTPStatus int       `json:"http_status,omitempty"`
	Summary    string    `json:"summary,omitempty"`
	// Evidence and EvidenceURL, for an operator's resolution: what was checked, and where.
	Evidence    string `json:"evidence,omitempty"`
	EvidenceURL string `json:"evidence_url,omitempty"`
	// Proposal, on an operation whose target asks for a second operator, is the
	// resolution proposed and waiting for approval; ProposedBy, on the resolution that
	// approval applied, names the operator who proposed it.
	Proposal   *Proposal `json:"proposal,omitempty"`
	ProposedBy string    `json:"proposed_by,omitempty"`
	// EventID, for evidence, is the id of the target's event it recorded
	// (store.InboundEvidence).
	EventID string `json:"event_id,omitempty"`
	// RetryAfterSeconds, for a send's answer, is the wait its Retry-After asked for (at
	// most an hour): a replay of an operation it left UNKNOWN waits for it.
	RetryAfterSeconds int64 `json:"retry_after_seconds,omitempty"`
}

// Proposal is a resolution one operator proposed and another must approve.
type Proposal struct {
	State      State     `json:"state"`
	RemoteRef  string    `json:"remote_ref,omitempty"`
	ProposedBy string    `json:"proposed_by"`
	ExpiresAt  time.Time `json:"expires_at"`
}

// Operation is a ledger row without its payload bytes.
type Operation struct {
	TenantID      string
	ID            uuid.UUID
	OperationType string
	IntentRef     string
	ContentType   string
	PayloadSHA256 []byte
	State         State
	Revision      int64
	FenceToken    int64
	AttemptCount  int32
	// NotExecuted counts the attempts the target answered with an answer its
	// documentation says was not executed. While it equals AttemptCount, nothing sent
	// has taken effect: such an operation may be PREPARED (or CANCELLED) again.
	NotExecuted int32
	// RemoteKey is the random key the operation is sent with (the idempotency key or
	// request id): not customer data, it finds the operation at the target.
	RemoteKey        uuid.UUID
	RemoteRef        string
	LastObservation  *Observation
	SupersedesID     uuid.NullUUID
	Labels           map[string]string
	DispatchDeadline *time.Time
	NotBefore        *time.Time // scheduled: not sent earlier
	FirstSentAt      *time.Time
	CreatedAt        time.Time
	UpdatedAt        time.Time

	// NextCheckAt is when the broker next acts on the operation: an UNKNOWN one's next
	// check, or a PREPARED one's next send after an answer documented as not executed.
	NextCheckAt *time.Time
	// Reconciliation of an UNKNOWN operation.
	Checks             int32
	Replays            int32
	AcceptedUnfinished bool
	Escalation         *Escalation

	// TraceParent is the W3C traceparent of the call that prepared it, or "".
	TraceParent string

	// Contradiction, as Scope.Get and Scope.List read an operation, is a verified success
	// of the target's that contradicts how the operation ended (ContradictionError): of
	// those, the one of the latest fence (for a FAILED_TERMINAL, the one StaleSuccess
	// finds), or nil.
	Contradiction *Contradiction
}

// Contradiction is a target's verified success, to a send, that came after the send's
// lease, of an operation the ledger ended FAILED_TERMINAL, or SUCCEEDED with another
// reference: the effect the target confirmed, by its reference, and when the answer was
// recorded.
type Contradiction struct {
	RemoteRef  string
	RecordedAt time.Time
}

// Escalation records who an operation was handed to, and why.
type Escalation struct {
	Owner       string    `json:"owner"`
	Reason      string    `json:"reason"`
	EscalatedAt time.Time `json:"escalated_at"`
}

// operationColumns is the select list that scanOperation reads, in order.
const operationColumns = `tenant_id, operation_id, operation_type, intent_ref, content_type,
	payload_sha256, state, revision, fence_token, attempt_count, not_executed, remote_key, coalesce(remote_ref, ''),
	last_observation, supersedes_id, labels, dispatch_deadline, not_before, first_sent_at, created_at, updated_at,
	next_check_at, checks, replays, accepted_unfinished, escalation, coalesce(trace_parent, '')`

func scanOperation(row pgx.CollectableRow) (Operation, error) {
	var op Operation
	err := row.Scan(operationDest(&op)...)
	return op, err
}

// contradicted is operations o joined to the first verified success that contradicts
// how o ended (contradicts), if any: the FROM clause of the statements that read
// operations with contradictedColumns.
var contradicted = `operations o LEFT JOIN LATERAL (
		SELECT s.remote_ref AS contradicting_ref, s.recorded_at AS contradicted_at FROM stale_outcomes s
		WHERE s.tenant_id = o.tenant_id AND s.operation_id = o.operation_id AND ` + contradicts("s", "o") + `
		ORDER BY s.fence_token DESC LIMIT 1) c ON true`

// contradictedColumns is operationColumns and the contradiction's, from contradicted,
// as scanContradicted reads them.
const contradictedColumns = operationColumns + `, contradicting_ref, contradicted_at`

func scanContradicted(row pgx.CollectableRow) (Operation, error) {
	var op Operation
	var ref *string
	var at *time.Time
	if err := row.Scan(operationDest(&op, &ref, &at)...); err != nil {
		return Operation{}, err
	}
	if at != nil {
		op.Contradiction = &Contradiction{RemoteRef: *ref, RecordedAt: *at}
	}
	return op, nil
}

// operationDest returns the scan destinations of operationColumns, then more, in one
// allocation. The ids are scanned as arrays of 16 bytes, which pgx fills from
// PostgreSQL's binary format directly (a uuid.UUID, a sql.Scanner, it fills through
// the id's text).
func operationDest(op *Operation, more ...any) []any {
	return append(append(make([]any, 0, 27+len(more)),
		&op.TenantID, (*[16]byte)(&op.ID), &op.OperationType, &op.IntentRef, &op.ContentType,
		&op.PayloadSHA256, &op.State, &op.Revision, &op.FenceToken, &op.AttemptCount, &op.NotExecuted, (*[16]byte)(&op.RemoteKey), &op.RemoteRef,
		&op.LastObservation, &op.SupersedesID, &op.Labels, &op.DispatchDeadline, &op.NotBefore, &op.FirstSentAt,
		&op.CreatedAt, &op.UpdatedAt, &op.NextCheckAt, &op.Checks, &op.Replays, &op.AcceptedUnfinished, &op.Escalation,
		&op.TraceParent), more...)
}

// eventsFrom returns the statement that appends one event for every row of the CTE
// rows, which holds operations rows as they are after a change: the one place that says
// what an event records. from, actor, reason and observation are SQL expressions; like
// rows, they are constants of this package or parameters, never input.
func eventsFrom(rows, from, actor, reason, observation string) string {
	return outcomeEventsFrom(rows, from, actor, reason, observation, "NULL")
}

// outcomeEventsFrom is eventsFrom for the outcome of a send, recorded by the holder of
// its claim: sent says whether its request can have left (false: it provably never did).
func outcomeEventsFrom(rows, from, actor, reason, observation, sent string) string {
	return `
			INSERT INTO operation_events (tenant_id, operation_id, revision, from_state, to_state, fence_token,
				actor, reason, observation, remote_ref, attempt_count, escalation, created_at, sent)
			SELECT tenant_id, operation_id, revision, ` + from + `::operation_state, state, fence_token,
				` + actor + `, ` + reason + `, ` + observation + `, remote_ref, attempt_count, escalation, updated_at,
				` + sent + ` FROM ` + rows + `
		`
}

// ErrNotFound means no operation has that id in that tenant.
var ErrNotFound = errors.New("operation not found")

// PayloadMismatchError means the intent is already recorded with another payload.
type PayloadMismatchError struct {
	Existing Operation
}

func (e *PayloadMismatchError) Error() string {
	return fmt.Sprintf("intent already recorded as operation %s with another payload", e.Existing.ID)
}

// StateError means the operation is not in a state that allows the change.
type StateError struct {
	Operation Operation
	Want      State
}

func (e *StateError) Error() string {
	return fmt.Sprintf("operation %s is %s, not %s", e.Operation.ID, e.Operation.State, e.Want)
}

// ErrSupersededNotFound means the operation named as superseded does not exist in the
// tenant.
var ErrSupersededNotFound = errors.New("superseded operation not found")

// unresolvedStates is the SQL list of the states of an operation that has been sent and
// whose effect is not settled: it may still happen, or have happened unconfirmed.
const unresolvedStates = `('IN_FLIGHT', 'UNKNOWN', 'ESCALATED')`

// SupersededUnresolvedError means an amendment named an operation that may still cause
// its effect, or caused it unconfirmed (IN_FLIGHT, UNKNOWN or ESCALATED): recording the
// amendment could put both effects at the target. It is refused until the superseded
// operation is resolved. Superseded holds the operation as it is now.
type SupersededUnresolvedError struct {
	Superseded Operation
}

func (e *SupersededUnresolvedError) Error() string {
	return fmt.Sprintf("the superseded operation %s is %s: it may still take effect, so it must be resolved before an amendment",
		e.Superseded.ID, e.Superseded.State)
}

// ErrUnavailable wraps errors of reaching the database: the connection failed, was lost,
// the server is shutting down or starting, or it is a standby (during a failover).
// Whatever the call was, it may be retried: every write of the ledger is idempotent or
// conditional.
var ErrUnavailable = errors.New("database unavailable")

// translate turns driver errors into the package's errors.
func translate(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrNotFound
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.ConstraintName == "operations_supersedes_fkey":
			return ErrSupersededNotFound
		case strings.HasPrefix(pgErr.Code, "08"), // connection exception
			strings.HasPrefix(pgErr.Code, "57P"), // operator intervention: shutdown, terminated, starting up
			pgErr.Code == "25006":                // read-only transaction: the connection reached a standby (a failover)
			return fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		return err
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) || pgconn.SafeToRetry(err) || pgconn.Timeout(err) || isNetError(err) {
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return err
}

func isNetError(err error) bool {
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF)
}
