package chaos

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/opbroker/opbroker/simtarget"
	"github.com/opbroker/opbroker/target"
)

// ledgerOp is an operation as the audit reads it from the ledger.
type ledgerOp struct {
	Tenant, Type, IntentRef, State string
	Name, RemoteKey, RemoteRef     string
	Supersedes                     string // the name of the operation it amends, or ""
	Escalated, NextCheck           bool
	LastObservation                string
	Events                         []ledgerEvent
	// Stale are the outcomes workers recorded after losing their fence.
	Stale []staleOutcome
}

type ledgerEvent struct {
	Revision int64
	From     *string
	To       string
	Fence    int64
	At       time.Time
	Actor    string
	Reason   string
	// For a person's resolution: why, and what was checked.
	Summary, Evidence string
	// EventID, for a change evidence made, is the target's event it records.
	EventID string
	// Class is the event's reason alone: on the outcome its holder recorded, the
	// outcome's class. Sent, on that outcome, says whether the request can have left.
	Class string
	Sent  *bool
}

type staleOutcome struct {
	Fence   int64
	Actor   string
	At      time.Time
	Outcome string
}

// ledgerAttempt is one attempt as the ledger records it: the event that took the
// operation into IN_FLIGHT under its fence and, when its outcome was recorded, the
// holder's event out of IN_FLIGHT under the same fence or a stale worker's record.
type ledgerAttempt struct {
	Fence    int64
	Applied  bool
	Worker   string
	Claimed  time.Time
	Finished *time.Time
	Outcome  string
	// Sent, for an applied outcome, says whether the request can have left.
	Sent bool
}

// attempts derives the operation's attempts from its events and stale outcomes.
func (op *ledgerOp) attempts() []ledgerAttempt {
	var out []ledgerAttempt
	for _, e := range op.Events {
		if e.To != "IN_FLIGHT" {
			continue
		}
		a := ledgerAttempt{Fence: e.Fence, Worker: e.Actor, Claimed: e.At}
		for _, f := range op.Events {
			if f.From != nil && *f.From == "IN_FLIGHT" && f.Fence == e.Fence && f.Sent != nil {
				a.Applied, a.Finished, a.Outcome, a.Sent = true, &f.At, f.Class, *f.Sent
			}
		}
		for _, st := range op.Stale {
			if st.Fence == e.Fence && !a.Applied {
				a.Finished, a.Outcome = &st.At, st.Outcome
			}
		}
		out = append(out, a)
	}
	return out
}

// trail tells an operation's history, for a violation's report.
func (op *ledgerOp) trail(kt *simtarget.KeyTruth) []string {
	out := []string{fmt.Sprintf("    %s (%s), key %s; the target saw %d attempts, %d effects", op.Name, op.Type, op.RemoteKey, kt.Attempts, kt.Effects)}
	for _, e := range op.Events {
		out = append(out, fmt.Sprintf("      %s rev %d -> %s fence %d by %s: %s", e.At.Format("15:04:05.000"), e.Revision, e.To, e.Fence, e.Actor, e.Reason))
	}
	for _, a := range op.attempts() {
		finished := "unfinished"
		if a.Finished != nil {
			finished = a.Finished.Format("15:04:05.000") + " " + a.Outcome
			if !a.Applied {
				finished += " (stale)"
			}
		}
		out = append(out, fmt.Sprintf("      attempt fence %d by %s claimed %s, %s", a.Fence, a.Worker, a.Claimed.Format("15:04:05.000"), finished))
	}
	return out
}

// readLedger reads every operation of the run with its events and stale outcomes.
func (c *cluster) readLedger(ctx context.Context) (map[string]*ledgerOp, error) {
	ops := map[string]*ledgerOp{}
	rows, _ := c.admin.Query(ctx, `SELECT tenant_id, operation_type, intent_ref, state::text,
			'tenants/' || tenant_id || '/operations/' || operation_id, remote_key::text, coalesce(remote_ref, ''),
			coalesce('tenants/' || tenant_id || '/operations/' || supersedes_id, ''),
			escalation IS NOT NULL, next_check_at IS NOT NULL,
			coalesce(last_observation->>'outcome', '') || ' ' || coalesce(last_observation->>'summary', '')
		FROM operations`)
	var op ledgerOp
	if _, err := pgx.ForEachRow(rows, []any{&op.Tenant, &op.Type, &op.IntentRef, &op.State, &op.Name, &op.RemoteKey,
		&op.RemoteRef, &op.Supersedes, &op.Escalated, &op.NextCheck, &op.LastObservation}, func() error {
		o := op
		ops[o.Name] = &o
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reading operations: %w", err)
	}
	rows, _ = c.admin.Query(ctx, `SELECT 'tenants/' || tenant_id || '/operations/' || operation_id,
			revision, from_state::text, to_state::text, fence_token, created_at, actor,
			coalesce(reason, '') || ' ' || coalesce(observation->>'outcome', ''),
			coalesce(observation->>'summary', ''), coalesce(observation->>'evidence', ''), coalesce(reason, ''), sent,
			coalesce(observation->>'event_id', '')
		FROM operation_events ORDER BY tenant_id, operation_id, revision`)
	var name string
	var ev ledgerEvent
	if _, err := pgx.ForEachRow(rows, []any{&name, &ev.Revision, &ev.From, &ev.To, &ev.Fence, &ev.At, &ev.Actor, &ev.Reason, &ev.Summary, &ev.Evidence, &ev.Class, &ev.Sent, &ev.EventID}, func() error {
		if o := ops[name]; o != nil {
			o.Events = append(o.Events, ev)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reading events: %w", err)
	}
	rows, _ = c.admin.Query(ctx, `SELECT 'tenants/' || tenant_id || '/operations/' || operation_id, fence_token,
			actor, recorded_at, outcome
		FROM stale_outcomes ORDER BY tenant_id, operation_id, fence_token`)
	var st staleOutcome
	if _, err := pgx.ForEachRow(rows, []any{&name, &st.Fence, &st.Actor, &st.At, &st.Outcome}, func() error {
		if o := ops[name]; o != nil {
			o.Stale = append(o.Stale, st)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reading stale outcomes: %w", err)
	}
	return ops, nil
}

// truth merges the ground truth of the run's targets, by idempotency key (or request
// id, for the unkeyed target).
func (c *cluster) truth() map[string]*simtarget.KeyTruth {
	out := map[string]*simtarget.KeyTruth{}
	for _, s := range c.sims {
		for k, v := range s.Snapshot().Keys {
			out[k] = v
		}
	}
	return out
}

var terminal = []string{"SUCCEEDED", "FAILED_TERMINAL", "CANCELLED"}

// credentialLeaks returns I12's violations: the log lines of the replicas that held one
// of the run's secrets (checkLog), and the rows of the run's schema that do, every table
// searched with each row as text. A remote key the ledger holds is searched for with
// the secrets, as a control that the search finds what is there.
func (c *cluster) credentialLeaks(ctx context.Context, ops map[string]*ledgerOp) ([]string, error) {
	c.mu.Lock()
	secrets := slices.Clone(c.secrets)
	out := slices.Clone(c.logViolations)
	lines := c.logLines
	c.mu.Unlock()
	if lines == 0 {
		out = append(out, "no replica log line was read, so none was checked")
	}
	values := make([]string, 0, len(secrets)+1)
	for _, s := range secrets {
		values = append(values, s.value)
	}
	var control string
	for _, name := range slices.Sorted(maps.Keys(ops)) {
		if control = ops[name].RemoteKey; control != "" {
			values = append(values, control)
			break
		}
	}
	rows, _ := c.admin.Query(ctx, `SELECT tablename FROM pg_tables WHERE schemaname = @schema ORDER BY tablename`,
		pgx.NamedArgs{"schema": c.schema})
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("listing the ledger's tables: %w", err)
	}
	controlFound := false
	for _, table := range tables {
		// The lateral subquery turns each row into text once, not once per secret.
		rows, _ := c.admin.Query(ctx, `SELECT d.doc FROM `+pgx.Identifier{c.schema, table}.Sanitize()+` AS ledger_row
			CROSS JOIN LATERAL (SELECT ledger_row::text AS doc OFFSET 0) AS d
			WHERE EXISTS (SELECT FROM unnest(@values::text[]) AS v WHERE strpos(d.doc, v) > 0)`,
			pgx.NamedArgs{"values": values})
		docs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("searching %s for the run's secrets: %w", table, err)
		}
		for _, doc := range docs {
			controlFound = controlFound || control != "" && strings.Contains(doc, control)
			if held, redacted := redact(doc, secrets); len(held) > 0 {
				out = append(out, fmt.Sprintf("a row of %s holds %s: %s", table, strings.Join(held, " and "), redacted))
			}
		}
	}
	if control != "" && !controlFound {
		out = append(out, fmt.Sprintf("the search of the ledger did not find remote key %s, which it holds: it checked nothing", control))
	}
	return out, nil
}

// redact returns the names of the secrets text holds and, when it holds any, up to 300
// bytes of text around the first, every secret replaced by its name (replaced before
// the cut, so that no part of one is left at an edge).
func redact(text string, secrets []secret) (held []string, excerpt string) {
	for _, s := range secrets {
		if strings.Contains(text, s.value) {
			held = append(held, s.name)
			text = strings.ReplaceAll(text, s.value, "<"+s.name+">")
		}
	}
	if len(held) == 0 {
		return nil, ""
	}
	first := len(text)
	for _, name := range held {
		first = min(first, strings.Index(text, "<"+name+">"))
	}
	from := max(0, first-100)
	return held, strings.ToValidUTF8(text[from:min(len(text), from+300)], "")
}

// evidenceAudit is what I14 and I15 read: the events the charge target sent, those the
// reporter reported, and those the ledger kept.
type evidenceAudit struct {
	sent    []simtarget.WebhookTruth
	kept    map[string]ledgerEvidence // by evidenceKey
	reports []report
}

// audit checks invariants I1–I16 (docs/testing.md#the-chaos-run) and fills the report's
// counts; leaks are I12's violations (credentialLeaks).
func audit(r *Report, ops map[string]*ledgerOp, truth map[string]*simtarget.KeyTruth, h *history, leaks []string, ev evidenceAudit) {
	inv := map[string][]string{}
	fail := func(id, format string, args ...any) { inv[id] = append(inv[id], fmt.Sprintf(format, args...)) }
	keys := map[string]string{} // remote key → operation
	var resolutions []time.Duration

	for _, op := range ops {
		kt := truth[op.RemoteKey]
		if kt == nil {
			kt = &simtarget.KeyTruth{}
		}
		keys[op.RemoteKey] = op.Name
		// I1: at most one real effect per intent.
		if kt.Effects > 1 {
			r.Duplicated++
			fail("I1", "%s: %d effects at the target\n%s", op.Name, kt.Effects, strings.Join(op.trail(kt), "\n"))
		}
		// I3: SUCCEEDED has a real effect, and the reference recorded is that effect's;
		// one the target still processes, or failed, is not a success.
		if op.State == "SUCCEEDED" && (kt.Effects-kt.Processing-kt.Failed == 0 || !slices.Contains(kt.IDs, op.RemoteRef)) {
			r.Unconfirmed++
			fail("I3", "%s: SUCCEEDED with reference %q, the target has %v (%d processing, %d failed)\n%s",
				op.Name, op.RemoteRef, kt.IDs, kt.Processing, kt.Failed, strings.Join(op.trail(kt), "\n"))
		}
		// I4: FAILED_TERMINAL has no effect (an effect that failed at the target, final
		// and without effect as documented, is none).
		if op.State == "FAILED_TERMINAL" && kt.Effects-kt.Failed > 0 {
			r.FalseFailed++
			fail("I4", "%s: FAILED_TERMINAL but the target has %d effects\n%s", op.Name, kt.Effects, strings.Join(op.trail(kt), "\n"))
		}
		// I6: the target saw one payload for the key.
		if len(kt.PayloadSHA256) > 1 && len(slices.Compact(slices.Sorted(slices.Values(kt.PayloadSHA256)))) > 1 {
			fail("I6", "%s: the target saw %d different payloads under its key", op.Name, len(kt.PayloadSHA256))
		}
		auditEvents(op, fail)
		if slices.ContainsFunc(op.Events, func(e ledgerEvent) bool { return strings.Contains(e.Reason, target.ClassPending) }) {
			r.Pending++
		}
		if slices.ContainsFunc(op.Events, func(e ledgerEvent) bool { return e.From != nil && *e.From == "IN_FLIGHT" && e.To == "PREPARED" }) {
			r.Resent++
		}
		if op.Supersedes != "" {
			r.Amendments++
			auditAmendment(op, ops[op.Supersedes], truth, fail)
		}
		// I9: after healing, terminal, or ESCALATED/UNKNOWN with an owner.
		switch {
		case slices.Contains(terminal, op.State):
		case op.State == "ESCALATED" && op.Escalated:
		case op.State == "UNKNOWN" && op.NextCheck:
			if r.Unresolved++; len(r.UnresolvedSamples) < 20 {
				r.UnresolvedSamples = append(r.UnresolvedSamples, fmt.Sprintf("%s (%s): %s", op.Name, op.Type, op.LastObservation))
			}
		default:
			fail("I9", "%s: %s after healing", op.Name, op.State)
		}
		// I16: the operator resolved every escalation once the work had settled. Work
		// that did not settle may still escalate after the operator's last look.
		if op.State == "ESCALATED" && r.Settled {
			fail("I16", "%s: still ESCALATED at the end of the run", op.Name)
		}
		r.ByState[op.State]++
		if slices.ContainsFunc(op.Events, func(e ledgerEvent) bool { return e.To == "ESCALATED" }) {
			r.Escalated++ // ever: the run's operator resolves them at the end
		}
		// I13: a person's resolution names the operator, why, and what was checked.
		for _, e := range op.Events {
			if strings.HasPrefix(e.Reason, "MANUAL_RESOLUTION") &&
				(!strings.HasPrefix(e.Actor, "operator:") || e.Summary == "" || e.Evidence == "") {
				fail("I13", "%s: a manual resolution at revision %d by %q without its reason or evidence", op.Name, e.Revision, e.Actor)
			}
		}
		if d, recovered := resolution(op); recovered {
			r.Recovered++
			resolutions = append(resolutions, d)
		} else if d > 0 {
			resolutions = append(resolutions, d)
		}
	}
	// I6 (cont.): every key the target saw belongs to an operation.
	for k, kt := range truth {
		if k != "" && keys[k] == "" && kt.Attempts > 0 {
			fail("I6", "the target saw key %s, which no operation holds", k)
		}
	}
	// I2 and I7: every acknowledged intent has exactly its one operation.
	names := map[string]string{}
	for _, in := range h.intents {
		key := in.req.GetTenant() + "/" + in.req.GetOperationType() + "/" + in.req.GetIntentRef()
		for _, name := range in.acked {
			if ops[name] == nil {
				r.Lost++
				fail("I2", "%s: acknowledged as %s, which the ledger does not hold", key, name)
			}
			if name != in.acked[0] {
				fail("I7", "%s: acknowledged as %s and as %s", key, in.acked[0], name)
			}
			if other, ok := names[name]; ok && other != key {
				fail("I7", "%s and %s: both acknowledged as %s", key, other, name)
			}
			names[name] = key
		}
	}
	// I8: the probes were refused.
	for _, v := range h.violations {
		fail("I8", "%s", v)
	}
	for _, v := range leaks {
		fail("I12", "%s", v)
	}
	auditEvidence(r, ops, truth, ev.sent, ev.kept, ev.reports, fail)
	if r.EscalationsLeft != "" {
		fail("I16", "the operator: %s", r.EscalationsLeft)
	}

	slices.Sort(resolutions)
	if n := len(resolutions); n > 0 {
		r.UnknownToResolution = Durations{Median: resolutions[n/2].Round(time.Millisecond), Worst: resolutions[n-1].Round(time.Millisecond)}
	}
	r.AmendmentsWaited = h.amendmentsWaited
	for _, id := range []string{"I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12", "I13", "I14", "I15", "I16"} {
		res := Invariant{ID: id, Name: invariantNames[id], Held: len(inv[id]) == 0}
		res.Violations = inv[id][:min(len(inv[id]), 20)]
		r.Invariants = append(r.Invariants, res)
	}
}

// auditEvents checks one operation's event log (I10) and fences (I5).
func auditEvents(op *ledgerOp, fail func(id, format string, args ...any)) {
	if len(op.Events) == 0 {
		fail("I10", "%s: no events", op.Name)
		return
	}
	for i, e := range op.Events {
		if e.Revision != int64(i+1) {
			fail("I10", "%s: event %d has revision %d", op.Name, i+1, e.Revision)
		}
		if i == 0 && (e.From != nil || e.To != "PREPARED") {
			fail("I10", "%s: the first event is not the creation", op.Name)
		}
		if i > 0 {
			prev := op.Events[i-1]
			if e.From == nil || *e.From != prev.To {
				fail("I10", "%s: revision %d starts from %v, the previous ended in %s", op.Name, e.Revision, e.From, prev.To)
			}
			if e.Fence < prev.Fence {
				fail("I5", "%s: the fence went back from %d to %d at revision %d", op.Name, prev.Fence, e.Fence, e.Revision)
			}
		}
	}
	if last := op.Events[len(op.Events)-1]; last.To != op.State {
		fail("I10", "%s: the last event ends in %s, the operation is %s", op.Name, last.To, op.State)
	}
	// I5: an outcome was applied only under the fence of its own claim: every event that
	// took the operation out of IN_FLIGHT, other than to UNKNOWN (which the sweeper may
	// do when the lease expires), is a holder's outcome (it says whether the request
	// left) under the fence the operation entered IN_FLIGHT with, or the target's
	// evidence, which takes the next fence from the holder; and a stale outcome was
	// kept only for a fence that was claimed and whose holder applied no outcome.
	for i, e := range op.Events {
		if e.From == nil || *e.From != "IN_FLIGHT" || i == 0 {
			continue
		}
		claim := op.Events[i-1]
		if e.EventID != "" {
			if e.Sent != nil || e.Fence != claim.Fence+1 {
				fail("I5", "%s: evidence took it out of IN_FLIGHT under fence %d, entered under %d", op.Name, e.Fence, claim.Fence)
			}
			continue
		}
		if e.To != "UNKNOWN" && e.Sent == nil {
			fail("I5", "%s: left IN_FLIGHT for %s under fence %d, but not as its holder's outcome", op.Name, e.To, e.Fence)
		}
		if e.Fence != claim.Fence {
			fail("I5", "%s: left IN_FLIGHT under fence %d, entered under %d", op.Name, e.Fence, claim.Fence)
		}
	}
	for _, st := range op.Stale {
		claimed := slices.ContainsFunc(op.attempts(), func(a ledgerAttempt) bool { return a.Fence == st.Fence && !a.Applied })
		if !claimed {
			fail("I5", "%s: a stale outcome under fence %d, which no unapplied attempt holds", op.Name, st.Fence)
		}
	}
}

// auditAmendment checks I11 for an amendment: it was recorded only beside an original
// that was settled, or PREPARED and then cancelled by it in the same transaction, in
// which case the original never reached the target.
func auditAmendment(op, original *ledgerOp, truth map[string]*simtarget.KeyTruth, fail func(id, format string, args ...any)) {
	if original == nil {
		fail("I11", "%s: amends %s, which the ledger does not hold", op.Name, op.Supersedes)
		return
	}
	found, _, _ := strings.Cut(strings.TrimPrefix(op.Events[0].Reason, "SUPERSEDES_"), " ")
	switch {
	case found == "PREPARED":
		// PREPARED: never sent, or only answered with answers documented as not executed
		// (or given back unsent: NOT_STARTED, before a send into a refused credential).
		kt := orEmpty(truth[original.RemoteKey])
		executable := slices.ContainsFunc(original.attempts(), func(a ledgerAttempt) bool {
			return a.Outcome != target.ClassNotExecuted && a.Outcome != target.ClassCredentialRefused && !(a.Applied && !a.Sent)
		})
		if original.State != "CANCELLED" || executable || kt.Effects > 0 {
			fail("I11", "%s: amended %s while PREPARED, but the original is %s with %d attempts and %d effects\n%s",
				op.Name, original.Name, original.State, len(original.attempts()), kt.Effects, strings.Join(original.trail(kt), "\n"))
		}
	case slices.Contains(terminal, found):
	default:
		fail("I11", "%s: recorded while its original %s was %q", op.Name, original.Name, found)
	}
}

func orEmpty(kt *simtarget.KeyTruth) *simtarget.KeyTruth {
	if kt == nil {
		return &simtarget.KeyTruth{}
	}
	return kt
}

// resolution returns how long the operation spent from its first UNKNOWN to the change
// that resolved it (SUCCEEDED, FAILED_TERMINAL or ESCALATED), and whether it recovered
// (resolved to SUCCEEDED or FAILED_TERMINAL). Zero when it never was UNKNOWN or is still.
func resolution(op *ledgerOp) (time.Duration, bool) {
	var since time.Time
	for _, e := range op.Events {
		switch {
		case e.To == "UNKNOWN" && since.IsZero():
			since = e.At
		case !since.IsZero() && (e.To == "SUCCEEDED" || e.To == "FAILED_TERMINAL"):
			return e.At.Sub(since), true
		case !since.IsZero() && e.To == "ESCALATED":
			return e.At.Sub(since), false
		}
	}
	return 0, false
}

var invariantNames = map[string]string{
	"I1":  "no intent has more than one real effect at the target",
	"I2":  "every acknowledged PrepareOperation has its operation",
	"I3":  "every SUCCEEDED has evidence and a real effect at the target",
	"I4":  "every FAILED_TERMINAL has no effect at the target",
	"I5":  "fences only increase; no write was accepted under a stale fence",
	"I6":  "the target saw one key and one payload per operation",
	"I7":  "the same intent always mapped to the same operation, a new intent to a new one",
	"I8":  "no tenant read or changed another tenant's operation",
	"I9":  "after healing, every operation is terminal, or ESCALATED/UNKNOWN with an owner",
	"I10": "only allowed transitions in the event log, and the counts add up",
	"I11": "an amendment is recorded only beside a settled original, or one it cancelled before any send",
	"I12": "no credential appears in the ledger or the replicas' logs",
	"I13": "every resolution by a person names the operator, the reason and the evidence",
	"I14": "no quarantined, unverified or fabricated event changed an operation",
	"I15": "every matched event's operation is consistent with the target's ground truth",
	"I16": "after the work settles, the operator resolves every escalation through the API",
}
