-- The ledger's schema as store/migrations leave a new database (schema opbroker, as
-- in opbroker dev). Written by `make schema`; do not edit: add a migration.
--
-- PostgreSQL database dump
--

--
-- Name: opbroker; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA opbroker;

--
-- Name: operation_state; Type: TYPE; Schema: opbroker; Owner: -
--

CREATE TYPE opbroker.operation_state AS ENUM (
    'PREPARED',
    'IN_FLIGHT',
    'SUCCEEDED',
    'FAILED_TERMINAL',
    'UNKNOWN',
    'ESCALATED',
    'CANCELLED'
);

--
-- Name: history_goes_with_operations(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.history_goes_with_operations() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  IF pg_trigger_depth() < 2 THEN
    RAISE EXCEPTION '%: deleted with its operations, never on its own', TG_TABLE_NAME
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NULL;
END;
$$;

--
-- Name: history_has_operations(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.history_has_operations() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM new_rows n LEFT JOIN LATERAL (
      SELECT true AS found FROM operations o
      WHERE o.tenant_id = n.tenant_id AND o.operation_id = n.operation_id LIMIT 1 FOR KEY SHARE) o ON true
    WHERE o.found IS NULL) THEN
    RAISE EXCEPTION '%: a row for an operation that does not exist', TG_TABLE_NAME
      USING ERRCODE = 'foreign_key_violation';
  END IF;
  RETURN NULL;
END;
$$;

--
-- Name: operation_events_append_only(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operation_events_append_only() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  RAISE EXCEPTION 'operation_events is append-only' USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

--
-- Name: operation_keys_guard(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operation_keys_guard() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF pg_trigger_depth() < 2 THEN
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

--
-- Name: operations_delete_history(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operations_delete_history() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  DELETE FROM operation_events e USING old_rows o WHERE e.tenant_id = o.tenant_id AND e.operation_id = o.operation_id;
  DELETE FROM stale_outcomes s USING old_rows o WHERE s.tenant_id = o.tenant_id AND s.operation_id = o.operation_id;
  DELETE FROM inbound_evidence i USING old_rows o WHERE i.tenant_id = o.tenant_id AND i.operation_id = o.operation_id;
  DELETE FROM operation_keys k USING old_rows o WHERE k.remote_key = o.remote_key AND k.tenant_id = o.tenant_id;
  RETURN NULL;
END;
$$;

--
-- Name: operations_deleted_when_terminal(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operations_deleted_when_terminal() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
DECLARE
  scope text;
  open boolean;
BEGIN
  IF TG_OP = 'DELETE' THEN
    RAISE EXCEPTION 'operation %: % is not terminal; an operation is deleted only once it is SUCCEEDED, FAILED_TERMINAL or CANCELLED',
      OLD.operation_id, OLD.state USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  -- TRUNCATE ignores row-level security, so the check must not see only the caller's
  -- tenants: it reads every tenant's operations (only whether one is open), and puts the
  -- caller's scope back. A raise aborts the (sub)transaction, which restores it too.
  scope := current_setting('opbroker.tenant', true);
  PERFORM set_config('opbroker.tenant', '*', true);
  open := EXISTS (SELECT 1 FROM operations WHERE state NOT IN ('SUCCEEDED', 'FAILED_TERMINAL', 'CANCELLED'));
  PERFORM set_config('opbroker.tenant', coalesce(scope, ''), true);
  IF open THEN
    RAISE EXCEPTION 'operations: some are not terminal; operations are truncated only once every one is SUCCEEDED, FAILED_TERMINAL or CANCELLED'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NULL;
END;
$$;

--
-- Name: operations_formats(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operations_formats() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $_$
BEGIN
  IF NEW.tenant_id !~ '^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$' THEN
    RAISE EXCEPTION 'new row for relation "operations" violates check constraint "operations_tenant_id_format"'
      USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_tenant_id_format', TABLE = 'operations';
  END IF;
  RAISE EXCEPTION 'new row for relation "operations" violates check constraint "operations_trace_parent_format"'
    USING ERRCODE = 'check_violation', CONSTRAINT = 'operations_trace_parent_format', TABLE = 'operations';
END;
$_$;

--
-- Name: operations_guard(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operations_guard() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
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

--
-- Name: operations_have_keys(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operations_have_keys() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    SET enable_seqscan TO 'off'
    AS $$
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

--
-- Name: operations_truncate_history(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.operations_truncate_history() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  TRUNCATE operation_events, stale_outcomes, inbound_evidence, operation_keys;
  RETURN NULL;
END;
$$;

--
-- Name: stale_outcomes_append_only(); Type: FUNCTION; Schema: opbroker; Owner: -
--

CREATE FUNCTION opbroker.stale_outcomes_append_only() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'opbroker', 'pg_temp'
    AS $$
BEGIN
  RAISE EXCEPTION 'stale_outcomes is append-only' USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

--
-- Name: inbound_evidence; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.inbound_evidence (
    target text NOT NULL,
    event_id text NOT NULL,
    source text NOT NULL,
    reporter text DEFAULT ''::text NOT NULL,
    claimed_tenant text,
    event_type text NOT NULL,
    meaning text NOT NULL,
    reference text NOT NULL,
    reference_kind text NOT NULL,
    remote_ref text,
    body bytea,
    body_purge_at timestamp with time zone NOT NULL,
    received_at timestamp with time zone DEFAULT now() NOT NULL,
    match_until timestamp with time zone NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    next_match_at timestamp with time zone DEFAULT now() NOT NULL,
    disposition text DEFAULT 'PENDING'::text NOT NULL,
    reason text,
    detail text,
    tenant_id text,
    operation_id uuid,
    decided_at timestamp with time zone,
    reviewed_by text,
    reviewed_at timestamp with time zone,
    review_note text,
    CONSTRAINT inbound_evidence_disposition CHECK (
CASE disposition
    WHEN 'PENDING'::text THEN ((reason IS NULL) AND (operation_id IS NULL) AND (decided_at IS NULL))
    WHEN 'APPLIED'::text THEN ((reason IS NULL) AND (operation_id IS NOT NULL) AND (decided_at IS NOT NULL))
    WHEN 'OBSERVED'::text THEN ((reason IS NULL) AND (operation_id IS NOT NULL) AND (decided_at IS NOT NULL))
    WHEN 'QUARANTINED'::text THEN ((reason IS NOT NULL) AND (decided_at IS NOT NULL) AND (reviewed_by IS NULL))
    WHEN 'ATTACHED'::text THEN ((reason IS NOT NULL) AND (operation_id IS NOT NULL) AND (reviewed_by IS NOT NULL))
    WHEN 'DISMISSED'::text THEN ((reason IS NOT NULL) AND (reviewed_by IS NOT NULL) AND (review_note IS NOT NULL))
    ELSE false
END),
    CONSTRAINT inbound_evidence_meaning CHECK ((meaning = ANY (ARRAY['SUCCEEDED'::text, 'PENDING'::text, 'FAILED'::text]))),
    CONSTRAINT inbound_evidence_operation CHECK (((tenant_id IS NULL) = (operation_id IS NULL))),
    CONSTRAINT inbound_evidence_reference_kind CHECK ((reference_kind = ANY (ARRAY['remote_key'::text, 'remote_ref'::text]))),
    CONSTRAINT inbound_evidence_sizes CHECK ((((octet_length(event_id) >= 1) AND (octet_length(event_id) <= 256)) AND (octet_length(event_type) <= 256) AND ((octet_length(reference) >= 1) AND (octet_length(reference) <= 512)) AND (COALESCE(octet_length(remote_ref), 0) <= 512) AND (COALESCE(octet_length(detail), 0) <= 1024))),
    CONSTRAINT inbound_evidence_source CHECK (((source = ANY (ARRAY['WEBHOOK'::text, 'REPORTED'::text])) AND ((source = 'REPORTED'::text) = (reporter <> ''::text)) AND ((source = 'REPORTED'::text) = (claimed_tenant IS NOT NULL))))
);

ALTER TABLE ONLY opbroker.inbound_evidence FORCE ROW LEVEL SECURITY;

--
-- Name: opbroker_schema_version; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.opbroker_schema_version (
    version integer NOT NULL
);

--
-- Name: operation_events; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.operation_events (
    tenant_id text NOT NULL,
    operation_id uuid NOT NULL,
    revision bigint NOT NULL,
    from_state opbroker.operation_state,
    to_state opbroker.operation_state NOT NULL,
    fence_token bigint NOT NULL,
    actor text NOT NULL,
    reason text,
    observation jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    remote_ref text,
    attempt_count integer,
    escalation jsonb,
    xact_id xid8 DEFAULT pg_current_xact_id() NOT NULL,
    seq bigint NOT NULL,
    sent boolean,
    CONSTRAINT operation_events_creation CHECK (((from_state IS NULL) = (revision = 1))),
    CONSTRAINT operation_events_sent_on_outcomes CHECK (((sent IS NULL) OR (from_state = 'IN_FLIGHT'::opbroker.operation_state))),
    CONSTRAINT operation_events_transition CHECK (((from_state IS NULL) OR ((((((((((((((((from_state = 'PREPARED'::opbroker.operation_state) AND (to_state = 'IN_FLIGHT'::opbroker.operation_state)) OR ((from_state = 'PREPARED'::opbroker.operation_state) AND (to_state = 'CANCELLED'::opbroker.operation_state))) OR ((from_state = 'PREPARED'::opbroker.operation_state) AND (to_state = 'FAILED_TERMINAL'::opbroker.operation_state))) OR ((from_state = 'IN_FLIGHT'::opbroker.operation_state) AND (to_state = 'SUCCEEDED'::opbroker.operation_state))) OR ((from_state = 'IN_FLIGHT'::opbroker.operation_state) AND (to_state = 'FAILED_TERMINAL'::opbroker.operation_state))) OR ((from_state = 'IN_FLIGHT'::opbroker.operation_state) AND (to_state = 'UNKNOWN'::opbroker.operation_state))) OR ((from_state = 'IN_FLIGHT'::opbroker.operation_state) AND (to_state = 'PREPARED'::opbroker.operation_state))) OR ((from_state = 'UNKNOWN'::opbroker.operation_state) AND (to_state = 'IN_FLIGHT'::opbroker.operation_state))) OR ((from_state = 'UNKNOWN'::opbroker.operation_state) AND (to_state = 'SUCCEEDED'::opbroker.operation_state))) OR ((from_state = 'UNKNOWN'::opbroker.operation_state) AND (to_state = 'FAILED_TERMINAL'::opbroker.operation_state))) OR ((from_state = 'UNKNOWN'::opbroker.operation_state) AND (to_state = 'ESCALATED'::opbroker.operation_state))) OR ((from_state = 'UNKNOWN'::opbroker.operation_state) AND (to_state = 'UNKNOWN'::opbroker.operation_state))) OR ((from_state = 'ESCALATED'::opbroker.operation_state) AND (to_state = 'SUCCEEDED'::opbroker.operation_state))) OR ((from_state = 'ESCALATED'::opbroker.operation_state) AND (to_state = 'FAILED_TERMINAL'::opbroker.operation_state))) OR ((from_state = 'ESCALATED'::opbroker.operation_state) AND (to_state = 'ESCALATED'::opbroker.operation_state)))))
);

ALTER TABLE ONLY opbroker.operation_events FORCE ROW LEVEL SECURITY;

--
-- Name: operation_events_seq_seq; Type: SEQUENCE; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.operation_events ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME opbroker.operation_events_seq_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: operation_keys; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.operation_keys (
    tenant_id text NOT NULL,
    operation_id uuid NOT NULL,
    operation_type text NOT NULL,
    intent_ref text NOT NULL,
    remote_key uuid DEFAULT gen_random_uuid() NOT NULL
);

ALTER TABLE ONLY opbroker.operation_keys FORCE ROW LEVEL SECURITY;

--
-- Name: operation_transitions; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.operation_transitions (
    from_state opbroker.operation_state NOT NULL,
    to_state opbroker.operation_state NOT NULL,
    who text NOT NULL
);

--
-- Name: operations; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.operations (
    tenant_id text NOT NULL,
    operation_id uuid NOT NULL,
    operation_type text NOT NULL,
    intent_ref text NOT NULL,
    content_type text NOT NULL,
    payload bytea,
    payload_sha256 bytea NOT NULL,
    remote_key uuid DEFAULT gen_random_uuid() NOT NULL,
    state opbroker.operation_state DEFAULT 'PREPARED'::opbroker.operation_state NOT NULL,
    revision bigint DEFAULT 1 NOT NULL,
    fence_token bigint DEFAULT 0 NOT NULL,
    attempt_count integer DEFAULT 0 NOT NULL,
    lease_owner text,
    lease_expires_at timestamp with time zone,
    remote_ref text,
    first_sent_at timestamp with time zone,
    dispatch_deadline timestamp with time zone,
    supersedes_id uuid,
    labels jsonb DEFAULT '{}'::jsonb NOT NULL,
    last_observation jsonb,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    next_check_at timestamp with time zone,
    checks integer DEFAULT 0 NOT NULL,
    replays integer DEFAULT 0 NOT NULL,
    accepted_unfinished boolean DEFAULT false NOT NULL,
    escalation jsonb,
    not_executed integer DEFAULT 0 NOT NULL,
    key_window_end timestamp with time zone,
    key_scope text,
    not_before timestamp with time zone,
    trace_parent text,
    lookup_scope bytea,
    CONSTRAINT operations_counters CHECK (((revision >= 1) AND (fence_token >= 0) AND (attempt_count >= 0))),
    CONSTRAINT operations_deadline_after_not_before CHECK (((dispatch_deadline IS NULL) OR (not_before IS NULL) OR (dispatch_deadline > not_before))),
    CONSTRAINT operations_escalated_has_owner CHECK (((state <> 'ESCALATED'::opbroker.operation_state) OR COALESCE(((escalation ? 'owner'::text) AND (escalation ? 'reason'::text)), false))),
    CONSTRAINT operations_in_flight_leased CHECK (((state <> 'IN_FLIGHT'::opbroker.operation_state) OR ((lease_owner IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT operations_intent_ref_size CHECK (((octet_length(intent_ref) >= 1) AND (octet_length(intent_ref) <= 256))),
    CONSTRAINT operations_labels_object CHECK ((jsonb_typeof(labels) = 'object'::text)),
    CONSTRAINT operations_not_executed_count CHECK (((not_executed >= 0) AND (not_executed <= attempt_count))),
    CONSTRAINT operations_payload_kept_until_terminal CHECK (((payload IS NOT NULL) OR (state = ANY (ARRAY['SUCCEEDED'::opbroker.operation_state, 'FAILED_TERMINAL'::opbroker.operation_state, 'CANCELLED'::opbroker.operation_state])))),
    CONSTRAINT operations_payload_sha256_size CHECK ((octet_length(payload_sha256) = 32)),
    CONSTRAINT operations_reconcile_counters CHECK (((checks >= 0) AND (replays >= 0))),
    CONSTRAINT operations_sent CHECK (((state <> ALL (ARRAY['IN_FLIGHT'::opbroker.operation_state, 'UNKNOWN'::opbroker.operation_state, 'ESCALATED'::opbroker.operation_state, 'SUCCEEDED'::opbroker.operation_state])) OR ((fence_token > 0) AND (first_sent_at IS NOT NULL)))),
    CONSTRAINT operations_succeeded_has_ref CHECK (((state <> 'SUCCEEDED'::opbroker.operation_state) OR (remote_ref IS NOT NULL))),
    CONSTRAINT operations_supersedes_other CHECK ((supersedes_id <> operation_id)),
    CONSTRAINT operations_terminal_unleased CHECK (((state <> ALL (ARRAY['SUCCEEDED'::opbroker.operation_state, 'FAILED_TERMINAL'::opbroker.operation_state, 'CANCELLED'::opbroker.operation_state])) OR ((lease_owner IS NULL) AND (lease_expires_at IS NULL)))),
    CONSTRAINT operations_unsent CHECK (((state <> ALL (ARRAY['PREPARED'::opbroker.operation_state, 'CANCELLED'::opbroker.operation_state])) OR ((attempt_count = not_executed) AND ((attempt_count > 0) OR ((fence_token = 0) AND (first_sent_at IS NULL))))))
);

ALTER TABLE ONLY opbroker.operations FORCE ROW LEVEL SECURITY;

--
-- Name: payload_mismatches; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.payload_mismatches (
    tenant_id text NOT NULL,
    operation_id uuid NOT NULL,
    refused_at timestamp with time zone DEFAULT now() NOT NULL,
    payload_sha256 bytea NOT NULL
);

ALTER TABLE ONLY opbroker.payload_mismatches FORCE ROW LEVEL SECURITY;

--
-- Name: stale_outcomes; Type: TABLE; Schema: opbroker; Owner: -
--

CREATE TABLE opbroker.stale_outcomes (
    tenant_id text NOT NULL,
    operation_id uuid NOT NULL,
    fence_token bigint NOT NULL,
    actor text NOT NULL,
    recorded_at timestamp with time zone DEFAULT now() NOT NULL,
    outcome text NOT NULL,
    observation jsonb NOT NULL,
    remote_ref text,
    sent boolean NOT NULL,
    CONSTRAINT stale_outcomes_fence_positive CHECK ((fence_token > 0))
);

ALTER TABLE ONLY opbroker.stale_outcomes FORCE ROW LEVEL SECURITY;

--
-- Name: inbound_evidence inbound_evidence_pkey; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.inbound_evidence
    ADD CONSTRAINT inbound_evidence_pkey PRIMARY KEY (target, event_id, reporter);

--
-- Name: operation_events operation_events_pkey; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.operation_events
    ADD CONSTRAINT operation_events_pkey PRIMARY KEY (tenant_id, operation_id, revision);

--
-- Name: operation_keys operation_keys_intent; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.operation_keys
    ADD CONSTRAINT operation_keys_intent UNIQUE (operation_type, intent_ref, tenant_id);

--
-- Name: operation_keys operation_keys_pkey; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.operation_keys
    ADD CONSTRAINT operation_keys_pkey PRIMARY KEY (remote_key, tenant_id);

--
-- Name: operation_transitions operation_transitions_pkey; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.operation_transitions
    ADD CONSTRAINT operation_transitions_pkey PRIMARY KEY (from_state, to_state);

--
-- Name: operations operations_pkey; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.operations
    ADD CONSTRAINT operations_pkey PRIMARY KEY (tenant_id, operation_id);

--
-- Name: stale_outcomes stale_outcomes_pkey; Type: CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.stale_outcomes
    ADD CONSTRAINT stale_outcomes_pkey PRIMARY KEY (tenant_id, operation_id, fence_token);

--
-- Name: inbound_evidence_operation_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX inbound_evidence_operation_idx ON opbroker.inbound_evidence USING btree (tenant_id, operation_id) WHERE (operation_id IS NOT NULL);

--
-- Name: inbound_evidence_pending_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX inbound_evidence_pending_idx ON opbroker.inbound_evidence USING btree (next_match_at) WHERE (disposition = 'PENDING'::text);

--
-- Name: inbound_evidence_purge_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX inbound_evidence_purge_idx ON opbroker.inbound_evidence USING btree (body_purge_at) WHERE (body IS NOT NULL);

--
-- Name: inbound_evidence_quarantine_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX inbound_evidence_quarantine_idx ON opbroker.inbound_evidence USING btree (received_at, target, event_id, reporter) WHERE (disposition = 'QUARANTINED'::text);

--
-- Name: operation_events_feed_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operation_events_feed_idx ON opbroker.operation_events USING btree (tenant_id, xact_id, seq);

--
-- Name: operations_claim_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_claim_idx ON opbroker.operations USING btree (tenant_id, operation_type, operation_id) WHERE (state = 'PREPARED'::opbroker.operation_state);

--
-- Name: operations_deadline_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_deadline_idx ON opbroker.operations USING btree (dispatch_deadline) WHERE ((state = 'PREPARED'::opbroker.operation_state) AND (dispatch_deadline IS NOT NULL));

--
-- Name: operations_escalated_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_escalated_idx ON opbroker.operations USING btree (operation_type) WHERE (state = 'ESCALATED'::opbroker.operation_state);

--
-- Name: operations_lease_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_lease_idx ON opbroker.operations USING btree (lease_expires_at) WHERE (state = 'IN_FLIGHT'::opbroker.operation_state);

--
-- Name: operations_purge_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_purge_idx ON opbroker.operations USING btree (updated_at) WHERE ((payload IS NOT NULL) AND (state = ANY (ARRAY['SUCCEEDED'::opbroker.operation_state, 'FAILED_TERMINAL'::opbroker.operation_state, 'CANCELLED'::opbroker.operation_state])));

--
-- Name: operations_remote_ref_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_remote_ref_idx ON opbroker.operations USING btree (remote_ref) WHERE (remote_ref IS NOT NULL);

--
-- Name: operations_unknown_due_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX operations_unknown_due_idx ON opbroker.operations USING btree (tenant_id, next_check_at) WHERE (state = 'UNKNOWN'::opbroker.operation_state);

--
-- Name: payload_mismatches_operation_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX payload_mismatches_operation_idx ON opbroker.payload_mismatches USING btree (tenant_id, operation_id);

--
-- Name: payload_mismatches_refused_idx; Type: INDEX; Schema: opbroker; Owner: -
--

CREATE INDEX payload_mismatches_refused_idx ON opbroker.payload_mismatches USING btree (refused_at);

--
-- Name: inbound_evidence inbound_evidence_goes_with_operations; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER inbound_evidence_goes_with_operations BEFORE DELETE ON opbroker.inbound_evidence FOR EACH ROW WHEN (((old.operation_id IS NOT NULL) AND (pg_trigger_depth() < 1))) EXECUTE FUNCTION opbroker.history_goes_with_operations();

--
-- Name: inbound_evidence inbound_evidence_truncated_with_operations; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER inbound_evidence_truncated_with_operations BEFORE TRUNCATE ON opbroker.inbound_evidence FOR EACH STATEMENT EXECUTE FUNCTION opbroker.history_goes_with_operations();

--
-- Name: operation_events operation_events_append_only; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operation_events_append_only BEFORE UPDATE ON opbroker.operation_events FOR EACH ROW EXECUTE FUNCTION opbroker.operation_events_append_only();

--
-- Name: operation_events operation_events_go_with_operations; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operation_events_go_with_operations BEFORE DELETE OR TRUNCATE ON opbroker.operation_events FOR EACH STATEMENT EXECUTE FUNCTION opbroker.history_goes_with_operations();

--
-- Name: operation_events operation_events_have_operations; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operation_events_have_operations AFTER INSERT ON opbroker.operation_events REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION opbroker.history_has_operations();

--
-- Name: operation_keys operation_keys_guard; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operation_keys_guard BEFORE DELETE OR UPDATE ON opbroker.operation_keys FOR EACH ROW EXECUTE FUNCTION opbroker.operation_keys_guard();

--
-- Name: operation_keys operation_keys_truncate_guard; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operation_keys_truncate_guard BEFORE TRUNCATE ON opbroker.operation_keys FOR EACH STATEMENT EXECUTE FUNCTION opbroker.operation_keys_guard();

--
-- Name: operations operations_delete_history; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_delete_history AFTER DELETE ON opbroker.operations REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION opbroker.operations_delete_history();

--
-- Name: operations operations_deleted_when_terminal; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_deleted_when_terminal BEFORE DELETE ON opbroker.operations FOR EACH ROW WHEN ((old.state <> ALL (ARRAY['SUCCEEDED'::opbroker.operation_state, 'FAILED_TERMINAL'::opbroker.operation_state, 'CANCELLED'::opbroker.operation_state]))) EXECUTE FUNCTION opbroker.operations_deleted_when_terminal();

--
-- Name: operations operations_formats; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_formats BEFORE INSERT ON opbroker.operations FOR EACH ROW WHEN (((new.tenant_id !~ '^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$'::text) OR (new.trace_parent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'::text))) EXECUTE FUNCTION opbroker.operations_formats();

--
-- Name: operations operations_guard; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_guard BEFORE UPDATE ON opbroker.operations FOR EACH ROW WHEN (((new.tenant_id <> old.tenant_id) OR (new.operation_id <> old.operation_id) OR (new.operation_type <> old.operation_type) OR (new.intent_ref <> old.intent_ref) OR (new.content_type <> old.content_type) OR (new.payload_sha256 <> old.payload_sha256) OR (new.remote_key <> old.remote_key) OR (new.created_at <> old.created_at) OR (new.supersedes_id IS DISTINCT FROM old.supersedes_id) OR (new.dispatch_deadline IS DISTINCT FROM old.dispatch_deadline) OR (new.not_before IS DISTINCT FROM old.not_before) OR (new.trace_parent IS DISTINCT FROM old.trace_parent) OR (new.labels <> old.labels) OR ((new.first_sent_at IS DISTINCT FROM old.first_sent_at) AND (old.first_sent_at IS NOT NULL)) OR ((new.key_window_end IS DISTINCT FROM old.key_window_end) AND (old.key_window_end IS NOT NULL) AND (NOT ((old.state = 'PREPARED'::opbroker.operation_state) AND COALESCE((new.key_window_end < old.key_window_end), false)))) OR (((new.key_scope IS DISTINCT FROM old.key_scope) OR (new.lookup_scope IS DISTINCT FROM old.lookup_scope)) AND (old.state <> 'PREPARED'::opbroker.operation_state)) OR (new.fence_token < old.fence_token) OR (new.revision < old.revision) OR (new.attempt_count < old.attempt_count) OR (new.not_executed < old.not_executed) OR (new.not_executed > (old.not_executed +
        CASE
            WHEN ((old.state = 'IN_FLIGHT'::opbroker.operation_state) AND (new.state <> 'IN_FLIGHT'::opbroker.operation_state)) THEN 1
            ELSE 0
        END)) OR ((new.state = 'IN_FLIGHT'::opbroker.operation_state) AND (old.state <> 'IN_FLIGHT'::opbroker.operation_state) AND ((new.fence_token <> (old.fence_token + 1)) OR (new.attempt_count <> (old.attempt_count + 1)))) OR ((new.state <> old.state) AND ((new.revision <> (old.revision + 1)) OR ((((((((((((((((old.state <> 'PREPARED'::opbroker.operation_state) OR (new.state <> 'IN_FLIGHT'::opbroker.operation_state)) AND ((old.state <> 'PREPARED'::opbroker.operation_state) OR (new.state <> 'CANCELLED'::opbroker.operation_state))) AND ((old.state <> 'PREPARED'::opbroker.operation_state) OR (new.state <> 'FAILED_TERMINAL'::opbroker.operation_state))) AND ((old.state <> 'IN_FLIGHT'::opbroker.operation_state) OR (new.state <> 'SUCCEEDED'::opbroker.operation_state))) AND ((old.state <> 'IN_FLIGHT'::opbroker.operation_state) OR (new.state <> 'FAILED_TERMINAL'::opbroker.operation_state))) AND ((old.state <> 'IN_FLIGHT'::opbroker.operation_state) OR (new.state <> 'UNKNOWN'::opbroker.operation_state))) AND ((old.state <> 'IN_FLIGHT'::opbroker.operation_state) OR (new.state <> 'PREPARED'::opbroker.operation_state))) AND ((old.state <> 'UNKNOWN'::opbroker.operation_state) OR (new.state <> 'IN_FLIGHT'::opbroker.operation_state))) AND ((old.state <> 'UNKNOWN'::opbroker.operation_state) OR (new.state <> 'SUCCEEDED'::opbroker.operation_state))) AND ((old.state <> 'UNKNOWN'::opbroker.operation_state) OR (new.state <> 'FAILED_TERMINAL'::opbroker.operation_state))) AND ((old.state <> 'UNKNOWN'::opbroker.operation_state) OR (new.state <> 'ESCALATED'::opbroker.operation_state))) AND ((old.state <> 'UNKNOWN'::opbroker.operation_state) OR (new.state <> 'UNKNOWN'::opbroker.operation_state))) AND ((old.state <> 'ESCALATED'::opbroker.operation_state) OR (new.state <> 'SUCCEEDED'::opbroker.operation_state))) AND ((old.state <> 'ESCALATED'::opbroker.operation_state) OR (new.state <> 'FAILED_TERMINAL'::opbroker.operation_state))) AND ((old.state <> 'ESCALATED'::opbroker.operation_state) OR (new.state <> 'ESCALATED'::opbroker.operation_state))))))) EXECUTE FUNCTION opbroker.operations_guard();

--
-- Name: operations operations_have_keys; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_have_keys AFTER INSERT ON opbroker.operations REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION opbroker.operations_have_keys();

--
-- Name: operations operations_payload_guard; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_payload_guard BEFORE UPDATE OF payload ON opbroker.operations FOR EACH ROW WHEN (((new.payload IS DISTINCT FROM old.payload) AND (new.payload IS NOT NULL))) EXECUTE FUNCTION opbroker.operations_guard();

--
-- Name: operations operations_truncate_history; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_truncate_history AFTER TRUNCATE ON opbroker.operations FOR EACH STATEMENT EXECUTE FUNCTION opbroker.operations_truncate_history();

--
-- Name: operations operations_truncated_when_terminal; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER operations_truncated_when_terminal BEFORE TRUNCATE ON opbroker.operations FOR EACH STATEMENT EXECUTE FUNCTION opbroker.operations_deleted_when_terminal();

--
-- Name: stale_outcomes stale_outcomes_append_only; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER stale_outcomes_append_only BEFORE UPDATE ON opbroker.stale_outcomes FOR EACH ROW EXECUTE FUNCTION opbroker.stale_outcomes_append_only();

--
-- Name: stale_outcomes stale_outcomes_go_with_operations; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER stale_outcomes_go_with_operations BEFORE DELETE OR TRUNCATE ON opbroker.stale_outcomes FOR EACH STATEMENT EXECUTE FUNCTION opbroker.history_goes_with_operations();

--
-- Name: stale_outcomes stale_outcomes_have_operations; Type: TRIGGER; Schema: opbroker; Owner: -
--

CREATE TRIGGER stale_outcomes_have_operations AFTER INSERT ON opbroker.stale_outcomes REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION opbroker.history_has_operations();

--
-- Name: operations operations_supersedes_fkey; Type: FK CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.operations
    ADD CONSTRAINT operations_supersedes_fkey FOREIGN KEY (tenant_id, supersedes_id) REFERENCES opbroker.operations(tenant_id, operation_id);

--
-- Name: payload_mismatches payload_mismatches_tenant_id_operation_id_fkey; Type: FK CONSTRAINT; Schema: opbroker; Owner: -
--

ALTER TABLE ONLY opbroker.payload_mismatches
    ADD CONSTRAINT payload_mismatches_tenant_id_operation_id_fkey FOREIGN KEY (tenant_id, operation_id) REFERENCES opbroker.operations(tenant_id, operation_id) ON DELETE CASCADE;

--
-- Name: inbound_evidence; Type: ROW SECURITY; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.inbound_evidence ENABLE ROW LEVEL SECURITY;

--
-- Name: operation_events; Type: ROW SECURITY; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.operation_events ENABLE ROW LEVEL SECURITY;

--
-- Name: operation_keys; Type: ROW SECURITY; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.operation_keys ENABLE ROW LEVEL SECURITY;

--
-- Name: operations; Type: ROW SECURITY; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.operations ENABLE ROW LEVEL SECURITY;

--
-- Name: payload_mismatches; Type: ROW SECURITY; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.payload_mismatches ENABLE ROW LEVEL SECURITY;

--
-- Name: stale_outcomes; Type: ROW SECURITY; Schema: opbroker; Owner: -
--

ALTER TABLE opbroker.stale_outcomes ENABLE ROW LEVEL SECURITY;

--
-- Name: inbound_evidence tenant_isolation; Type: POLICY; Schema: opbroker; Owner: -
--

CREATE POLICY tenant_isolation ON opbroker.inbound_evidence USING (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END) WITH CHECK (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END);

--
-- Name: operation_events tenant_isolation; Type: POLICY; Schema: opbroker; Owner: -
--

CREATE POLICY tenant_isolation ON opbroker.operation_events USING (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END) WITH CHECK (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END);

--
-- Name: operation_keys tenant_isolation; Type: POLICY; Schema: opbroker; Owner: -
--

CREATE POLICY tenant_isolation ON opbroker.operation_keys USING (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END) WITH CHECK (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END);

--
-- Name: operations tenant_isolation; Type: POLICY; Schema: opbroker; Owner: -
--

CREATE POLICY tenant_isolation ON opbroker.operations USING (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END) WITH CHECK (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END);

--
-- Name: payload_mismatches tenant_isolation; Type: POLICY; Schema: opbroker; Owner: -
--

CREATE POLICY tenant_isolation ON opbroker.payload_mismatches USING (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END) WITH CHECK (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END);

--
-- Name: stale_outcomes tenant_isolation; Type: POLICY; Schema: opbroker; Owner: -
--

CREATE POLICY tenant_isolation ON opbroker.stale_outcomes USING (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END) WITH CHECK (
CASE current_setting('opbroker.tenant'::text, true)
    WHEN '*'::text THEN true
    ELSE (tenant_id = ANY (string_to_array(current_setting('opbroker.tenant'::text, true), ','::text)))
END);

--
-- PostgreSQL database dump complete
--

