-- pgwork schema 1 -> 2. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--   * pgwork.retired: what retention leaves of a delivered or dead occurrence of a live reminder,
--     so that deleting old work can never cause a second send;
--   * reminder_status shows retired occurrences with their outcome;
--   * a reminder's delete removes its tombstones;
--   * daemons record their heartbeat interval (status shows the gone ones; they are cleaned up);
--   * an index for dead letters (gauges and listings cost O(dead rows));
--   * app writes are checked for what used to get through or fail obscurely: payload size as
--     JSON text, nesting depth, remind_before entries with a negative part, zone names (exactly
--     the server's IANA names), local times out of range; every refusal names the column.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-drop-view, require-concurrent-index-creation

CREATE TABLE pgwork.retired (
    reminder_id  bigint NOT NULL,
    deadline     timestamptz NOT NULL,
    occurrence   interval NOT NULL,
    status       text NOT NULL CHECK (status IN ('delivered', 'dead')),
    operation_id uuid NOT NULL,
    finished_at  timestamptz NOT NULL,
    retired_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (reminder_id, deadline, occurrence)
);
COMMENT ON TABLE pgwork.retired IS
    'What retention leaves of a delivered or dead occurrence of a reminder that still exists: its '
    'identity and outcome. The materialiser never inserts an occurrence listed here, so deleting old '
    'work can never cause a second send (not even after the deadline moves away and back). Removed '
    'with the reminder.';

-- Occurrences delivered or dead-lettered before this upgrade whose rows retention already deleted
-- cannot be recovered here; from now on none is lost.

ALTER TABLE pgwork.daemon ADD COLUMN heartbeat_every interval NOT NULL DEFAULT '20 seconds';
COMMENT ON TABLE pgwork.daemon IS
    'Running (or recently running) daemons, refreshed by their heartbeat. A row whose heartbeat is '
    'older than three heartbeat_every is shown as gone; after ten it is deleted by the others.';

CREATE INDEX work_dead ON pgwork.renewal_work (channel, finished_at, id) WHERE status = 'dead';

CREATE OR REPLACE FUNCTION pgwork.reminder_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
BEGIN
    UPDATE pgwork.renewal_work
       SET status = 'cancelled', finished_at = now()
     WHERE reminder_id = OLD.id AND status = 'ready';
    DELETE FROM pgwork.retired WHERE reminder_id = OLD.id;
    RETURN NULL;
END
$$;

DROP VIEW pgwork.reminder_status;
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
    ON t.reminder_id = r.id AND t.deadline = r.due_at AND t.occurrence = b.before;
COMMENT ON VIEW pgwork.reminder_status IS
    'Each occurrence of each current reminder and where it stands: scheduled (not yet materialised), '
    'ready, claimed, delivered, dead. retired: its work row was removed by retention (status is the '
    'outcome it had; attempts are no longer known); it is never sent again.';
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT SELECT ON pgwork.reminder_status TO pgwork_app;
    END IF;
END
$$;

CREATE TABLE pgwork.time_zone (
    name text PRIMARY KEY
);
COMMENT ON TABLE pgwork.time_zone IS
    'The IANA zone names a local-time reminder may use: the server''s pg_timezone_names without '
    'the posix/ and right/ trees, copied by `pgwork migrate` (a lookup here is cheap; the view is not).';
INSERT INTO pgwork.time_zone
SELECT name FROM pg_timezone_names
 WHERE name !~ '^(posix|right)/' AND name NOT IN ('localtime', 'posixrules')
    ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION pgwork.reminder_before_write() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    what text;
    bad  interval;
    size integer;
BEGIN
    what := format('reminder (%s, %s)', NEW.source, NEW.business_key);
    IF TG_OP = 'UPDATE' AND (NEW.source IS DISTINCT FROM OLD.source OR NEW.business_key IS DISTINCT FROM OLD.business_key) THEN
        RAISE EXCEPTION 'pgwork: source and business_key identify a reminder and cannot change'
            USING ERRCODE = 'check_violation', COLUMN = 'business_key',
                  HINT = 'Delete the reminder and insert a new one.';
    END IF;

    -- The deadline: an instant, or a wall-clock time plus an IANA zone.
    IF (NEW.due_local IS NULL) <> (NEW.due_tz IS NULL) THEN
        RAISE EXCEPTION 'pgwork: % gives only one of due_local and due_tz', what
            USING ERRCODE = 'check_violation', COLUMN = 'due_tz',
                  HINT = 'A local deadline needs both the wall-clock time and the IANA zone.';
    END IF;
    IF NEW.due_local IS NOT NULL THEN
        IF TG_OP = 'INSERT' AND NEW.due_at IS NOT NULL THEN
            RAISE EXCEPTION 'pgwork: % gives both due_at and due_local/due_tz', what
                USING ERRCODE = 'check_violation', COLUMN = 'due_at',
                      HINT = 'Give the deadline either as an instant or as local time plus zone.';
        END IF;
        IF TG_OP = 'UPDATE' AND NEW.due_at IS DISTINCT FROM OLD.due_at
           AND NEW.due_local IS NOT DISTINCT FROM OLD.due_local AND NEW.due_tz IS NOT DISTINCT FROM OLD.due_tz THEN
            RAISE EXCEPTION 'pgwork: % has a local-time deadline; due_at is computed from it', what
                USING ERRCODE = 'check_violation', COLUMN = 'due_at',
                      HINT = 'Update due_local (and due_tz), or set due_local and due_tz to NULL together with due_at.';
        END IF;
        IF NOT EXISTS (SELECT 1 FROM pgwork.time_zone z WHERE z.name = NEW.due_tz) THEN
            RAISE EXCEPTION 'pgwork: % has unknown time zone "%"', what, NEW.due_tz
                USING ERRCODE = 'invalid_parameter_value', COLUMN = 'due_tz',
                      HINT = 'Use an IANA zone name as the server knows it (pgwork.time_zone), e.g. Europe/London or UTC.';
        END IF;
        IF NOT (NEW.due_local > '1970-01-02' AND NEW.due_local < '9998-12-31') THEN
            RAISE EXCEPTION 'pgwork: % has due_local % outside 1970-01-02 .. 9998-12-31', what, NEW.due_local
                USING ERRCODE = 'check_violation', COLUMN = 'due_local';
        END IF;
        NEW.due_at := pgwork.local_to_instant(NEW.due_local, NEW.due_tz);
    ELSIF NEW.due_at IS NULL THEN
        RAISE EXCEPTION 'pgwork: % has no deadline', what
            USING ERRCODE = 'not_null_violation', COLUMN = 'due_at', HINT = 'Set due_at, or due_local and due_tz.';
    END IF;

    -- The payload, measured as the JSON text a receiver gets (the CHECK sees the compressed size).
    size := octet_length(NEW.payload::text);
    IF size > 65536 THEN
        RAISE EXCEPTION 'pgwork: % has a payload of % bytes; at most 65536 (64 KiB) as JSON text', what, size
            USING ERRCODE = 'check_violation', COLUMN = 'payload';
    END IF;
    IF size > 128 AND NOT pgwork.jsonb_nesting_within(NEW.payload, 64) THEN
        RAISE EXCEPTION 'pgwork: % has a payload nested deeper than 64 levels', what
            USING ERRCODE = 'check_violation', COLUMN = 'payload';
    END IF;

    -- (Re)plan: every occurrence of the current schedule is due for materialisation again; ones
    -- already made for this deadline are kept by ON CONFLICT, ones retention retired by their
    -- tombstones. Ranges and counts are CHECK constraints (cheaper than checking here).
    IF TG_OP = 'INSERT' OR NEW.due_at IS DISTINCT FROM OLD.due_at OR NEW.remind_before IS DISTINCT FROM OLD.remind_before THEN
        -- Exactly {0}: '1 mon -30 days' compares equal to 0 as an interval, so '=' is not enough.
        IF NEW.due_local IS NULL AND cardinality(NEW.remind_before) = 1
           AND array_ndims(NEW.remind_before) = 1 AND NEW.remind_before[1] = '0'
           AND extract(year FROM NEW.remind_before[1]) = 0
           AND extract(month FROM NEW.remind_before[1]) = 0
           AND extract(day FROM NEW.remind_before[1]) = 0 THEN
            NEW.next_fire_at := NULL;  -- the common case: one send, at the deadline (due_at)
        ELSE
            IF array_ndims(NEW.remind_before) > 1 THEN
                RAISE EXCEPTION 'pgwork: % has a remind_before that is not a list of intervals', what
                    USING ERRCODE = 'check_violation', COLUMN = 'remind_before',
                          HINT = 'Write e.g. ''{30 days, 7 days, 0}''.';
            END IF;
            SELECT x INTO bad FROM unnest(NEW.remind_before) AS x
             WHERE extract(year FROM x) < 0 OR extract(month FROM x) < 0 OR extract(day FROM x) < 0
                OR extract(hour FROM x) < 0 OR extract(minute FROM x) < 0 OR extract(second FROM x) < 0
             LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'pgwork: % has remind_before entry "%" with a negative part; it could fire after the deadline', what, bad
                    USING ERRCODE = 'check_violation', COLUMN = 'remind_before',
                          HINT = 'Every part of every entry must be zero or positive, e.g. ''1 mon'' or ''30 days''.';
            END IF;
            IF cardinality(NEW.remind_before) > 1 AND (SELECT count(DISTINCT x) FROM unnest(NEW.remind_before) AS x) <> cardinality(NEW.remind_before) THEN
                RAISE EXCEPTION 'pgwork: % lists the same remind_before entry twice', what
                    USING ERRCODE = 'check_violation', COLUMN = 'remind_before';
            END IF;
            SELECT min(pgwork.fire_at(NEW.due_at, NEW.due_local, NEW.due_tz, x)) INTO NEW.next_fire_at
              FROM unnest(NEW.remind_before) AS x;
        END IF;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        NEW.updated_at := now();
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER reminder_before_insert ON pgwork.reminder;
DROP TRIGGER reminder_before_update ON pgwork.reminder;
-- The common insert (an instant deadline, one send at it, a small payload) needs no trigger call
-- at all: its next_fire_at stays NULL, which means due_at. Everything else goes through the
-- function; a payload of 128 bytes or less can be neither too large nor too deep.
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

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT UPDATE (source, business_key) ON pgwork.reminder TO pgwork_app;
        GRANT SELECT ON pgwork.time_zone TO pgwork_app;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 2, applied_at = now();
