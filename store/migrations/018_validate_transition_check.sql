-- Migration 017 added the events' transition CHECK without reading the events already
-- written. Validating it reads them all while writes go on (a validation holds off only
-- schema changes), in a transaction of its own.
ALTER TABLE operation_events VALIDATE CONSTRAINT operation_events_transition;
