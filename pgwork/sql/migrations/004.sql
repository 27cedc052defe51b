-- pgwork schema 3 -> 4. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it adds: channel state every daemon's claim honours (pause, throttle, global
-- concurrency, rate limit, catch-up policy); the terminal status `expired`; when a reminder's
-- schedule was written (planned_at, for catch_up); when an attempt's next try is due.
--
-- Cost on a large database: the two CHECK constraints on renewal_work are validated in one scan
-- of the table, and the work_terminal index (terminal rows) is rebuilt, under the table's lock:
-- stop the daemons first (see README, Upgrades). The new columns need no table rewrite.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-drop-constraint, ban-drop-not-null, constraint-missing-not-valid, prefer-bigint-over-int, require-concurrent-index-creation, require-concurrent-index-deletion

ALTER TABLE pgwork.channel
    ADD COLUMN paused boolean NOT NULL DEFAULT false,
    ADD COLUMN paused_at timestamptz,
    ADD COLUMN paused_by text,
    ADD COLUMN paused_reason text,
    ADD COLUMN not_before timestamptz,
    ADD COLUMN throttle_limit integer CHECK (throttle_limit > 0),
    ADD COLUMN throttle_from integer,
    ADD COLUMN throttled_at timestamptz,
    ADD COLUMN throttle_reason text,
    ADD COLUMN global_concurrency integer CHECK (global_concurrency > 0),
    ADD COLUMN rate_limit double precision CHECK (rate_limit > 0),
    ADD COLUMN rate_burst double precision CHECK (rate_burst >= 1),
    ADD COLUMN catch_up text NOT NULL DEFAULT 'all' CHECK (catch_up IN ('all', 'latest', 'none')),
    ADD COLUMN breaker_after integer CHECK (breaker_after > 0),
    ADD COLUMN breaker_probe interval,
    ADD COLUMN failures integer NOT NULL DEFAULT 0,
    ADD COLUMN tokens double precision,
    ADD COLUMN tokens_at timestamptz;
COMMENT ON TABLE pgwork.channel IS
    'Delivery channels known to the daemons (registered from their config at start), and the '
    'state every daemon''s claim honours: paused, throttled (not_before, throttle_limit), '
    'global_concurrency and rate_limit. A reminder naming any other channel is refused.';
COMMENT ON COLUMN pgwork.channel.paused IS
    'No work of this channel is claimed while true; its rows wait (nothing dropped, no attempt counted).';
COMMENT ON COLUMN pgwork.channel.not_before IS
    'Throttled: no claim before this instant (a receiver answered 429/502/503/504; Retry-After if it gave one).';
COMMENT ON COLUMN pgwork.channel.throttle_limit IS
    'Throttled: rows claimed across all daemons at most; halved by a throttling answer, grown by each '
    'success, cleared once back at throttle_from.';
COMMENT ON COLUMN pgwork.channel.breaker_after IS
    'Circuit breaker: after this many failed attempts in a row (any daemon) the channel is held for '
    'breaker_probe, then one delivery at a time probes it: a success lifts it step by step, a '
    'failure holds it again. NULL: off.';
COMMENT ON COLUMN pgwork.channel.catch_up IS
    'Occurrences already past when their reminder was written or moved: all are sent; latest: only the '
    'most recent; none: none (the others are closed as expired).';

-- Existing reminders keep NULL (read as created_at); new and moved ones get the write's time.
ALTER TABLE pgwork.reminder ADD COLUMN planned_at timestamptz;
ALTER TABLE pgwork.reminder ALTER COLUMN planned_at SET DEFAULT now();
COMMENT ON COLUMN pgwork.reminder.planned_at IS
    'Maintained by pgwork: when the schedule was last written (insert, or a move of due_at or '
    'remind_before); the channel''s catch_up policy judges occurrences that fired before it. NULL '
    '(rows from before schema 4): created_at.';

ALTER TABLE pgwork.renewal_work
    DROP CONSTRAINT renewal_work_status_check,
    DROP CONSTRAINT work_finished_iff_terminal,
    ADD CONSTRAINT renewal_work_status_check
        CHECK (status IN ('ready', 'claimed', 'delivered', 'dead', 'cancelled', 'superseded', 'expired')),
    ADD CONSTRAINT work_finished_iff_terminal
        CHECK ((finished_at IS NOT NULL) = (status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired')));
COMMENT ON COLUMN pgwork.renewal_work.status IS
    'ready: waiting for available_at; claimed: a worker holds a lease until available_at; '
    'delivered, dead, cancelled, superseded, expired: terminal (expired: past the channel''s '
    'expire_after, or skipped by its catch_up policy; never sent; last_error says why).';

DROP INDEX pgwork.work_terminal;
CREATE INDEX work_terminal ON pgwork.renewal_work (finished_at, id)
    WHERE status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired');
CREATE INDEX work_held ON pgwork.renewal_work (channel, available_at) WHERE status = 'claimed';

ALTER TABLE pgwork.daemon ALTER COLUMN listener_up DROP NOT NULL;
COMMENT ON COLUMN pgwork.daemon.listener_up IS
    'Whether its LISTEN connection is up; NULL: it runs without one by configuration (behind a '
    'transaction pooler with no listen_dsn: the tick alone finds new work).';

ALTER TABLE pgwork.attempt ADD COLUMN retry_at timestamptz;
COMMENT ON COLUMN pgwork.attempt.retry_at IS 'For outcome retry: when the next try is due.';

ALTER TABLE pgwork.retired
    DROP CONSTRAINT retired_status_check,
    ADD CONSTRAINT retired_status_check CHECK (status IN ('delivered', 'dead', 'expired'));
COMMENT ON TABLE pgwork.retired IS
    'What retention leaves of a delivered, dead or expired occurrence of a reminder that still exists: its '
    'identity and outcome. The materialiser never inserts an occurrence listed here, so deleting old '
    'work can never cause a second send (not even after the deadline moves away and back). Removed '
    'with the reminder.';

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
        IF NEW.due_at IS DISTINCT FROM OLD.due_at OR NEW.remind_before IS DISTINCT FROM OLD.remind_before THEN
            NEW.planned_at := now();  -- what catch_up judges against
        END IF;
    END IF;
    RETURN NEW;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Many apps, one database: row-level security by source (off until an operator enables it)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE pgwork.app_source (
    role   name NOT NULL,
    source text NOT NULL,
    PRIMARY KEY (role, source)
);
COMMENT ON TABLE pgwork.app_source IS
    'Which database role may write and read reminders of which source, once row-level security '
    'is enabled on pgwork.reminder (ALTER TABLE pgwork.reminder ENABLE ROW LEVEL SECURITY).';

CREATE FUNCTION pgwork.source_allowed(source text, who name) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pgwork
RETURN EXISTS (SELECT 1 FROM pgwork.app_source a WHERE a.role = who AND a.source = source_allowed.source)
    OR EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = who AND (r.rolsuper OR r.rolbypassrls))
    OR pg_has_role(who, (SELECT c.relowner FROM pg_class c WHERE c.oid = 'pgwork.reminder'::regclass), 'MEMBER');
COMMENT ON FUNCTION pgwork.source_allowed(text, name) IS
    'Whether a role may see and write reminders of a source: listed in pgwork.app_source, or the '
    'tables'' owner (the daemon), a superuser or a BYPASSRLS role.';

CREATE POLICY reminder_by_source ON pgwork.reminder
    USING (pgwork.source_allowed(source, current_user))
    WITH CHECK (pgwork.source_allowed(source, current_user));

CREATE OR REPLACE VIEW pgwork.reminder_status AS
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

UPDATE pgwork.schema_version SET version = 4, applied_at = now();
