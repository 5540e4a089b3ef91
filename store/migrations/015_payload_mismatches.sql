-- A repeat of a recorded intent with another payload is refused and changes nothing; each
-- refusal is counted here, against the operation that records the intent, for the
-- ledger's statistics (AdminService.GetStats). It keeps the refused payload's hash, never
-- its bytes, and goes with its operation.
CREATE TABLE payload_mismatches (
  tenant_id      text        NOT NULL,
  operation_id   uuid        NOT NULL,
  refused_at     timestamptz NOT NULL DEFAULT now(),
  payload_sha256 bytea       NOT NULL,
  FOREIGN KEY (tenant_id, operation_id) REFERENCES operations (tenant_id, operation_id) ON DELETE CASCADE
);
CREATE INDEX payload_mismatches_operation_idx ON payload_mismatches (tenant_id, operation_id);
CREATE INDEX payload_mismatches_refused_idx ON payload_mismatches (refused_at);

ALTER TABLE payload_mismatches ENABLE ROW LEVEL SECURITY;
ALTER TABLE payload_mismatches FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON payload_mismatches
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);
