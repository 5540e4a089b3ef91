-- Evidence from outside: the events a target reports about its effects, by signed
-- webhook or through an internal service (EvidenceService.ReportEvidence). Every event
-- that passed its verification is kept here before its sender is answered, once per
-- event id within its target and its sender (a repeated delivery adds nothing; a
-- webhook and each reporter have ids of their own, so that no sender's event can stand
-- in for another's), and then matched to exactly one operation by its reference:
--
-- * PENDING: received, not matched yet (next at next_match_at). A reference that names
--   no operation is matched again until match_until (the event may have come before its operation's send was
--   recorded), then quarantined.
-- * APPLIED: it changed its operation (an event of that operation says how).
-- * OBSERVED: it matched and agreed with the ledger, or said the effect is pending.
-- * QUARANTINED: it changed nothing and waits for review; reason says why.
-- * ATTACHED / DISMISSED: an operator reviewed a quarantined event (reviewed_by, note).
--
-- A row names an operation only once matched; before that it belongs to no tenant, so
-- only the broker's own scope ('*') reaches it. The body is kept for matching and for
-- review, and purged after a short retention (body_purge_at); the rest is what review
-- needs, never the payload.
CREATE TABLE inbound_evidence (
  target         text        NOT NULL,
  event_id       text        NOT NULL,
  source         text        NOT NULL,
  reporter       text        NOT NULL DEFAULT '',
  claimed_tenant text,
  event_type     text        NOT NULL,
  meaning        text        NOT NULL,
  reference      text        NOT NULL,
  reference_kind text        NOT NULL,
  remote_ref     text,
  body           bytea,
  body_purge_at  timestamptz NOT NULL,
  received_at    timestamptz NOT NULL DEFAULT now(),
  match_until    timestamptz NOT NULL,
  attempts       integer     NOT NULL DEFAULT 0,
  next_match_at  timestamptz NOT NULL DEFAULT now(),
  disposition    text        NOT NULL DEFAULT 'PENDING',
  reason         text,
  detail         text,
  tenant_id      text,
  operation_id   uuid,
  decided_at     timestamptz,
  reviewed_by    text,
  reviewed_at    timestamptz,
  review_note    text,
  PRIMARY KEY (target, event_id, reporter),
  CONSTRAINT inbound_evidence_sizes CHECK (octet_length(event_id) BETWEEN 1 AND 256
    AND octet_length(event_type) <= 256 AND octet_length(reference) BETWEEN 1 AND 512
    AND coalesce(octet_length(remote_ref), 0) <= 512 AND coalesce(octet_length(detail), 0) <= 1024),
  CONSTRAINT inbound_evidence_source CHECK (source IN ('WEBHOOK', 'REPORTED')
    AND (source = 'REPORTED') = (reporter <> '') AND (source = 'REPORTED') = (claimed_tenant IS NOT NULL)),
  CONSTRAINT inbound_evidence_meaning CHECK (meaning IN ('SUCCEEDED', 'PENDING', 'FAILED')),
  CONSTRAINT inbound_evidence_reference_kind CHECK (reference_kind IN ('remote_key', 'remote_ref')),
  CONSTRAINT inbound_evidence_disposition CHECK (CASE disposition
    WHEN 'PENDING' THEN reason IS NULL AND operation_id IS NULL AND decided_at IS NULL
    WHEN 'APPLIED' THEN reason IS NULL AND operation_id IS NOT NULL AND decided_at IS NOT NULL
    WHEN 'OBSERVED' THEN reason IS NULL AND operation_id IS NOT NULL AND decided_at IS NOT NULL
    WHEN 'QUARANTINED' THEN reason IS NOT NULL AND decided_at IS NOT NULL AND reviewed_by IS NULL
    WHEN 'ATTACHED' THEN reason IS NOT NULL AND operation_id IS NOT NULL AND reviewed_by IS NOT NULL
    WHEN 'DISMISSED' THEN reason IS NOT NULL AND reviewed_by IS NOT NULL AND review_note IS NOT NULL
    ELSE false END),
  CONSTRAINT inbound_evidence_operation CHECK ((tenant_id IS NULL) = (operation_id IS NULL))
);

-- The matcher's queue, the quarantine's list and the body purge.
CREATE INDEX inbound_evidence_pending_idx ON inbound_evidence (next_match_at) WHERE disposition = 'PENDING';
CREATE INDEX inbound_evidence_quarantine_idx ON inbound_evidence (received_at, target, event_id, reporter)
  WHERE disposition = 'QUARANTINED';
CREATE INDEX inbound_evidence_purge_idx ON inbound_evidence (body_purge_at) WHERE body IS NOT NULL;
CREATE INDEX inbound_evidence_operation_idx ON inbound_evidence (tenant_id, operation_id)
  WHERE operation_id IS NOT NULL;

ALTER TABLE inbound_evidence ENABLE ROW LEVEL SECURITY;
ALTER TABLE inbound_evidence FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON inbound_evidence
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);

-- An event finds its operation by the reference the target carries: the broker's remote
-- key (the idempotency key it sent) or the target's own reference, recorded at the
-- outcome. Neither column changes once set; the second index holds only the operations
-- that have a reference. Both are built under a lock that holds off writes to
-- operations while they build (docs/operations.md#upgrading).
CREATE INDEX operations_remote_key_idx ON operations (remote_key);
CREATE INDEX operations_remote_ref_idx ON operations (remote_ref) WHERE remote_ref IS NOT NULL;

-- A deleted operation takes its evidence with it, as it takes its history.
CREATE OR REPLACE FUNCTION operations_delete_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM operation_events e USING old_rows o WHERE e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id;
  DELETE FROM stale_outcomes s USING old_rows o WHERE s.tenant_id = o.tenant_id AND s.operation_id = o.operation_id;
  DELETE FROM inbound_evidence i USING old_rows o WHERE i.tenant_id = o.tenant_id AND i.operation_id = o.operation_id;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_delete_history() SET search_path FROM CURRENT;

CREATE OR REPLACE FUNCTION operations_truncate_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  TRUNCATE operation_events, stale_outcomes, inbound_evidence;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_truncate_history() SET search_path FROM CURRENT;
