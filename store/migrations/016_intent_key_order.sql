-- A foreign-key check looks an operation up by (tenant_id, operation_id). Its plan is
-- made once per connection, often while the table is nearly empty, and then kept. While
-- the intent key led with the tenant, such a plan could choose it over the primary key
-- (both estimated one row) and then read a tenant's every operation for each event,
-- attempt or refusal written: 5 ms per check at 4,000 operations, in a Prepare
-- benchmark. Led by the operation type and the intent reference, the intent key has no
-- condition on the tenant to start from, so only the primary key can answer the check.
-- Every statement that uses the intent key gives all three columns.
--
-- Building the new index holds off writes to operations while it runs. On a large
-- ledger, build it beforehand without blocking (docs/operations.md, "Upgrading"):
--   CREATE UNIQUE INDEX CONCURRENTLY operations_intent_key_new
--     ON operations (operation_type, intent_ref, tenant_id);
-- and this migration only swaps it in.
DO $$
DECLARE
  built regclass := to_regclass('operations_intent_key_new');
BEGIN
  IF built IS NULL THEN
    CREATE UNIQUE INDEX operations_intent_key_new ON operations (operation_type, intent_ref, tenant_id);
  ELSIF NOT EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = built AND indisvalid AND indisunique
      AND indrelid = 'operations'::regclass AND indpred IS NULL AND indexprs IS NULL
      AND indkey::text = array_to_string(ARRAY(SELECT attnum FROM unnest(ARRAY['operation_type', 'intent_ref', 'tenant_id'])
        WITH ORDINALITY AS c (name, i) JOIN pg_attribute ON attrelid = 'operations'::regclass AND attname = c.name
        ORDER BY i), ' ')) THEN
    RAISE EXCEPTION 'operations_intent_key_new is not a valid unique index on operations (operation_type, intent_ref, tenant_id): DROP INDEX CONCURRENTLY operations_intent_key_new, build it again as docs/operations.md says, and migrate';
  END IF;
END
$$;
ALTER TABLE operations DROP CONSTRAINT operations_intent_key,
  ADD CONSTRAINT operations_intent_key UNIQUE USING INDEX operations_intent_key_new;
