-- Row-level security on every table that holds a tenant's data, as the second line of
-- defence behind the API's authorisation: a statement sees and writes only the rows of
-- the tenant set for its transaction (set_config('opbroker.tenant', tenant, true)), or
-- of every tenant for the broker's own workers ('*'). With nothing set it sees nothing.
-- FORCE applies it to the table owner too; superusers and BYPASSRLS roles would still
-- bypass it, so the broker refuses to start as one (store.CheckSchema).
ALTER TABLE operations ENABLE ROW LEVEL SECURITY;
ALTER TABLE operations FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operations
  USING (tenant_id = current_setting('opbroker.tenant', true) OR current_setting('opbroker.tenant', true) = '*')
  WITH CHECK (tenant_id = current_setting('opbroker.tenant', true) OR current_setting('opbroker.tenant', true) = '*');

ALTER TABLE operation_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE operation_events FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operation_events
  USING (tenant_id = current_setting('opbroker.tenant', true) OR current_setting('opbroker.tenant', true) = '*')
  WITH CHECK (tenant_id = current_setting('opbroker.tenant', true) OR current_setting('opbroker.tenant', true) = '*');

ALTER TABLE operation_attempts ENABLE ROW LEVEL SECURITY;
ALTER TABLE operation_attempts FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operation_attempts
  USING (tenant_id = current_setting('opbroker.tenant', true) OR current_setting('opbroker.tenant', true) = '*')
  WITH CHECK (tenant_id = current_setting('opbroker.tenant', true) OR current_setting('opbroker.tenant', true) = '*');

-- Terminal operations whose payload bytes are still kept, oldest first (the purge).
CREATE INDEX operations_purge_idx ON operations (updated_at)
  WHERE payload IS NOT NULL AND state IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED');
