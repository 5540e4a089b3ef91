-- The ledger's gauges count ESCALATED operations by type every few seconds on every
-- replica. Row-level security keeps the state out of the tenant-and-state index's
-- conditions (enum equality is not leakproof), so without a partial index of their own
-- they are found by scanning the whole table.
CREATE INDEX operations_escalated_idx ON operations (operation_type) WHERE state = 'ESCALATED';
