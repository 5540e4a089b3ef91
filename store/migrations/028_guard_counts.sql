-- The guard held the fence and the counts to never decreasing, which let a writer
-- raise the not-executed count by any amount on any update: equal to the attempts, it
-- satisfies operations_unsent, so an operation whose attempt may have executed could go
-- back to PREPARED and be claimed and sent as if new. Now the not-executed count rises
-- by one at most, and only as an attempt ends (a move out of IN_FLIGHT, where the
-- outcome that says the request never left is recorded; the guard does not check that
-- outcome, whose statement sets both), so earlier attempts are never counted away; and
-- a move into IN_FLIGHT (a claim, a same-key replay) takes the next fence and counts
-- one attempt more. The function names the two new rules;
-- the other rules are as in 023 (the WHEN condition) and 014 (the function).
DROP TRIGGER operations_guard ON operations;
CREATE TRIGGER operations_guard BEFORE UPDATE ON operations FOR EACH ROW WHEN (
  NEW.tenant_id <> OLD.tenant_id OR NEW.operation_id <> OLD.operation_id
  OR NEW.operation_type <> OLD.operation_type OR NEW.intent_ref <> OLD.intent_ref
  OR NEW.content_type <> OLD.content_type OR NEW.payload_sha256 <> OLD.payload_sha256
  OR NEW.remote_key <> OLD.remote_key OR NEW.created_at <> OLD.created_at
  OR NEW.supersedes_id IS DISTINCT FROM OLD.supersedes_id
  OR NEW.dispatch_deadline IS DISTINCT FROM OLD.dispatch_deadline
  OR NEW.not_before IS DISTINCT FROM OLD.not_before
  OR NEW.trace_parent IS DISTINCT FROM OLD.trace_parent
  OR NEW.labels <> OLD.labels
  OR NEW.first_sent_at IS DISTINCT FROM OLD.first_sent_at AND OLD.first_sent_at IS NOT NULL
  OR NEW.key_window_end IS DISTINCT FROM OLD.key_window_end AND OLD.key_window_end IS NOT NULL
  OR NEW.key_scope IS DISTINCT FROM OLD.key_scope AND OLD.key_scope IS NOT NULL
  OR NEW.fence_token < OLD.fence_token OR NEW.revision < OLD.revision
  OR NEW.attempt_count < OLD.attempt_count OR NEW.not_executed < OLD.not_executed
  OR NEW.not_executed > OLD.not_executed + CASE WHEN OLD.state = 'IN_FLIGHT' AND NEW.state <> 'IN_FLIGHT' THEN 1 ELSE 0 END
  OR NEW.state = 'IN_FLIGHT' AND OLD.state <> 'IN_FLIGHT'
     AND (NEW.fence_token <> OLD.fence_token + 1 OR NEW.attempt_count <> OLD.attempt_count + 1)
  OR NEW.state <> OLD.state AND (NEW.revision <> OLD.revision + 1 OR (OLD.state, NEW.state) NOT IN (
    ('PREPARED', 'IN_FLIGHT'), ('PREPARED', 'CANCELLED'), ('PREPARED', 'FAILED_TERMINAL'),
    ('IN_FLIGHT', 'SUCCEEDED'), ('IN_FLIGHT', 'FAILED_TERMINAL'), ('IN_FLIGHT', 'UNKNOWN'),
    ('IN_FLIGHT', 'PREPARED'),
    ('UNKNOWN', 'IN_FLIGHT'), ('UNKNOWN', 'SUCCEEDED'), ('UNKNOWN', 'FAILED_TERMINAL'),
    ('UNKNOWN', 'ESCALATED'), ('UNKNOWN', 'UNKNOWN'),
    ('ESCALATED', 'SUCCEEDED'), ('ESCALATED', 'FAILED_TERMINAL'), ('ESCALATED', 'ESCALATED'))))
  EXECUTE FUNCTION operations_guard();

CREATE OR REPLACE FUNCTION operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.tenant_id <> OLD.tenant_id OR NEW.operation_id <> OLD.operation_id
     OR NEW.operation_type <> OLD.operation_type OR NEW.intent_ref <> OLD.intent_ref
     OR NEW.content_type <> OLD.content_type OR NEW.payload_sha256 <> OLD.payload_sha256
     OR NEW.remote_key <> OLD.remote_key OR NEW.created_at <> OLD.created_at
     OR NEW.supersedes_id IS DISTINCT FROM OLD.supersedes_id
     OR NEW.dispatch_deadline IS DISTINCT FROM OLD.dispatch_deadline
     OR NEW.not_before IS DISTINCT FROM OLD.not_before
     OR NEW.trace_parent IS DISTINCT FROM OLD.trace_parent
     OR NEW.labels <> OLD.labels
     OR NEW.first_sent_at IS DISTINCT FROM OLD.first_sent_at AND OLD.first_sent_at IS NOT NULL
     OR NEW.key_window_end IS DISTINCT FROM OLD.key_window_end AND OLD.key_window_end IS NOT NULL
     OR NEW.key_scope IS DISTINCT FROM OLD.key_scope AND OLD.key_scope IS NOT NULL THEN
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
  IF NEW.not_executed > OLD.not_executed + (CASE WHEN OLD.state = 'IN_FLIGHT' AND NEW.state <> 'IN_FLIGHT' THEN 1 ELSE 0 END) THEN
    RAISE EXCEPTION 'operation %: the not-executed count rises by one at most, as an attempt ends', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF NEW.state = 'IN_FLIGHT' AND OLD.state <> 'IN_FLIGHT'
     AND (NEW.fence_token <> OLD.fence_token + 1 OR NEW.attempt_count <> OLD.attempt_count + 1) THEN
    RAISE EXCEPTION 'operation %: a move into IN_FLIGHT takes the next fence and counts one attempt more', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END;
$$;
