-- TRUNCATE ignores row-level security, but 025's guard asked whether operations has
-- any row under it: a session of the broker's role with no tenant set (or a tenant
-- with no operations) saw none, and could truncate every tenant's keys while their
-- operations stayed, after which an intent already recorded could be recorded again.
-- Keys are now truncated only by the truncation of operations (its trigger, one level
-- down), never by a statement of their own.
CREATE OR REPLACE FUNCTION operation_keys_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF pg_trigger_depth() < 2 THEN
      RAISE EXCEPTION 'operation_keys: keys are truncated with operations, never on their own'
        USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NULL;
  END IF;
  IF TG_OP = 'UPDATE' THEN
    RAISE EXCEPTION 'operation %: its keys never change', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF EXISTS (SELECT 1 FROM operations WHERE tenant_id = OLD.tenant_id AND operation_id = OLD.operation_id) THEN
    RAISE EXCEPTION 'operation %: its keys are deleted with it, never on their own', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN OLD;
END;
$$;
ALTER FUNCTION operation_keys_guard() SET search_path FROM CURRENT;
