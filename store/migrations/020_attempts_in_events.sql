-- Attempts folded into the events. Every attempt already had two events: the one that
-- took its operation into IN_FLIGHT under the attempt's fence (who claimed it, when) and,
-- when its holder recorded the outcome, the one that took it out under the same fence
-- (when, the outcome, the answer's status and summary in its observation, the target's
-- reference). The attempt's own row repeated them, inserted at the claim and updated at
-- the outcome: two row versions, an index entry and a check per operation in a
-- burn-down. What only the attempt held now lives here:
--
-- * whether the request can have left (sent): on the event of the holder's outcome.
--   false: it provably never left; true: it may have. NULL on every other event (a
--   claim, the sweeper's, a resolution), and on the outcomes recorded before this
--   migration whose attempt did not say false: unknown, so it may have been sent.
-- * the outcome a worker recorded after losing its fence: it changed nothing, so it has
--   no event (an event is a revision of its operation); it is kept as evidence in
--   stale_outcomes, one row per fence at most, never rewritten.
--
-- The attempts' target name, written at each claim and read by nothing, is not kept:
-- the operation's type names its target.
-- The check on sent is added without reading the events (none has sent yet, and the
-- backfill below sets it only on outcomes); migration 021 validates it without holding
-- off writes.
ALTER TABLE operation_events ADD COLUMN sent boolean;
ALTER TABLE operation_events ADD CONSTRAINT operation_events_sent_on_outcomes
  CHECK (sent IS NULL OR from_state = 'IN_FLIGHT') NOT VALID;

CREATE TABLE stale_outcomes (
  tenant_id    text        NOT NULL,
  operation_id uuid        NOT NULL,
  fence_token  bigint      NOT NULL,
  actor        text        NOT NULL,
  recorded_at  timestamptz NOT NULL DEFAULT now(),
  outcome      text        NOT NULL,
  observation  jsonb       NOT NULL,
  remote_ref   text,
  sent         boolean     NOT NULL,
  PRIMARY KEY (tenant_id, operation_id, fence_token),
  CONSTRAINT stale_outcomes_fence_positive CHECK (fence_token > 0)
);

ALTER TABLE stale_outcomes ENABLE ROW LEVEL SECURITY;
ALTER TABLE stale_outcomes FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON stale_outcomes
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);

CREATE FUNCTION stale_outcomes_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'stale_outcomes is append-only' USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

CREATE TRIGGER stale_outcomes_append_only BEFORE UPDATE ON stale_outcomes
  FOR EACH ROW EXECUTE FUNCTION stale_outcomes_append_only();
CREATE TRIGGER stale_outcomes_have_operations AFTER INSERT ON stale_outcomes
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION history_has_operations();

-- The attempts carried forward, under every tenant's scope. A stale attempt becomes a
-- stale outcome (a dispatcher records every attempt's outcome, hence its actor); an applied attempt that provably never left marks its outcome's event
-- (the only rewrite an event ever gets, here, with its guard set aside for it).
SELECT set_config('opbroker.tenant', '*', true);

INSERT INTO stale_outcomes (tenant_id, operation_id, fence_token, actor, recorded_at, outcome, observation,
    remote_ref, sent)
  SELECT tenant_id, operation_id, fence_token, 'dispatcher:' || worker, finished_at, outcome,
    jsonb_strip_nulls(jsonb_build_object('observed_at', finished_at, 'source', 'DISPATCH', 'outcome', outcome,
      'http_status', http_status, 'summary', summary)),
    remote_ref, coalesce(sent, true)
  FROM operation_attempts WHERE NOT applied;

ALTER TABLE operation_events DISABLE TRIGGER operation_events_append_only;
UPDATE operation_events e SET sent = false
  FROM operation_attempts a
  WHERE a.applied AND NOT a.sent
    AND e.tenant_id = a.tenant_id AND e.operation_id = a.operation_id
    AND e.from_state = 'IN_FLIGHT' AND e.fence_token = a.fence_token;
ALTER TABLE operation_events ENABLE TRIGGER operation_events_append_only;

CREATE OR REPLACE FUNCTION operations_delete_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM operation_events e USING old_rows o WHERE e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id;
  DELETE FROM stale_outcomes s USING old_rows o WHERE s.tenant_id = o.tenant_id AND s.operation_id = o.operation_id;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_delete_history() SET search_path FROM CURRENT;

CREATE OR REPLACE FUNCTION operations_truncate_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  TRUNCATE operation_events, stale_outcomes;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_truncate_history() SET search_path FROM CURRENT;

DROP TABLE operation_attempts;
DROP FUNCTION operation_attempts_guard();
