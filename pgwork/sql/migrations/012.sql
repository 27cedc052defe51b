-- pgwork schema 11 -> 12. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it adds (issue 27): recurring deadlines.
--   * pgwork.reminder.recur (an RFC 5545 RRULE subset anchored at due_local in due_tz, the first
--     deadline), with recur_until, recur_skip and paused, all plain SQL for apps; recur_rule,
--     recur_version and series_from are maintained by pgwork.
--   * The recurrence evaluator, in the database where local times become instants:
--     pgwork.recur_rule / recur_compile (a rule checked against its first deadline, refused with
--     the column named), recur_between / recur_upcoming (the occurrences in a window of local
--     time, by matching whole periods, never by iterating from the start), recur_preview.
--   * renewal_work.deadline_local (and retired.deadline_local): an occurrence of a series is
--     identified by its local deadline (work_series_occurrence_unique, series_operation_id), so
--     a zone edit or a time zone data update never makes a second one.
--   * The materialiser's page makes a series' occurrences as they come due (nothing beyond its
--     look-ahead), through pgwork.materialise_series, called only for a page that has a series; claims and redrives ask pgwork.series_unwanted whether one is still wanted;
--     pgwork.reminder_status shows a series' next deadline; the claim and the page return the
--     occurrence's local deadline and zone.
-- A daemon of version 11 must be stopped before this runs (its claim and page statements read
-- columns that change): upgrade by stopping the daemons, `pgwork migrate`, starting the new version.

ALTER TABLE pgwork.reminder
    ADD COLUMN recur         text,
    ADD COLUMN recur_until   timestamp,
    ADD COLUMN recur_skip    timestamp[]
        CONSTRAINT reminder_recur_skip_at_most_366 CHECK (cardinality(recur_skip) <= 366),
    ADD COLUMN paused        boolean NOT NULL DEFAULT false,
    ADD COLUMN recur_rule    jsonb,
    ADD COLUMN recur_version integer NOT NULL DEFAULT 0,
    ADD COLUMN series_from   timestamptz;
COMMENT ON COLUMN pgwork.reminder.recur IS
    'A recurring deadline: an RFC 5545 RRULE (e.g. FREQ=MONTHLY;BYMONTHDAY=1) anchored at due_local in '
    'due_tz, the first deadline. Each occurrence x remind_before entry is sent once, with its own key.';
COMMENT ON COLUMN pgwork.reminder.recur_until IS 'The last local deadline a series may have (inclusive); NULL: none.';
COMMENT ON COLUMN pgwork.reminder.recur_skip IS 'Local deadlines of the series not to send (at most 366).';
COMMENT ON COLUMN pgwork.reminder.paused IS
    'A paused series makes nothing; resumed, it starts from the moment it resumes (what fell in the pause is skipped).';
COMMENT ON COLUMN pgwork.reminder.recur_rule IS 'Maintained by pgwork: recur compiled against the first deadline (pgwork.recur_compile).';
COMMENT ON COLUMN pgwork.reminder.recur_version IS 'Maintained by pgwork: counts the edits of the series'' rule, zone, end, skips and pauses.';
COMMENT ON COLUMN pgwork.reminder.series_from IS
    'Maintained by pgwork: when the series was written, last edited or resumed; its deadlines before this are '
    'history and never sent.';

ALTER TABLE pgwork.renewal_work
    ADD COLUMN deadline_local timestamp,
    ADD COLUMN recur_version integer;
COMMENT ON COLUMN pgwork.renewal_work.deadline_local IS
    'For an occurrence of a recurring reminder: its deadline as local wall-clock time, its identity in the '
    'series (a zone edit or a time zone data update moves deadline, never this). NULL for a one-off.';
COMMENT ON COLUMN pgwork.renewal_work.recur_version IS 'The reminder''s recur_version when this occurrence was made.';
-- A recurring reminder's occurrences are identified by their local deadline.
CREATE UNIQUE INDEX work_series_occurrence_unique ON pgwork.renewal_work (reminder_id, deadline_local, occurrence)
    WHERE deadline_local IS NOT NULL;

ALTER TABLE pgwork.retired ADD COLUMN deadline_local timestamp;

-- An occurrence of a series is identified by its local deadline (its position in the series), so
-- its key survives a zone edit and a time zone data update; the tag keeps it apart from one-offs.
CREATE FUNCTION pgwork.series_operation_id(reminder_id bigint, source text, business_key text,
                                           deadline_local timestamp, occurrence interval)
RETURNS uuid LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT md5('series' || E'\x1f' || reminder_id::text || E'\x1f' || source || E'\x1f' || business_key
               || E'\x1f' || to_char(deadline_local, 'YYYY-MM-DD"T"HH24:MI:SS.US')
               || E'\x1f' || extract(epoch FROM occurrence)::text)::uuid
$$;
COMMENT ON FUNCTION pgwork.series_operation_id(bigint, text, text, timestamp, interval) IS
    'The stable idempotency key of one occurrence of a recurring reminder (by its local deadline).';

-- ---------------------------------------------------------------------------------------------
-- Recurrence (issue 27): an RFC 5545 RRULE subset. A rule is compiled once against its first
-- deadline (pgwork.recur_compile: checked, RFC defaults filled in from the first deadline, COUNT
-- turned into its last occurrence) and evaluated by matching the candidate days of the whole
-- periods that overlap a bounded window of local wall-clock time (pgwork.recur_between): the
-- cost is the window's, never the series' history. Local times become instants only through
-- pgwork.local_to_instant (the DST policy of one-off deadlines). What evaluates rules in an app's
-- session runs with jit off: generate_series' default row estimates make the planner compile
-- these small queries (0.8 s a call on PostgreSQL 15 built with LLVM; pgwork's own sessions
-- have jit off already).
-- ---------------------------------------------------------------------------------------------

CREATE FUNCTION pgwork.recur_error(message text, hint text DEFAULT NULL, col text DEFAULT 'recur')
RETURNS void LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RAISE EXCEPTION 'pgwork: %', message
        USING ERRCODE = 'check_violation', COLUMN = col, HINT = coalesce(hint, '');
END
$$;
COMMENT ON FUNCTION pgwork.recur_error(text, text, text) IS
    'Refuses a recurrence rule with a message naming the column (recur unless said otherwise).';

CREATE FUNCTION pgwork.recur_ints(part text, value text, lo integer, hi integer, signed boolean)
RETURNS integer[] LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
-- A comma-separated list of whole numbers in lo..hi (also -hi..-lo when signed), sorted, once each.
DECLARE
    item text;
    n    integer;
    got  integer[] := '{}';
BEGIN
    FOREACH item IN ARRAY string_to_array(value, ',') LOOP
        item := btrim(item);
        IF item !~ '^[+-]?[0-9]{1,4}$' THEN
            PERFORM pgwork.recur_error(format('recur %s has "%s", not a whole number', part, item));
        END IF;
        n := item::integer;
        IF NOT (n BETWEEN lo AND hi OR (signed AND n BETWEEN -hi AND -lo)) THEN
            PERFORM pgwork.recur_error(format('recur %s %s is out of range (%s)', part, item,
                CASE WHEN signed THEN format('%s..%s or -%s..-%s', lo, hi, hi, lo)
                     ELSE format('%s..%s', lo, hi) END));
        END IF;
        got := got || n;
    END LOOP;
    RETURN ARRAY(SELECT DISTINCT x FROM unnest(got) AS x ORDER BY x);
END
$$;
COMMENT ON FUNCTION pgwork.recur_ints(text, text, integer, integer, boolean) IS
    'A recurrence part''s list of whole numbers, checked against its range.';

CREATE FUNCTION pgwork.recur_period(freq text, wkst integer, t timestamp) RETURNS timestamp
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- The start of the period (day, week from wkst, month, year) that holds t.
RETURN CASE freq WHEN 'DAILY' THEN date_trunc('day', t)
                 WHEN 'WEEKLY' THEN date_trunc('day', t) - ((extract(isodow FROM t)::integer - wkst + 7) % 7) * interval '1 day'
                 WHEN 'MONTHLY' THEN date_trunc('month', t)
                 ELSE date_trunc('year', t) END;
COMMENT ON FUNCTION pgwork.recur_period(text, integer, timestamp) IS
    'The start of the recurrence period (day, week starting on wkst, month or year) that holds t.';

CREATE FUNCTION pgwork.recur_index(freq text, first timestamp, p timestamp) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- How many periods period p starts after period first (both period starts): INTERVAL keeps
-- the periods whose index it divides, counted by arithmetic, never by iteration.
RETURN CASE freq WHEN 'DAILY' THEN p::date - first::date
                 WHEN 'WEEKLY' THEN (p::date - first::date) / 7
                 WHEN 'MONTHLY' THEN (extract(year FROM p) - extract(year FROM first))::integer * 12
                                     + (extract(month FROM p) - extract(month FROM first))::integer
                 ELSE (extract(year FROM p) - extract(year FROM first))::integer END;
COMMENT ON FUNCTION pgwork.recur_index(text, timestamp, timestamp) IS
    'How many recurrence periods period p starts after period first.';

CREATE FUNCTION pgwork.recur_between(rule jsonb, dtstart timestamp, lo timestamp, hi timestamp)
RETURNS SETOF timestamp LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- The occurrences of a compiled rule (pgwork.recur_compile) anchored at dtstart, as local
    -- wall-clock times in [lo, hi], in order. Every period (of FREQ, INTERVAL apart from
    -- dtstart's) that overlaps the window is taken whole, so BYSETPOS ranks all of a period's
    -- candidates; its days are matched against the BY parts and crossed with the times of day.
    WITH r AS MATERIALIZED (
        SELECT rule->>'freq' AS freq, (rule->>'interval')::integer AS ival,
               (rule->>'wkst')::integer AS wkst, (rule->>'second')::float8 AS sec,
               ARRAY(SELECT jsonb_array_elements_text(rule->'bymonth')::integer) AS bymonth,
               ARRAY(SELECT jsonb_array_elements_text(rule->'bymonthday')::integer) AS bymonthday,
               ARRAY(SELECT jsonb_array_elements_text(rule->'bydayn')::integer) AS bydayn,
               ARRAY(SELECT jsonb_array_elements_text(rule->'bydaywd')::integer) AS bydaywd,
               ARRAY(SELECT jsonb_array_elements_text(rule->'bysetpos')::integer) AS bysetpos,
               ARRAY(SELECT jsonb_array_elements_text(rule->'byhour')::integer) AS byhour,
               ARRAY(SELECT jsonb_array_elements_text(rule->'byminute')::integer) AS byminute,
               greatest(lo, dtstart) AS lo,
               least(hi, coalesce((rule->>'until')::timestamp, 'infinity')) AS hi,
               CASE rule->>'freq' WHEN 'DAILY' THEN interval '1 day' WHEN 'WEEKLY' THEN interval '7 days'
                                  WHEN 'MONTHLY' THEN interval '1 month' ELSE interval '1 year' END AS unit
    ), w AS MATERIALIZED (
        SELECT r.*, pgwork.recur_period(r.freq, r.wkst, dtstart) AS first,
               pgwork.recur_index(r.freq, pgwork.recur_period(r.freq, r.wkst, dtstart),
                                  pgwork.recur_period(r.freq, r.wkst, r.lo)) AS k_lo,
               pgwork.recur_index(r.freq, pgwork.recur_period(r.freq, r.wkst, dtstart),
                                  pgwork.recur_period(r.freq, r.wkst, r.hi)) AS k_hi
          FROM r
         WHERE r.lo <= r.hi
    ), periods AS (
        -- The periods INTERVAL keeps, from the first at or after the window's.
        SELECT w.first + k * w.unit AS p
          FROM w, generate_series(((greatest(w.k_lo, 0) + w.ival - 1) / w.ival) * w.ival, w.k_hi, w.ival) AS k
    ), spans AS (
        -- A YEARLY rule with BYMONTH looks only at those months.
        SELECT p.p, s.s, s.e
          FROM periods p, w
         CROSS JOIN LATERAL (
               SELECT p.p AS s, p.p + w.unit AS e
                WHERE w.freq <> 'YEARLY' OR cardinality(w.bymonth) = 0
               UNION ALL
               SELECT p.p + (mo - 1) * interval '1 month', p.p + mo * interval '1 month'
                 FROM unnest(w.bymonth) AS mo
                WHERE w.freq = 'YEARLY') AS s
    ), days AS (
        SELECT s.p, d.d,
               extract(day FROM d.d)::integer AS dom,
               extract(day FROM date_trunc('month', d.d) + interval '1 month - 1 day')::integer AS mlen,
               extract(doy FROM d.d)::integer AS doy,
               extract(doy FROM date_trunc('year', d.d) + interval '1 year - 1 day')::integer AS ylen,
               extract(isodow FROM d.d)::integer AS dow
          FROM spans s, generate_series(s.s, s.e - interval '1 day', interval '1 day') AS d(d)
    ), matched AS (
        SELECT d.p, d.d + make_interval(hours => h, mins => mi, secs => w.sec) AS t
          FROM days d, w, unnest(w.byhour) AS h, unnest(w.byminute) AS mi
         WHERE (cardinality(w.bymonth) = 0 OR extract(month FROM d.d)::integer = ANY (w.bymonth))
           AND (cardinality(w.bymonthday) = 0 OR d.dom = ANY (w.bymonthday)
                OR d.dom - d.mlen - 1 = ANY (w.bymonthday))
           -- BYDAY: a weekday (n = 0), or its n-th (from the end when negative) in the month
           -- (MONTHLY, or YEARLY with BYMONTH) or the year (YEARLY).
           AND (cardinality(w.bydaywd) = 0
                OR EXISTS (SELECT FROM unnest(w.bydayn, w.bydaywd) AS b(n, wd)
                            WHERE b.wd = d.dow
                              AND (b.n = 0
                                   OR (CASE WHEN w.freq = 'MONTHLY' OR cardinality(w.bymonth) > 0
                                            THEN b.n IN ((d.dom - 1) / 7 + 1, -((d.mlen - d.dom) / 7 + 1))
                                            ELSE b.n IN ((d.doy - 1) / 7 + 1, -((d.ylen - d.doy) / 7 + 1)) END))))
    ), ranked AS (
        SELECT m.t, row_number() OVER (PARTITION BY m.p ORDER BY m.t) AS pos,
               count(*) OVER (PARTITION BY m.p) AS n
          FROM matched m
    )
    SELECT k.t
      FROM ranked k, w
     WHERE k.t BETWEEN w.lo AND w.hi
       AND (cardinality(w.bysetpos) = 0 OR k.pos = ANY (w.bysetpos) OR k.pos - k.n - 1 = ANY (w.bysetpos))
     ORDER BY k.t
$$;
COMMENT ON FUNCTION pgwork.recur_between(jsonb, timestamp, timestamp, timestamp) IS
    'The occurrences (local wall-clock times) of a compiled recurrence rule in [lo, hi], in order.';

CREATE FUNCTION pgwork.recur_upcoming(rule jsonb, dtstart timestamp, from_local timestamp, n integer)
RETURNS SETOF timestamp LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- The first n occurrences at or after from_local, searched window by window (a window holds a
-- few periods; a rule that matches rarely, e.g. 29 February, costs a few windows).
DECLARE
    lo   timestamp := greatest(from_local, dtstart);
    span interval;
    t    timestamp;
    got  integer := 0;
    stop timestamp := least(coalesce((rule->>'until')::timestamp, 'infinity'), '9999-12-31');
BEGIN
    span := (rule->>'interval')::integer
            * CASE rule->>'freq' WHEN 'DAILY' THEN interval '32 days' WHEN 'WEEKLY' THEN interval '35 days'
                                 WHEN 'MONTHLY' THEN interval '3 months' ELSE interval '4 years' END;
    WHILE got < n AND lo <= stop LOOP
        FOR t IN SELECT x FROM pgwork.recur_between(rule, dtstart, lo, lo + span) AS x LOOP
            RETURN NEXT t;
            got := got + 1;
            EXIT WHEN got >= n;
        END LOOP;
        lo := lo + span + interval '1 microsecond';
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgwork.recur_upcoming(jsonb, timestamp, timestamp, integer) IS
    'The first n occurrences of a compiled recurrence rule at or after a local time.';

CREATE FUNCTION pgwork.recur_rule(recur text, dtstart timestamp, tz text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
-- The rule as pgwork evaluates it, anchored at its first deadline dtstart (local, in tz):
--   {freq, interval, wkst, second, bymonth, bymonthday, bydayn, bydaywd, bysetpos, byhour,
--    byminute, count, until}
-- with RFC 5545's defaults taken from dtstart (the time of day; the weekday of a WEEKLY rule;
-- the day of a MONTHLY one; the day and month of a YEARLY one). A rule that cannot be right is
-- refused here, naming the column. (pgwork.recur_compile also checks dtstart against it.)
DECLARE
    names constant text[] := '{MO,TU,WE,TH,FR,SA,SU}';
    parts constant text := 'pgwork takes FREQ, INTERVAL, BYMONTH, BYMONTHDAY, BYDAY, BYSETPOS, BYHOUR, BYMINUTE, WKST, COUNT and UNTIL.';
    body  text;
    part  text;
    key   text;
    val   text;
    seen  text[] := '{}';
    freq  text;
    ival  integer := 1;
    cnt   integer;
    until timestamp;
    bymonth integer[] := '{}';
    bymonthday integer[] := '{}';
    bydayn integer[] := '{}';
    bydaywd integer[] := '{}';
    byday_text text;
    bysetpos integer[] := '{}';
    byhour integer[];
    byminute integer[];
    wkst integer := 1;
    item text;
    m text[];
    rule jsonb;
BEGIN
    IF dtstart IS NULL OR tz IS NULL THEN
        PERFORM pgwork.recur_error('recur needs due_local and due_tz (the first deadline and its zone)',
                                   'Use due_tz = ''UTC'' for a series in UTC.', 'due_local');
    END IF;
    body := regexp_replace(btrim(recur), '^RRULE:', '', 'i');
    IF body = '' THEN
        PERFORM pgwork.recur_error('recur is empty', 'Write e.g. ''FREQ=MONTHLY;BYMONTHDAY=1'', or leave recur NULL.');
    END IF;
    FOREACH part IN ARRAY string_to_array(body, ';') LOOP
        CONTINUE WHEN btrim(part) = '';
        IF position('=' IN part) = 0 THEN
            PERFORM pgwork.recur_error(format('recur part "%s" is not NAME=VALUE', part));
        END IF;
        key := upper(btrim(split_part(part, '=', 1)));
        val := upper(btrim(substr(part, position('=' IN part) + 1)));
        IF key = ANY (seen) THEN
            PERFORM pgwork.recur_error(format('recur gives %s twice', key));
        END IF;
        seen := seen || key;
        IF val = '' THEN
            PERFORM pgwork.recur_error(format('recur %s has no value', key));
        END IF;
        CASE key
        WHEN 'FREQ' THEN
            IF val IN ('SECONDLY', 'MINUTELY', 'HOURLY') THEN
                PERFORM pgwork.recur_error(format('recur has FREQ=%s; pgwork recurs DAILY, WEEKLY, MONTHLY or YEARLY', val),
                    'A reminder is a deadline, not a job: give several times a day with BYHOUR and BYMINUTE.');
            ELSIF val NOT IN ('DAILY', 'WEEKLY', 'MONTHLY', 'YEARLY') THEN
                PERFORM pgwork.recur_error(format('recur FREQ=%s is not DAILY, WEEKLY, MONTHLY or YEARLY', val));
            END IF;
            freq := val;
        WHEN 'INTERVAL', 'COUNT' THEN
            IF val LIKE '%,%' THEN
                PERFORM pgwork.recur_error(format('recur %s takes one number', key));
            END IF;
            IF key = 'INTERVAL' THEN
                ival := (pgwork.recur_ints('INTERVAL', val, 1, 1000, false))[1];
            ELSE
                cnt := (pgwork.recur_ints('COUNT', val, 1, 1000, false))[1];
            END IF;
        WHEN 'UNTIL' THEN
            m := regexp_match(val, '^([0-9]{8})(T([0-9]{6})(Z?))?$');
            IF m IS NULL THEN
                PERFORM pgwork.recur_error(format('recur UNTIL=%s is neither a date (YYYYMMDD) nor a time (YYYYMMDDTHHMMSS, local; with Z, UTC)', val));
            END IF;
            BEGIN
                until := to_timestamp(m[1] || coalesce(m[3], '235959'), 'YYYYMMDDHH24MISS')::timestamp;
            EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow THEN
                until := NULL;
            END;
            IF until IS NULL OR to_char(until, 'YYYYMMDDHH24MISS') <> m[1] || coalesce(m[3], '235959') THEN
                PERFORM pgwork.recur_error(format('recur UNTIL=%s is not a valid date', val));
            END IF;
            IF m[4] = 'Z' THEN
                until := (until AT TIME ZONE 'UTC') AT TIME ZONE tz;
            END IF;
        WHEN 'BYMONTH' THEN
            bymonth := pgwork.recur_ints('BYMONTH', val, 1, 12, false);
        WHEN 'BYMONTHDAY' THEN
            bymonthday := pgwork.recur_ints('BYMONTHDAY', val, 1, 31, true);
        WHEN 'BYSETPOS' THEN
            bysetpos := pgwork.recur_ints('BYSETPOS', val, 1, 366, true);
        WHEN 'BYHOUR' THEN
            byhour := pgwork.recur_ints('BYHOUR', val, 0, 23, false);
        WHEN 'BYMINUTE' THEN
            byminute := pgwork.recur_ints('BYMINUTE', val, 0, 59, false);
        WHEN 'WKST' THEN
            wkst := array_position(names, val);
            IF wkst IS NULL THEN
                PERFORM pgwork.recur_error(format('recur WKST=%s is not a weekday (MO, TU, WE, TH, FR, SA, SU)', val));
            END IF;
        WHEN 'BYDAY' THEN
            byday_text := val;
            FOREACH item IN ARRAY string_to_array(val, ',') LOOP
                m := regexp_match(btrim(item), '^([+-]?[0-9]{1,2})?(MO|TU|WE|TH|FR|SA|SU)$');
                IF m IS NULL OR m[1]::integer = 0 THEN
                    PERFORM pgwork.recur_error(format('recur BYDAY has "%s", not a weekday with an optional ordinal (MO, -1FR, 2TU)', item));
                END IF;
                IF NOT EXISTS (SELECT FROM unnest(bydayn, bydaywd) AS x(a, b)
                                WHERE x.a = coalesce(m[1]::integer, 0) AND x.b = array_position(names, m[2])) THEN
                    bydayn := bydayn || coalesce(m[1]::integer, 0);
                    bydaywd := bydaywd || array_position(names, m[2]);
                END IF;
            END LOOP;
        WHEN 'BYWEEKNO', 'BYYEARDAY', 'BYSECOND', 'BYEASTER', 'RSCALE', 'SKIP' THEN
            PERFORM pgwork.recur_error(format('recur part %s is not supported', key), parts);
        ELSE
            PERFORM pgwork.recur_error(format('recur has unknown part %s', key), parts);
        END CASE;
    END LOOP;

    IF freq IS NULL THEN
        PERFORM pgwork.recur_error('recur has no FREQ', 'Start the rule with FREQ=DAILY, WEEKLY, MONTHLY or YEARLY.');
    END IF;
    IF cnt IS NOT NULL AND until IS NOT NULL THEN
        PERFORM pgwork.recur_error('recur gives both COUNT and UNTIL', 'End a series by one of them.');
    END IF;
    IF EXISTS (SELECT FROM unnest(bydayn) AS n WHERE n <> 0) THEN
        IF freq IN ('DAILY', 'WEEKLY') THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s has an ordinal, which needs FREQ=MONTHLY or YEARLY', byday_text),
                'An ordinal counts in a month or a year; with FREQ=WEEKLY write the weekday alone.');
        END IF;
        IF EXISTS (SELECT FROM unnest(bydayn) AS n WHERE n = 0) THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s mixes weekdays with and without an ordinal', byday_text),
                'Use one kind per rule (or two reminders).');
        END IF;
        IF (freq = 'MONTHLY' OR cardinality(bymonth) > 0)
           AND EXISTS (SELECT FROM unnest(bydayn) AS n WHERE abs(n) > 5) THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s has an ordinal past 5 in a month', byday_text));
        END IF;
    END IF;
    IF freq = 'WEEKLY' AND cardinality(bymonthday) > 0 THEN
        PERFORM pgwork.recur_error('recur BYMONTHDAY cannot go with FREQ=WEEKLY (RFC 5545)',
            'Use FREQ=MONTHLY with BYMONTHDAY, or FREQ=WEEKLY with BYDAY.');
    END IF;
    IF cardinality(bysetpos) > 0 AND cardinality(bymonth) = 0 AND cardinality(bymonthday) = 0
       AND cardinality(bydaywd) = 0 AND byhour IS NULL AND byminute IS NULL THEN
        PERFORM pgwork.recur_error('recur BYSETPOS needs BYDAY, BYMONTHDAY or BYMONTH',
            'BYSETPOS picks among the candidates the other BY parts give a period.');
    END IF;
    IF until IS NOT NULL AND until < dtstart THEN
        PERFORM pgwork.recur_error(format('recur UNTIL %s is before due_local %s', until, dtstart));
    END IF;

    -- RFC 5545's defaults, from the first deadline.
    IF cardinality(bymonthday) = 0 AND cardinality(bydaywd) = 0 THEN
        IF freq = 'YEARLY' THEN
            IF cardinality(bymonth) = 0 THEN
                bymonth := ARRAY[extract(month FROM dtstart)::integer];
            END IF;
            bymonthday := ARRAY[extract(day FROM dtstart)::integer];
        ELSIF freq = 'MONTHLY' THEN
            bymonthday := ARRAY[extract(day FROM dtstart)::integer];
        ELSIF freq = 'WEEKLY' THEN
            bydayn := '{0}';
            bydaywd := ARRAY[extract(isodow FROM dtstart)::integer];
        END IF;
    END IF;
    rule := jsonb_build_object(
        'freq', freq, 'interval', ival, 'wkst', wkst,
        'second', extract(second FROM dtstart),
        'bymonth', to_jsonb(bymonth), 'bymonthday', to_jsonb(bymonthday),
        'bydayn', to_jsonb(bydayn), 'bydaywd', to_jsonb(bydaywd), 'bysetpos', to_jsonb(bysetpos),
        'byhour', to_jsonb(coalesce(byhour, ARRAY[extract(hour FROM dtstart)::integer])),
        'byminute', to_jsonb(coalesce(byminute, ARRAY[extract(minute FROM dtstart)::integer])),
        'count', cnt, 'until', until);
    RETURN rule;
END
$$;
COMMENT ON FUNCTION pgwork.recur_rule(text, timestamp, text) IS
    'A recurrence rule (RFC 5545 RRULE subset) parsed and checked, with its defaults from the first deadline.';

CREATE FUNCTION pgwork.recur_compile(recur text, dtstart timestamp, tz text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- pgwork.recur_rule, and then: the first deadline must be one of the rule's occurrences, and
-- COUNT becomes until, the rule's last occurrence (so no evaluation ever counts from the start).
DECLARE
    rule     jsonb := pgwork.recur_rule(recur, dtstart, tz);
    cnt      integer := (rule->>'count')::integer;
    until    timestamp;
    next_one timestamp;
BEGIN
    -- The first deadline must be an occurrence (RFC 5545 leaves any other start undefined; this
    -- also gives every series at least one).
    IF NOT EXISTS (SELECT FROM pgwork.recur_between(rule, dtstart, dtstart, dtstart)) THEN
        SELECT x INTO next_one FROM pgwork.recur_upcoming(rule, dtstart, dtstart, 1) AS x;
        PERFORM pgwork.recur_error(
            format('due_local %s is not an occurrence of recur %s', dtstart, recur),
            CASE WHEN next_one IS NULL THEN 'The rule has no occurrence at or after due_local.'
                 ELSE format('Set due_local to the first deadline: the rule''s first occurrence from due_local is %s.', next_one) END,
            'due_local');
    END IF;
    IF cnt IS NOT NULL THEN
        SELECT max(x) INTO until FROM pgwork.recur_upcoming(rule, dtstart, dtstart, cnt) AS x;
        rule := rule || jsonb_build_object('until', until);
    END IF;
    RETURN rule;
END
$$;
COMMENT ON FUNCTION pgwork.recur_compile(text, timestamp, text) IS
    'A recurrence rule (RFC 5545 RRULE subset) checked and compiled against its first deadline; '
    'refuses a wrong rule naming the column.';

CREATE FUNCTION pgwork.recur_preview(recur text, due_local timestamp, due_tz text, n integer DEFAULT 10)
RETURNS TABLE (deadline_local timestamp, deadline timestamptz)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- The first n deadlines of a series from its first one: what an app shows before it saves.
-- Each local deadline becomes an instant by pgwork.local_to_instant (ambiguous: the earlier
-- instant; in a DST gap: shifted forward by the gap); a shifted deadline that lands on the
-- instant of another of the series is the same send, shown once.
DECLARE
    rule jsonb;
BEGIN
    IF n IS NULL OR n NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'pgwork: recur_preview takes n between 1 and 1000, not %', n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF due_tz IS NOT NULL AND NOT EXISTS (SELECT FROM pgwork.time_zone z WHERE z.name = due_tz) THEN
        RAISE EXCEPTION 'pgwork: unknown time zone "%"', due_tz
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'due_tz',
                  HINT = 'Use an IANA zone name as the server knows it (pgwork.time_zone), e.g. Europe/London or UTC.';
    END IF;
    rule := pgwork.recur_compile(recur, due_local, due_tz);
    RETURN QUERY
    SELECT s.l, s.i
      FROM (SELECT DISTINCT ON (i) u.l, pgwork.local_to_instant(u.l, due_tz) AS i
              FROM pgwork.recur_upcoming(rule, due_local, due_local, n + 64) AS u(l)
             ORDER BY pgwork.local_to_instant(u.l, due_tz),
                      (pgwork.local_to_instant(u.l, due_tz) AT TIME ZONE due_tz) <> u.l, u.l) AS s
     ORDER BY s.i
     LIMIT n;
END
$$;
COMMENT ON FUNCTION pgwork.recur_preview(text, timestamp, text, integer) IS
    'The first n deadlines (local, and as instants) of a recurring series from its first deadline.';

CREATE FUNCTION pgwork.series_unwanted(reminder_id bigint, recur_rule jsonb, due_local timestamp,
                                       paused boolean, recur_skip timestamp[], recur_until timestamp,
                                       remind_before interval[], recur_version integer,
                                       deadline_local timestamp, occurrence interval, made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why an occurrence of a series is no longer wanted (NULL while it is): the reminder is gone
-- (cancelled); or it is no longer a series, is paused, dropped the remind_before entry, skips or
-- ends before the deadline, or its rule no longer has it (superseded). The rule is evaluated only
-- when it changed since the occurrence was made (made_version: the reminder's recur_version then).
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN recur_rule IS NULL OR paused OR deadline_local IS NULL OR NOT occurrence = ANY (remind_before)
                 OR deadline_local = ANY (coalesce(recur_skip, '{}')) OR deadline_local > recur_until
                THEN 'superseded'
            WHEN made_version IS DISTINCT FROM recur_version
                 AND NOT EXISTS (SELECT FROM pgwork.recur_between(recur_rule, due_local, deadline_local, deadline_local))
                THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.series_unwanted(bigint, jsonb, timestamp, boolean, timestamp[], timestamp, interval[], integer, timestamp, interval, integer) IS
    'Why an occurrence of a recurring reminder is no longer wanted (cancelled, superseded), or NULL while it is.';

CREATE FUNCTION pgwork.work_unwanted(reminder_id bigint, reminder_due_at timestamptz, remind_before interval[],
                                     recur_rule jsonb, due_local timestamp, paused boolean,
                                     recur_skip timestamp[], recur_until timestamp, recur_version integer,
                                     deadline timestamptz, deadline_local timestamp, occurrence interval,
                                     made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why a work row's occurrence is no longer wanted by its reminder, one-off (pgwork.unwanted) or of
-- a series (pgwork.series_unwanted), or NULL while it is: what a claim and a redrive ask.
RETURN CASE WHEN deadline_local IS NULL
            THEN pgwork.unwanted(reminder_id, reminder_due_at, remind_before, deadline, occurrence)
            ELSE pgwork.series_unwanted(reminder_id, recur_rule, due_local, paused, recur_skip, recur_until,
                                        remind_before, recur_version, deadline_local, occurrence, made_version)
       END;
COMMENT ON FUNCTION pgwork.work_unwanted(bigint, timestamptz, interval[], jsonb, timestamp, boolean, timestamp[], timestamp, integer, timestamptz, timestamp, interval, integer) IS
    'Why a work row''s occurrence is no longer wanted (cancelled, superseded), or NULL while it is.';

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
    IF NEW.recur_until < NEW.due_local THEN
        PERFORM pgwork.recur_error(format('%s has recur_until %s before due_local %s', what, NEW.recur_until, NEW.due_local),
            'recur_until is the last local deadline the series may have.', 'recur_until');
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
    IF TG_OP = 'INSERT' OR NEW.due_at IS DISTINCT FROM OLD.due_at OR NEW.remind_before IS DISTINCT FROM OLD.remind_before
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

DROP TRIGGER reminder_before_insert ON pgwork.reminder;
DROP TRIGGER reminder_before_update ON pgwork.reminder;
CREATE TRIGGER reminder_before_insert
    BEFORE INSERT ON pgwork.reminder FOR EACH ROW
    WHEN (NEW.due_at IS NULL OR NEW.due_local IS NOT NULL OR NEW.due_tz IS NOT NULL
          -- Compared as text: as intervals, '{1 mon -30 days}' equals '{0}'. (Another
          -- IntervalStyle spells 0 differently and only takes the slower, equally right path.)
          OR NEW.remind_before::text <> '{00:00:00}' OR NEW.next_fire_at IS NOT NULL
          OR octet_length(NEW.payload::text) > 128
          OR NEW.recur IS NOT NULL OR NEW.recur_until IS NOT NULL OR NEW.recur_skip IS NOT NULL OR NEW.paused)
    EXECUTE FUNCTION pgwork.reminder_before_write();
CREATE TRIGGER reminder_before_update
    BEFORE UPDATE OF source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                     recur, recur_until, recur_skip, paused
    ON pgwork.reminder FOR EACH ROW EXECUTE FUNCTION pgwork.reminder_before_write();

CREATE OR REPLACE FUNCTION pgwork.reminder_after_reschedule() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork SET jit = off AS $$
BEGIN
    IF NEW.recur_rule IS NULL THEN
        UPDATE pgwork.renewal_work
           SET status = 'superseded', finished_at = now()
         WHERE reminder_id = NEW.id AND status IS NOT DISTINCT FROM 'ready'
           AND (deadline <> NEW.due_at OR NOT occurrence = ANY (NEW.remind_before) OR deadline_local IS NOT NULL);
    ELSE
        -- A series' edit: unsent occurrences it no longer has are superseded ...
        UPDATE pgwork.renewal_work w
           SET status = 'superseded', finished_at = now()
         WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
           AND pgwork.series_unwanted(NEW.id, NEW.recur_rule, NEW.due_local, NEW.paused, NEW.recur_skip,
                                      NEW.recur_until, NEW.remind_before, NEW.recur_version,
                                      w.deadline_local, w.occurrence, NULL) IS NOT NULL;
        -- ... and the others follow the zone (same local deadline, same key) and the version.
        UPDATE pgwork.renewal_work w
           SET deadline = n.deadline, due_at = n.due_at,
               available_at = CASE WHEN w.attempts = 0 THEN n.due_at ELSE w.available_at END,
               recur_version = NEW.recur_version
          FROM (SELECT x.id, pgwork.local_to_instant(x.deadline_local, NEW.due_tz) AS deadline,
                       pgwork.fire_at(pgwork.local_to_instant(x.deadline_local, NEW.due_tz), x.deadline_local,
                                      NEW.due_tz, x.occurrence) AS due_at
                  FROM pgwork.renewal_work x
                 WHERE x.reminder_id = NEW.id AND x.status IS NOT DISTINCT FROM 'ready') AS n
         WHERE w.id = n.id;
    END IF;
    RETURN NULL;
END
$$;
DROP TRIGGER reminder_after_reschedule ON pgwork.reminder;
CREATE TRIGGER reminder_after_reschedule
    AFTER UPDATE OF due_at, remind_before, due_local, due_tz, recur, recur_until, recur_skip, paused
    ON pgwork.reminder FOR EACH ROW
    WHEN (OLD.due_at IS DISTINCT FROM NEW.due_at OR OLD.remind_before IS DISTINCT FROM NEW.remind_before
          OR OLD.recur_version IS DISTINCT FROM NEW.recur_version
          OR (OLD.recur_rule IS NULL) <> (NEW.recur_rule IS NULL))
    EXECUTE FUNCTION pgwork.reminder_after_reschedule();

DROP TRIGGER reminder_notify ON pgwork.reminder;
CREATE TRIGGER reminder_notify
    AFTER INSERT OR UPDATE OF due_at, due_local, due_tz, remind_before, recur, recur_until, recur_skip, paused
    ON pgwork.reminder
    FOR EACH ROW WHEN (coalesce(NEW.next_fire_at, NEW.due_at) <= now() + interval '1 hour')
    EXECUTE FUNCTION pgwork.reminder_notify();

DROP VIEW pgwork.reminder_status;
CREATE VIEW pgwork.reminder_status WITH (security_barrier) AS
SELECT r.source, r.business_key, k.deadline, b.before AS remind_before,
       pgwork.fire_at(k.deadline, k.deadline_local, r.due_tz, b.before) AS send_at,
       coalesce(w.status, t.status, CASE WHEN r.paused THEN 'paused' ELSE 'scheduled' END) AS status,
       coalesce(w.attempts, 0) AS attempts,
       coalesce(w.finished_at, t.finished_at) AS finished_at,
       coalesce(w.operation_id, t.operation_id) AS operation_id,
       (w.id IS NULL AND t.reminder_id IS NOT NULL) AS retired,
       k.deadline_local, r.recur
  FROM pgwork.reminder r
 -- A one-off reminder's deadline; a series' next deadline (the first from now that it still
 -- has: not skipped, not past its end, not before its start), none once it has ended.
 CROSS JOIN LATERAL (
       SELECT r.due_at AS deadline, CASE WHEN r.due_local IS NOT NULL THEN r.due_local END AS deadline_local
        WHERE r.recur_rule IS NULL
       UNION ALL
       SELECT pgwork.local_to_instant(x.dl, r.due_tz), x.dl
         FROM pgwork.recur_upcoming(r.recur_rule, r.due_local,
                                    greatest(now(), r.series_from) AT TIME ZONE r.due_tz - interval '1 day', 64) AS x(dl)
        WHERE r.recur_rule IS NOT NULL AND x.dl <> ALL (coalesce(r.recur_skip, '{}'))
          AND (r.recur_until IS NULL OR x.dl <= r.recur_until)
          AND pgwork.local_to_instant(x.dl, r.due_tz) >= greatest(now(), r.series_from)
        ORDER BY 2 LIMIT 1) AS k
 CROSS JOIN LATERAL unnest(r.remind_before) AS b(before)
  LEFT JOIN pgwork.renewal_work w
    ON w.reminder_id = r.id AND w.occurrence = b.before
   AND (CASE WHEN r.recur_rule IS NULL THEN w.deadline = k.deadline AND w.deadline_local IS NULL
             ELSE w.deadline_local = k.deadline_local END)
  LEFT JOIN pgwork.retired t
    ON t.reminder_id = r.id AND t.occurrence = b.before
   AND (CASE WHEN r.recur_rule IS NULL THEN t.deadline = k.deadline AND t.deadline_local IS NULL
             ELSE t.deadline_local = k.deadline_local END)
 -- The view reads as its owner: with row-level security on, it shows an app only its sources.
 WHERE (SELECT NOT c.relrowsecurity FROM pg_class c WHERE c.oid = 'pgwork.reminder'::regclass)
    OR (SELECT pgwork.rls_exempt())
    OR r.source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]);
COMMENT ON VIEW pgwork.reminder_status IS
    'Each occurrence of each current reminder and where it stands: scheduled (not yet materialised), '
    'ready, claimed, delivered, dead. retired: its work row was removed by retention (status is the '
    'outcome it had; attempts are no longer known); it is never sent again. A recurring reminder '
    'shows its next deadline (deadline_local: as local time; paused while the series is).';

-- The channel's catch_up policy for a send that fired before its reminder (or series) was
-- written or last moved: all are sent; latest: only the most recent of them (latest_missed: the
-- reminder's latest send before planned_at); none: none. True: close it as expired instead.
CREATE FUNCTION pgwork.skipped_by_catch_up(policy text, fire_at timestamptz, planned_at timestamptz,
                                           latest_missed timestamptz)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE coalesce(policy, 'all') WHEN 'none' THEN fire_at < planned_at
                                    WHEN 'latest' THEN fire_at < latest_missed
                                    ELSE false END;
COMMENT ON FUNCTION pgwork.skipped_by_catch_up(text, timestamptz, timestamptz, timestamptz) IS
    'Whether a channel''s catch_up policy skips a send that fired before its reminder was written or moved.';

-- A page's recurring reminders (series), called by the page only when it has one (so the plan of
-- the one-off path stays what it was): for each, the local deadlines whose sends may fall between
-- its progress and the cutoff, their sends judged by the channel's catch_up, inserted keyed by
-- their local deadline; returns each reminder's new progress and what was made. Runs inside the
-- page's statement and transaction (the reminders are locked by it); never claims (a series'
-- occurrence due now is claimed by the next claim, one hop later).
CREATE FUNCTION pgwork.materialise_series(ids bigint[], cutoff timestamptz)
RETURNS TABLE (id bigint, next_fire_at timestamptz, made bigint, made_due bigint, skipped bigint,
               made_ready bigint, earliest_made timestamptz)
-- Every table it reads is read by key (a reminder by id, a tombstone or a work row by its
-- reminder's key): no sequential scan, whatever the statistics say. Taken while renewal_work was
-- empty, they made the probe for other local deadlines on the same instant a scan of the whole
-- table, once per occurrence made (tests/test_series.py::
-- test_a_series_page_probes_by_key_whatever_the_statistics_say).
LANGUAGE plpgsql VOLATILE SET jit = off SET enable_seqscan = off AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT r.id, r.source, r.business_key, r.due_local, r.due_tz, r.remind_before, r.channel,
               r.next_fire_at, coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate,
               r.recur_rule, r.recur_skip, r.recur_until, r.series_from, r.recur_version,
               materialise_series.cutoff AS cutoff
          FROM pgwork.reminder r
         WHERE r.id = ANY (materialise_series.ids) AND r.recur_rule IS NOT NULL
    ), windows AS MATERIALIZED (
        -- A recurring reminder (a series): the local deadlines whose sends may fall between its
        -- progress and the cutoff, from its progress plus its shortest remind_before entry (never
        -- before the series' start) to the cutoff plus its longest and a span in which the rule
        -- has its next deadline if it has one every period; a day more each side for DST.
        SELECT d.id, d.recur_rule, d.due_local, d.due_tz, b.longest,
               greatest((d.next_fire_at AT TIME ZONE d.due_tz) + b.shortest,
                        d.series_from AT TIME ZONE d.due_tz) - interval '1 day' AS lo,
               (d.cutoff AT TIME ZONE d.due_tz) + b.longest
                 + (d.recur_rule->>'interval')::integer
                   * CASE d.recur_rule->>'freq' WHEN 'DAILY' THEN interval '2 days' WHEN 'WEEKLY' THEN interval '8 days'
                                                WHEN 'MONTHLY' THEN interval '32 days' ELSE interval '367 days' END AS hi,
               least(coalesce((d.recur_rule->>'until')::timestamp, 'infinity'),
                     coalesce(d.recur_until, 'infinity')) AS last_local
          FROM due d
         CROSS JOIN LATERAL (SELECT min(x) AS shortest, max(x) AS longest FROM unnest(d.remind_before) AS x) AS b
         WHERE d.recur_rule IS NOT NULL
    ), deadlines AS MATERIALIZED (
        -- Its deadlines in the window, each as an instant (pgwork.local_to_instant), without the
        -- skipped ones and the history before the series' start; two deadlines on one instant (a
        -- time shifted by a DST gap onto another of the series) are one: the one not shifted.
        SELECT DISTINCT ON (k.id, k.deadline_at) k.id, k.dl, k.deadline_at
          FROM (SELECT w.id, x.dl, pgwork.local_to_instant(x.dl, w.due_tz) AS deadline_at, w.due_tz
                  FROM windows w
                 CROSS JOIN LATERAL pgwork.recur_between(w.recur_rule, w.due_local, w.lo, least(w.hi, w.last_local)) AS x(dl)) AS k
          JOIN due d ON d.id = k.id
         WHERE k.dl <> ALL (coalesce(d.recur_skip, '{}')) AND k.deadline_at >= d.series_from
         ORDER BY k.id, k.deadline_at, (k.deadline_at AT TIME ZONE k.due_tz) <> k.dl, k.dl
    ), fires AS MATERIALIZED (
        -- Each deadline x remind_before entry; the channel's catch_up judges the sends that fired
        -- before the series was written or last edited (never a deadline before it: history).
        SELECT d.id, d.source, d.business_key, k.deadline_at AS due_at, d.channel, b.before,
               d.next_fire_at AS progress,
               pgwork.fire_at(k.deadline_at, k.dl, d.due_tz, b.before) AS fire_at,
               greatest(d.planned_at, d.series_from) AS planned_at, d.cutoff, d.traceparent, d.tracestate,
               k.dl, d.recur_version
          FROM deadlines k
          JOIN due d ON d.id = k.id
         CROSS JOIN LATERAL unnest(d.remind_before) AS b(before)
    ), occ AS MATERIALIZED (
        SELECT f.*,
               pgwork.skipped_by_catch_up(ch.catch_up, f.fire_at, f.planned_at,
                                          max(f.fire_at) FILTER (WHERE f.fire_at < f.planned_at)
                                              OVER (PARTITION BY f.id)) AS skip,
               ch.catch_up
          FROM fires f
          LEFT JOIN pgwork.channel ch ON ch.name = f.channel
    ), made AS (
        -- A series' occurrences, identified by their local deadline (work_series_occurrence_unique),
        -- so a zone edit or a time zone data update never makes a second one. A tombstone of the
        -- same local deadline stops it, and so does a row of another local deadline on the same
        -- instant (the same send, made before an edit).
        INSERT INTO pgwork.renewal_work AS w
               (reminder_id, source, business_key, deadline, occurrence, due_at, channel, operation_id,
                available_at, status, finished_at, last_error, traceparent, tracestate,
                deadline_local, recur_version)
        SELECT o.id, o.source, o.business_key, o.due_at, o.before, o.fire_at, o.channel,
               pgwork.series_operation_id(o.id, o.source, o.business_key, o.dl, o.before),
               o.fire_at,
               CASE WHEN o.skip THEN 'expired' ELSE 'ready' END,
               CASE WHEN o.skip THEN now() END,
               CASE WHEN o.skip THEN format('skipped by catch_up = %s: due %s, before its series was written or edited (%s)',
                                           o.catch_up, o.fire_at, o.planned_at) END,
               o.traceparent, o.tracestate,
               o.dl, o.recur_version
          FROM occ o
         WHERE o.fire_at <= o.cutoff
           AND o.fire_at >= o.progress
           AND (SELECT true FROM pgwork.retired t
                 WHERE t.reminder_id = o.id AND t.deadline_local = o.dl AND t.occurrence = o.before
                 LIMIT 1) IS NULL
           AND (SELECT true FROM pgwork.renewal_work x
                 WHERE x.reminder_id = o.id AND x.deadline = o.due_at AND x.occurrence = o.before
                   AND x.deadline_local IS DISTINCT FROM o.dl
                 LIMIT 1) IS NULL
            ON CONFLICT (reminder_id, deadline_local, occurrence) WHERE deadline_local IS NOT NULL DO UPDATE
           SET status = excluded.status, available_at = excluded.available_at,
               finished_at = excluded.finished_at, last_error = excluded.last_error,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate,
               deadline = excluded.deadline, due_at = excluded.due_at, recur_version = excluded.recur_version
         WHERE w.status = 'superseded'
        RETURNING w.reminder_id, w.status, w.due_at
    ), nxt AS (
        -- Its first send past the cutoff in the window, but never later than the earliest send
        -- of a deadline past the window (not looked at yet), less a day for DST; with nothing in
        -- the window, that bound is a probe. 'infinity' once the window reached the series' end.
        SELECT w.id,
               CASE WHEN w.hi >= w.last_local THEN coalesce(f.next_at, 'infinity')
                    ELSE least(f.next_at, pgwork.local_to_instant(w.hi - w.longest, w.due_tz) - interval '1 day') END
                 AS next_fire_at
          FROM windows w
          LEFT JOIN (SELECT o.id, min(o.fire_at) FILTER (WHERE o.fire_at > o.cutoff) AS next_at
                       FROM occ o
                      GROUP BY o.id) AS f ON f.id = w.id
    )
    SELECT n.id, n.next_fire_at,
           count(m.reminder_id),
           count(m.reminder_id) FILTER (WHERE m.due_at <= now() AND m.status = 'ready'),
           count(m.reminder_id) FILTER (WHERE m.status = 'expired'),
           count(m.reminder_id) FILTER (WHERE m.status = 'ready'),
           min(m.due_at)
      FROM nxt n
      LEFT JOIN made m ON m.reminder_id = n.id
     GROUP BY n.id, n.next_fire_at;
END
$$;
COMMENT ON FUNCTION pgwork.materialise_series(bigint[], timestamptz) IS
    'The materialiser''s page for its recurring reminders (called by materialise_page only).';
REVOKE EXECUTE ON FUNCTION pgwork.materialise_series FROM PUBLIC;

DROP FUNCTION pgwork.materialise_page;
CREATE FUNCTION pgwork.materialise_page(
    coordinate boolean, cutoff_at timestamptz, lookahead interval, after_at timestamptz,
    after_id bigint, page_limit integer, origin text, take jsonb, claim_lease interval,
    daemon_id text)
RETURNS TABLE (
    cutoff timestamptz, scanned bigint, made bigint, made_due bigint, skipped bigint,
    notified bigint, earliest_made timestamptz, last_at timestamptz, last_id bigint,
    id bigint, reminder_id bigint, source text, business_key text, deadline timestamptz,
    occurrence interval, due_at timestamptz, channel text, operation_id uuid, status text,
    attempts integer, attempts_base integer, lease integer, retry_since timestamptz,
    prev_status text, recipient text, payload text, traceparent text, tracestate text,
    deadline_local timestamp, time_zone text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    got boolean;
BEGIN
    -- Under repeatable read or serializable, every statement here would share the snapshot taken
    -- before the lock: the ordering above, and with it "never sent twice", would not hold.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgwork.materialise_page needs transaction_isolation = read committed, not %',
                        current_setting('transaction_isolation')
              USING HINT = 'a default_transaction_isolation set on the database or role applies to '
                           'pgwork''s sessions too: set it to read committed for the daemon''s role';
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true),
            set_config('plan_cache_mode', 'force_generic_plan', true);
    got := CASE WHEN materialise_page.coordinate
                THEN (SELECT true FROM pgwork.materialiser_state FOR UPDATE SKIP LOCKED) IS NOT NULL
                ELSE (SELECT true FROM pgwork.materialiser_state FOR SHARE) IS NOT NULL END;
    IF NOT got THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH params AS MATERIALIZED (
        -- The first page of a pass fixes the cutoff; later pages pass it back.
        SELECT coalesce(materialise_page.cutoff_at, now() + materialise_page.lookahead) AS cutoff
    ), due AS MATERIALIZED (
        SELECT r.ctid AS row_ctid, r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz,
               r.remind_before, r.channel, coalesce(r.next_fire_at, r.due_at) AS next_fire_at,
               coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate,
               r.series_from
          FROM pgwork.reminder r
         WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
           AND coalesce(r.next_fire_at, r.due_at) <= (SELECT p.cutoff FROM params p)
           AND (coalesce(r.next_fire_at, r.due_at), r.id)
               > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
         ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
         LIMIT materialise_page.page_limit
           FOR UPDATE OF r SKIP LOCKED
    ), fires AS MATERIALIZED (
        SELECT d.id, d.source, d.business_key, d.due_at, d.channel, b.before, d.next_fire_at AS progress,
               pgwork.fire_at(d.due_at, d.due_local, d.due_tz, b.before) AS fire_at,
               d.planned_at, (SELECT p.cutoff FROM params p) AS cutoff, d.traceparent, d.tracestate
          FROM due d
         CROSS JOIN LATERAL unnest(d.remind_before) AS b(before)
         WHERE d.series_from IS NULL
    ), series AS MATERIALIZED (
        -- Recurring reminders are made by pgwork.materialise_series, called only when the page
        -- has one (the one-off path's plan stays as small as it was).
        SELECT s.*
          FROM (SELECT array_agg(d.id) AS ids FROM due d WHERE d.series_from IS NOT NULL) AS a
         CROSS JOIN LATERAL pgwork.materialise_series(a.ids, (SELECT p.cutoff FROM params p)) AS s
         WHERE a.ids IS NOT NULL
    ), occ AS MATERIALIZED (
        -- The channel's catch_up policy for occurrences that fired before the schedule was
        -- written: all are sent; latest: only the most recent of them; none: none. The others
        -- are closed as expired, with the reason.
        SELECT f.*,
               pgwork.skipped_by_catch_up(ch.catch_up, f.fire_at, f.planned_at,
                                          max(f.fire_at) FILTER (WHERE f.fire_at < f.planned_at)
                                              OVER (PARTITION BY f.id)) AS skip,
               ch.catch_up
          FROM fires f
          LEFT JOIN pgwork.channel ch ON ch.name = f.channel
    ), rooms AS MATERIALIZED (
        SELECT t.channel, t.room, make_interval(secs => t.expire_after_s) AS expire_after
          FROM jsonb_to_recordset(materialise_page.take) AS t(channel text, room integer, expire_after_s float8)
    ), take AS MATERIALIZED (
        -- The occurrences claimed here (see above): each channel's oldest due ones, up to its room.
        SELECT o.id, o.before
          FROM (SELECT o.id, o.before, o.channel, o.fire_at,
                       row_number() OVER (PARTITION BY o.channel ORDER BY o.fire_at, o.id, o.before) AS n
                  FROM occ o
                 WHERE NOT o.skip AND o.fire_at <= now() AND o.fire_at >= o.progress
                   AND o.channel IN (SELECT t.channel FROM rooms t)) AS o
          JOIN rooms t ON t.channel = o.channel
          JOIN pgwork.channel c ON c.name = o.channel
         WHERE o.n <= t.room
           AND (t.expire_after IS NULL OR o.fire_at + t.expire_after >= now())
           AND NOT c.paused AND (c.not_before IS NULL OR c.not_before <= now())
           AND c.rate_limit IS NULL AND c.global_concurrency IS NULL AND c.throttle_limit IS NULL
    ), made AS (
        INSERT INTO pgwork.renewal_work AS w
               (reminder_id, source, business_key, deadline, occurrence, due_at, channel, operation_id,
                available_at, status, finished_at, last_error, traceparent, tracestate,
                lease, attempts, claimed_at, claimed_by)
        SELECT o.id, o.source, o.business_key, o.due_at, o.before, o.fire_at, o.channel,
               pgwork.operation_id(o.id, o.source, o.business_key, o.due_at, o.before),
               CASE WHEN k.id IS NULL THEN o.fire_at ELSE now() + materialise_page.claim_lease END,
               CASE WHEN o.skip THEN 'expired' WHEN k.id IS NULL THEN 'ready' ELSE 'claimed' END,
               CASE WHEN o.skip THEN now() END,
               CASE WHEN o.skip THEN format('skipped by catch_up = %s: due %s, before its reminder was written (%s)',
                                           o.catch_up, o.fire_at, o.planned_at) END,
               o.traceparent, o.tracestate,
               (k.id IS NOT NULL)::int, (k.id IS NOT NULL)::int,
               CASE WHEN k.id IS NOT NULL THEN now() END,
               CASE WHEN k.id IS NOT NULL THEN materialise_page.daemon_id END
          FROM occ o
          LEFT JOIN take k ON k.id = o.id AND k.before = o.before
         WHERE o.fire_at <= o.cutoff
           AND o.fire_at >= o.progress
           -- A probe of retired's key per occurrence (a scalar subquery with LIMIT, not NOT EXISTS,
           -- which the planner may make a hash anti-join: the generic plan, which cannot see the
           -- page's size, then read every tombstone on every page), and none while there is no
           -- tombstone at all (the first test, made once per page).
           AND (NOT EXISTS (SELECT FROM pgwork.retired)
                OR (SELECT true FROM pgwork.retired t
                     WHERE t.reminder_id = o.id AND t.deadline = o.due_at AND t.occurrence = o.before
                     LIMIT 1) IS NULL)
            ON CONFLICT (reminder_id, deadline, occurrence) DO UPDATE
           -- A revived row keeps its lease and attempts: it is made ready, never claimed here.
           SET status = CASE WHEN excluded.status = 'claimed' THEN 'ready' ELSE excluded.status END,
               available_at = CASE WHEN excluded.status = 'claimed' THEN excluded.due_at ELSE excluded.available_at END,
               finished_at = excluded.finished_at, last_error = excluded.last_error,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate
         WHERE w.status = 'superseded'
        RETURNING w.id, w.reminder_id, w.source, w.business_key, w.deadline, w.occurrence, w.due_at,
                  w.channel, w.operation_id, w.status, w.attempts, w.attempts_base, w.lease,
                  coalesce(w.redriven_at, greatest(w.due_at, w.created_at)) AS retry_since,
                  w.traceparent, w.tracestate
    ), nxt AS (
        SELECT o.id, coalesce(min(o.fire_at) FILTER (WHERE o.fire_at > o.cutoff), 'infinity') AS next_fire_at
          FROM occ o
         GROUP BY o.id
        UNION ALL
        SELECT s.id, s.next_fire_at FROM series s
    ), advanced AS (
        -- By ctid: the rows are locked by this statement, and a join on id would scan the table.
        UPDATE pgwork.reminder r
           SET next_fire_at = n.next_fire_at
          FROM due d
          JOIN nxt n ON n.id = d.id
         WHERE r.ctid = d.row_ctid
    ), figures AS (
        SELECT (SELECT p.cutoff FROM params p) AS cutoff,
               (SELECT count(*) FROM due) AS scanned,
               (SELECT count(*) FROM made) + (SELECT coalesce(sum(s.made), 0) FROM series s)::bigint AS made,
               (SELECT count(*) FROM made m WHERE m.due_at <= now() AND m.status IN ('ready', 'claimed'))
                 + (SELECT coalesce(sum(s.made_due), 0) FROM series s)::bigint AS made_due,
               (SELECT count(*) FROM made m WHERE m.status = 'expired')
                 + (SELECT coalesce(sum(s.skipped), 0) FROM series s)::bigint AS skipped,
               (SELECT count(*) FROM (SELECT pg_notify('pgwork_work', materialise_page.origin)
                                       WHERE EXISTS (SELECT 1 FROM made m WHERE m.status = 'ready')
                                          OR EXISTS (SELECT 1 FROM series s WHERE s.made_ready > 0)) AS n) AS notified,
               least((SELECT min(m.due_at) FROM made m), (SELECT min(s.earliest_made) FROM series s)) AS earliest_made,
               l.next_fire_at AS last_at, l.id AS last_id
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (SELECT d.next_fire_at, d.id FROM due d ORDER BY d.next_fire_at DESC, d.id DESC LIMIT 1) l ON true
    ), claimed AS (
        -- The reminder as this statement's snapshot sees it (advanced changed only its progress).
        SELECT m.id, m.reminder_id, m.source, m.business_key, m.deadline, m.occurrence, m.due_at,
               m.channel, m.operation_id, m.status, m.attempts, m.attempts_base, m.lease, m.retry_since,
               'ready'::text AS prev_status, r.recipient, r.payload::text AS payload, m.traceparent, m.tracestate,
               NULL::timestamp AS deadline_local, NULL::text AS time_zone
          FROM made m
          JOIN pgwork.reminder r ON r.id = m.reminder_id
         WHERE m.status = 'claimed'
    )
    SELECT f.cutoff, f.scanned, f.made, f.made_due, f.skipped, f.notified, f.earliest_made,
           f.last_at, f.last_id,
           c.id, c.reminder_id, c.source, c.business_key, c.deadline, c.occurrence, c.due_at,
           c.channel, c.operation_id, c.status, c.attempts, c.attempts_base, c.lease, c.retry_since,
           c.prev_status, c.recipient, c.payload, c.traceparent, c.tracestate, c.deadline_local, c.time_zone
      FROM figures f
      LEFT JOIN claimed c ON true
     ORDER BY c.due_at, c.id;
END
$$;
COMMENT ON FUNCTION pgwork.materialise_page IS
    'The materialiser''s page (lock, page, the rows it claimed), called by the daemon only.';
REVOKE EXECUTE ON FUNCTION pgwork.materialise_page FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT INSERT (recur, recur_until, recur_skip, paused), UPDATE (recur, recur_until, recur_skip, paused)
              ON pgwork.reminder TO pgwork_app;
        GRANT SELECT ON pgwork.reminder_status TO pgwork_app;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        GRANT SELECT ON pgwork.reminder_status TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_page TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_series TO pgwork_daemon;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 12, applied_at = now();
