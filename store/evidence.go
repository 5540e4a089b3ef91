package store

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// The dispositions of inbound evidence (migration 024).
const (
	EvidencePending     = "PENDING"
	EvidenceApplied     = "APPLIED"
	EvidenceObserved    = "OBSERVED"
	EvidenceQuarantined = "QUARANTINED"
	EvidenceAttached    = "ATTACHED"
	EvidenceDismissed   = "DISMISSED"
)

// The sources of inbound evidence.
const (
	SourceWebhook  = "WEBHOOK"
	SourceReported = "REPORTED"
)

// EvidenceKey names one kept event: a webhook's by its target and id, a reported one
// by its reporter too (each sender's ids are its own).
type EvidenceKey struct {
	Target   string
	EventID  string
	Reporter string // "" for a webhook
}

// InboundEvidence is an event a target reported about one of its effects, verified, as
// the ledger keeps it: never the payload, and the event's body only until its purge.
type InboundEvidence struct {
	Target  string
	EventID string
	Source  string // SourceWebhook or SourceReported
	// Reporter and ClaimedTenant, for reported evidence: the principal that reported it
	// and the tenant it said the event is for.
	Reporter      string
	ClaimedTenant string
	EventType     string
	Meaning       string // SUCCEEDED, PENDING or FAILED
	Reference     string
	ReferenceKind string // remote_key or remote_ref
	RemoteRef     string
	Body          []byte // nil once purged
	ReceivedAt    time.Time
	Disposition   string
	// Reason says why it was quarantined; Detail, in words, what did not match.
	Reason string
	Detail string
	// TenantID and OperationID name the operation it matched (or, quarantined, the one
	// its reference found), "" and uuid.Nil when none.
	TenantID    string
	OperationID uuid.UUID
	ReviewedBy  string
	ReviewedAt  *time.Time
	ReviewNote  string
}

// Key returns the event's key.
func (e InboundEvidence) Key() EvidenceKey {
	return EvidenceKey{Target: e.Target, EventID: e.EventID, Reporter: e.Reporter}
}

const evidenceColumns = `target, event_id, source, reporter, coalesce(claimed_tenant, ''), event_type,
	meaning, reference, reference_kind, coalesce(remote_ref, ''), body, received_at, disposition,
	coalesce(reason, ''), coalesce(detail, ''), coalesce(tenant_id, ''), coalesce(operation_id, '00000000-0000-0000-0000-000000000000'),
	coalesce(reviewed_by, ''), reviewed_at, coalesce(review_note, '')`

func scanEvidence(row pgx.CollectableRow) (InboundEvidence, error) {
	var e InboundEvidence
	err := row.Scan(&e.Target, &e.EventID, &e.Source, &e.Reporter, &e.ClaimedTenant, &e.EventType,
		&e.Meaning, &e.Reference, &e.ReferenceKind, &e.RemoteRef, &e.Body, &e.ReceivedAt, &e.Disposition,
		&e.Reason, &e.Detail, &e.TenantID, &e.OperationID, &e.ReviewedBy, &e.ReviewedAt, &e.ReviewNote)
	return e, err
}

// ReceiveEvidence keeps a verified event, PENDING its match, with its body until
// bodyRetention and matched again while its reference finds nothing until matchFor, both
// from now by the database's clock. An event its sender already delivered (the same key)
// adds nothing: the row kept is returned, with fresh false.
func (q Scope) ReceiveEvidence(ctx context.Context, e InboundEvidence, bodyRetention, matchFor time.Duration) (InboundEvidence, bool, error) {
	var claimed, ref *string
	if e.Reporter != "" {
		claimed = &e.ClaimedTenant
	}
	if e.RemoteRef != "" {
		ref = &e.RemoteRef
	}
	rows := q.query(ctx, `
		WITH ins AS (
			INSERT INTO inbound_evidence (target, event_id, source, reporter, claimed_tenant, event_type, meaning,
				reference, reference_kind, remote_ref, body, body_purge_at, match_until)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, now() + $12::interval, now() + $13::interval)
			ON CONFLICT (target, event_id, reporter) DO NOTHING
			RETURNING *
		)
		SELECT `+evidenceColumns+` FROM ins`,
		e.Target, e.EventID, e.Source, e.Reporter, claimed, e.EventType, e.Meaning,
		e.Reference, e.ReferenceKind, ref, e.Body, bodyRetention, matchFor)
	kept, err := pgx.CollectExactlyOneRow(rows, scanEvidence)
	if err = translate(err); errors.Is(err, ErrNotFound) {
		// Kept before (ON CONFLICT DO NOTHING returns no row): the row kept answers.
		kept, err = q.Evidence(ctx, e.Key())
		return kept, false, err
	} else if err != nil {
		return InboundEvidence{}, false, fmt.Errorf("store: receive evidence: %w", err)
	}
	return kept, true, nil
}

// ErrEvidenceNotFound means no event has that key.
var ErrEvidenceNotFound = errors.New("evidence not found")

// Evidence returns one event.
func (q Scope) Evidence(ctx context.Context, k EvidenceKey) (InboundEvidence, error) {
	rows := q.query(ctx, `SELECT `+evidenceColumns+` FROM inbound_evidence WHERE target = $1 AND event_id = $2 AND reporter = $3`,
		k.Target, k.EventID, k.Reporter)
	e, err := pgx.CollectExactlyOneRow(rows, scanEvidence)
	if err = translate(err); errors.Is(err, ErrNotFound) {
		return InboundEvidence{}, ErrEvidenceNotFound
	} else if err != nil {
		return InboundEvidence{}, fmt.Errorf("store: evidence: %w", err)
	}
	return e, nil
}

// DueEvidence returns up to limit PENDING events whose next match is due, oldest first.
func (q Scope) DueEvidence(ctx context.Context, limit int) ([]InboundEvidence, error) {
	rows := q.query(ctx, `SELECT `+evidenceColumns+` FROM inbound_evidence
		WHERE disposition = 'PENDING' AND next_match_at <= now() ORDER BY next_match_at LIMIT $1`, limit)
	due, err := pgx.CollectRows(rows, scanEvidence)
	if err != nil {
		return nil, fmt.Errorf("store: due evidence: %w", translate(err))
	}
	return due, nil
}

// Candidate is an operation an event's reference found, with its approved payload (nil
// once purged).
type Candidate struct {
	Operation
	Payload []byte
	// VerifiedSuccess: the target answered one of its sends with a verified success
	// that reached a worker after it lost its fence (a stale outcome).
	VerifiedSuccess bool
}

// candidateColumns are a Candidate's columns, from operations.
var candidateColumns = operationColumns + `, payload, ` + successKept("operations.tenant_id", "operations.operation_id")

// EvidenceCandidates returns the operations of the given types that an event's
// reference names: by the remote key the broker sent, or by the target's reference. At
// most two: more than one is already ambiguous.
func (q Scope) EvidenceCandidates(ctx context.Context, operationTypes []string, referenceKind, reference string) ([]Candidate, error) {
	where := `remote_ref = $1`
	var arg any = reference
	if referenceKind == "remote_key" {
		key, err := uuid.Parse(reference)
		if err != nil {
			return nil, nil // no operation has a key that is not a UUID
		}
		where, arg = `(tenant_id, operation_id) IN (SELECT tenant_id, operation_id FROM operation_keys WHERE remote_key = $1)`, key
	}
	rows := q.query(ctx, `SELECT `+candidateColumns+` FROM operations
		WHERE `+where+` AND operation_type = ANY ($2) LIMIT 2`, arg, operationTypes)
	found, err := pgx.CollectRows(rows, scanCandidate)
	if err != nil {
		return nil, fmt.Errorf("store: evidence candidates: %w", translate(err))
	}
	return found, nil
}

// Candidate returns one operation with its approved payload, for an operator who names
// the operation an event is about.
func (q Scope) Candidate(ctx context.Context, tenantID string, id uuid.UUID) (Candidate, error) {
	rows := q.query(ctx, `SELECT `+candidateColumns+` FROM operations WHERE tenant_id = $1 AND operation_id = $2`, tenantID, id)
	c, err := pgx.CollectExactlyOneRow(rows, scanCandidate)
	if err != nil {
		return Candidate{}, fmt.Errorf("store: candidate: %w", translate(err))
	}
	return c, nil
}

func scanCandidate(row pgx.CollectableRow) (Candidate, error) {
	var c Candidate
	err := row.Scan(operationDest(&c.Operation, &c.Payload, &c.VerifiedSuccess)...)
	return c, err
}

// EvidenceSettlement decides an event: its new disposition and, when it changes its
// operation, the change.
type EvidenceSettlement struct {
	EvidenceKey
	// From is the disposition the event must still have (PENDING for the matcher,
	// QUARANTINED for a review): otherwise nothing is recorded.
	From string
	To   string
	// Reason and Detail, for a quarantined event, say why ("": a reviewed event keeps
	// the reason it was quarantined for).
	Reason string
	Detail string
	// TenantID and ID name the operation the event is about, if one.
	TenantID string
	ID       uuid.UUID
	// Change, when set, is recorded on that operation with an event, only if it is
	// still at Change.Revision: the event's disposition and the change commit together,
	// or neither does.
	Change *EvidenceChange
	// Revision, without a Change, is the operation's revision the decision read, if it
	// must still hold (an observation that depends on the operation's state): the
	// operation is held at it until the decision commits, or nothing is recorded.
	Revision int64
	// Reviewer and Note, for a review.
	Reviewer string
	Note     string
}

// EvidenceChange is what an event does to its operation.
type EvidenceChange struct {
	Revision int64 // the revision the decision read
	From     State // its state then
	// To is the state it moves to: SUCCEEDED or FAILED_TERMINAL (the fence goes up by
	// one, so a sender or reconciler that held it can no longer record, and its lease
	// ends), or From for an observation recorded as an event (UNKNOWN, ESCALATED).
	To                 State
	RemoteRef          string
	AcceptedUnfinished bool // the target accepted the request without finishing it
	Observation        Observation
	Actor              string
	Reason             string // the event's reason
}

// ErrEvidenceChanged means the event or its operation changed since they were read:
// nothing was recorded; read them again.
var ErrEvidenceChanged = errors.New("the evidence or its operation changed since they were read")

// SettleEvidence records a decision on an event, and its change to the operation, in one
// statement; ErrEvidenceChanged when the event is no longer From or the operation has
// moved past Change.Revision (or Revision), or when the change is to FAILED_TERMINAL and
// a verified success of the target's is kept as a stale outcome (one may have come
// since the decision: it is decided again, knowing it).
func (q Scope) SettleEvidence(ctx context.Context, s EvidenceSettlement) error {
	var tenant *string
	var id *uuid.UUID
	if s.TenantID != "" {
		tenant, id = &s.TenantID, &s.ID
	}
	var revision *int64
	var from, to *State
	var ref *string
	var accepted bool
	var obs *Observation
	var actor, reason *string
	if c := s.Change; c != nil {
		revision, from, to, accepted, obs, actor, reason = &c.Revision, &c.From, &c.To, c.AcceptedUnfinished, &c.Observation, &c.Actor, &c.Reason
		if c.RemoteRef != "" {
			ref = &c.RemoteRef
		}
	}
	nullable := func(s string) *string {
		if s == "" {
			return nil
		}
		return &s
	}
	var observedAt *int64
	if s.Change == nil && s.Revision > 0 {
		observedAt = &s.Revision
	}
	if s.Change != nil {
		ctx = lockedForFailure(ctx, s.Change.To, OperationKey{TenantID: s.TenantID, ID: s.ID})
	}
	var settled, changed bool
	err := q.queryRow(ctx, `
		WITH row0 AS (
			SELECT target, event_id, reporter FROM inbound_evidence
			WHERE target = $1 AND event_id = $2 AND reporter = $19 AND disposition = $3
			FOR UPDATE
		), held AS (
			SELECT 1 FROM operations o
			WHERE $20::bigint IS NOT NULL AND o.tenant_id = $5 AND o.operation_id = $6 AND o.revision = $20
			FOR SHARE
		), upd AS (
			UPDATE operations o SET state = $9, revision = o.revision + 1,
				fence_token = CASE WHEN $9 <> o.state THEN o.fence_token + 1 ELSE o.fence_token END,
				remote_ref = coalesce($10, o.remote_ref),
				last_observation = jsonb_set($12::jsonb, '{observed_at}', to_jsonb(now())),
				accepted_unfinished = o.accepted_unfinished OR $11,
				next_check_at = CASE WHEN $9 <> o.state THEN NULL ELSE o.next_check_at END,
				lease_owner = CASE WHEN $9 <> o.state THEN NULL ELSE o.lease_owner END,
				lease_expires_at = CASE WHEN $9 <> o.state THEN NULL ELSE o.lease_expires_at END,
				updated_at = now()
			WHERE $7::bigint IS NOT NULL AND o.tenant_id = $5 AND o.operation_id = $6 AND o.revision = $7
				AND o.state = $8 AND EXISTS (SELECT 1 FROM row0)
				AND `+noFailureAfterSuccess("$9", "o.tenant_id", "o.operation_id")+`
			RETURNING o.*
		), ev AS (`+eventsFrom("upd", "$8", "$13", "$14", "last_observation")+`
		), mark AS (
			UPDATE inbound_evidence i SET disposition = $4, reason = coalesce($15, i.reason), detail = coalesce($16, i.detail),
				tenant_id = coalesce($5, i.tenant_id), operation_id = coalesce($6, i.operation_id),
				decided_at = coalesce(i.decided_at, now()), reviewed_by = $17,
				reviewed_at = CASE WHEN $17::text IS NULL THEN NULL ELSE now() END, review_note = $18
			FROM row0 WHERE i.target = row0.target AND i.event_id = row0.event_id AND i.reporter = row0.reporter
				AND ($7::bigint IS NULL OR EXISTS (SELECT 1 FROM upd))
				AND ($20::bigint IS NULL OR EXISTS (SELECT 1 FROM held))
			RETURNING 1
		)
		SELECT EXISTS (SELECT 1 FROM mark), EXISTS (SELECT 1 FROM upd)`,
		s.Target, s.EventID, s.From, s.To, tenant, id, revision, from, to, ref, accepted, obs, actor, reason,
		nullable(s.Reason), nullable(clip(s.Detail)), nullable(s.Reviewer), nullable(s.Note), s.Reporter, observedAt).Scan(&settled, &changed)
	if err != nil {
		return fmt.Errorf("store: settle evidence: %w", translate(err))
	}
	if !settled {
		return ErrEvidenceChanged
	}
	if changed {
		q.s.events.signal()
	}
	return nil
}

// MatchLater records that a PENDING event's reference found no operation: it is matched
// again after a wait that doubles up to a minute, until its match window closes, when
// it is quarantined with reason and detail. It returns the event's disposition.
func (q Scope) MatchLater(ctx context.Context, k EvidenceKey, reason, detail string) (string, error) {
	var disposition string
	err := q.queryRow(ctx, `
		UPDATE inbound_evidence SET attempts = attempts + 1,
			disposition = CASE WHEN now() >= match_until THEN 'QUARANTINED' ELSE 'PENDING' END,
			reason = CASE WHEN now() >= match_until THEN $3 END,
			detail = CASE WHEN now() >= match_until THEN $4 END,
			decided_at = CASE WHEN now() >= match_until THEN now() END,
			next_match_at = least(now() + least(interval '1 second' * power(2, least(attempts, 6)), interval '1 minute'),
				greatest(match_until, now()))
		WHERE target = $1 AND event_id = $2 AND reporter = $5 AND disposition = 'PENDING'
		RETURNING disposition`, k.Target, k.EventID, reason, clip(detail), k.Reporter).Scan(&disposition)
	if err = translate(err); errors.Is(err, ErrNotFound) {
		return "", ErrEvidenceChanged
	} else if err != nil {
		return "", fmt.Errorf("store: match later: %w", err)
	}
	return disposition, nil
}

// QuarantineParams select a page of the quarantine, oldest first.
type QuarantineParams struct {
	Target string // "" for every target
	// After continues after the last event of the previous page.
	AfterReceived time.Time
	AfterKey      EvidenceKey
	Limit         int
}

// Quarantine returns up to Limit quarantined events and whether more follow.
func (q Scope) Quarantine(ctx context.Context, p QuarantineParams) ([]InboundEvidence, bool, error) {
	rows := q.query(ctx, `SELECT `+evidenceColumns+` FROM inbound_evidence
		WHERE disposition = 'QUARANTINED' AND ($1 = '' OR target = $1)
			AND (received_at, target, event_id, reporter) > ($2, $3, $4, $5)
		ORDER BY received_at, target, event_id, reporter LIMIT $6`,
		p.Target, p.AfterReceived, p.AfterKey.Target, p.AfterKey.EventID, p.AfterKey.Reporter, p.Limit+1)
	page, err := pgx.CollectRows(rows, scanEvidence)
	if err != nil {
		return nil, false, fmt.Errorf("store: quarantine: %w", translate(err))
	}
	if len(page) > p.Limit {
		return page[:p.Limit], true, nil
	}
	return page, false, nil
}

// PurgeEvidenceBodies drops the bodies of up to limit events whose retention has passed
// and returns how many it dropped.
func (q Scope) PurgeEvidenceBodies(ctx context.Context, limit int) (int64, error) {
	tag, err := q.exec(ctx, `UPDATE inbound_evidence SET body = NULL
		WHERE (target, event_id, reporter) IN (SELECT target, event_id, reporter FROM inbound_evidence
			WHERE body IS NOT NULL AND body_purge_at <= now() ORDER BY body_purge_at LIMIT $1)`, limit)
	if err != nil {
		return 0, fmt.Errorf("store: purge evidence bodies: %w", translate(err))
	}
	return tag.RowsAffected(), nil
}

// maxDetail is the most a quarantined event's detail holds (the column's check).
const maxDetail = 1024

// clip shortens a detail to maxDetail bytes without splitting a character: a detail
// quotes values the event controls, which must never keep its decision from being
// recorded.
func clip(detail string) string {
	if len(detail) <= maxDetail {
		return detail
	}
	cut := maxDetail - len("…")
	for cut > 0 && !utf8.RuneStart(detail[cut]) {
		cut--
	}
	return detail[:cut] + "…"
}

// PostponeEvidence puts off the next match of a PENDING event whose decision could not
// be recorded (a connection cut, a database restarting), so that it does not hold the
// matchers' queue: by a wait that doubles with each try from a second up to a minute,
// since most such failures pass at once, and an event that resolves an operation
// should not wait a minute for one of them.
func (q Scope) PostponeEvidence(ctx context.Context, k EvidenceKey) error {
	_, err := q.exec(ctx, `UPDATE inbound_evidence SET attempts = attempts + 1,
			next_match_at = now() + least(interval '1 second' * power(2, least(attempts, 6)), interval '1 minute')
		WHERE target = $1 AND event_id = $2 AND reporter = $3 AND disposition = 'PENDING'`, k.Target, k.EventID, k.Reporter)
	if err != nil {
		return fmt.Errorf("store: postpone evidence: %w", translate(err))
	}
	return nil
}
