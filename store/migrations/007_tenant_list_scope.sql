-- A statement's tenant scope may name several tenants, comma-separated
-- (set_config('opbroker.tenant', 'acme,globex', true)): intents prepared by several
-- tenants' clients at the same time are written by one statement (store.Prepare), and
-- that statement must reach exactly the tenants of its callers, no other. A tenant id
-- never holds a comma (operations_tenant_id_format), so one tenant's scope means what it
-- did; '*' is still every tenant, and nothing set still sees nothing.
ALTER POLICY tenant_isolation ON operations
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);

ALTER POLICY tenant_isolation ON operation_events
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);

ALTER POLICY tenant_isolation ON operation_attempts
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);
