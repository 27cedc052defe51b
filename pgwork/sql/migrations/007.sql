-- pgwork schema 6 -> 7. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes, so that materialising a reminder costs less (no behaviour changes):
--
-- * The value rules of single reminder columns move from table CHECK constraints to domains
--   (same names, same rules). A domain's check runs where a value is written; a table's CHECK
--   constraints all ran again on every UPDATE of a row, so the materialiser's progress update
--   (next_fire_at) evaluated every rule of the row, its regular expressions included, for each
--   reminder it materialised (source, business_key, the payload's shape, traceparent,
--   tracestate). Rules over several columns, due_at's range, recipient's length, remind_before's
--   and the payload's stored size stay table constraints.
-- * pgwork.operation_id is declared STABLE (its body is: extract() from a timestamptz), so the
--   planner inlines it instead of calling it through the SQL-function executor for each row.
--   Its values do not change.
--
-- The column types change without rewriting the table (each domain is created empty, the
-- columns take it, then its rules are added, which reads the table once to check the rows it
-- holds: they met the same rules already). The reminder table is locked against writes and reads
-- meanwhile. The view, policy and triggers that name these columns are dropped and made again;
-- a view of your own over pgwork.reminder's columns makes this migration fail (PostgreSQL
-- names it): drop it, migrate, and create it again. A daemon of version 6 keeps working on this
-- schema until it is restarted.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-alter-domain-with-add-constraint, ban-drop-constraint, ban-drop-view, changing-column-type

CREATE DOMAIN pgwork.reminder_source AS text;
CREATE DOMAIN pgwork.reminder_business_key AS text;
CREATE DOMAIN pgwork.reminder_payload AS jsonb;
CREATE DOMAIN pgwork.reminder_traceparent AS text;
CREATE DOMAIN pgwork.reminder_tracestate AS text;

-- What names the columns whose type changes.
DROP VIEW pgwork.reminder_status;
DROP POLICY reminder_by_source ON pgwork.reminder;
DROP TRIGGER reminder_before_insert ON pgwork.reminder;
DROP TRIGGER reminder_before_update ON pgwork.reminder;

ALTER TABLE pgwork.reminder
    DROP CONSTRAINT reminder_source_valid,
    DROP CONSTRAINT reminder_business_key_valid,
    DROP CONSTRAINT reminder_payload_is_object,
    DROP CONSTRAINT reminder_traceparent_w3c,
    DROP CONSTRAINT reminder_tracestate_valid,
    ALTER COLUMN source TYPE pgwork.reminder_source,
    ALTER COLUMN business_key TYPE pgwork.reminder_business_key,
    ALTER COLUMN payload TYPE pgwork.reminder_payload,
    ALTER COLUMN traceparent TYPE pgwork.reminder_traceparent,
    ALTER COLUMN tracestate TYPE pgwork.reminder_tracestate;

ALTER DOMAIN pgwork.reminder_source ADD CONSTRAINT reminder_source_valid CHECK (length(VALUE) BETWEEN 1 AND 100 AND VALUE !~ '^\s|\s$');
ALTER DOMAIN pgwork.reminder_business_key ADD CONSTRAINT reminder_business_key_valid CHECK (length(VALUE) BETWEEN 1 AND 500 AND VALUE !~ '^\s|\s$');
ALTER DOMAIN pgwork.reminder_payload ADD CONSTRAINT reminder_payload_is_object CHECK (jsonb_typeof(VALUE) = 'object');
ALTER DOMAIN pgwork.reminder_traceparent ADD CONSTRAINT reminder_traceparent_w3c
        CHECK (VALUE ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
               AND VALUE !~ '^ff-' AND VALUE !~ '^..-0{32}-' AND VALUE !~ '-0{16}-..$');
ALTER DOMAIN pgwork.reminder_tracestate ADD CONSTRAINT reminder_tracestate_valid CHECK (length(VALUE) <= 512 AND VALUE !~ '[[:cntrl:]]');

-- Made again as schema.sql makes them.
CREATE TRIGGER reminder_before_insert
    BEFORE INSERT ON pgwork.reminder FOR EACH ROW
    WHEN (NEW.due_at IS NULL OR NEW.due_local IS NOT NULL OR NEW.due_tz IS NOT NULL
          -- Compared as text: as intervals, '{1 mon -30 days}' equals '{0}'. (Another
          -- IntervalStyle spells 0 differently and only takes the slower, equally right path.)
          OR NEW.remind_before::text <> '{00:00:00}' OR NEW.next_fire_at IS NOT NULL
          OR octet_length(NEW.payload::text) > 128)
    EXECUTE FUNCTION pgwork.reminder_before_write();
CREATE TRIGGER reminder_before_update
    BEFORE UPDATE OF source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload
    ON pgwork.reminder FOR EACH ROW EXECUTE FUNCTION pgwork.reminder_before_write();

CREATE POLICY reminder_by_source ON pgwork.reminder
    USING (pgwork.source_allowed(source, current_user))
    WITH CHECK (pgwork.source_allowed(source, current_user));

CREATE VIEW pgwork.reminder_status AS
SELECT r.source, r.business_key, r.due_at AS deadline, b.before AS remind_before,
       pgwork.fire_at(r.due_at, r.due_local, r.due_tz, b.before) AS send_at,
       coalesce(w.status, t.status, 'scheduled') AS status,
       coalesce(w.attempts, 0) AS attempts,
       coalesce(w.finished_at, t.finished_at) AS finished_at,
       coalesce(w.operation_id, t.operation_id) AS operation_id,
       (w.id IS NULL AND t.reminder_id IS NOT NULL) AS retired
  FROM pgwork.reminder r
 CROSS JOIN LATERAL unnest(r.remind_before) AS b(before)
  LEFT JOIN pgwork.renewal_work w
    ON w.reminder_id = r.id AND w.deadline = r.due_at AND w.occurrence = b.before
  LEFT JOIN pgwork.retired t
    ON t.reminder_id = r.id AND t.deadline = r.due_at AND t.occurrence = b.before
 -- The view reads as its owner: with row-level security on, it shows an app only its sources.
 WHERE (SELECT NOT c.relrowsecurity FROM pg_class c WHERE c.oid = 'pgwork.reminder'::regclass)
    OR pgwork.source_allowed(r.source, current_user);
COMMENT ON VIEW pgwork.reminder_status IS
    'Each occurrence of each current reminder and where it stands: scheduled (not yet materialised), '
    'ready, claimed, delivered, dead. retired: its work row was removed by retention (status is the '
    'outcome it had; attempts are no longer known); it is never sent again.';

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT SELECT ON pgwork.reminder_status TO pgwork_app;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        GRANT SELECT ON pgwork.reminder_status TO pgwork_daemon;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 7, applied_at = now();
