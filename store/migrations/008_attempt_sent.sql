-- Whether an attempt's request can have reached the target. The reconciler asks it
-- before a same-key replay to a target whose key saves only successes: an attempt that
-- may have executed is not covered by such a key, so it may be replayed only after a
-- lookup proved its absence.
--
-- false: the request provably never left (the connection could not be made, or the
-- broker withheld the send). true: it was sent. NULL: unknown, so it may have been sent:
-- an attempt never finished (a crash, an expired lease) and every attempt finished
-- before this column existed.
ALTER TABLE operation_attempts
  ADD COLUMN sent boolean,
  ADD CONSTRAINT operation_attempts_sent_when_finished CHECK (finished_at IS NOT NULL OR sent IS NULL);
