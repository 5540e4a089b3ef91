-- A lookup's "not found" is taken as proof that no attempt took effect: it lets a key
-- that saves only successes be replayed, and past absence_final_after it makes the
-- operation FAILED_TERMINAL. The key's scope (010) covers the endpoint, the headers, the
-- key and the credential, but not where the lookup asks: a contract whose lookup was
-- repointed (another URL, method or "not found" status) after an operation was sent
-- would ask somewhere the effect need not be, and a second effect or a false failure
-- could follow. Each operation now keeps the fingerprint of the lookup it was sent
-- under (NULL for one sent before this migration, or under a contract without one).
--
-- Both scopes were also fixed at the first claim, even one whose send was answered as
-- not executed, so that an operation refused under one contract and then sent under
-- another (a rolling deploy, a rollback) kept the scopes of the send that did nothing.
-- They are now the scopes of the last claim from PREPARED: an operation is PREPARED
-- only while nothing sent for it can have taken effect (operations_unsent), so that
-- claim's send is the first that can. The guard lets them change only then. The key's
-- window stays the earliest of the claims' (a target may keep a key it did not execute
-- under): while PREPARED it may only come sooner, then never change. The other rules
-- are as in 028.
ALTER TABLE operations ADD COLUMN lookup_scope bytea; -- 16 bytes: rewritten with the row at each transition

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
     AND NOT (OLD.state = 'PREPARED' AND coalesce(NEW.key_window_end < OLD.key_window_end, false))
  OR (NEW.key_scope IS DISTINCT FROM OLD.key_scope OR NEW.lookup_scope IS DISTINCT FROM OLD.lookup_scope)
     AND OLD.state <> 'PREPARED'
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
        AND NOT (OLD.state = 'PREPARED' AND coalesce(NEW.key_window_end < OLD.key_window_end, false)) THEN
    RAISE EXCEPTION 'operation %: immutable column changed', OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF (NEW.key_scope IS DISTINCT FROM OLD.key_scope OR NEW.lookup_scope IS DISTINCT FROM OLD.lookup_scope)
     AND OLD.state <> 'PREPARED' THEN
    RAISE EXCEPTION 'operation %: immutable column changed: the scopes change only while nothing sent can have taken effect', OLD.operation_id
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

DO $$
BEGIN
  EXECUTE format('ALTER FUNCTION operations_guard() SET search_path = %I, pg_temp', current_schema());
END;
$$;
