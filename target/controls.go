package target

import (
	"fmt"
	"strings"
	"time"
)

// ControlResult is one go/no-go control (docs/targets.md#the-gono-go-controls) judged for
// one target: pass or fail with the reason, never a score.
type ControlResult struct {
	Number int
	Name   string
	Pass   bool
	Reason string
}

// Controls judges the eleven go/no-go controls for the target. Controls that the broker
// meets by construction (the ledger, the claim, the intent key) say how; the others are
// judged from the recorded contract.
func (c *Contract) Controls() []ControlResult {
	pass := func(n int, name, reason string) ControlResult {
		return ControlResult{Number: n, Name: name, Pass: true, Reason: reason}
	}
	credentials := c.Credentials() // read once: the control and its reason agree
	judge := func(n int, name string, problems []string, ok string) ControlResult {
		if len(problems) > 0 {
			return ControlResult{Number: n, Name: name, Reason: strings.Join(problems, "; ")}
		}
		return pass(n, name, ok)
	}
	return []ControlResult{
		judge(1, "target contract recorded", c.contractProblems(credentials),
			fmt.Sprintf("documented at %s, checked %s; capabilities: %s%s%s", c.Documentation.URL, c.Documentation.Checked, c.Capabilities(), c.keySummary(), credentialSummary(credentials))),
		pass(2, "durable operation identity",
			"the ledger row is committed before any send, unique per (tenant, operation type, intent_ref), and its remote key is random and never regenerated"),
		pass(3, "payload binding",
			"the SHA-256 of the canonical payload is stored at preparation and re-verified at every claim; a changed payload for the same intent is rejected"),
		pass(4, "atomic claim",
			"one conditional UPDATE moves PREPARED to IN_FLIGHT and increments the fence; only the fence holder records"),
		pass(5, "atomic scheduling",
			"the ledger row is the schedule: PrepareOperation returns only after it is committed, and the dispatcher finds it there"),
		judge(6, "unknown handling", c.unknownProblems(),
			c.unknownSummary()),
		judge(7, "verified acknowledgment", c.acknowledgmentProblems(),
			"every success class names where the target's reference is in the body"),
		judge(8, "terminal failure rule", c.rejectionProblems(),
			c.rejectionSummary()),
		judge(9, "escalation path", c.ownerProblems(),
			fmt.Sprintf("escalations go to %s (%s)", c.Owner.Team, c.Owner.Escalation)),
		judge(10, "privacy ownership", c.dataProblems(),
			fmt.Sprintf("stored data owned by %s; payload bytes purged %s after a terminal state (the hash, events and attempts stay until the tenant's data is deleted); remote keys are random",
				c.Data.Owner, c.Data.Retention)),
		pass(11, "legitimate repeat operations",
			"a new intent_ref makes a new operation even with a byte-identical payload"),
	}
}

func (c *Contract) contractProblems(credentials []Credential) []string {
	var p []string
	if c.Documentation.URL == "" {
		p = append(p, "documentation.url is missing: link the vendor's primary documentation")
	}
	if c.Documentation.Checked == "" {
		p = append(p, "documentation.checked is missing: the date the documentation was read")
	} else if d, err := time.Parse(time.DateOnly, c.Documentation.Checked); err == nil && d.After(time.Now()) {
		p = append(p, "documentation.checked is in the future")
	}
	if c.Idempotency != nil && c.Idempotency.ParameterMismatch == "undocumented" && c.Lookup == nil {
		p = append(p, "the key's parameter-mismatch behaviour is undocumented and there is no lookup to check a replay against")
	}
	if c.Conditional != nil && strings.TrimSpace(c.Conditional.Documented) == "" {
		p = append(p, "conditional_mutation.documented is missing: quote the documentation that says the target refuses the request when the precondition fails")
	}
	if c.Idempotency != nil && c.Idempotency.Saves == "" {
		p = append(p, fmt.Sprintf("idempotency.saves is missing: say whether a repeat of the key returns the first answer, errors included (%s), or executes again after anything but a success (%s; the reading to take when the documentation is unclear)",
			SavesEveryAnswer, SavesSuccessesOnly))
	}
	// A credential that cannot be read now would make every request fail: the broker
	// does not start on it.
	return append(p, credentialProblems(credentials)...)
}

// credentialSummary says, for control 1, which credentials were read.
func credentialSummary(credentials []Credential) string {
	var fields []string
	for _, cred := range credentials {
		fields = append(fields, cred.Field)
	}
	if len(fields) == 0 {
		return ""
	}
	return "; credentials present: " + strings.Join(fields, ", ")
}

// keySummary says, for control 1, what a repeat of the target's key does.
func (c *Contract) keySummary() string {
	precondition := ""
	if c.Conditional != nil {
		precondition = "; every send carries a precondition under which the target creates the effect only if it does not exist: a resend can never make a second one"
	}
	switch {
	case c.Idempotency == nil:
		return precondition
	case c.Idempotency.CoversEveryAttempt():
		return "; the key saves every answer: a replay never executes an earlier attempt again" + precondition
	default:
		return "; the key saves only successes: after an answer that may have executed, a replay needs a lookup that proves absence" + precondition
	}
}

func (c *Contract) unknownProblems() []string {
	var p []string
	for _, class := range c.Responses.Success {
		for _, st := range class.Status {
			if st >= 500 || st == 202 || st < 200 || st >= 300 {
				p = append(p, fmt.Sprintf("%d is listed as success: only a 2xx with a reference, never 202 or 5xx, verifies an effect", st))
			}
		}
	}
	for _, class := range c.Responses.Rejection {
		for _, st := range class.Status {
			if st >= 500 {
				p = append(p, fmt.Sprintf("%d is listed as a rejection: a 5xx may have had an effect", st))
			}
		}
	}
	if c.Lookup != nil {
		for _, st := range c.Lookup.NotFound {
			if st >= 500 {
				p = append(p, fmt.Sprintf("%d is listed as lookup.not_found: a 5xx says nothing of whether the object exists", st))
			}
		}
	}
	for i, class := range c.Responses.NotExecuted {
		if strings.TrimSpace(class.Documented) == "" {
			p = append(p, fmt.Sprintf("responses.not_executed[%d] does not quote the documentation that says the request was not executed", i))
		}
		for _, st := range class.Status {
			if st >= 200 && st < 300 {
				p = append(p, fmt.Sprintf("%d is listed as not executed: a 2xx may have had an effect", st))
			}
		}
	}
	return p
}

func (c *Contract) unknownSummary() string {
	summary := "timeouts, resets, 5xx, 202 and every unlisted answer are UNKNOWN; nothing is retried inline"
	if len(c.Responses.NotExecuted) > 0 {
		summary += "; only the answers quoted from the documentation as not executed are sent again, later, with the same key"
	}
	return summary
}

func (c *Contract) acknowledgmentProblems() []string {
	var p []string
	for i, class := range c.Responses.Success {
		if class.RemoteRef == "" {
			p = append(p, fmt.Sprintf("responses.success[%d] names no remote_ref: a success without the target's reference cannot be verified", i))
		}
	}
	return p
}

func (c *Contract) rejectionProblems() []string {
	var p []string
	if c.Completion != nil && len(c.Completion.Failed) > 0 && strings.TrimSpace(c.Completion.Documented) == "" {
		p = append(p, "completion.failed lists statuses but completion.documented does not quote the documentation that says they are final and had no effect")
	}
	for i, class := range c.Responses.Rejection {
		if strings.TrimSpace(class.Documented) == "" {
			p = append(p, fmt.Sprintf("responses.rejection[%d] does not quote the documentation that says it has no side effect", i))
		}
	}
	if c.Lookup != nil && c.Lookup.AbsenceFinalAfter > 0 && c.Idempotency == nil {
		// Absence may become final only if a late arrival cannot take effect; without a
		// key there is nothing that stops a late duplicate.
		p = append(p, "lookup.absence_final_after is set but without an idempotency key a late arrival cannot be fenced")
	}
	return p
}

func (c *Contract) rejectionSummary() string {
	if len(c.Responses.Rejection) == 0 {
		return "no answer is taken as a rejection: FAILED_TERMINAL only by an operator"
	}
	return "FAILED_TERMINAL only for rejections quoted from the documentation as side-effect free"
}

func (c *Contract) ownerProblems() []string {
	var p []string
	if c.Owner.Team == "" {
		p = append(p, "owner.team is missing: stuck operations need a named owner")
	}
	if c.Owner.Escalation == "" {
		p = append(p, "owner.escalation is missing: where the owner's runbook or queue is")
	}
	return p
}

func (c *Contract) dataProblems() []string {
	var p []string
	if c.Data.Owner == "" {
		p = append(p, "data.owner is missing: who owns retention and deletion of this target's data")
	}
	if c.Data.Retention <= 0 {
		p = append(p, "data.retention is missing: how long payloads are kept after a terminal state")
	}
	return p
}
