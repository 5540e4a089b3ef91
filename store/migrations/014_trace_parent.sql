-- The W3C trace context (traceparent) of the call that prepared an operation, so that
-- its sends and lookups, made later by another replica, link back to the caller's
-- trace. It holds tracing identifiers only, never customer data, and never changes.
ALTER TABLE operations
  ADD COLUMN trace_parent text,
  ADD CONSTRAINT operations_trace_parent_format CHECK (trace_parent ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$');

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
  RETURN NEW;
END;
$$;
