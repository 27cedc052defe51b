-- pgwork/sql/code/occurrence.sql — Instants and identities of occurrences: the DST policy (local_to_instant), when a send fires,
-- and the operation id every attempt of one occurrence carries.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.local_to_instant(local_time timestamp, tz text) RETURNS timestamptz
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE AS $$
-- The DST policy, in one place:
--   * a wall time that happens once maps to that instant;
--   * an ambiguous wall time (clocks go back, it happens twice) maps to the EARLIER instant;
--   * a nonexistent wall time (clocks go forward, it never happens) is shifted forward by the
--     length of the gap: 02:30 on a 02:00->03:00 night becomes 03:30.
DECLARE
    guess      timestamptz;
    off_before interval;
    off_after  interval;
    a          timestamptz;
    b          timestamptz;
BEGIN
    guess := local_time AT TIME ZONE tz;
    -- UTC offsets in force a day before and a day after (local minus UTC).
    off_before := ((guess - interval '24 hours') AT TIME ZONE tz) - ((guess - interval '24 hours') AT TIME ZONE 'UTC');
    off_after  := ((guess + interval '24 hours') AT TIME ZONE tz) - ((guess + interval '24 hours') AT TIME ZONE 'UTC');
    a := (local_time - off_before) AT TIME ZONE 'UTC';
    b := (local_time - off_after) AT TIME ZONE 'UTC';
    IF (a AT TIME ZONE tz) = local_time AND (b AT TIME ZONE tz) = local_time THEN
        RETURN least(a, b);
    ELSIF (a AT TIME ZONE tz) = local_time THEN
        RETURN a;
    ELSIF (b AT TIME ZONE tz) = local_time THEN
        RETURN b;
    END IF;
    RETURN a;  -- in the gap: read with the offset in force before it, i.e. shifted forward
END
$$;
COMMENT ON FUNCTION pgwork.local_to_instant(timestamp, text) IS
    'Wall-clock time in an IANA zone to an instant. DST policy: ambiguous -> earlier instant; '
    'nonexistent -> shifted forward by the gap.';

-- How far a local time and the instant it becomes can stray from a plain shift near an instant:
-- the changes of the zone's UTC offset within a day either side of it (a DST change: an hour;
-- none most of the year). Windows of local deadlines reach this much past the instants they
-- stand for (pgwork.materialise_series); local_to_instant looks a day either side too.
CREATE OR REPLACE FUNCTION pgwork.offset_shift(tz text, at timestamptz) RETURNS interval
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT greatest(d.later, -d.later) + greatest(d.earlier, -d.earlier)
      FROM (SELECT (((at + interval '24 hours') AT TIME ZONE tz) - ((at + interval '24 hours') AT TIME ZONE 'UTC'))
                   - ((at AT TIME ZONE tz) - (at AT TIME ZONE 'UTC')) AS later,
                   ((at AT TIME ZONE tz) - (at AT TIME ZONE 'UTC'))
                   - (((at - interval '24 hours') AT TIME ZONE tz) - ((at - interval '24 hours') AT TIME ZONE 'UTC')) AS earlier) AS d
$$;
COMMENT ON FUNCTION pgwork.offset_shift(text, timestamptz) IS
    'The changes of a zone''s UTC offset within a day either side of an instant (0 most of the year).';

CREATE OR REPLACE FUNCTION pgwork.fire_at(due_at timestamptz, due_local timestamp, due_tz text, before interval)
RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- Offsets count in the reminder's own calendar: in its zone for local-time reminders
    -- ("7 days before 09:00 London" is 09:00 London), in UTC otherwise. A send before the
    -- deadline never fires after it: a local time in a DST gap is shifted forward by the gap,
    -- which can carry it past the deadline (02:29 before a 02:30 deadline, on a night whose
    -- clocks jump from 02:00 to 02:30); it then fires at the deadline.
    SELECT CASE WHEN due_local IS NULL
                THEN ((due_at AT TIME ZONE 'UTC') - before) AT TIME ZONE 'UTC'
                ELSE least(pgwork.local_to_instant(due_local - before, due_tz), due_at) END
$$;
COMMENT ON FUNCTION pgwork.fire_at(timestamptz, timestamp, text, interval) IS
    'When the occurrence "before" ahead of a deadline fires.';

-- STABLE, as extract() from a timestamptz is: so the planner inlines it into the page (an
-- IMMUTABLE function whose body is STABLE is called through the SQL-function executor, once per
-- row: a third of a bare INSERT ... SELECT's time). The value depends on its arguments only.
CREATE OR REPLACE FUNCTION pgwork.operation_id(reminder_id bigint, source text, business_key text,
                                    deadline timestamptz, occurrence interval)
RETURNS uuid LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT md5(reminder_id::text || E'\x1f' || source || E'\x1f' || business_key || E'\x1f'
               || extract(epoch FROM deadline)::text || E'\x1f' || extract(epoch FROM occurrence)::text)::uuid
$$;
COMMENT ON FUNCTION pgwork.operation_id(bigint, text, text, timestamptz, interval) IS
    'The stable idempotency key of one occurrence; a function of its identity only.';

-- An occurrence of a series is identified by its local deadline (its position in the series), so
-- its key survives a zone edit and a time zone data update; the tag keeps it apart from one-offs.
CREATE OR REPLACE FUNCTION pgwork.series_operation_id(reminder_id bigint, source text, business_key text,
                                           deadline_local timestamp, occurrence interval)
RETURNS uuid LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT md5('series' || E'\x1f' || reminder_id::text || E'\x1f' || source || E'\x1f' || business_key
               || E'\x1f' || to_char(deadline_local, 'YYYY-MM-DD"T"HH24:MI:SS.US')
               || E'\x1f' || extract(epoch FROM occurrence)::text)::uuid
$$;
COMMENT ON FUNCTION pgwork.series_operation_id(bigint, text, text, timestamp, interval) IS
    'The stable idempotency key of one occurrence of a recurring reminder (by its local deadline).';
