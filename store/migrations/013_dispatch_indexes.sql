-- A dispatcher claims for one target at a time, that is for its operation types. With
-- the type in the claim's index, a claim for a type with no due work reads one index
-- entry per tenant instead of every PREPARED entry of every tenant, and a claim for a
-- type reads that type's entries in order without stepping over the others'.
CREATE INDEX operations_claim_idx ON operations (tenant_id, operation_type, operation_id) WHERE state = 'PREPARED';
DROP INDEX operations_prepared_idx;

-- The tenant-and-state index serves no statement of the broker: under row-level
-- security the state is never one of its conditions (enum equality is not leakproof),
-- so it is a slower primary key. It cost two entries on every change of state, and
-- foreign-key checks planned while the table was empty chose it over the primary key
-- and scanned a tenant's whole range for each event written (0.2 ms instead of 0.01).
DROP INDEX operations_tenant_state_idx;
