-- Row-level security on every table that holds a tenant's data, as the second line of
-- defence behind the API's authorisation: a statement sees and writes only the rows of
-- the tenant set for its transaction (set_config('opbroker.tenant', tenant, true)), or
-- of every tenant for the broker's own workers ('*'). With nothing set it sees nothing.
-- FORCE applies it to the table owner too; superusers and BYPASSRLS roles would still
-- bypass it, so the broker refuses to start as one (store.CheckSchema).
--
-- The policy is a CASE rather than "tenant_id = … OR … = '*'": the planner cannot know
-- the setting, and estimates that OR as a few rows, which turned the workers' ordered,
-- limited claims into sorts of a tenant's whole backlog. Every statement of the broker
-- names its tenant anyway, so the policy is never needed as an index condition.
ALTER TABLE operations ENABLE ROW LEVEL SECURITY;
ALTER TABLE operations FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operations
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true ELSE tenant_id = current_setting('opbroker.tenant', true) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true ELSE tenant_id = current_setting('opbroker.tenant', true) END);

ALTER TABLE operation_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE operation_events FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operation_events
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true ELSE tenant_id = current_setting('opbroker.tenant', true) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true ELSE tenant_id = current_setting('opbroker.tenant', true) END);

ALTER TABLE operation_attempts ENABLE ROW LEVEL SECURITY;
ALTER TABLE operation_attempts FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operation_attempts
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true ELSE tenant_id = current_setting('opbroker.tenant', true) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true ELSE tenant_id = current_setting('opbroker.tenant', true) END);

-- Terminal operations whose payload bytes are still kept, oldest first (the purge).
CREATE INDEX operations_purge_idx ON operations (updated_at)
  WHERE payload IS NOT NULL AND state IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED');
