-- The guard's rule that a payload is only ever purged, never replaced, compared the
-- payload's bytes on every update of an operation, claims and outcomes included, which
-- never set it. A payload stored out of line (larger than about 2 KB) is then read back
-- twice per update: 20,000 updates of rows with 8,000-byte payloads took 262–286 ms with
-- the comparison in the guard's WHEN condition, 80–96 ms without (no difference at 200
-- bytes). Only an update that sets the payload can change it, so that rule moves to a
-- trigger that fires only for those (BEFORE UPDATE OF payload: the purge); it calls the
-- same function, which names the broken rule. The guard's other rules are as in 019.
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
  OR NEW.state <> OLD.state AND (NEW.revision <> OLD.revision + 1 OR (OLD.state, NEW.state) NOT IN (
    ('PREPARED', 'IN_FLIGHT'), ('PREPARED', 'CANCELLED'), ('PREPARED', 'FAILED_TERMINAL'),
    ('IN_FLIGHT', 'SUCCEEDED'), ('IN_FLIGHT', 'FAILED_TERMINAL'), ('IN_FLIGHT', 'UNKNOWN'),
    ('IN_FLIGHT', 'PREPARED'),
    ('UNKNOWN', 'IN_FLIGHT'), ('UNKNOWN', 'SUCCEEDED'), ('UNKNOWN', 'FAILED_TERMINAL'),
    ('UNKNOWN', 'ESCALATED'), ('UNKNOWN', 'UNKNOWN'),
    ('ESCALATED', 'SUCCEEDED'), ('ESCALATED', 'FAILED_TERMINAL'), ('ESCALATED', 'ESCALATED'))))
  EXECUTE FUNCTION operations_guard();

CREATE TRIGGER operations_payload_guard BEFORE UPDATE OF payload ON operations FOR EACH ROW
  WHEN (NEW.payload IS DISTINCT FROM OLD.payload AND NEW.payload IS NOT NULL)
  EXECUTE FUNCTION operations_guard();
