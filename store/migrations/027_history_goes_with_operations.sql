-- An operation's history (its events and stale outcomes) and the targets' events matched
-- to it were guarded against UPDATE only: a DELETE or TRUNCATE of their own was
-- accepted, and TRUNCATE ignores row-level security, so one statement of the broker's
-- role could empty every tenant's history while the operations stayed. The reconciler
-- reads that history before a same-key replay (whether an earlier attempt may have
-- executed, when the last send ended), so a history gone could allow a second effect.
-- Like the keys (026), they now go only with their operations: by the triggers of
-- operations, one level down, never by a statement of their own. A target's event
-- matched to no operation belongs to no history, and may still be deleted by hand.
CREATE FUNCTION history_goes_with_operations() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF pg_trigger_depth() < 2 THEN
    RAISE EXCEPTION '%: deleted with its operations, never on its own', TG_TABLE_NAME
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NULL;
END;
$$;
ALTER FUNCTION history_goes_with_operations() SET search_path FROM CURRENT;

CREATE TRIGGER operation_events_go_with_operations BEFORE DELETE OR TRUNCATE ON operation_events
  FOR EACH STATEMENT EXECUTE FUNCTION history_goes_with_operations();
CREATE TRIGGER stale_outcomes_go_with_operations BEFORE DELETE OR TRUNCATE ON stale_outcomes
  FOR EACH STATEMENT EXECUTE FUNCTION history_goes_with_operations();
CREATE TRIGGER inbound_evidence_truncated_with_operations BEFORE TRUNCATE ON inbound_evidence
  FOR EACH STATEMENT EXECUTE FUNCTION history_goes_with_operations();
-- Per row, for the rows that name an operation; the function's NULL would skip the
-- row's deletion, so it is only reached to raise.
CREATE TRIGGER inbound_evidence_goes_with_operations BEFORE DELETE ON inbound_evidence
  FOR EACH ROW WHEN (OLD.operation_id IS NOT NULL AND pg_trigger_depth() < 1)
  EXECUTE FUNCTION history_goes_with_operations();
