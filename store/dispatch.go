package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Claimed is an operation the caller now holds: it may send it once, with this fence.
type Claimed struct {
	Operation
	Payload []byte

	// Times the database measured, by its own clock, when the claim was taken. A caller
	// turns them into deadlines on its own clock from a reading taken before it asked
	// for the claim, so that each falls no later than the database's; it never compares
	// a timestamp the database wrote with its own clock, which may be off by seconds.
	//
	// LeaseLeft is what was left of the lease; SinceFirstSend how long ago the
	// operation was first sent (zero before any send); DeadlineLeft what was left
	// before the dispatch deadline (nil without one; negative once it passed).
	LeaseLeft      time.Duration
	SinceFirstSend time.Duration
	DeadlineLeft   *time.Duration
	// KeyWindowLeft is what was left of the idempotency key's retention window, the
	// earliest end a claim gave it (nil when none did: a target without a key, or an
	// operation first sent before the window was recorded). KeyScope is the fingerprint
	// of the scope the key was sent in by the first send that may have executed
	// (target.Contract.KeyScope), or ""; LookupScope that of the lookup it was sent
	// under (target.Contract.LookupScope, hexadecimal), or "" (none, or sent before it
	// was recorded).
	KeyWindowLeft *time.Duration
	KeyScope      string
	LookupScope   string
}

// FairClaim selects what one claim takes, fairly across tenants: up to Limit operations
// of OperationTypes, at most PerTenant of one tenant, visiting at most MaxTenants tenants
// starting after AfterTenant (a rotating cursor: each claim continues where the last one
// stopped, so every tenant with work is reached within a bounded number of claims whatever
// the others' backlogs). Worker names the claimer (the lease owner), Lease how long it
// holds what it takes.
type FairClaim struct {
	OperationTypes []string
	Worker         string
	Lease          time.Duration
	Limit          int
	PerTenant      int
	MaxTenants     int
	AfterTenant    string
}

// ClaimParams select what a dispatcher's claim takes.
type ClaimParams struct {
	FairClaim
	// KeyRetention and KeyScope, for a target with an idempotency key, fix what the key
	// means: its window ends KeyRetention after a claim by the database's clock, and its
	// scope's fingerprint is KeyScope. LookupScope, for a target with a lookup, fixes
	// where a "not found" is proof of absence. Each claim records the scopes again: a
	// claim takes only PREPARED operations, for which nothing sent can have taken effect,
	// so its send is the first that can. The window is the earliest of the claims' (a
	// target may have kept the key from a send it did not execute); replays keep them.
	KeyRetention time.Duration
	KeyScope     string
	LookupScope  string
}

// NewWorkerName returns a name for a claimer of this process, as leases and attempts
// record it: the host, the process id and a random suffix, unique per call.
func NewWorkerName() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), uuid.NewString()[:8])
}

// ErrFenceLost means the caller's fence is no longer current: another claim, the
// sweeper or a reconciler moved the operation on. The caller must not send, and what it
// observed is only evidence.
var ErrFenceLost = errors.New("fence lost")

// ErrRecordedBefore means that the same outcome was recorded under the fence already,
// by an earlier try of the same call whose answer was lost (the connection failed after
// the commit), and that the operation has moved on since. (While it has not, the call
// is answered with the operation as that outcome left it, as the earlier try was.)
var ErrRecordedBefore = errors.New("outcome recorded before, by an earlier try")

// ContradictionError is ErrFenceLost for a verified success kept as stale evidence
// (its fence was lost) while the ledger has the operation ended otherwise: FAILED_TERMINAL,
// or SUCCEEDED with another reference of the target's. The target says it made an effect
// the ledger does not record: a false failure, or a second effect. The ledger keeps its
// terminal state; a person must reconcile the two.
type ContradictionError struct {
	State     State  // the operation's state in the ledger
	RemoteRef string // the reference the ledger recorded, if any
}

func (e *ContradictionError) Error() string {
	if e.RemoteRef == "" {
		return fmt.Sprintf("%v: the target's verified success contradicts the ledger's %s", ErrFenceLost, e.State)
	}
	return fmt.Sprintf("%v: the target's verified success contradicts the ledger's %s (reference %s)", ErrFenceLost,
		e.State, e.RemoteRef)
}

func (e *ContradictionError) Unwrap() error { return ErrFenceLost }

// contradicts is the SQL condition that the stale outcome s (an alias of
// stale_outcomes) is a verified success that contradicts how the ledger ended its
// operation o (of operations): FAILED_TERMINAL, or SUCCEEDED with another reference.
func contradicts(s, o string) string {
	return s + `.outcome = 'VERIFIED_SUCCESS' AND (` + o + `.state = 'FAILED_TERMINAL'
		OR (` + o + `.state = 'SUCCEEDED' AND ` + o + `.remote_ref IS DISTINCT FROM ` + s + `.remote_ref))`
}

// rotate runs claim from p.AfterTenant and, when that comes back short, once more from
// the first tenant for the rest: the cursor goes round the tenants, and a claim that
// started late in the order still takes the work of the tenants before it. (Without
// it, a claim after the last tenant with due work took nothing, and its loop slept.)
// The second claim's error is not returned: what the first took is held and must be
// worked; the next claim tries again.
func rotate[C any](p FairClaim, claim func(FairClaim) ([]C, error)) ([]C, error) {
	got, err := claim(p)
	if err != nil || p.AfterTenant == "" || len(got) >= p.Limit {
		return got, err
	}
	p.AfterTenant, p.Limit = "", p.Limit-len(got)
	p.PerTenant = min(p.PerTenant, p.Limit)
	more, err := claim(p)
	if err != nil {
		return got, nil
	}
	return append(got, more...), nil
}

// fairPick returns the CTEs "tenants" and "picked" of a fair claim: up to $5 operations
// in state, of the types $3, that are due, at most $4 per tenant, over at most $2
// tenants after $1 (a rotating cursor), oldest first by order, locked and skipping rows
// other claimers hold. Its arguments are constants of this package, never input.
//
// picked carries each row's ctid and revision, for the statement that updates what it
// picked (pickedRows).
func fairPick(state, due, order string, types int) string {
	// The walk over the tenants orders by the tenant and next, the column after the
	// tenant in the state's partial index: only that index gives the order, so the walk
	// never reads the primary key instead, stepping over every row in another state
	// (statistics taken when most rows were in this state make that look cheap). A
	// tenant's share is held to it the same way (below).
	next := walkOrder(state)
	// A tenant's share, oldest first, of the types typeCond admits, ordered by orderBy.
	share := func(typeCond, orderBy string) string {
		return `
				SELECT ctid, tenant_id, operation_id, revision, ` + order + ` AS sort FROM operations
				WHERE tenant_id = t.tenant_id AND state = '` + state + `' AND ` + typeCond + `
				  AND ` + due + `
				ORDER BY ` + orderBy + `
				LIMIT $4
				FOR UPDATE SKIP LOCKED`
	}
	perTenant := share("operation_type = ANY ($3)", order)
	if state == "PREPARED" {
		// A tenant's share is read from the claim index (tenant, type, id, of PREPARED
		// operations only), a type at a time: in that index a type's rows are in the
		// order of their ids. The type is fixed by a range of one value, not an equality,
		// and the order names it: PostgreSQL drops a column an equality fixes from an
		// order, and the primary key (tenant, id) gives the rest, so with statistics taken
		// while most operations were PREPARED (right after a backlog is loaded) it read
		// the primary key and stepped over every operation of the tenant claimed since:
		// 22 ms for a share of 128 with four fifths of the tenant's operations claimed,
		// against 0.3 ms by the index. For all the types at once, the order came from the
		// primary key too, which steps over every finished operation of the tenant
		// (24,000 at 100,000 finished operations: a claim of 64 took 34 ms there and 203
		// ms at a million, against 3 ms). Several types are picked one by one and merged,
		// each by a branch of its own whose type is an element of $3 (a type taken from
		// a join instead led the planner to the intent key); a type's rows past the
		// tenant's share stay locked until the claim commits.
		oneType := func(i int) string {
			typ := fmt.Sprintf("($3::text[])[%d]", i)
			return share("operation_type >= "+typ+" AND operation_type <= "+typ, "operation_type, "+order)
		}
		if types == 1 {
			perTenant = oneType(1)
		} else {
			branches := make([]string, types)
			for i := range branches {
				branches[i] = fmt.Sprintf("SELECT * FROM (%s) b%d", oneType(i+1), i+1)
			}
			perTenant = `
				SELECT x.ctid, x.tenant_id, x.operation_id, x.revision FROM (` + strings.Join(branches, " UNION ALL ") + `) x
				ORDER BY x.sort
				LIMIT $4`
		}
	}
	return tenantWalk(state, next) + `, picked AS (
			SELECT p.ctid, p.tenant_id, p.operation_id, p.revision FROM tenants t, LATERAL (` + perTenant + `) p
			LIMIT $5`
}

// walkOrder is the column after the tenant in the partial index of a fair claim's
// state: the walk over the tenants orders by the tenant and it.
func walkOrder(state string) string {
	switch state {
	case "PREPARED":
		return "operation_type"
	case "UNKNOWN":
		return "next_check_at"
	}
	panic("store: no partial index for a fair claim of " + state)
}

// tenantWalk is the CTE "tenants" of a fair claim of state: up to $2 tenants that have
// an operation in state, after $1, in order, each numbered n. Whether a tenant has work
// that is due, of the claim's types, is not asked here: a claim finds that in each
// tenant's share (fairPick), and a claim that comes back short is followed by one that
// starts after the walk's end (WalkEnd).
func tenantWalk(state, next string) string {
	return `
		WITH RECURSIVE tenants (tenant_id, n) AS (
			(SELECT tenant_id, 1 FROM operations
			 WHERE state = '` + state + `' AND tenant_id > $1
			 ORDER BY tenant_id, ` + next + ` LIMIT 1)
			UNION ALL
			(SELECT next.tenant_id, t.n + 1 FROM tenants t, LATERAL (
				SELECT tenant_id FROM operations
				WHERE state = '` + state + `' AND tenant_id > t.tenant_id
				ORDER BY tenant_id, ` + next + ` LIMIT 1) next
			 WHERE t.n < $2)
		)`
}

// WalkEnd returns the last of the p.MaxTenants tenants that a fair claim of p, of
// operations in state (PREPARED or UNKNOWN), walks over now, or "" when fewer are left
// after p.AfterTenant. A claimer reads it just before each claim, and gives it to
// CursorAfter. It is read before the claim, not after: a tenant whose work the claim
// takes drops out of the walk, and a walk read after it would reach past tenants the
// claim never looked at.
func (q Scope) WalkEnd(ctx context.Context, state State, p FairClaim) (string, error) {
	var last string
	err := q.queryRow(withIndexOrder(ctx), tenantWalk(string(state), walkOrder(string(state)))+`
		SELECT tenant_id FROM tenants WHERE n = $2`, p.AfterTenant, p.MaxTenants).Scan(&last)
	if err = translate(err); errors.Is(err, ErrNotFound) {
		return "", nil
	} else if err != nil {
		return "", fmt.Errorf("store: walk end: %w", err)
	}
	return last, nil
}

// CursorAfter returns where the fair claim after a claim of p starts: after the last
// tenant it took from, when its first pass (the walk after p.AfterTenant) filled it;
// otherwise after walkEnd, the end of that walk (WalkEnd, read just before the claim),
// or from the first tenant ("") when the walk reached the last one. claimed are the
// tenants of what the claim returned, in its order (rotate's second pass, from the first
// tenant, after the first's). Starting again from the first tenant after a claim that
// was short, or topped up from the first tenants, a claimer would never reach past
// the first MaxTenants tenants while those hold only work that is not due (a later
// send time, a look backed off) or another target's, or get new work all the time.
func CursorAfter(p FairClaim, walkEnd string, claimed []string) string {
	wrapped := p.AfterTenant != "" && slices.ContainsFunc(claimed, func(t string) bool { return t <= p.AfterTenant })
	if len(claimed) >= p.Limit && !wrapped {
		return claimed[len(claimed)-1]
	}
	return walkEnd
}

// pickedRows is the FROM and WHERE of an update of operations o that finds the rows a
// CTE named rows picked and locked (fairPick, a sweep's): each by its ctid, with a TID
// scan, and only in the version picked, at the revision it had. A row another
// transaction updated after the statement began is locked in its new version, which
// the statement's snapshot cannot see: the update skips it (it stays as it is, and the
// next claim or sweep takes it), never updates another row. The update needs no
// condition on the state: every change of state takes the revision up (the schema
// refuses any other), and the pick read the state at that revision. Such a condition
// would let a partial index of the state win the plan from statistics of a small
// ledger (the planner thinks it a page, and filters every row of it by the ctids).
// rows is a constant of this package, never input.
func pickedRows(rows string) string {
	return `FROM ` + rows + ` p WHERE o.ctid = p.ctid AND o.revision = p.revision`
}

// keyedRows is a from-item of the ctids of the rows of table that keys (a from-item
// that names its rows k) names, where match relates a row r of table to a key k, with
// the keys' columns beside them: a statement joins table to it by ctid, with a TID
// scan. Each key is looked up on its own (the LIMIT keeps the planner from making the
// lookups a join, which statistics taken earlier could have it plan as a scan of the
// whole table). Without sequential scans (setScope) each lookup reads the key; the
// statement must not name another condition that an index could serve (the key's
// columns, a state with a partial index): the planner then read that index whole and
// filtered it by the ctids.
//
// A row another transaction changed after the statement's snapshot may be skipped (its
// latest version has another ctid), or changed if the statement's other conditions,
// rechecked on that version, still hold. So it serves only statements for which such a
// row is one they need not change (a lease extension: the operation moved on, as
// long as no two extensions of one lease run at once, which one lease keeper per
// dispatcher ensures), never the outcome's move of the operation, which a lease
// extension may have touched. The arguments are constants of this package.
func keyedRows(table, keys, match string) string {
	return `(SELECT r.ctid, k.* FROM ` + keys + ` CROSS JOIN LATERAL (
		SELECT ctid FROM ` + table + ` r WHERE ` + match + ` LIMIT 1) r)`
}

// inFlight is the condition that the operation o is IN_FLIGHT, for a statement that
// finds it by its ctid: a range of one value, not an equality, so that it does not imply
// the predicate of the lease index (the operations in flight), which the planner would
// otherwise read whole and filter by the ctids when statistics make that index look a
// page. (The outcomes, which find operations by their keys, keep the equality: with
// the statistics of a ledger at work, reading the lease index beats one lookup per
// outcome by the primary key, by a quarter of PostgreSQL's CPU in a burn-down.)
const inFlight = `o.state >= 'IN_FLIGHT' AND o.state <= 'IN_FLIGHT'`

// operationKey matches a row r to a key k.
const operationKey = `r.tenant_id = k.tenant_id AND r.operation_id = k.operation_id`

// claimedColumns is what a claim returns, read by scanClaimed: the operation, its
// payload and key, and the durations of Claimed, in microseconds.
var claimedColumns = operationColumns + `, payload, ` +
	micros("lease_expires_at - now()") + `, coalesce(` + micros("now() - first_sent_at") + `, 0), ` +
	micros("dispatch_deadline - now()") + `, ` + micros("key_window_end - now()") + `, coalesce(key_scope, ''), coalesce(encode(lookup_scope, 'hex'), '')`

// micros returns the SQL of an interval expression in whole microseconds (NULL stays
// NULL); interval is a constant of this package, never input.
func micros(interval string) string {
	return `floor(extract(epoch FROM ` + interval + `) * 1e6)::bigint`
}

// duration converts microseconds from micros.
func duration(us int64) time.Duration { return time.Duration(us) * time.Microsecond }

// durationOrNil converts microseconds from micros that may be NULL.
func durationOrNil(us *int64) *time.Duration {
	if us == nil {
		return nil
	}
	d := duration(*us)
	return &d
}

func scanClaimed(row pgx.CollectableRow) (Claimed, error) {
	var c Claimed
	return c, scanClaimedInto(row, &c)
}

// scanClaimedInto scans claimedColumns, then extra destinations, into c.
func scanClaimedInto(row pgx.CollectableRow, c *Claimed, extra ...any) error {
	var leaseLeft, sinceFirst int64
	var deadlineLeft, windowLeft *int64
	dest := operationDest(&c.Operation, &c.Payload, &leaseLeft, &sinceFirst, &deadlineLeft, &windowLeft, &c.KeyScope, &c.LookupScope)
	if err := row.Scan(append(dest, extra...)...); err != nil {
		return err
	}
	c.LeaseLeft, c.SinceFirstSend = duration(leaseLeft), duration(sinceFirst)
	c.DeadlineLeft, c.KeyWindowLeft = durationOrNil(deadlineLeft), durationOrNil(windowLeft)
	return nil
}

// Claim moves up to Limit PREPARED operations of the given types to IN_FLIGHT with one
// statement: each gets fence + 1, attempt + 1, a lease, its first-send time and an event,
// which is the attempt's record. Rows locked by another claimer are skipped, so concurrent
// claimers never take the same operation. Operations whose dispatch deadline has passed
// are left to ExpireDeadlines.
func (q Scope) Claim(ctx context.Context, p ClaimParams) ([]Claimed, error) {
	return rotate(p.FairClaim, func(f FairClaim) ([]Claimed, error) {
		p.FairClaim = f
		return q.claimFrom(ctx, p)
	})
}

func (q Scope) claimFrom(ctx context.Context, p ClaimParams) ([]Claimed, error) {
	rows := q.query(withIndexOrder(ctx), fairPick("PREPARED",
		"(dispatch_deadline IS NULL OR dispatch_deadline > now()) AND (next_check_at IS NULL OR next_check_at <= now())", "operation_id",
		len(p.OperationTypes))+`
		), claimed AS (
			UPDATE operations o SET
				state = 'IN_FLIGHT', revision = o.revision + 1, fence_token = o.fence_token + 1,
				attempt_count = o.attempt_count + 1, lease_owner = $6, lease_expires_at = now() + $7::interval,
				first_sent_at = coalesce(o.first_sent_at, now()), next_check_at = NULL, updated_at = now(),
				key_window_end = least(o.key_window_end, now() + $8::interval), key_scope = $9, lookup_scope = decode($10, 'hex')
			`+pickedRows("picked")+`
			RETURNING o.*
		), ev AS (`+eventsFrom("claimed", "'PREPARED'", "'dispatcher:' || $6", "NULL", "NULL")+`)
		SELECT `+claimedColumns+` FROM claimed ORDER BY tenant_id, operation_id`,
		p.AfterTenant, p.MaxTenants, p.OperationTypes, p.PerTenant, p.Limit, p.Worker, p.Lease,
		nullIfZeroDuration(p.KeyRetention), nullIfEmpty(p.KeyScope), nullIfEmpty(p.LookupScope))
	claimed, err := pgx.CollectRows(rows, scanClaimed) // no room made for Limit: between backlogs a claim asks for hundreds and gets a few
	if err != nil {
		return nil, fmt.Errorf("store: claim: %w", translate(err))
	}
	if len(claimed) > 0 {
		q.s.events.signal()
	}
	return claimed, nil
}

// OutcomeParams is what the holder of a claim learned from its one send.
type OutcomeParams struct {
	TenantID string
	ID       uuid.UUID
	Fence    int64
	// State is SUCCEEDED, FAILED_TERMINAL or UNKNOWN, or PREPARED to send again after
	// an answer documented as not executed (NotExecuted, SendAgainAfter).
	State     State
	RemoteRef string // required for SUCCEEDED
	// NotSent records that the request provably never left (nothing can have executed).
	// The zero value, "it may have been sent", is the safe one.
	NotSent bool
	// NotExecuted records that the target answered with an answer its documentation
	// says was not executed: the attempt had no effect (it counts in not_executed).
	NotExecuted bool
	// SendAgainAfter, for PREPARED, is how long from now the next send waits.
	SendAgainAfter time.Duration
	Observation    Observation
	Actor          string
}

// outcomeColumns are outcomes as the columns of their statements' unnest.
//
// Ids go into statements as 16-byte arrays (nullable ones as pgtype.UUID), here and
// wherever the package passes many of them: pgx writes a uuid.UUID, a driver.Valuer,
// alone or in an array, by trying the binary form of its Value (a string), failing,
// formatting the error and reading the text back, twenty allocations an id.
type outcomeColumns struct {
	tenants                                []string
	ids                                    [][16]byte
	fences                                 []int64
	states, observations, actors, outcomes []string
	refs                                   []*string
	sent, notExecuted                      []bool
	waits                                  []time.Duration
}

func columnsOf(ps []OutcomeParams) (outcomeColumns, error) {
	n := len(ps)
	c := outcomeColumns{tenants: make([]string, n), ids: make([][16]byte, n), fences: make([]int64, n),
		states: make([]string, n), observations: make([]string, n), actors: make([]string, n), outcomes: make([]string, n),
		refs: make([]*string, n), sent: make([]bool, n), notExecuted: make([]bool, n), waits: make([]time.Duration, n)}
	for i, p := range ps {
		obs, err := json.Marshal(p.Observation)
		if err != nil {
			return outcomeColumns{}, fmt.Errorf("store: record outcome: %w", err)
		}
		c.tenants[i], c.ids[i], c.fences[i], c.states[i] = p.TenantID, p.ID, p.Fence, string(p.State)
		c.observations[i], c.actors[i], c.outcomes[i] = string(obs), p.Actor, p.Observation.Outcome
		c.refs[i], c.sent[i], c.notExecuted[i], c.waits[i] = nullIfEmpty(p.RemoteRef), p.sent(), p.NotExecuted, p.SendAgainAfter
	}
	return c, nil
}

// sent reports whether the request can have reached the target: an attempt documented
// as not executed cannot have taken effect, as one never sent.
func (p OutcomeParams) sent() bool { return !p.NotSent && !p.NotExecuted }

// RecordOutcome records the outcome of the claim's send: only if the fence still holds
// (the operation is IN_FLIGHT with this fence), it moves the operation to the outcome's
// state with an event, which records whether the request can have left. It returns
// ErrFenceLost when the fence had moved on: the outcome is then kept as evidence in
// stale_outcomes (the first one recorded for the fence) and the operation is untouched.
//
// It answers with what the outcome left of the operation (RecordedOutcome), not the
// whole row: read the operation for the rest.
//
// Outcomes recorded at the same time are written together, in one statement and one
// commit (at most maxOutcomeBatch, by at most outcomeWriters statements at once): a
// caller waits while the statements before it run, and the outcomes that arrive
// meanwhile join its statement (see combiner). Each keeps its own fence check, and an
// outcome the statement cannot write fails alone (recordOutcomes).
func (q Scope) RecordOutcome(ctx context.Context, p OutcomeParams) (RecordedOutcome, error) {
	if p.State != StateSucceeded && p.State != StateFailedTerminal && p.State != StateUnknown && p.State != StatePrepared {
		return RecordedOutcome{}, fmt.Errorf("store: record outcome: %s is not an outcome of a send", p.State)
	}
	if p.State == StatePrepared && !p.NotExecuted {
		return RecordedOutcome{}, fmt.Errorf("store: record outcome: only an answer documented as not executed sends again")
	}
	if p.State == StateSucceeded && p.RemoteRef == "" {
		return RecordedOutcome{}, fmt.Errorf("store: record outcome: SUCCEEDED needs the target's reference")
	}
	if q.tenants == "" {
		return RecordedOutcome{}, ErrNoScope
	}
	// Outcomes are combined only with outcomes in the same scope.
	recorded, i, err := q.s.outcomes.do(ctx, q.tenants, p, q.recordOutcomes)
	if err != nil {
		return RecordedOutcome{}, err
	}
	return recorded.answer(i, p)
}

// RecordedOutcome is the operation as an outcome left it, in the columns the outcomes'
// statement returns: what the dispatcher reads. Whole rows (27 columns, and the payload
// among the statement's own rows) cost a burn-down about a tenth of the broker's CPU
// (docs/benchmarks.md).
type RecordedOutcome struct {
	State       State
	FenceToken  int64
	Replays     int32 // same-key replays of the operation: only a reconciler's replay counts one
	FirstSentAt *time.Time
	UpdatedAt   time.Time
}

// recordedOutcomeOf is RecordOutcome's answer for an outcome that left the operation as
// op is.
func recordedOutcomeOf(op Operation) RecordedOutcome {
	return RecordedOutcome{State: op.State, FenceToken: op.FenceToken, Replays: op.Replays, FirstSentAt: op.FirstSentAt,
		UpdatedAt: op.UpdatedAt}
}

// recordedOutcomes is what the statements of a batch of outcomes did: the operations
// they moved, and each outcome's own error, if any, by its index in the batch (nil when
// there is none).
type recordedOutcomes struct {
	moved map[OperationKey]RecordedOutcome
	errs  []error
}

// answer is RecordOutcome's answer for p, the outcome at index i of the batch.
func (r recordedOutcomes) answer(i int, p OutcomeParams) (RecordedOutcome, error) {
	if op, ok := r.applied(p); ok {
		return op, nil
	}
	if r.errs != nil && r.errs[i] != nil {
		return RecordedOutcome{}, r.errs[i]
	}
	return RecordedOutcome{}, ErrFenceLost
}

// failed records err as the error of the outcomes from index i to j; r.errs is made
// for n outcomes when it is nil.
func (r *recordedOutcomes) failed(n, i, j int, err error) {
	if r.errs == nil {
		r.errs = make([]error, n)
	}
	for k := i; k < j; k++ {
		r.errs[k] = err
	}
}

// applied returns the operation as p's outcome left it, if p's fence held and p is the
// outcome applied: of two for one fence in a batch, the statement applies one, and the
// other, of another state, is not answered as applied too.
func (r recordedOutcomes) applied(p OutcomeParams) (RecordedOutcome, bool) {
	op, ok := r.moved[OperationKey{TenantID: p.TenantID, ID: p.ID}]
	if !ok || op.FenceToken != p.Fence || op.State != p.State {
		return RecordedOutcome{}, false
	}
	return op, true
}

// At most maxOutcomeBatch outcomes per statement, and outcomeWriters statements at once,
// each taken as soon as a batch is ready.
const (
	maxOutcomeBatch = 1000
	outcomeWriters  = 2
)

// recordOutcomesSQL writes outcomes, each under its own fence (recordOutcomes).
var recordOutcomesSQL = compileNamed(`
		WITH u AS (
			SELECT * FROM unnest(@tenant_ids::text[], @operation_ids::uuid[], @fences::bigint[], @states::text[]::operation_state[],
				@remote_refs::text[], @observations::text[]::jsonb[], @actors::text[], @outcomes::text[],
				@sent::boolean[], @not_executed::boolean[], @send_again_after::interval[])
				AS u (tenant_id, operation_id, fence, state,
					remote_ref, observation, actor, outcome,
					sent, not_executed, send_again_after)
		), upd AS (
			UPDATE operations o SET
				state = u.state, revision = o.revision + 1, remote_ref = coalesce(u.remote_ref, o.remote_ref),
				last_observation = u.observation, lease_owner = NULL, lease_expires_at = NULL, updated_at = now(),
				not_executed = o.not_executed + u.not_executed::int,
				next_check_at = CASE u.state WHEN 'UNKNOWN' THEN now() WHEN 'PREPARED' THEN now() + u.send_again_after END
			FROM u
			WHERE o.tenant_id = u.tenant_id AND o.operation_id = u.operation_id AND o.state = 'IN_FLIGHT' AND o.fence_token = u.fence
			RETURNING o.tenant_id, o.operation_id, o.revision, o.state, o.fence_token, o.remote_ref, o.last_observation,
				o.attempt_count, o.escalation, o.updated_at, o.replays, o.first_sent_at,
				u.actor AS outcome_actor, u.outcome AS outcome_reason, u.sent AS outcome_sent
		), ev AS (`+outcomeEventsFrom("upd", "'IN_FLIGHT'", "outcome_actor", "outcome_reason", "last_observation", "outcome_sent")+`
		)
		SELECT tenant_id, operation_id, state, fence_token, replays, first_sent_at, updated_at FROM upd`,
	"tenant_ids", "operation_ids", "fences", "states", "remote_refs", "observations", "actors", "outcomes",
	"sent", "not_executed", "send_again_after")

// recordOutcomes writes outcomes in one statement, each under its own fence, and keeps
// those whose fence was lost as stale outcomes (keepStale). A statement that a deadlock
// rolled back is run again, after a pause (up to conflictTries times). When the
// statement fails for what one outcome in it can cause (byOneOutcome), each half of the
// outcomes is written again on its own, down to single outcomes, so that only the
// outcomes at fault fail, each with its own error; the others' operations do not wait
// for their leases to end as UNKNOWN.
func (q Scope) recordOutcomes(ctx context.Context, ps []OutcomeParams) (recordedOutcomes, error) {
	recorded, err := q.recordTogether(ctx, ps)
	for try := 1; try <= conflictTries && conflicted(err); try++ {
		// The victim of a deadlock (or a serialization failure) changed nothing. It waits
		// a moment first: run again at once, it could take the rows back before the
		// transaction it met, which waited for them, and meet it again.
		select {
		case <-ctx.Done():
			return recordedOutcomes{}, err
		case <-time.After(time.Duration(try) * (10*time.Millisecond + rand.N(20*time.Millisecond))):
		}
		recorded, err = q.recordTogether(ctx, ps)
	}
	if err == nil || len(ps) == 1 || !byOneOutcome(err) {
		return recorded, err
	}
	recorded = recordedOutcomes{moved: make(map[OperationKey]RecordedOutcome, len(ps))}
	for _, half := range [][2]int{{0, len(ps) / 2}, {len(ps) / 2, len(ps)}} {
		from, to := half[0], half[1]
		r, err := q.recordOutcomes(ctx, ps[from:to])
		if err != nil {
			recorded.failed(len(ps), from, to, err)
			continue
		}
		maps.Copy(recorded.moved, r.moved)
		for k, err := range r.errs {
			if err != nil {
				recorded.failed(len(ps), from+k, from+k+1, err)
			}
		}
	}
	return recorded, nil
}

// byOneOutcome reports whether err, a statement's over many rows, can have been caused
// by one of them: a value PostgreSQL refused (a data exception; an integrity
// constraint, which the schema's guards raise too; a limit, such as an index entry's
// size, passed), or one the driver could not send. Not the database out of reach, a
// timeout, a cancellation or the server's lack of resources, which the statement's every
// part would meet again; nor a deadlock or a serialization failure, which no one row
// causes.
func byOneOutcome(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23") || strings.HasPrefix(pgErr.Code, "54")
	}
	return !errors.Is(err, ErrUnavailable) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
}

// conflictTries is how many times more recordOutcomes runs a statement that a deadlock
// or a serialization failure rolled back.
const conflictTries = 3

// conflicted reports whether err is a deadlock's or a serialization failure's: the
// statement was rolled back because of another transaction, and may be run again.
func conflicted(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40P01" || pgErr.Code == "40001")
}

// recordTogether is recordOutcomes' one statement, and the stale outcomes' if any
// (settleStale).
func (q Scope) recordTogether(ctx context.Context, ps []OutcomeParams) (recordedOutcomes, error) {
	c, err := columnsOf(ps)
	if err != nil {
		return recordedOutcomes{}, err
	}
	rows := q.query(withCustomPlan(ctx), recordOutcomesSQL.sql, recordOutcomesSQL.args(pgx.NamedArgs{
		"tenant_ids": c.tenants, "operation_ids": c.ids, "fences": c.fences, "states": c.states,
		"remote_refs": c.refs, "observations": c.observations, "actors": c.actors, "outcomes": c.outcomes,
		"sent": c.sent, "not_executed": c.notExecuted, "send_again_after": c.waits})...)
	type movedRow struct {
		key OperationKey
		op  RecordedOutcome
	}
	moved, err := pgx.AppendRows(make([]movedRow, 0, len(ps)), rows, func(row pgx.CollectableRow) (r movedRow, err error) {
		err = row.Scan(&r.key.TenantID, (*[16]byte)(&r.key.ID), &r.op.State, &r.op.FenceToken, &r.op.Replays, &r.op.FirstSentAt,
			&r.op.UpdatedAt)
		return r, err
	})
	if err != nil {
		return recordedOutcomes{}, fmt.Errorf("store: record outcome: %w", translate(err))
	}
	recorded := recordedOutcomes{moved: make(map[OperationKey]RecordedOutcome, len(moved))}
	for _, m := range moved {
		recorded.moved[m.key] = m.op
	}
	if len(moved) > 0 {
		q.s.events.signal()
	}
	var stale []OutcomeParams
	var staleAt []int
	for i, p := range ps {
		if _, ok := recorded.applied(p); !ok {
			stale, staleAt = append(stale, p), append(staleAt, i)
		}
	}
	if len(stale) > 0 {
		q.settleStale(ctx, &recorded, len(ps), stale, staleAt)
	}
	return recorded, nil
}

// settleStale answers the outcomes of a batch of n that their statement did not apply,
// stale (at their indexes at in the batch): one already recorded under its fence by an
// earlier try is answered as that try was, with the operation as it left it, or with
// ErrRecordedBefore once the operation has moved on; the others are kept as evidence
// (keepStale) and answered ErrFenceLost, unless that fails, and a verified success that
// contradicts the ledger with a *ContradictionError (contradictions).
func (q Scope) settleStale(ctx context.Context, recorded *recordedOutcomes, n int, stale []OutcomeParams, at []int) {
	before, err := q.keepStale(ctx, stale)
	if err != nil {
		for _, i := range at {
			recorded.failed(n, i, i+1, err)
		}
		return
	}
	var successes []OutcomeParams
	var successAt []int
	for k, p := range stale {
		b, ok := before[HeldLease{OperationKey: OperationKey{TenantID: p.TenantID, ID: p.ID}, Fence: p.Fence}]
		switch {
		case !ok:
			if p.State == StateSucceeded {
				successes, successAt = append(successes, p), append(successAt, at[k])
			}
		case b.op.Revision == b.revision && b.op.FenceToken == p.Fence: // as the earlier try left it (a reconciler's claim takes the fence, not the revision)
			recorded.moved[OperationKey{TenantID: p.TenantID, ID: p.ID}] = recordedOutcomeOf(b.op)
		default:
			recorded.failed(n, at[k], at[k]+1, ErrRecordedBefore)
		}
	}
	if len(successes) == 0 {
		return
	}
	found, err := q.contradictions(ctx, successes)
	for k, i := range successAt {
		switch {
		case err != nil: // kept all the same; the ledger's count (Contradicted) finds it
			recorded.failed(n, i, i+1, fmt.Errorf("%w (kept as evidence; whether it contradicts the ledger was not read: %w)", ErrFenceLost, err))
		case found[k] != nil:
			recorded.failed(n, i, i+1, found[k])
		}
	}
}

// contradictions reads, for verified successes that keepStale has handled (ps), which
// contradict the ledger: each one's *ContradictionError at its index, nil for the
// others. A success contradicts when its fence's stale outcome is a verified success
// and the operation ended FAILED_TERMINAL, or SUCCEEDED with another reference. It is
// a statement after keepStale's, so that it reads the operation as the ledger has it
// once that success is kept: a failure recorded while keepStale ran (after its
// snapshot, before its row lock) is seen. An end recorded after it (by a replay's own
// answer; a reconciler's, a target event's or an operator's failure is refused,
// noFailureAfterSuccess) is not answered here; the ledger's count (Contradicted) finds every one.
func (q Scope) contradictions(ctx context.Context, ps []OutcomeParams) ([]*ContradictionError, error) {
	c, err := columnsOf(ps)
	if err != nil {
		return nil, err
	}
	rows := q.query(ctx, `
		SELECT u.i::int, o.state, coalesce(o.remote_ref, '')
		FROM unnest($1::text[], $2::uuid[], $3::bigint[]) WITH ORDINALITY AS u (tenant_id, operation_id, fence, i)
		JOIN stale_outcomes s ON s.tenant_id = u.tenant_id AND s.operation_id = u.operation_id AND s.fence_token = u.fence
		JOIN operations o ON o.tenant_id = u.tenant_id AND o.operation_id = u.operation_id
		WHERE `+contradicts("s", "o"),
		c.tenants, c.ids, c.fences)
	found := make([]*ContradictionError, len(ps))
	var i int
	var e ContradictionError
	_, err = pgx.ForEachRow(rows, []any{&i, &e.State, &e.RemoteRef}, func() error {
		found[i-1] = &ContradictionError{State: e.State, RemoteRef: e.RemoteRef}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: record outcome: reading whether a stale success contradicts the ledger: %w", translate(err))
	}
	return found, nil
}

// recordedBefore is an outcome its fence's holder recorded already: the operation as
// it is now, the fence, and the revision that recording gave the operation.
type recordedBefore struct {
	op              Operation
	fence, revision int64
}

// keepStale keeps outcomes whose fence was lost as evidence: each only under a fence
// that was claimed and whose holder applied no outcome, and only the first one of each
// fence. It runs after the outcomes' statement, in a statement of its own, so that it
// sees an outcome of the same fence that statement waited for (a retry's, say, of one
// that had already been applied). It returns the outcomes the holder of their fence
// recorded already, the same state and class (an earlier try's).
func (q Scope) keepStale(ctx context.Context, ps []OutcomeParams) (map[HeldLease]recordedBefore, error) {
	c, err := columnsOf(ps)
	if err != nil {
		return nil, err
	}
	// holder is the fence's holder's outcome event.
	const holder = `e.tenant_id = u.tenant_id AND e.operation_id = u.operation_id
					AND e.from_state = 'IN_FLIGHT' AND e.fence_token = u.fence AND e.sent IS NOT NULL`
	rows := q.query(ctx, `
		WITH u AS (
			SELECT * FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::text[], $5::text[], $6::text[]::jsonb[],
					$7::text[], $8::boolean[], $9::text[]::operation_state[])
				AS u (tenant_id, operation_id, fence, actor, outcome, observation, remote_ref, sent, state)
		), kept AS (
			INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, outcome, observation, remote_ref, sent)
			SELECT u.tenant_id, u.operation_id, u.fence, u.actor, u.outcome, u.observation, u.remote_ref, u.sent FROM u
			WHERE EXISTS (SELECT FROM operation_events e
					WHERE e.tenant_id = u.tenant_id AND e.operation_id = u.operation_id
						AND e.to_state = 'IN_FLIGHT' AND e.fence_token = u.fence)
				AND NOT EXISTS (SELECT FROM operation_events e WHERE `+holder+`)
			ON CONFLICT DO NOTHING
		), before AS (
			SELECT u.tenant_id, u.operation_id, u.fence, e.revision AS recorded_revision FROM u, LATERAL (
				SELECT e.revision, e.to_state, e.reason, e.sent FROM operation_events e WHERE `+holder+` LIMIT 1) e
			WHERE e.to_state = u.state AND e.reason = u.outcome AND e.sent = u.sent
		)
		SELECT `+operationColumns+`, b.fence, b.recorded_revision FROM operations JOIN before b USING (tenant_id, operation_id)`,
		c.tenants, c.ids, c.fences, c.actors, c.outcomes, c.observations, c.refs, c.sent, c.states)
	found, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (recordedBefore, error) {
		var b recordedBefore
		err := row.Scan(operationDest(&b.op, &b.fence, &b.revision)...)
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: record outcome: keeping a stale outcome: %w", translate(err))
	}
	before := make(map[HeldLease]recordedBefore, len(found))
	for _, b := range found {
		before[HeldLease{OperationKey: OperationKey{TenantID: b.op.TenantID, ID: b.op.ID}, Fence: b.fence}] = b
	}
	return before, nil
}

func nullIfZeroDuration(d time.Duration) *time.Duration {
	if d == 0 {
		return nil
	}
	return &d
}

func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// extendLockWait bounds ExtendLeases' wait for a lock other than a row's (a migration's
// lock on the table, say); it never waits for a row.
const extendLockWait = 100 * time.Millisecond

// HeldLease names a claim its holder still holds: the operation and the fence it was
// claimed with.
type HeldLease struct {
	OperationKey
	Fence int64
}

// Extended is what ExtendLeases did with the claims it was given. A claim in neither
// map has lost its fence: another claim, the sweeper or a reconciler moved the
// operation on.
type Extended struct {
	// Left is what is left of each extended lease, as the database measured it.
	Left map[OperationKey]time.Duration
	// Busy are the claims whose operation another transaction held locked (its outcome
	// being written, most likely): not extended this time, their fence not known to be
	// lost. (One lost by a commit after the statement's snapshot may be among them: the
	// next statement finds it lost.)
	Busy map[OperationKey]bool
}

// ExtendLeases pushes the leases of claims the caller still holds to now + lease, by
// the database's clock, in one statement.
//
// It skips the rows other transactions hold locked against its update, without
// waiting: an outcome statement holding some of them may be waiting for others this
// one holds, and the outcome must win; and a statement that waited for one row, or
// failed for it, left every other claim unextended. (With a wait of 100 ms, a slow
// outcome commit made extensions fail one after another, and the claims were cut as
// their leases neared their end: a wave of UNKNOWN operations.) A skipped claim whose
// operation is still in flight under its fence is Busy.
func (q Scope) ExtendLeases(ctx context.Context, held []HeldLease, lease time.Duration) (Extended, error) {
	ctx = withLockTimeout(ctx, extendLockWait)
	tenants, ids, fences := make([]string, len(held)), make([][16]byte, len(held)), make([]int64, len(held))
	for i, h := range held {
		tenants[i], ids[i], fences[i] = h.TenantID, h.ID, h.Fence
	}
	// mine locks the rows still in flight under their fence that no one else holds, as
	// the update would (a foreign key's check, which shares the key, does not stop it). The
	// statement also returns, with no time left, every row in flight under its fence as
	// its snapshot has them, unlocked: those not extended are busy. (Which ones, a join
	// with upd would say, but the planner takes upd for a row and checks each of those
	// rows against all of it.)
	rows := q.query(ctx, `WITH h AS (SELECT * FROM unnest($1::text[], $2::uuid[], $3::bigint[]) AS h (tenant_id, operation_id, fence)),
		f AS MATERIALIZED (SELECT * FROM `+keyedRows("operations", "h AS k", operationKey)+` f),
		mine AS (
			SELECT o.ctid FROM operations o, f
			WHERE o.ctid = f.ctid AND `+inFlight+` AND o.fence_token = f.fence
			FOR NO KEY UPDATE OF o SKIP LOCKED
		), upd AS (
			UPDATE operations o SET lease_expires_at = now() + $4::interval
			FROM mine m WHERE o.ctid = m.ctid
			RETURNING o.tenant_id, o.operation_id, `+micros("o.lease_expires_at - now()")+` AS left_us
		)
		SELECT tenant_id, operation_id, left_us FROM upd
		UNION ALL
		SELECT o.tenant_id, o.operation_id, NULL FROM operations o, f
		WHERE o.ctid = f.ctid AND `+inFlight+` AND o.fence_token = f.fence`,
		tenants, ids, fences, lease)
	got := Extended{Left: make(map[OperationKey]time.Duration, len(held)), Busy: map[OperationKey]bool{}}
	var valid []OperationKey
	var k OperationKey
	var us *int64
	_, err := pgx.ForEachRow(rows, []any{&k.TenantID, &k.ID, &us}, func() error {
		if us == nil {
			valid = append(valid, k)
		} else {
			got.Left[k] = duration(*us)
		}
		return nil
	})
	if err != nil {
		return Extended{}, fmt.Errorf("store: extend leases: %w", translate(err))
	}
	for _, k := range valid {
		if _, ok := got.Left[k]; !ok {
			got.Busy[k] = true
		}
	}
	return got, nil
}

// SweepParams bound one pass of a sweeper.
type SweepParams struct {
	// Now is the time to judge by; zero means the database's clock.
	Now   time.Time
	Limit int
}

func (p SweepParams) now() *time.Time {
	if p.Now.IsZero() {
		return nil
	}
	return &p.Now
}

// Swept counts the operations a sweep moved, by operation type.
type Swept map[string]int

// Total is how many operations the sweep moved.
func (s Swept) Total() int {
	var n int
	for _, c := range s {
		n += c
	}
	return n
}

// OutcomeLeaseExpired is the outcome class of an operation made UNKNOWN because its
// sender's lease expired.
const OutcomeLeaseExpired = "LEASE_EXPIRED"

// SweepExpiredLeases moves IN_FLIGHT operations whose lease has expired to UNKNOWN (never
// back to PREPARED: the holder may have sent), with an event, and returns how many of
// each type.
func (q Scope) SweepExpiredLeases(ctx context.Context, p SweepParams) (Swept, error) {
	return q.sweep(ctx, p, sweep{
		due:     "lease_expires_at < coalesce($1, now())",
		order:   "lease_expires_at",
		from:    StateInFlight,
		to:      StateUnknown,
		source:  "SWEEPER",
		outcome: OutcomeLeaseExpired,
		summary: "the sender's lease expired before it recorded an outcome; it may have sent",
		actor:   "sweeper",
	})
}

// ExpireDeadlines moves PREPARED operations whose dispatch deadline passed before any
// send to FAILED_TERMINAL (nothing was sent, so nothing happened), with an event, and
// returns how many of each type.
func (q Scope) ExpireDeadlines(ctx context.Context, p SweepParams) (Swept, error) {
	return q.sweep(ctx, p, sweep{
		due:     "dispatch_deadline IS NOT NULL AND dispatch_deadline <= coalesce($1, now())",
		order:   "dispatch_deadline",
		from:    StatePrepared,
		to:      StateFailedTerminal,
		source:  "BROKER",
		outcome: "DISPATCH_DEADLINE_PASSED",
		summary: "the dispatch deadline passed before any send; nothing was sent",
		actor:   "dispatcher",
	})
}

// sweep describes a transition the broker makes on its own for every operation in state
// from that is due: its SQL fragments are constants of this package, never input. The
// state is written into the statement as a constant, so that the planner can use its
// partial index.
type sweep struct {
	due, order                      string
	from, to                        State
	source, outcome, summary, actor string
}

func (q Scope) sweep(ctx context.Context, p SweepParams, w sweep) (Swept, error) {
	rows := q.query(ctx, `
		WITH due AS (
			SELECT ctid, tenant_id, operation_id, revision FROM operations
			WHERE state = '`+string(w.from)+`' AND `+w.due+`
			ORDER BY `+w.order+`
			LIMIT $2
			FOR UPDATE SKIP LOCKED
		), upd AS (
			UPDATE operations o SET state = $3, revision = o.revision + 1,
				lease_owner = NULL, lease_expires_at = NULL, updated_at = now(),
				next_check_at = CASE WHEN $3::operation_state = 'UNKNOWN' THEN now() END,
				last_observation = jsonb_build_object('observed_at', now(), 'source', $5::text, 'outcome', $6::text, 'summary', $7::text)
			`+pickedRows("due")+`
			RETURNING o.*
		), ev AS (`+eventsFrom("upd", "$4", "$8", "$6", "last_observation")+`)
		SELECT operation_type, count(*) FROM upd GROUP BY operation_type`,
		p.now(), p.Limit, w.to, w.from, w.source, w.outcome, w.summary, w.actor)
	swept := Swept{}
	var typ string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&typ, &n}, func() error {
		swept[typ] = n
		return nil
	}); err != nil {
		return nil, fmt.Errorf("store: sweep %s to %s: %w", w.from, w.to, translate(err))
	}
	if len(swept) > 0 {
		q.s.events.signal()
	}
	return swept, nil
}
