-- pgwork/sql/code/reminder_triggers.sql — What an app's INSERT, UPDATE and DELETE of a reminder do: check and normalise the row,
-- close the work of a schedule that no longer holds, and NOTIFY the daemons.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.jsonb_nesting_within(doc jsonb, max_depth integer) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    -- Walks containers only, and no deeper than max_depth + 1: cheap for any document.
    WITH RECURSIVE walk(v, depth) AS (
        SELECT doc, 1
        UNION ALL
        SELECT c.v, w.depth + 1
          FROM walk w
         CROSS JOIN LATERAL (
               SELECT value FROM jsonb_each(CASE WHEN jsonb_typeof(w.v) = 'object' THEN w.v END)
               UNION ALL
               SELECT value FROM jsonb_array_elements(CASE WHEN jsonb_typeof(w.v) = 'array' THEN w.v END)
         ) AS c(v)
         WHERE w.depth <= max_depth AND jsonb_typeof(c.v) IN ('object', 'array')
    )
    SELECT max(depth) <= max_depth FROM walk
$$;
COMMENT ON FUNCTION pgwork.jsonb_nesting_within(jsonb, integer) IS
    'Whether a JSON document nests containers at most max_depth levels deep.';

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

    -- A series is anchored at its first deadline as local time; its companions need it.
    IF NEW.recur IS NOT NULL AND NEW.due_local IS NULL THEN
        PERFORM pgwork.recur_error(format('%s has recur but no due_local and due_tz', what),
            'A series starts at its first deadline, as local time: set due_local and due_tz (''UTC'' for a series in UTC).',
            'due_local');
    END IF;
    IF NEW.recur IS NULL AND (NEW.recur_until IS NOT NULL OR NEW.recur_skip IS NOT NULL OR NEW.paused) THEN
        PERFORM pgwork.recur_error(format('%s sets %s but has no recur', what,
                                          CASE WHEN NEW.recur_until IS NOT NULL THEN 'recur_until'
                                               WHEN NEW.recur_skip IS NOT NULL THEN 'recur_skip' ELSE 'paused' END),
            'recur_until, recur_skip and paused belong to a recurring reminder (recur).', 'recur');
    END IF;
    IF array_position(NEW.recur_skip, NULL) IS NOT NULL THEN
        PERFORM pgwork.recur_error(format('%s lists NULL in recur_skip', what),
            'recur_skip lists the local deadlines not to send; leave NULL out (NULL or ''{}'' skips none).',
            'recur_skip');
    END IF;
    IF NEW.recur_until < NEW.due_local THEN
        PERFORM pgwork.recur_error(format('%s has recur_until %s before due_local %s', what, NEW.recur_until, NEW.due_local),
            'recur_until is the last local deadline the series may have.', 'recur_until');
    END IF;

    -- The payload, measured as the JSON text a receiver gets (the documented limit; the table
    -- constraint only bounds a row written around this trigger, in its binary form).
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
    -- tombstones. Ranges and counts are CHECK constraints (cheaper than checking here). A new
    -- channel re-plans too: the unsent rows on the old one are closed (below) and made again on
    -- the new one.
    IF TG_OP = 'INSERT' OR NEW.due_at IS DISTINCT FROM OLD.due_at OR NEW.remind_before IS DISTINCT FROM OLD.remind_before
       OR NEW.channel IS DISTINCT FROM OLD.channel
       OR (NEW.recur IS NOT NULL OR OLD.recur IS NOT NULL)
          AND (NEW.recur IS DISTINCT FROM OLD.recur OR NEW.due_local IS DISTINCT FROM OLD.due_local
               OR NEW.due_tz IS DISTINCT FROM OLD.due_tz OR NEW.recur_until IS DISTINCT FROM OLD.recur_until
               OR NEW.recur_skip IS DISTINCT FROM OLD.recur_skip OR NEW.paused IS DISTINCT FROM OLD.paused) THEN
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
            IF NEW.recur IS NULL THEN
                SELECT min(pgwork.fire_at(NEW.due_at, NEW.due_local, NEW.due_tz, x)) INTO NEW.next_fire_at
                  FROM unnest(NEW.remind_before) AS x;
            ELSIF TG_OP = 'UPDATE' AND OLD.recur IS NOT NULL AND NEW.recur = OLD.recur
                  AND NEW.due_at IS NOT DISTINCT FROM OLD.due_at AND NEW.remind_before = OLD.remind_before
                  AND NEW.due_local IS NOT DISTINCT FROM OLD.due_local AND NEW.due_tz IS NOT DISTINCT FROM OLD.due_tz
                  AND NEW.recur_until IS NOT DISTINCT FROM OLD.recur_until
                  AND NEW.recur_skip IS NOT DISTINCT FROM OLD.recur_skip AND NEW.paused = OLD.paused THEN
                -- Only the channel: the schedule is the same series, not restarted. Its unsent
                -- sends on the old channel are closed and its progress rewound to the earliest of
                -- them (reminder_after_reschedule), so the page makes them again on the new one.
                NULL;
            ELSE
                -- A series (re)starts now: its deadlines before now are history, never sent. Its
                -- progress starts at the earliest send a deadline from now can have; the
                -- materialiser's page evaluates the rule from there (nothing is evaluated here).
                NEW.recur_rule := pgwork.recur_compile(NEW.recur, NEW.due_local, NEW.due_tz);
                NEW.recur_version := CASE WHEN TG_OP = 'INSERT' THEN 1 ELSE OLD.recur_version + 1 END;
                NEW.series_from := now();
                NEW.next_fire_at := CASE WHEN NEW.paused THEN 'infinity'
                                         ELSE now() - (SELECT max(x) FROM unnest(NEW.remind_before) AS x) - interval '1 day' END;
            END IF;
        END IF;
        IF NEW.recur IS NULL THEN
            NEW.recur_rule := NULL;
            NEW.series_from := NULL;
        END IF;
        IF TG_OP = 'UPDATE' THEN
            NEW.planned_at := now();  -- what catch_up judges against
        END IF;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        NEW.updated_at := now();
    END IF;
    RETURN NEW;
END
$$;

-- The common insert (an instant deadline, one send at it, a small payload) needs no trigger call
-- at all: its next_fire_at stays NULL, which means due_at. Everything else goes through the
-- function; a payload of 128 bytes or less can be neither too large nor too deep.
CREATE OR REPLACE TRIGGER reminder_before_insert
    BEFORE INSERT ON pgwork.reminder FOR EACH ROW
    WHEN (NEW.due_at IS NULL OR NEW.due_local IS NOT NULL OR NEW.due_tz IS NOT NULL
          -- Compared as text: as intervals, '{1 mon -30 days}' equals '{0}'. (Another
          -- IntervalStyle spells 0 differently and only takes the slower, equally right path.)
          OR NEW.remind_before::text <> '{00:00:00}' OR NEW.next_fire_at IS NOT NULL
          OR octet_length(NEW.payload::text) > 128
          OR NEW.recur IS NOT NULL OR NEW.recur_until IS NOT NULL OR NEW.recur_skip IS NOT NULL OR NEW.paused)
    EXECUTE FUNCTION pgwork.reminder_before_write();
CREATE OR REPLACE TRIGGER reminder_before_update
    BEFORE UPDATE OF source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                     recur, recur_until, recur_skip, paused
    ON pgwork.reminder FOR EACH ROW EXECUTE FUNCTION pgwork.reminder_before_write();

-- Unclaimed work for a schedule that no longer holds is closed at once (pgwork.close_unsent):
-- its ready row (which the claim takes with SKIP LOCKED: an app's open transaction holding it
-- delays no claim) goes, then its record is closed. Work already claimed (a lease row, no ready
-- row) is left alone and re-checked by the claim itself, which re-reads the reminder in the same
-- statement.
CREATE OR REPLACE FUNCTION pgwork.close_unsent(work_ids bigint[], status text)
RETURNS SETOF timestamptz
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- Of the work rows named, those still waiting in work_ready (read by primary key: an id
    -- array) leave it and are closed with this status; returns their due times.
    RETURN QUERY
    WITH unready AS (
        DELETE FROM pgwork.work_ready q
         WHERE q.work_id = ANY (close_unsent.work_ids)
        RETURNING q.work_id
    )
    UPDATE pgwork.renewal_work w
       SET status = close_unsent.status, finished_at = now()
      FROM unready u
     WHERE w.id = u.work_id
    RETURNING w.due_at;
END
$$;
COMMENT ON FUNCTION pgwork.close_unsent(bigint[], text) IS
    'Close the work rows named that no worker holds (their work_ready rows go), returning their due times (the reminder triggers'' only).';
REVOKE EXECUTE ON FUNCTION pgwork.close_unsent(bigint[], text) FROM PUBLIC;

-- Both triggers read the reminder's own rows through work_occurrence_unique, whatever the
-- statistics say: the status is tested with IS NOT DISTINCT FROM (status is NOT NULL, so the same
-- test as =), which the planner cannot match to a partial index's predicate. With '=', statistics
-- taken while little work was live made it add a scan of all of the (then) claim index (a
-- BitmapAnd), and every app's move or delete of a reminder read every live work row of every channel.
CREATE OR REPLACE FUNCTION pgwork.reminder_after_reschedule() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork SET jit = off AS $$
DECLARE
    rewind timestamptz;
BEGIN
    -- An app's edit only ever closes or removes work rows: it never makes a row ready (or
    -- changes a ready one), so it takes no lane lock (pgwork.wake_lanes), which the daemon's
    -- pages, claims and outcome flushes of every source would otherwise wait on until the app's
    -- transaction ends.
    IF NEW.recur_rule IS NULL THEN
        PERFORM pgwork.close_unsent(
            ARRAY(SELECT w.id FROM pgwork.renewal_work w
                   WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
                     AND (w.deadline <> NEW.due_at OR NOT w.occurrence = ANY (NEW.remind_before)
                          OR w.deadline_local IS NOT NULL OR w.channel <> NEW.channel)),
            'superseded');
    ELSE
        -- A new zone moves the instants of the series' local deadlines. Its occurrences made and
        -- never tried (ready, or closed unsent) that move are removed: the next page makes each
        -- again at its new instant, with the same key (its local deadline), if the series still
        -- has it then (a deadline the move put before now is history) and no other row holds
        -- that instant (one send per instant). Kept, they would hold their old instant against
        -- another local deadline that the new zone puts there.
        IF NEW.due_tz IS DISTINCT FROM OLD.due_tz THEN
            -- (A live one only when it is not held: its ready row goes with it.)
            WITH unready AS (
                DELETE FROM pgwork.work_ready q
                 WHERE q.work_id = ANY ((SELECT array_agg(w.id) FROM pgwork.renewal_work w
                                          WHERE w.reminder_id = NEW.id
                                            AND w.status IS NOT DISTINCT FROM 'ready' AND w.attempts = 0
                                            AND w.deadline IS DISTINCT FROM
                                                pgwork.local_to_instant(w.deadline_local, NEW.due_tz))::bigint[])
                RETURNING q.work_id
            )
            DELETE FROM pgwork.renewal_work w
             WHERE w.reminder_id = NEW.id
               AND (coalesce(w.status, '') IN ('superseded', 'expired')
                    OR w.id = ANY ((SELECT coalesce(array_agg(u.work_id), '{}') FROM unready u)::bigint[]))
               AND w.attempts = 0
               AND w.deadline IS DISTINCT FROM pgwork.local_to_instant(w.deadline_local, NEW.due_tz);
        END IF;
        -- Unsent occurrences the series no longer has, those it moves that were tried (waiting
        -- for a retry: they keep their instant, as that send), and those of another channel are
        -- superseded.
        SELECT min(c.due_at) INTO rewind
          FROM pgwork.close_unsent(
                   ARRAY(SELECT w.id FROM pgwork.renewal_work w
                          WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
                            AND (w.deadline IS DISTINCT FROM pgwork.local_to_instant(w.deadline_local, NEW.due_tz)
                                 OR w.channel <> NEW.channel
                                 OR pgwork.series_unwanted(NEW.id, NEW.recur_rule, NEW.due_local, NEW.paused,
                                                           NEW.recur_skip, NEW.recur_until, NEW.remind_before,
                                                           NEW.recur_version, w.deadline_local, w.occurrence,
                                                           NULL) IS NOT NULL)),
                   'superseded') AS c(due_at);
        -- Only the channel changed (the series was not restarted: the same version): what was
        -- closed is wanted still, on the new channel; the page makes it again from there (a send
        -- waiting for a retry goes on; one never tried is judged by the new channel's catch_up).
        IF NEW.recur_version = OLD.recur_version AND NEW.channel IS DISTINCT FROM OLD.channel
           AND rewind < coalesce(NEW.next_fire_at, 'infinity') THEN
            UPDATE pgwork.reminder r SET next_fire_at = rewind WHERE r.id = NEW.id;
        END IF;
    END IF;
    -- A new channel: the sends still live on another one are in flight now (the unsent ones were
    -- closed above). Where each goes when its lease ends without an outcome (its daemon died) is
    -- written beside it, in pgwork.work_moved: the new channel's claim finds it there and takes
    -- it over, whether or not a daemon still serves the old one. The lease a daemon holds is not
    -- touched (its outcome, and its heartbeat, never wait for this transaction); a send moved
    -- back to its channel is no longer moved.
    IF NEW.channel IS DISTINCT FROM OLD.channel THEN
        WITH live AS MATERIALIZED (
            SELECT w.id, w.channel FROM pgwork.renewal_work w
             WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
        ), back AS (
            DELETE FROM pgwork.work_moved m USING live v
             WHERE m.work_id = v.id AND v.channel = NEW.channel
        )
        INSERT INTO pgwork.work_moved AS m (work_id, channel)
        SELECT v.id, NEW.channel FROM live v WHERE v.channel <> NEW.channel
            ON CONFLICT (work_id) DO UPDATE SET channel = excluded.channel, moved_at = now();
    END IF;
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER reminder_after_reschedule
    AFTER UPDATE OF due_at, remind_before, due_local, due_tz, recur, recur_until, recur_skip, paused, channel
    ON pgwork.reminder FOR EACH ROW
    WHEN (OLD.due_at IS DISTINCT FROM NEW.due_at OR OLD.remind_before IS DISTINCT FROM NEW.remind_before
          OR OLD.channel IS DISTINCT FROM NEW.channel
          OR OLD.recur_version IS DISTINCT FROM NEW.recur_version
          OR (OLD.recur_rule IS NULL) <> (NEW.recur_rule IS NULL))
    EXECUTE FUNCTION pgwork.reminder_after_reschedule();

CREATE OR REPLACE FUNCTION pgwork.reminder_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
BEGIN
    PERFORM pgwork.close_unsent(
        ARRAY(SELECT w.id FROM pgwork.renewal_work w
               WHERE w.reminder_id = OLD.id AND w.status IS NOT DISTINCT FROM 'ready'),
        'cancelled');
    DELETE FROM pgwork.retired WHERE reminder_id = OLD.id;
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER reminder_after_delete
    AFTER DELETE ON pgwork.reminder FOR EACH ROW EXECUTE FUNCTION pgwork.reminder_after_delete();

-- NOTIFY is a hint: only for a written reminder that fires within the next hour (the longest
-- look-ahead a daemon may use), so a bulk insert of far-future deadlines costs no notification.
-- Postgres folds identical notifications of one transaction into one. An INSERT asks once per
-- statement, over the rows it wrote (a transition table): a call per row cost a bulk insert of
-- due reminders a sixth of its rate (bench/insert_cost.py). An UPDATE of the schedule asks per
-- row (a trigger naming columns cannot read a transition table; the WHEN clause is evaluated
-- without calling any function), so the materialiser's own updates (next_fire_at only) do not
-- fire it.
CREATE OR REPLACE FUNCTION pgwork.reminder_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- (A row's trigger was filtered by its WHEN clause; `written` exists for the statement's.)
    IF TG_LEVEL = 'STATEMENT' THEN
        IF NOT EXISTS (SELECT FROM written w WHERE coalesce(w.next_fire_at, w.due_at) <= now() + interval '1 hour') THEN
            RETURN NULL;
        END IF;
    END IF;
    PERFORM pg_notify('pgwork_reminder', '');
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER reminder_notify
    AFTER UPDATE OF due_at, due_local, due_tz, remind_before, recur, recur_until, recur_skip, paused, channel
    ON pgwork.reminder
    FOR EACH ROW WHEN (coalesce(NEW.next_fire_at, NEW.due_at) <= now() + interval '1 hour')
    EXECUTE FUNCTION pgwork.reminder_notify();
CREATE OR REPLACE TRIGGER reminder_notify_insert
    AFTER INSERT ON pgwork.reminder REFERENCING NEW TABLE AS written
    FOR EACH STATEMENT EXECUTE FUNCTION pgwork.reminder_notify();
