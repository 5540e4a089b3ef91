-- Dispatching: one attempt record per claim (fence), and the indexes the sweepers use.

-- Every transmission to a target, keyed by the fence of the claim that made it: a claim
-- is at most one send. The outcome is written by the claim's holder even when the fence
-- has moved on (applied = false): a stale worker's observation is kept as evidence.
CREATE TABLE operation_attempts (
  tenant_id    text        NOT NULL,
  operation_id uuid        NOT NULL,
  fence_token  bigint      NOT NULL,
  target       text        NOT NULL,
  worker       text        NOT NULL,
  claimed_at   timestamptz NOT NULL DEFAULT now(),
  finished_at  timestamptz,
  outcome      text,
  http_status  integer,
  remote_ref   text,
  summary      text,
  applied      boolean,
  PRIMARY KEY (tenant_id, operation_id, fence_token),
  FOREIGN KEY (tenant_id, operation_id) REFERENCES operations (tenant_id, operation_id) ON DELETE CASCADE,
  CONSTRAINT operation_attempts_fence_positive CHECK (fence_token > 0),
  CONSTRAINT operation_attempts_finished CHECK ((finished_at IS NULL) = (outcome IS NULL) AND (finished_at IS NULL) = (applied IS NULL))
);

-- A finished attempt is evidence: it is never rewritten.
CREATE FUNCTION operation_attempts_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.finished_at IS NOT NULL THEN
    RAISE EXCEPTION 'attempt % of operation % is finished and cannot change', OLD.fence_token, OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF NEW.tenant_id <> OLD.tenant_id OR NEW.operation_id <> OLD.operation_id OR NEW.fence_token <> OLD.fence_token
     OR NEW.target <> OLD.target OR NEW.worker <> OLD.worker OR NEW.claimed_at <> OLD.claimed_at THEN
    RAISE EXCEPTION 'attempt % of operation %: identity columns are immutable', OLD.fence_token, OLD.operation_id
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END;
$$;

CREATE TRIGGER operation_attempts_guard BEFORE UPDATE ON operation_attempts
  FOR EACH ROW EXECUTE FUNCTION operation_attempts_guard();

-- PREPARED operations whose dispatch deadline may pass.
CREATE INDEX operations_deadline_idx ON operations (dispatch_deadline)
  WHERE state = 'PREPARED' AND dispatch_deadline IS NOT NULL;
