-- A tenant's events as one feed (WatchOperations). Each event records the transaction
-- that wrote it and a sequence number; the feed is read in (xact_id, seq) order, and only
-- below the oldest transaction still running (pg_snapshot_xmin), where no event can
-- appear any more. A reader of "sequence greater than the last seen" alone would skip an
-- event whose transaction took its number early and committed late.
ALTER TABLE operation_events
  ADD COLUMN xact_id xid8   NOT NULL DEFAULT pg_current_xact_id(),
  ADD COLUMN seq     bigint NOT NULL GENERATED ALWAYS AS IDENTITY;

CREATE INDEX operation_events_feed_idx ON operation_events (tenant_id, xact_id, seq);
