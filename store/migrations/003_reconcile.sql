-- Reconciling UNKNOWN operations: when to look next, what was tried, and where an
-- operation that cannot be resolved automatically went.

ALTER TABLE operations
  -- When the reconciler should next look at an UNKNOWN operation.
  ADD COLUMN next_check_at timestamptz,
  -- Lookups made and same-key replays sent while resolving, against their budgets.
  ADD COLUMN checks integer NOT NULL DEFAULT 0,
  ADD COLUMN replays integer NOT NULL DEFAULT 0,
  -- The target accepted the request without finishing it: no replay may follow.
  ADD COLUMN accepted_unfinished boolean NOT NULL DEFAULT false,
  -- For ESCALATED: {"owner", "reason", "escalated_at"}.
  ADD COLUMN escalation jsonb,
  ADD CONSTRAINT operations_reconcile_counters CHECK (checks >= 0 AND replays >= 0),
  -- coalesce: a CHECK passes when its expression is NULL, and NULL ? 'owner' is NULL.
  ADD CONSTRAINT operations_escalated_has_owner CHECK (
    state <> 'ESCALATED' OR coalesce(escalation ? 'owner' AND escalation ? 'reason', false));

UPDATE operations SET next_check_at = updated_at WHERE state = 'UNKNOWN';

-- Due UNKNOWN operations, per tenant (the reconciler's fair claim).
CREATE INDEX operations_unknown_due_idx ON operations (tenant_id, next_check_at) WHERE state = 'UNKNOWN';
