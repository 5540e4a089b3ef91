-- An operation's two keys in a table of their own. The intent key (one operation per
-- tenant, operation type and intent reference) and the remote key (the idempotency key
-- a target sees) never change after the insert, but while their indexes were on
-- operations every new version of the row (a claim, an outcome) added an entry to
-- both: a fifth of PostgreSQL's CPU per dispatched operation (docs/benchmarks.md). Here
-- each operation has one row, written once with it, which carries both indexes:
--
-- * operation_keys_intent, unique: a Prepare's insert of its intent here is the one
--   that conflicts (and then records nothing), before anything is written to operations;
-- * the primary key, led by the remote key: a target's event finds its operation by it.
--
-- The columns stay on operations too (every read of an operation returns them). What
-- keeps the two tables equal:
--
-- * every statement that inserts operations inserts, after it, the keys of each row
--   that has none yet, and fails when a row's keys are already another operation's
--   (operations_have_keys); the broker's own Prepare writes the keys first, so this only
--   finds them;
-- * operations_guard already keeps the columns from changing; operation_keys_guard
--   refuses to change a key, or to delete or truncate one whose operation exists;
-- * deleting or truncating operations deletes their keys, in the same statement.
--
-- This migration holds off writes to operations while it copies the keys and builds
-- the two indexes (seconds at a million operations), and the replicas of the previous
-- version cannot record a new intent once it has run: stop them first
-- (docs/operations.md#upgrading).
LOCK TABLE operations IN SHARE MODE;

CREATE TABLE operation_keys (
  tenant_id      text NOT NULL,
  operation_id   uuid NOT NULL,
  operation_type text NOT NULL,
  intent_ref     text NOT NULL,
  remote_key     uuid NOT NULL DEFAULT gen_random_uuid(),
  CONSTRAINT operation_keys_pkey PRIMARY KEY (remote_key, tenant_id),
  CONSTRAINT operation_keys_intent UNIQUE (operation_type, intent_ref, tenant_id)
);

-- Every tenant's operations, under row-level security (for this transaction only).
SELECT set_config('opbroker.tenant', '*', true);
INSERT INTO operation_keys (tenant_id, operation_id, operation_type, intent_ref, remote_key)
  SELECT tenant_id, operation_id, operation_type, intent_ref, remote_key FROM operations;

ALTER TABLE operations DROP CONSTRAINT operations_intent_key;
DROP INDEX operations_remote_key_idx;

ALTER TABLE operation_keys ENABLE ROW LEVEL SECURITY;
ALTER TABLE operation_keys FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON operation_keys
  USING (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END)
  WITH CHECK (CASE current_setting('opbroker.tenant', true) WHEN '*' THEN true
    ELSE tenant_id = ANY (string_to_array(current_setting('opbroker.tenant', true), ',')) END);

-- The keys of the inserted rows that have none: each row's are looked up on its own by
-- the primary key (the LIMIT keeps the lookups from becoming a join the planner could
-- make with a scan of operation_keys). Keys that are another operation's (its intent,
-- or its remote key) make the insert fail with their unique violation. The function
-- plans without sequential scans: a session keeps its plan of this statement, and one
-- made while operation_keys looked empty would read the whole table for every row.
CREATE FUNCTION operations_have_keys() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO operation_keys (tenant_id, operation_id, operation_type, intent_ref, remote_key)
    SELECT n.tenant_id, n.operation_id, n.operation_type, n.intent_ref, n.remote_key
    FROM new_rows n LEFT JOIN LATERAL (
      SELECT true AS found FROM operation_keys k
      WHERE k.remote_key = n.remote_key AND k.tenant_id = n.tenant_id AND k.operation_id = n.operation_id
        AND k.operation_type = n.operation_type AND k.intent_ref = n.intent_ref LIMIT 1) k ON true
    WHERE k.found IS NULL
    ORDER BY n.tenant_id, n.operation_type, n.intent_ref;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_have_keys() SET search_path FROM CURRENT;
ALTER FUNCTION operations_have_keys() SET enable_seqscan = off;

CREATE TRIGGER operations_have_keys AFTER INSERT ON operations
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION operations_have_keys();

CREATE FUNCTION operation_keys_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF EXISTS (SELECT 1 FROM operations) THEN
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

CREATE TRIGGER operation_keys_guard BEFORE UPDATE OR DELETE ON operation_keys
  FOR EACH ROW EXECUTE FUNCTION operation_keys_guard();
CREATE TRIGGER operation_keys_truncate_guard BEFORE TRUNCATE ON operation_keys
  FOR EACH STATEMENT EXECUTE FUNCTION operation_keys_guard();

CREATE OR REPLACE FUNCTION operations_delete_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM operation_events e USING old_rows o WHERE e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id;
  DELETE FROM stale_outcomes s USING old_rows o WHERE s.tenant_id = o.tenant_id AND s.operation_id = o.operation_id;
  DELETE FROM inbound_evidence i USING old_rows o WHERE i.tenant_id = o.tenant_id AND i.operation_id = o.operation_id;
  DELETE FROM operation_keys k USING old_rows o WHERE k.remote_key = o.remote_key AND k.tenant_id = o.tenant_id;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_delete_history() SET search_path FROM CURRENT;

-- operations is empty by then, so operation_keys_guard lets the keys go.
CREATE OR REPLACE FUNCTION operations_truncate_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  TRUNCATE operation_events, stale_outcomes, inbound_evidence, operation_keys;
  RETURN NULL;
END;
$$;
ALTER FUNCTION operations_truncate_history() SET search_path FROM CURRENT;
