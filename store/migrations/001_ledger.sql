-- The operation ledger: one row per business intent, an append-only event for every
-- change, and the state machine enforced by the schema itself.
--
-- Every table is keyed by tenant_id first, so the ledger can later be distributed by
-- tenant on a distributed PostgreSQL without changing keys.

CREATE TYPE operation_state AS ENUM (
  'PREPARED',
  'IN_FLIGHT',
  'SUCCEEDED',
  'FAILED_TERMINAL',
  'UNKNOWN',
  'ESCALATED',
  'CANCELLED'
);

-- The allowed transitions, drawn in docs/state-machine.md. A row that changes state must
-- follow one of these; the self-loops are events that record a new observation without
-- a change of state.
CREATE TABLE operation_transitions (
  from_state operation_state NOT NULL,
  to_state   operation_state NOT NULL,
  who        text            NOT NULL,
  PRIMARY KEY (from_state, to_state)
);

INSERT INTO operation_transitions (from_state, to_state, who) VALUES
  ('PREPARED',  'IN_FLIGHT',       'dispatcher: claim, fence + 1, payload hash re-verified'),
  ('PREPARED',  'CANCELLED',       'client: cancel before any send'),
  ('PREPARED',  'FAILED_TERMINAL', 'dispatcher: dispatch deadline passed before any send'),
  ('IN_FLIGHT', 'SUCCEEDED',       'fence holder: verified acknowledgment with remote reference'),
  ('IN_FLIGHT', 'FAILED_TERMINAL', 'fence holder: rejection documented as side-effect free'),
  ('IN_FLIGHT', 'UNKNOWN',         'fence holder or sweeper: unclear outcome or expired lease'),
  ('UNKNOWN',   'IN_FLIGHT',       'reconciler: same-key replay inside the retention window'),
  ('UNKNOWN',   'SUCCEEDED',       'reconciler or operator: lookup evidence or manual resolution'),
  ('UNKNOWN',   'FAILED_TERMINAL', 'reconciler or operator: absence provably final, or manual resolution'),
  ('UNKNOWN',   'ESCALATED',       'reconciler: mismatch, no capability, deadline or budget spent'),
  ('ESCALATED', 'SUCCEEDED',       'operator: manual resolution with evidence'),
  ('ESCALATED', 'FAILED_TERMINAL', 'operator: manual resolution with evidence'),
  ('UNKNOWN',   'UNKNOWN',         'reconciler: a new observation that resolves nothing yet'),
  ('ESCALATED', 'ESCALATED',       'reconciler or operator: a new observation or note');

CREATE TABLE operations (
  tenant_id         text            NOT NULL,
  operation_id      uuid            NOT NULL,
  operation_type    text            NOT NULL,
  intent_ref        text            NOT NULL,
  content_type      text            NOT NULL,
  -- The approved bytes, sent as they are. NULL once purged after a terminal state; the
  -- hash and the events stay.
  payload           bytea,
  -- SHA-256 of the canonical payload (package payload).
  payload_sha256    bytea           NOT NULL,
  -- The idempotency key sent to the target: random, generated once, never derived from
  -- customer data.
  remote_key        uuid            NOT NULL DEFAULT gen_random_uuid(),
  state             operation_state NOT NULL DEFAULT 'PREPARED',
  revision          bigint          NOT NULL DEFAULT 1,
  fence_token       bigint          NOT NULL DEFAULT 0,
  attempt_count     integer         NOT NULL DEFAULT 0,
  lease_owner       text,
  lease_expires_at  timestamptz,
  remote_ref        text,
  first_sent_at     timestamptz,
  dispatch_deadline timestamptz,
  supersedes_id     uuid,
  labels            jsonb           NOT NULL DEFAULT '{}',
  last_observation  jsonb,
  created_at        timestamptz     NOT NULL DEFAULT now(),
  updated_at        timestamptz     NOT NULL DEFAULT now(),

  PRIMARY KEY (tenant_id, operation_id),
  CONSTRAINT operations_intent_key UNIQUE (tenant_id, operation_type, intent_ref),
  CONSTRAINT operations_supersedes_fkey FOREIGN KEY (tenant_id, supersedes_id)
    REFERENCES operations (tenant_id, operation_id),

  CONSTRAINT operations_tenant_id_format CHECK (tenant_id ~ '^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$'),
  CONSTRAINT operations_intent_ref_size CHECK (octet_length(intent_ref) BETWEEN 1 AND 256),
  CONSTRAINT operations_payload_sha256_size CHECK (octet_length(payload_sha256) = 32),
  CONSTRAINT operations_counters CHECK (revision >= 1 AND fence_token >= 0 AND attempt_count >= 0),
  CONSTRAINT operations_supersedes_other CHECK (supersedes_id <> operation_id),
  CONSTRAINT operations_labels_object CHECK (jsonb_typeof(labels) = 'object'),
  -- Nothing was ever sent for an operation that is PREPARED or CANCELLED.
  CONSTRAINT operations_unsent CHECK (
    state NOT IN ('PREPARED', 'CANCELLED')
    OR (fence_token = 0 AND attempt_count = 0 AND first_sent_at IS NULL)),
  -- Every state after a claim has a fence and a first-send time.
  CONSTRAINT operations_sent CHECK (
    state NOT IN ('IN_FLIGHT', 'UNKNOWN', 'ESCALATED', 'SUCCEEDED')
    OR (fence_token > 0 AND first_sent_at IS NOT NULL)),
  -- An operation in flight has a lease and its owner; a terminal one has neither.
  CONSTRAINT operations_in_flight_leased CHECK (
    state <> 'IN_FLIGHT' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
  CONSTRAINT operations_terminal_unleased CHECK (
    state NOT IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED')
    OR (lease_owner IS NULL AND lease_expires_at IS NULL)),
  -- Nothing is SUCCEEDED without the target's reference.
  CONSTRAINT operations_succeeded_has_ref CHECK (state <> 'SUCCEEDED' OR remote_ref IS NOT NULL),
  -- Payload bytes may only be purged once nothing can send them again.
  CONSTRAINT operations_payload_kept_until_terminal CHECK (
    payload IS NOT NULL OR state IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED'))
);

-- Listing a tenant's operations by state, newest first.
CREATE INDEX operations_tenant_state_idx ON operations (tenant_id, state, operation_id);
-- The next PREPARED operations, per tenant in arrival order (claims).
CREATE INDEX operations_prepared_idx ON operations (tenant_id, operation_id) WHERE state = 'PREPARED';
-- Expired leases (the sweeper).
CREATE INDEX operations_lease_idx ON operations (lease_expires_at) WHERE state = 'IN_FLIGHT';

-- One row for every change of an operation, written in the same statement as the
-- change. Append-only: the audit trail and the source of watch streams.
CREATE TABLE operation_events (
  tenant_id    text            NOT NULL,
  operation_id uuid            NOT NULL,
  revision     bigint          NOT NULL,
  from_state   operation_state,
  to_state     operation_state NOT NULL,
  fence_token  bigint          NOT NULL,
  actor        text            NOT NULL,
  reason       text,
  observation  jsonb,
  created_at   timestamptz     NOT NULL DEFAULT now(),
  PRIMARY KEY (tenant_id, operation_id, revision),
  FOREIGN KEY (tenant_id, operation_id) REFERENCES operations (tenant_id, operation_id) ON DELETE CASCADE,
  CONSTRAINT operation_events_transition_fkey FOREIGN KEY (from_state, to_state)
    REFERENCES operation_transitions (from_state, to_state),
  CONSTRAINT operation_events_creation CHECK ((from_state IS NULL) = (revision = 1))
);

-- Guards every update of an operation: immutable columns stay, the fence and the
-- revision never go back, a state change follows operation_transitions and bumps the
-- revision by exactly one.
CREATE FUNCTION operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
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
     OR NEW.attempt_count < OLD.attempt_count THEN
    RAISE EXCEPTION 'operation %: fence, revision and attempt count never decrease', OLD.operation_id
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

CREATE TRIGGER operations_guard BEFORE UPDATE ON operations
  FOR EACH ROW EXECUTE FUNCTION operations_guard();

CREATE FUNCTION operation_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'operation_events is append-only' USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

CREATE TRIGGER operation_events_append_only BEFORE UPDATE ON operation_events
  FOR EACH ROW EXECUTE FUNCTION operation_events_append_only();
