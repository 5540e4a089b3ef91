-- Migration 020 added the check that only a send's outcome says whether its request
-- left, without reading the events already written. Validating it reads them all while
-- writes go on (a validation holds off only schema changes), in a transaction of its own.
ALTER TABLE operation_events VALIDATE CONSTRAINT operation_events_sent_on_outcomes;
