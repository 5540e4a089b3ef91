-- Events carry what a watcher shows of the operation after the change, so a stream can
-- replay history from the event table alone.
ALTER TABLE operation_events
  ADD COLUMN remote_ref    text,
  ADD COLUMN attempt_count integer,
  ADD COLUMN escalation    jsonb;

UPDATE operation_events e SET remote_ref = o.remote_ref, attempt_count = o.attempt_count, escalation = o.escalation
FROM operations o
WHERE o.tenant_id = e.tenant_id AND o.operation_id = e.operation_id AND o.revision = e.revision;
