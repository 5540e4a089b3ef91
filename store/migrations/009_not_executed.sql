-- Answers a target documents as not executed (a rate limit before its idempotency layer,
-- a rejected credential): such an attempt had no effect, so an operation whose every
-- attempt was answered that way has still caused nothing and goes back to PREPARED, to
-- be sent again, with the same key and bytes, once next_check_at has passed.
--
-- not_executed counts those attempts. PREPARED and CANCELLED used to mean "never sent";
-- they now mean "nothing sent took effect": every attempt was answered as not executed
-- (none at all for an operation never claimed). The guard keeps the count from going
-- back, and the schema still refuses PREPARED for an operation with any other attempt.
ALTER TABLE operations
  ADD COLUMN not_executed integer NOT NULL DEFAULT 0,
  ADD CONSTRAINT operations_not_executed_count CHECK (not_executed >= 0 AND not_executed <= attempt_count),
  DROP CONSTRAINT operations_unsent,
  ADD CONSTRAINT operations_unsent CHECK (
    state NOT IN ('PREPARED', 'CANCELLED')
    OR attempt_count = not_executed AND (attempt_count > 0 OR fence_token = 0 AND first_sent_at IS NULL));

INSERT INTO operation_transitions (from_state, to_state, who) VALUES
  ('IN_FLIGHT', 'PREPARED', 'fence holder: an answer the target documents as not executed; sent again later');

CREATE OR REPLACE FUNCTION operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.tenant_id <> OLD.tenant_id OR NEW.operation_id <> OLD.operation_id
     OR NEW.operation_type <> OLD.operation_type OR NEW.intent_ref <> OLD.intent_ref
     OR NEW.content_type <> OLD.content_type OR NEW.payload_sha256 <> OLD.payload_sha256
     OR NEW.remote_key <> OLD.remote_key OR NEW.created_at <> OLD.created_at
     OR NEW.supersedes_id IS DISTINCT FROM OLD.supersedes_id
     OR NEW.dispatch_deadline IS DISTINCT FROM OLD.dispatch_deadline
     OR NEW.labels <> OLD.labels
     OR NEW.first_sent_at IS DISTINCT FROM OLD.first_sent_at AND OLD.first_sent_at IS NOT NULL THEN
    RAISE EXCEPTION 'operation %: immutable column changed', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF NEW.payload IS DISTINCT FROM OLD.payload AND NEW.payload IS NOT NULL THEN
    RAISE EXCEPTION 'operation %: payload can only be purged, never replaced', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF NEW.fence_token < OLD.fence_token OR NEW.revision < OLD.revision
     OR NEW.attempt_count < OLD.attempt_count OR NEW.not_executed < OLD.not_executed THEN
    RAISE EXCEPTION 'operation %: fence, revision, attempt count and not-executed count never decrease', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF NEW.state <> OLD.state THEN
    IF NEW.revision <> OLD.revision + 1 THEN
      RAISE EXCEPTION 'operation %: a state change must bump the revision by one', OLD.operation_id
        USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    PERFORM 1 FROM operation_transitions t WHERE t.from_state = OLD.state AND t.to_state = NEW.state;
    IF NOT FOUND THEN
      RAISE EXCEPTION 'operation %: transition % -> % is not allowed', OLD.operation_id, OLD.state, NEW.state
        USING ERRCODE = 'integrity_constraint_violation';
    END IF;
  END IF;
  RETURN NEW;
END;
$$;
