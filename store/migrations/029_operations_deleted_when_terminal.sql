-- An operation could be deleted, or every operation truncated, in any state: with it
-- went its history and its keys, so an intent acknowledged and not yet sent was lost, and
-- one sent but unresolved could be prepared and sent again, a second effect. The store
-- deletes only terminal operations (DeleteTenant); the schema now refuses the rest, by
-- any role: a DELETE of an operation that is not SUCCEEDED, FAILED_TERMINAL or
-- CANCELLED, and a TRUNCATE while any operation of any tenant is not terminal.
CREATE FUNCTION operations_deleted_when_terminal() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  scope text;
  open boolean;
BEGIN
  IF TG_OP = 'DELETE' THEN
    RAISE EXCEPTION 'operation %: % is not terminal; an operation is deleted only once it is SUCCEEDED, FAILED_TERMINAL or CANCELLED',
      OLD.operation_id, OLD.state USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  -- TRUNCATE ignores row-level security, so the check must not see only the caller's
  -- tenants: it reads every tenant's operations (only whether one is open), and puts the
  -- caller's scope back. A raise aborts the (sub)transaction, which restores it too.
  scope := current_setting('opbroker.tenant', true);
  PERFORM set_config('opbroker.tenant', '*', true);
  open := EXISTS (SELECT 1 FROM operations WHERE state NOT IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED'));
  PERFORM set_config('opbroker.tenant', coalesce(scope, ''), true);
  IF open THEN
    RAISE EXCEPTION 'operations: some are not terminal; operations are truncated only once every one is SUCCEEDED, FAILED_TERMINAL or CANCELLED'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_deleted_when_terminal() SET search_path FROM CURRENT;

-- Per row, for the rows that are not terminal; the function's NULL would skip the row's
-- deletion, so it is only reached to raise.
CREATE TRIGGER operations_deleted_when_terminal BEFORE DELETE ON operations
  FOR EACH ROW WHEN (OLD.state NOT IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED'))
  EXECUTE FUNCTION operations_deleted_when_terminal();
CREATE TRIGGER operations_truncated_when_terminal BEFORE TRUNCATE ON operations
  FOR EACH STATEMENT EXECUTE FUNCTION operations_deleted_when_terminal();
