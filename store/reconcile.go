package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// UnknownClaim is a reconciler's claim of an UNKNOWN operation, with what the ledger
// knows of the operation's sends, measured when it was claimed. Its AcceptedUnfinished
// also holds when an event matched to the operation said the target accepted the request
// and has not finished it, even one that came while the operation was IN_FLIGHT.
type UnknownClaim struct {
	Claimed
	// MayHaveExecuted reports that some attempt may have reached the target: any attempt
	// (a claim into IN_FLIGHT) whose outcome was not recorded as provably never sent
	// (OutcomeParams.NotSent), by its holder or, later, by a stale worker.
	MayHaveExecuted bool
	// SinceLastSend is how long ago, by the database's clock, the broker stopped waiting
	// for the operation's last send: its outcome was recorded (by the holder of its
	// fence or, later, by a stale one) or its lease expired. A lookup cannot see a write
	// that send made until the target's visibility delay has passed since then.
	SinceLastSend time.Duration
	// StaleAnswers are the outcome classes of the answers workers received after losing
	// their fence (kept in stale_outcomes), oldest first: a target's answer that came
	// after the operation's lease expired is among them, not in LastObservation.
	StaleAnswers []string
	// EffectExists reports that the target refused one of the operation's sends because
	// its precondition failed (PRECONDITION_FAILED, answered in time or after the lease):
	// an earlier send made the effect (effectExists). No replay may follow.
	EffectExists bool
}

// lastSendEnded is when the broker stopped waiting for the last send of the operation of
// the row named alias, by the database's clock: the operation's last exit from
// IN_FLIGHT (its outcome, or the sweep of its expired lease), or a stale worker's later
// record. NULL for an operation never sent.
func lastSendEnded(alias string) string {
	return `greatest(
		(SELECT max(e.created_at) FROM operation_events e
		 WHERE e.tenant_id = ` + alias + `.tenant_id AND e.operation_id = ` + alias + `.operation_id AND e.from_state = 'IN_FLIGHT'),
		(SELECT max(s.recorded_at) FROM stale_outcomes s
		 WHERE s.tenant_id = ` + alias + `.tenant_id AND s.operation_id = ` + alias + `.operation_id))`
}

// ClaimUnknown takes due UNKNOWN operations for reconciliation: each gets a lease and
// fence + 1 without a change of state, so two reconcilers never act on one operation at
// once, and only the holder of the new fence can record what it finds.
func (q Scope) ClaimUnknown(ctx context.Context, p FairClaim) ([]UnknownClaim, error) {
	return rotate(p, func(p FairClaim) ([]UnknownClaim, error) { return q.claimUnknownFrom(ctx, p) })
}

func (q Scope) claimUnknownFrom(ctx context.Context, p FairClaim) ([]UnknownClaim, error) {
	// An attempt is an event into IN_FLIGHT; its outcome, the event out of IN_FLIGHT
	// under its fence or a stale worker's record (lastSendEnded).
	rows := q.query(withCustomPlan(ctx), fairPick("UNKNOWN",
		"next_check_at <= now() AND (lease_expires_at IS NULL OR lease_expires_at < now())", "next_check_at", 0)+`
		), claimed AS (
			UPDATE operations o SET fence_token = o.fence_token + 1, lease_owner = $6, lease_expires_at = now() + $7::interval
			`+pickedRows("picked")+`
			RETURNING o.*
		)
		SELECT `+claimedColumns+`,
			EXISTS (SELECT 1 FROM operation_events a
				WHERE a.tenant_id = claimed.tenant_id AND a.operation_id = claimed.operation_id AND a.to_state = 'IN_FLIGHT'
					AND NOT EXISTS (SELECT 1 FROM operation_events e
						WHERE e.tenant_id = a.tenant_id AND e.operation_id = a.operation_id
							AND e.from_state = 'IN_FLIGHT' AND e.fence_token = a.fence_token AND NOT e.sent)
					AND NOT EXISTS (SELECT 1 FROM stale_outcomes s
						WHERE s.tenant_id = a.tenant_id AND s.operation_id = a.operation_id
							AND s.fence_token = a.fence_token AND NOT s.sent)),
			coalesce(`+micros(`now() - `+lastSendEnded("claimed"))+`, 0),
			`+acceptedByEvidence("claimed.tenant_id", "claimed.operation_id")+`,
			ARRAY(SELECT s.outcome FROM stale_outcomes s
				WHERE s.tenant_id = claimed.tenant_id AND s.operation_id = claimed.operation_id
				ORDER BY s.recorded_at, s.fence_token),
			`+effectExists("claimed.tenant_id", "claimed.operation_id")+`
		FROM claimed ORDER BY tenant_id, operation_id`,
		p.AfterTenant, p.MaxTenants, p.OperationTypes, p.PerTenant, p.Limit, p.Worker, p.Lease)
	claimed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (UnknownClaim, error) {
		var c UnknownClaim
		var sinceLast int64
		var accepted bool
		err := scanClaimedInto(row, &c.Claimed, &c.MayHaveExecuted, &sinceLast, &accepted, &c.StaleAnswers, &c.EffectExists)
		c.SinceLastSend = duration(sinceLast)
		c.AcceptedUnfinished = c.AcceptedUnfinished || accepted
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("store: claim unknown: %w", translate(err))
	}
	return claimed, nil
}

// CheckParams record a look at an UNKNOWN operation that resolved nothing.
type CheckParams struct {
	TenantID    string
	ID          uuid.UUID
	Fence       int64
	Observation Observation
	// CheckAfter is how long from now, by the database's clock, to look again.
	CheckAfter time.Duration
	// AcceptedUnfinished marks that the target accepted the request without finishing
	// it (sticky: no replay may ever follow).
	AcceptedUnfinished bool
	Actor              string
}

// RecordCheck records the observation as an UNKNOWN → UNKNOWN event, schedules the next
// look and releases the lease; only under the fence, else ErrFenceLost.
func (q Scope) RecordCheck(ctx context.Context, p CheckParams) (Operation, error) {
	rows := q.query(ctx, `
		WITH upd AS (
			UPDATE operations SET revision = revision + 1, last_observation = $4, next_check_at = now() + $5::interval,
				checks = checks + 1, accepted_unfinished = accepted_unfinished OR $6,
				lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
			WHERE tenant_id = $1 AND operation_id = $2 AND state = 'UNKNOWN' AND fence_token = $3
			RETURNING *
		), ev AS (`+eventsFrom("upd", "'UNKNOWN'", "$7", "$8", "last_observation")+`)
		SELECT `+operationColumns+` FROM upd`,
		p.TenantID, p.ID, p.Fence, p.Observation, p.CheckAfter, p.AcceptedUnfinished, p.Actor, p.Observation.Outcome)
	return q.collectFenced(rows, "record check")
}

// ResolveParams end an UNKNOWN operation: SUCCEEDED (with the found reference),
// FAILED_TERMINAL, or ESCALATED (with its owner and reason).
type ResolveParams struct {
	TenantID    string
	ID          uuid.UUID
	Fence       int64
	State       State
	RemoteRef   string
	Observation Observation
	Escalation  *Escalation
	Actor       string
}

// ResolveUnknown moves an UNKNOWN operation to its resolution with an event; only under
// the fence, else ErrFenceLost.
func (q Scope) ResolveUnknown(ctx context.Context, p ResolveParams) (Operation, error) {
	switch p.State {
	case StateSucceeded, StateFailedTerminal:
	case StateEscalated:
		if p.Escalation == nil {
			return Operation{}, errors.New("store: resolve unknown: an escalation needs its owner and reason")
		}
	default:
		return Operation{}, fmt.Errorf("store: resolve unknown: %s is not a resolution", p.State)
	}
	var ref *string
	if p.RemoteRef != "" {
		ref = &p.RemoteRef
	}
	rows := q.query(lockedForFailure(ctx, p.State, OperationKey{TenantID: p.TenantID, ID: p.ID}), `
		WITH upd AS (
			UPDATE operations SET state = $4, revision = revision + 1, remote_ref = coalesce($5, remote_ref),
				last_observation = $6, escalation = $7, next_check_at = NULL,
				lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
			WHERE tenant_id = $1 AND operation_id = $2 AND state = 'UNKNOWN' AND fence_token = $3
				AND `+noFailureAfterSuccess("$4", "$1", "$2")+`
			RETURNING *
		), ev AS (`+eventsFrom("upd", "'UNKNOWN'", "$8", "$9", "last_observation")+`)
		SELECT `+operationColumns+` FROM upd`,
		p.TenantID, p.ID, p.Fence, p.State, ref, p.Observation, p.Escalation, p.Actor, p.Observation.Outcome)
	return q.collectFenced(rows, "resolve unknown")
}

// BeginReplayParams start a same-key replay of an UNKNOWN operation.
type BeginReplayParams struct {
	TenantID string
	ID       uuid.UUID
	// Fence is the reconciler's claim; the replay gets a new one.
	Fence  int64
	Worker string
	Lease  time.Duration
	// AcceptedClasses are the outcome classes that say the target accepted a request
	// without finishing it, for this operation's target: a stale outcome of one of them
	// refuses the replay too.
	AcceptedClasses []string
}

// BeginReplay moves an UNKNOWN operation to IN_FLIGHT for a same-key replay: fence + 1,
// attempt + 1 and an event, only under the caller's fence, and never once the target
// said it accepted the request without finishing it, answered it with a verified
// success, or refused a send because an earlier one made the effect:
// accepted_unfinished, which an event saying so sets on an UNKNOWN operation without
// taking its fence, or a stale outcome of one of p.AcceptedClasses or VERIFIED_SUCCESS
// (an answer a worker received after losing its fence), or effectExists; any may have
// come after the caller decided. The returned claim is sent and recorded like a
// dispatcher's.
func (q Scope) BeginReplay(ctx context.Context, p BeginReplayParams) (Claimed, error) {
	// It must see an answer kept until it has the row (withOperationLocked).
	ctx = withOperationLocked(ctx, OperationKey{TenantID: p.TenantID, ID: p.ID})
	rows := q.query(ctx, `
		WITH upd AS (
			UPDATE operations SET state = 'IN_FLIGHT', revision = revision + 1, fence_token = fence_token + 1,
				attempt_count = attempt_count + 1, replays = replays + 1, next_check_at = NULL,
				lease_owner = $4, lease_expires_at = now() + $5::interval, updated_at = now()
			WHERE tenant_id = $1 AND operation_id = $2 AND state = 'UNKNOWN' AND fence_token = $3
				AND NOT accepted_unfinished
				AND NOT EXISTS (SELECT 1 FROM stale_outcomes s
					WHERE s.tenant_id = $1 AND s.operation_id = $2 AND s.outcome = ANY($6))
				AND NOT `+successKept("$1", "$2")+`
				AND NOT `+effectExists("$1", "$2")+`
			RETURNING *
		), ev AS (`+eventsFrom("upd", "'UNKNOWN'", "'reconciler:' || $4", "'SAME_KEY_REPLAY'", "NULL")+`)
		SELECT `+claimedColumns+` FROM upd`,
		p.TenantID, p.ID, p.Fence, p.Worker, p.Lease, p.AcceptedClasses)
	c, err := pgx.CollectExactlyOneRow(rows, scanClaimed)
	if err != nil {
		if err = translate(err); errors.Is(err, ErrNotFound) {
			return Claimed{}, ErrFenceLost
		}
		return Claimed{}, fmt.Errorf("store: begin replay: %w", err)
	}
	q.s.events.signal()
	return c, nil
}

// collectFenced reads the one row of a fenced update and signals its event; no row
// means the fence was lost.
func (q Scope) collectFenced(rows pgx.Rows, what string) (Operation, error) {
	op, err := pgx.CollectExactlyOneRow(rows, scanOperation)
	if err != nil {
		if err = translate(err); errors.Is(err, ErrNotFound) {
			return Operation{}, ErrFenceLost
		}
		return Operation{}, fmt.Errorf("store: %s: %w", what, err)
	}
	q.s.events.signal()
	return op, nil
}

// StaleSuccess returns the target's reference from a verified success that a worker
// observed after losing its fence (kept as evidence in stale_outcomes), if there is one:
// the latest fence's, "" if that one has none. It is found by the same condition as the
// ledger's refusals of a failure or a replay after one (successKept), so that a
// reconciler never decides what the ledger then refuses.
func (q Scope) StaleSuccess(ctx context.Context, tenantID string, id uuid.UUID) (string, bool, error) {
	var ref string
	err := q.queryRow(ctx, `SELECT coalesce(remote_ref, '') FROM stale_outcomes
		WHERE tenant_id = $1 AND operation_id = $2 AND outcome = 'VERIFIED_SUCCESS'
		ORDER BY fence_token DESC LIMIT 1`, tenantID, id).Scan(&ref)
	if err = translate(err); errors.Is(err, ErrNotFound) {
		return "", false, nil
	} else if err != nil {
		return "", false, fmt.Errorf("store: stale success: %w", err)
	}
	return ref, true, nil
}

// successKept is the SQL condition that a verified success of the target's to one of
// the operation's sends (tenant and id, SQL expressions of this package) is kept as a
// stale outcome: it reached a worker after it lost its fence. StaleSuccess finds the
// same ones.
func successKept(tenant, id string) string {
	return `EXISTS (SELECT 1 FROM stale_outcomes s WHERE s.tenant_id = ` + tenant + ` AND s.operation_id = ` + id + `
		AND s.outcome = 'VERIFIED_SUCCESS')`
}

// effectExists is the SQL condition that the target refused one of the operation's
// sends (tenant and id, SQL expressions of this package) because its precondition
// failed: a conditional send's answer that an earlier send made the effect, recorded
// as the send's outcome or kept as a stale one. It stays true whatever a lookup finds
// later (a lookup that lags, an object its owner removed since): sending again could
// make the effect a second time.
func effectExists(tenant, id string) string {
	return `(EXISTS (SELECT 1 FROM operation_events e WHERE e.tenant_id = ` + tenant + ` AND e.operation_id = ` + id + `
		AND e.from_state = 'IN_FLIGHT' AND e.reason = 'PRECONDITION_FAILED')
		OR EXISTS (SELECT 1 FROM stale_outcomes s WHERE s.tenant_id = ` + tenant + ` AND s.operation_id = ` + id + `
		AND s.outcome = 'PRECONDITION_FAILED'))`
}

// noFailureAfterSuccess is the SQL condition of every write that may record a
// FAILED_TERMINAL (to, an operation_state expression): none while the target has
// confirmed an effect of the operation (tenant and id): a verified success of one of
// its sends kept as a stale outcome (successKept), or an event of its saying it
// succeeded, matched to the operation (evidenceSays; on an ESCALATED operation such
// an event is recorded for the owner to judge). Each such write runs under
// lockedForFailure, so that a success being kept meanwhile is seen.
func noFailureAfterSuccess(to, tenant, id string) string {
	return `(` + to + `::operation_state <> 'FAILED_TERMINAL' OR NOT (` + successKept(tenant, id) + ` OR ` +
		evidenceSays(tenant, id, "SUCCEEDED") + `))`
}

// reportedSuccess returns the target's reference (possibly "") and the event id of the
// latest event of the target's that said the operation succeeded and was matched to it
// (evidenceMatched, as noFailureAfterSuccess finds it), if there is one.
func (q Scope) reportedSuccess(ctx context.Context, tenantID string, id uuid.UUID) (ref, eventID string, ok bool, err error) {
	err = q.queryRow(ctx, `SELECT coalesce(remote_ref, ''), event_id FROM inbound_evidence i
		WHERE `+evidenceMatched("$1", "$2", "SUCCEEDED")+`
		ORDER BY decided_at DESC LIMIT 1`, tenantID, id).Scan(&ref, &eventID)
	if err = translate(err); errors.Is(err, ErrNotFound) {
		return "", "", false, nil
	} else if err != nil {
		return "", "", false, fmt.Errorf("store: reported success: %w", err)
	}
	return ref, eventID, true, nil
}

// lockedForFailure returns ctx for a write that records to for the operation key: a
// FAILED_TERMINAL first locks the row (withOperationLocked), so that its condition
// (noFailureAfterSuccess) sees a verified success being kept until it has the row.
func lockedForFailure(ctx context.Context, to State, key OperationKey) context.Context {
	if to != StateFailedTerminal {
		return ctx
	}
	return withOperationLocked(ctx, key)
}

// acceptedByEvidence is the SQL condition that an event matched to the operation
// (tenant and id, SQL expressions of this package) said the target accepted its request
// without finishing it.
func acceptedByEvidence(tenant, id string) string {
	return evidenceSays(tenant, id, "PENDING")
}

// evidenceSays is the SQL condition that an event of the meaning given was matched to
// the operation (tenant and id, SQL expressions of this package): evidenceMatched.
func evidenceSays(tenant, id, meaning string) string {
	return `EXISTS (SELECT 1 FROM inbound_evidence i WHERE ` + evidenceMatched(tenant, id, meaning) + `)`
}

// evidenceMatched is the SQL condition that the event i, of the meaning given, was
// matched to the operation (tenant and id) through every check of the matcher: applied,
// observed, or attached by a reviewer (never one quarantined or dismissed).
func evidenceMatched(tenant, id, meaning string) string {
	return `i.tenant_id = ` + tenant + ` AND i.operation_id = ` + id + `
		AND i.meaning = '` + meaning + `' AND i.disposition IN ('APPLIED', 'OBSERVED', 'ATTACHED')`
}
