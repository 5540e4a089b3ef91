-- The checks on the history, without a foreign key on its hot tables. In a burn-down the
-- three foreign keys of operation_events and operation_attempts cost a quarter of
-- PostgreSQL's CPU per operation (a check queued, run and row-locked for every event
-- and attempt); what they guaranteed is kept by cheaper means:
--
-- * an event is an allowed move: a CHECK with the list of operation_transitions (a
--   CHECK cannot read a table; TestEventsFollowTheTransitions keeps the two equal);
-- * an event or attempt belongs to an operation: one check per statement over the rows
--   it inserted, each looked up by the primary key and locked against deletion until
--   the transaction ends, as a foreign key's check does;
-- * deleting (or truncating) operations deletes their events and attempts, in the same
--   statement.
--
-- The CHECK is added without reading the existing events (every one followed the
-- foreign key it replaces); migration 018 validates them without holding off writes.
ALTER TABLE operation_events DROP CONSTRAINT operation_events_transition_fkey;
ALTER TABLE operation_events DROP CONSTRAINT operation_events_tenant_id_operation_id_fkey;
ALTER TABLE operation_attempts DROP CONSTRAINT operation_attempts_tenant_id_operation_id_fkey;

ALTER TABLE operation_events ADD CONSTRAINT operation_events_transition CHECK (
  from_state IS NULL OR (from_state, to_state) IN (
    ('PREPARED', 'IN_FLIGHT'), ('PREPARED', 'CANCELLED'), ('PREPARED', 'FAILED_TERMINAL'),
    ('IN_FLIGHT', 'SUCCEEDED'), ('IN_FLIGHT', 'FAILED_TERMINAL'), ('IN_FLIGHT', 'UNKNOWN'),
    ('IN_FLIGHT', 'PREPARED'),
    ('UNKNOWN', 'IN_FLIGHT'), ('UNKNOWN', 'SUCCEEDED'), ('UNKNOWN', 'FAILED_TERMINAL'),
    ('UNKNOWN', 'ESCALATED'), ('UNKNOWN', 'UNKNOWN'),
    ('ESCALATED', 'SUCCEEDED'), ('ESCALATED', 'FAILED_TERMINAL'), ('ESCALATED', 'ESCALATED'))) NOT VALID;

-- Each inserted row's operation is looked up on its own (the LIMIT keeps the lookups
-- from becoming a join the planner could make with a scan of operations), and locked
-- as a foreign key's check locks it: a concurrent deletion waits for this transaction,
-- or this one sees the deletion and fails.
CREATE FUNCTION history_has_operations() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM new_rows n LEFT JOIN LATERAL (
      SELECT true AS found FROM operations o
      WHERE o.tenant_id = n.tenant_id AND o.operation_id = n.operation_id LIMIT 1 FOR KEY SHARE) o ON true
    WHERE o.found IS NULL) THEN
    RAISE EXCEPTION '%: a row for an operation that does not exist', TG_TABLE_NAME
      USING ERRCODE = 'foreign_key_violation';
  END IF;
  RETURN NULL;
END;
$$;

ALTER FUNCTION history_has_operations() SET search_path FROM CURRENT;

CREATE TRIGGER operation_events_have_operations AFTER INSERT ON operation_events
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION history_has_operations();
CREATE TRIGGER operation_attempts_have_operations AFTER INSERT ON operation_attempts
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION history_has_operations();

CREATE FUNCTION operations_delete_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM operation_events e USING old_rows o WHERE e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id;
  DELETE FROM operation_attempts a USING old_rows o WHERE a.tenant_id = o.tenant_id AND a.operation_id = o.operation_id;
  RETURN NULL;
END;
$$;

ALTER FUNCTION operations_delete_history() SET search_path FROM CURRENT;

CREATE TRIGGER operations_delete_history AFTER DELETE ON operations
  REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION operations_delete_history();

CREATE FUNCTION operations_truncate_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  TRUNCATE operation_events, operation_attempts;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_truncate_history() SET search_path FROM CURRENT;

CREATE TRIGGER operations_truncate_history AFTER TRUNCATE ON operations
  FOR EACH STATEMENT EXECUTE FUNCTION operations_truncate_history();
