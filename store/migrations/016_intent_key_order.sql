-- A foreign-key check looks an operation up by (tenant_id, operation_id). Its plan is
-- made once per connection, often while the table is nearly empty, and then kept. While
-- the intent key led with the tenant, such a plan could choose it over the primary key
-- (both estimated one row) and then read a tenant's every operation for each event,
-- attempt or refusal written: 5 ms per check at 4,000 operations, in a Prepare
-- benchmark. Led by the operation type and the intent reference, the intent key has no
-- condition on the tenant to start from, so only the primary key can answer the check.
-- Every statement that uses the intent key gives all three columns.
ALTER TABLE operations DROP CONSTRAINT operations_intent_key;
ALTER TABLE operations ADD CONSTRAINT operations_intent_key UNIQUE (operation_type, intent_ref, tenant_id);
