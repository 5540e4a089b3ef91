package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	opbrokerv1 "github.com/opbroker/opbroker/gen/opbroker/v1"
	"github.com/opbroker/opbroker/simtarget"
)

// ledgerEvidence is a target's event as the ledger kept it.
type ledgerEvidence struct {
	EventID, Reporter, EventType, Meaning, Reference, RemoteRef string
	Disposition, Reason                                         string
	Name                                                        string // the operation it names, or ""
}

// evidenceKey is how the audit names a kept event: its id and its reporter ("" for the
// target's webhooks).
func evidenceKey(eventID, reporter string) string { return eventID + "\x00" + reporter }

// readEvidence reads every event the replicas kept, by evidenceKey.
func (c *cluster) readEvidence(ctx context.Context) (map[string]ledgerEvidence, error) {
	out := map[string]ledgerEvidence{}
	rows, _ := c.admin.Query(ctx, `SELECT event_id, reporter, event_type, meaning, reference, coalesce(remote_ref, ''),
			disposition, coalesce(reason, ''), coalesce('tenants/' || tenant_id || '/operations/' || operation_id, '')
		FROM inbound_evidence`)
	var e ledgerEvidence
	if _, err := pgx.ForEachRow(rows, []any{&e.EventID, &e.Reporter, &e.EventType, &e.Meaning, &e.Reference, &e.RemoteRef,
		&e.Disposition, &e.Reason, &e.Name}, func() error {
		out[evidenceKey(e.EventID, e.Reporter)] = e
		return nil
	}); err != nil {
		return nil, fmt.Errorf("reading evidence: %w", err)
	}
	return out, nil
}

// settleEvidence waits, up to bound, until the charge target has no delivery pending
// and the replicas have decided every event they kept; it reports whether they did.
func (c *cluster) settleEvidence(ctx context.Context, bound time.Duration) bool {
	waitCtx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	if err := c.charge.WebhooksIdle(waitCtx); err != nil {
		unsent := 0
		for _, s := range c.charge.Snapshot().Webhooks {
			if !s.Acknowledged && !s.GaveUp {
				unsent++
			}
		}
		fmt.Fprintf(c.cfg.Log, "chaos: %d webhook sendings still pending after %s\n", unsent, bound)
		return false
	}
	var pending int
	for waitCtx.Err() == nil {
		err := c.admin.QueryRow(waitCtx, `SELECT count(*) FROM inbound_evidence WHERE disposition = 'PENDING'`).Scan(&pending)
		if err == nil && pending == 0 {
			return true
		}
		time.Sleep(250 * time.Millisecond)
	}
	fmt.Fprintf(c.cfg.Log, "chaos: %d kept events still PENDING after %s\n", pending, bound)
	return false
}

// auditEvidence checks I14 and I15 against the charge target's record of the events it
// sent, and counts what became of them.
//
// I14: an operation event that records evidence names an event kept as APPLIED or
// ATTACHED for that operation, and an event kept as APPLIED has one; every event the
// ledger kept is one the target sent; an event reported for another tenant than its
// account's is quarantined as a tenant conflict; no
// event a fault fabricated (another reference, account or amount) was applied,
// attached or observed; no delivery signed with a wrong secret was acknowledged.
//
// I15: every event matched to an operation is genuine and about that operation's
// charge (its reference is the operation's remote key, its charge one the target made
// under that key), and the operation agrees with it: a success is never FAILED_TERMINAL
// (and, SUCCEEDED, has the charge's reference), a failure never SUCCEEDED.
func auditEvidence(r *Report, ops map[string]*ledgerOp, truth map[string]*simtarget.KeyTruth, sent []simtarget.WebhookTruth,
	kept map[string]ledgerEvidence, reports []report, fail func(id, format string, args ...any)) {
	byID := map[string]simtarget.WebhookTruth{} // the genuine or fabricated event of each id
	faulted := map[simtarget.WebhookFault]map[string]bool{}
	for _, s := range sent {
		if s.Forged {
			r.Evidence.Forged++
			if s.Acknowledged {
				fail("I14", "event %s: a copy signed with a wrong secret was acknowledged (status %d)", s.EventID, s.LastStatus)
			}
			continue
		}
		if !s.Duplicate {
			byID[s.EventID] = s
		}
		if s.Genuine && s.Fault != simtarget.WebhookNone { // charges, by their genuine events
			if faulted[s.Fault] == nil {
				faulted[s.Fault] = map[string]bool{}
			}
			faulted[s.Fault][s.Reference] = true
		}
	}
	for f, charges := range faulted {
		r.Faults["webhook: "+string(f)] = len(charges)
	}
	byEvent := map[string][]ledgerEvidence{} // the kept events of each id, every sender's
	for _, k := range kept {
		byEvent[k.EventID] = append(byEvent[k.EventID], k)
	}
	for _, op := range ops {
		for _, e := range op.Events {
			if e.EventID == "" {
				continue
			}
			if !slices.ContainsFunc(byEvent[e.EventID], func(k ledgerEvidence) bool {
				return (k.Disposition == "APPLIED" || k.Disposition == "ATTACHED") && k.Name == op.Name
			}) {
				fail("I14", "%s: revision %d records event %s, which the ledger kept as applied to it from no sender", op.Name, e.Revision, e.EventID)
			}
		}
	}
	for _, rep := range reports {
		r.Evidence.Reported++
		k, ok := kept[evidenceKey(rep.eventID, reporterName)]
		if !ok {
			fail("I14", "event %s was reported and acknowledged, but the ledger did not keep it", rep.eventID)
			continue
		}
		if rep.wrong {
			r.Evidence.ReportedForAnotherTenant++
			if k.Disposition != "QUARANTINED" || k.Reason != "TENANT_CONFLICT" {
				fail("I14", "event %s, reported for tenant %s, which is not its account's, was kept as %s %s for %q",
					rep.eventID, rep.tenant, k.Disposition, k.Reason, k.Name)
			}
		}
	}
	for _, key := range slices.Sorted(func(yield func(string) bool) {
		for key := range kept {
			if !yield(key) {
				return
			}
		}
	}) {
		k := kept[key]
		id := k.EventID
		r.Evidence.Kept++
		switch k.Disposition {
		case "APPLIED":
			r.Evidence.Applied++
		case "OBSERVED":
			r.Evidence.Observed++
		case "QUARANTINED":
			r.Evidence.Quarantined[k.Reason]++
		}
		if k.Disposition == "APPLIED" {
			if op := ops[k.Name]; op == nil || !slices.ContainsFunc(op.Events, func(e ledgerEvent) bool { return e.EventID == id }) {
				fail("I14", "event %s was kept as applied to %s, which has no event recording it", id, k.Name)
			}
		}
		s, ok := byID[id]
		if !ok {
			fail("I14", "event %s was kept, but the target never sent it", id)
			continue
		}
		matched := k.Disposition == "APPLIED" || k.Disposition == "OBSERVED" || k.Disposition == "ATTACHED"
		if !s.Genuine {
			if matched {
				fail("I14", "event %s, fabricated (%s), was %s for %s", id, s.Fault, k.Disposition, k.Name)
			}
			continue
		}
		if !matched {
			continue
		}
		op := ops[k.Name]
		if op == nil {
			fail("I15", "event %s matched %s, which the ledger does not hold", id, k.Name)
			continue
		}
		kt := orEmpty(truth[op.RemoteKey])
		switch {
		case s.Reference != op.RemoteKey:
			fail("I15", "event %s, about the charge under key %s, matched %s (key %s)", id, s.Reference, op.Name, op.RemoteKey)
		case !slices.Contains(kt.IDs, s.EffectID):
			fail("I15", "event %s is about charge %s, which the target did not make under %s's key", id, s.EffectID, op.Name)
		case k.Meaning == "SUCCEEDED" && (op.State == "FAILED_TERMINAL" || op.State == "CANCELLED"):
			fail("I15", "%s is %s, but event %s reported its charge succeeded", op.Name, op.State, id)
		case k.Meaning == "SUCCEEDED" && op.State == "SUCCEEDED" && op.RemoteRef != s.EffectID:
			fail("I15", "%s succeeded with reference %s, but event %s reported charge %s", op.Name, op.RemoteRef, id, s.EffectID)
		case k.Meaning == "FAILED" && (op.State == "SUCCEEDED" || kt.Failed == 0):
			fail("I15", "%s is %s and the target has %d failed charges, but event %s reported its charge failed", op.Name, op.State, kt.Failed, id)
		}
	}
}

// reporterName is the principal that reports the charge target's events, as an internal
// service that receives a provider's events itself would.
const reporterName = "evidence-reporter"

// report is one event the reporter reported, for the tenant it named.
type report struct {
	eventID string
	tenant  string
	wrong   bool // another tenant than the event's account: it must be quarantined
}

// reportEvidence reports, until ctx ends, a quarter of the charge target's genuine
// events that were delivered, each for the tenant its account names or, the first and
// then one in five, for another tenant, and returns what it reported. A report the broker did not acknowledge
// is tried again at the next pass.
func (c *cluster) reportEvidence(ctx context.Context, rng *rand.Rand) []report {
	var reported []report
	seen := map[string]bool{}
	// retry holds each report whose call failed, sent again unchanged as a client
	// retries: the failed call may have been kept, and its retry is then a duplicate of
	// the same report.
	retry := map[string]report{}
	tenants := tenants(c.cfg.Tenants)
	for {
		select {
		case <-ctx.Done():
			return reported
		case <-time.After(300 * time.Millisecond):
		}
		for _, s := range c.charge.Snapshot().Webhooks {
			if !s.Genuine || s.Forged || s.Duplicate || !s.Acknowledged || seen[s.EventID] || ctx.Err() != nil {
				continue
			}
			r, retrying := retry[s.EventID]
			if !retrying && rng.IntN(4) != 0 {
				seen[s.EventID] = true
				continue
			}
			body, ok := c.charge.WebhookBody(s.EventID)
			if !ok {
				seen[s.EventID] = true
				continue
			}
			var event struct {
				Data struct {
					Object struct {
						Account string `json:"account"`
					} `json:"object"`
				} `json:"data"`
			}
			if json.Unmarshal(body, &event) != nil || event.Data.Object.Account == "" {
				seen[s.EventID] = true
				continue
			}
			if !retrying {
				r = report{eventID: s.EventID, tenant: event.Data.Object.Account}
				if len(reported) == 0 || rng.IntN(5) == 0 { // the first too, so that a short run has one
					r.tenant, r.wrong = tenants[(slices.Index(tenants, r.tenant)+1+rng.IntN(len(tenants)-1))%len(tenants)], true
				}
			}
			conn, err := c.client(rng)
			if err != nil {
				retry[s.EventID] = r
				continue
			}
			callCtx, cancel := context.WithTimeout(c.as(ctx, reporterName), 5*time.Second)
			_, err = opbrokerv1.NewEvidenceServiceClient(conn).ReportEvidence(callCtx,
				&opbrokerv1.ReportEvidenceRequest{Tenant: r.tenant, Target: "chaos-payments", Event: body})
			cancel()
			if err != nil {
				retry[s.EventID] = r
				continue
			}
			delete(retry, s.EventID)
			seen[s.EventID] = true
			reported = append(reported, r)
		}
	}
}
