-- pgwork schema 12 -> 13. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes (issue 27, recurring deadlines at scale); no table changes:
--   * pgwork.recur_between: with BYMONTHDAY, a period's candidate days are the days it names,
--     computed month by month, instead of every day of the period; recur_index is called with
--     columns, so the planner inlines it; the compiled rule's lists are read with one cast each
--     (pgwork.recur_list, new).
--   * pgwork.materialise_series: series of one rule, zone and window (INTERVAL=1, the window
--     after the first deadline) share one evaluation of their deadlines and sends per page; its joins
--     are never nested loops (estimated at a few rows, a page's series were matched against
--     every occurrence of the page: 0.4 s a page).
--   * pgwork.recur_compile: a rule without BYSETPOS or an ordinal BYDAY has its first deadline
--     tested part by part, without evaluating its period (an app's insert of a series). A rule
--     with no occurrence near its first deadline is refused after a search of 8 years (it was
--     searched to the year 9999: 15 s for a daily rule on 30 February); a COUNT the rule does
--     not reach within 100 years is refused.
--   * pgwork.recur_rule and recur_ints parse a rule with expressions only, no query per part
--     (each query was a statement started for each row an app inserts).
--   * pgwork.recur_upcoming (recur_preview, reminder_status) searches at most 100 years ahead.
--   * pgwork.reminder_after_reschedule: a zone edit that puts an unsent occurrence on the
--     instant of one sent (another local deadline) supersedes it as that send; one that puts
--     it on the instant of another row is refused naming due_tz (both broke
--     work_occurrence_unique with a bare unique violation).
-- Every function keeps its signature; upgrade as always: stop the daemons, `pgwork migrate`,
-- start the new version.

CREATE OR REPLACE FUNCTION pgwork.recur_ints(part text, value text, lo integer, hi integer, signed boolean)
RETURNS integer[] LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
-- A comma-separated list of whole numbers in lo..hi (also -hi..-lo when signed), sorted, once each.
-- Written with expressions only (no query): a query here is a statement started for each row an
-- app inserts, and cost a series' insert ~10 us.
DECLARE
    item text;
    n    integer;
    i    integer;
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
        IF NOT n = ANY (got) THEN
            i := 1;
            WHILE i <= cardinality(got) AND got[i] < n LOOP
                i := i + 1;
            END LOOP;
            got := got[1:i - 1] || n || got[i:];
        END IF;
    END LOOP;
    RETURN got;
END
$$;

CREATE FUNCTION pgwork.recur_list(rule jsonb, part text) RETURNS integer[]
LANGUAGE sql STABLE PARALLEL SAFE
-- A compiled rule's list (a JSON array of whole numbers) as an array, by one cast: no query, and
-- the planner inlines it (a query per list was a statement per row).
RETURN translate((rule -> part)::text, '[]', '{}')::integer[];
COMMENT ON FUNCTION pgwork.recur_list(jsonb, text) IS
    'One of a compiled recurrence rule''s lists (bymonth, bymonthday, bydayn, bydaywd, bysetpos, byhour, byminute).';

CREATE OR REPLACE FUNCTION pgwork.recur_between(rule jsonb, dtstart timestamp, lo timestamp, hi timestamp)
RETURNS SETOF timestamp LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- The occurrences of a compiled rule (pgwork.recur_compile) anchored at dtstart, as local
    -- wall-clock times in [lo, hi], in order. Every period (of FREQ, INTERVAL apart from
    -- dtstart's) that overlaps the window is taken whole, so BYSETPOS ranks all of a period's
    -- candidates; its days are matched against the BY parts and crossed with the times of day.
    WITH r AS MATERIALIZED (
        SELECT rule->>'freq' AS freq, (rule->>'interval')::integer AS ival,
               (rule->>'wkst')::integer AS wkst, (rule->>'second')::float8 AS sec,
               pgwork.recur_list(rule, 'bymonth') AS bymonth,
               pgwork.recur_list(rule, 'bymonthday') AS bymonthday,
               pgwork.recur_list(rule, 'bydayn') AS bydayn,
               pgwork.recur_list(rule, 'bydaywd') AS bydaywd,
               pgwork.recur_list(rule, 'bysetpos') AS bysetpos,
               pgwork.recur_list(rule, 'byhour') AS byhour,
               pgwork.recur_list(rule, 'byminute') AS byminute,
               greatest(lo, dtstart) AS lo,
               least(hi, coalesce((rule->>'until')::timestamp, 'infinity')) AS hi,
               CASE rule->>'freq' WHEN 'DAILY' THEN interval '1 day' WHEN 'WEEKLY' THEN interval '7 days'
                                  WHEN 'MONTHLY' THEN interval '1 month' ELSE interval '1 year' END AS unit
    ), bounds AS MATERIALIZED (
        SELECT r.*, pgwork.recur_period(r.freq, r.wkst, dtstart) AS first,
               pgwork.recur_period(r.freq, r.wkst, r.lo) AS p_lo, pgwork.recur_period(r.freq, r.wkst, r.hi) AS p_hi
          FROM r
         WHERE r.lo <= r.hi
    ), w AS MATERIALIZED (
        -- recur_index's arguments are columns here: an argument it uses twice that is itself an
        -- expression keeps the planner from inlining it, and each call then ran through the
        -- SQL-function executor (most of a call's fixed cost).
        SELECT b.*, pgwork.recur_index(b.freq, b.first, b.p_lo) AS k_lo,
               pgwork.recur_index(b.freq, b.first, b.p_hi) AS k_hi
          FROM bounds b
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
          FROM spans s, w
         CROSS JOIN LATERAL (
               -- With BYMONTHDAY, only the days it names can match: they are computed, month by
               -- month (a 31st or a -31st that a month lacks is not a day of it), instead of
               -- trying every day of the period (a monthly rule's period cost ~20 us that way).
               SELECT DISTINCT x.d
                 FROM generate_series(date_trunc('month', s.s), s.e - interval '1 day', interval '1 month') AS m(m)
                CROSS JOIN unnest(w.bymonthday) AS md
                CROSS JOIN LATERAL (SELECT CASE WHEN md > 0 THEN m.m + (md - 1) * interval '1 day'
                                                ELSE m.m + interval '1 month' + md * interval '1 day' END AS d) AS x
                WHERE cardinality(w.bymonthday) > 0
                  AND date_trunc('month', x.d) = m.m AND x.d >= s.s AND x.d < s.e
               UNION ALL
               SELECT g FROM generate_series(s.s, s.e - interval '1 day', interval '1 day') AS g
                WHERE cardinality(w.bymonthday) = 0) AS d(d)
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

CREATE OR REPLACE FUNCTION pgwork.recur_upcoming(rule jsonb, dtstart timestamp, from_local timestamp, n integer)
RETURNS SETOF timestamp LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- The first n occurrences at or after from_local, searched window by window (a window holds a
-- few periods; a rule that matches rarely, e.g. 29 February, costs a few windows), at most 100
-- years ahead: a daily rule that matches once in four years would otherwise be searched to the
-- year 9999 (seconds of an app's statement).
DECLARE
    lo   timestamp := greatest(from_local, dtstart);
    span interval;
    t    timestamp;
    got  integer := 0;
    stop timestamp := least(coalesce((rule->>'until')::timestamp, 'infinity'),
                            greatest(from_local, dtstart) + interval '100 years', '9999-12-31');
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

CREATE OR REPLACE FUNCTION pgwork.recur_rule(recur text, dtstart timestamp, tz text) RETURNS jsonb
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
    byday_seen integer[] := '{}';  -- ordinal * 8 + weekday: each BYDAY entry once
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
                IF NOT coalesce(m[1]::integer, 0) * 8 + array_position(names, m[2]) = ANY (byday_seen) THEN
                    byday_seen := byday_seen || (coalesce(m[1]::integer, 0) * 8 + array_position(names, m[2]));
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
    -- (Array operators, not queries over unnest: each query is a statement started per insert.)
    IF NOT bydayn <@ '{0}'::integer[] THEN
        IF freq IN ('DAILY', 'WEEKLY') THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s has an ordinal, which needs FREQ=MONTHLY or YEARLY', byday_text),
                'An ordinal counts in a month or a year; with FREQ=WEEKLY write the weekday alone.');
        END IF;
        IF 0 = ANY (bydayn) THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s mixes weekdays with and without an ordinal', byday_text),
                'Use one kind per rule (or two reminders).');
        END IF;
        IF (freq = 'MONTHLY' OR cardinality(bymonth) > 0)
           AND NOT bydayn <@ '{-5,-4,-3,-2,-1,1,2,3,4,5}'::integer[] THEN
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

CREATE OR REPLACE FUNCTION pgwork.recur_compile(recur text, dtstart timestamp, tz text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- pgwork.recur_rule, and then: the first deadline must be one of the rule's occurrences, and
-- COUNT becomes until, the rule's last occurrence (so no evaluation ever counts from the start).
DECLARE
    rule       jsonb := pgwork.recur_rule(recur, dtstart, tz);
    cnt        integer := (rule->>'count')::integer;
    bymonth    integer[] := pgwork.recur_list(rule, 'bymonth');
    bymonthday integer[] := pgwork.recur_list(rule, 'bymonthday');
    bydaywd    integer[] := pgwork.recur_list(rule, 'bydaywd');
    until      timestamp;
    next_one   timestamp;
    is_first   boolean;
    reached    bigint;  -- occurrences found for COUNT
BEGIN
    -- The first deadline must be an occurrence (RFC 5545 leaves any other start undefined; this
    -- also gives every series at least one). A rule without BYSETPOS and without an ordinal
    -- BYDAY (most: "the 1st at 09:00", "Mondays") is one whose occurrences are the days and times
    -- that pass each of its parts, so its first deadline is tested part by part, as
    -- recur_between's match does: evaluating its period here cost an app ~60 us more per insert
    -- (a statement of its own, started for each row).
    IF cardinality(pgwork.recur_list(rule, 'bysetpos')) = 0 AND pgwork.recur_list(rule, 'bydayn') <@ '{0}' THEN
        is_first := dtstart <= coalesce((rule->>'until')::timestamp, 'infinity')
            AND extract(hour FROM dtstart)::integer = ANY (pgwork.recur_list(rule, 'byhour'))
            AND extract(minute FROM dtstart)::integer = ANY (pgwork.recur_list(rule, 'byminute'))
            AND extract(second FROM dtstart) = (rule->>'second')::numeric
            AND (cardinality(bymonth) = 0 OR extract(month FROM dtstart)::integer = ANY (bymonth))
            AND (cardinality(bymonthday) = 0 OR extract(day FROM dtstart)::integer = ANY (bymonthday)
                 OR extract(day FROM dtstart)::integer
                    - extract(day FROM date_trunc('month', dtstart) + interval '1 month - 1 day')::integer - 1
                    = ANY (bymonthday))
            AND (cardinality(bydaywd) = 0 OR extract(isodow FROM dtstart)::integer = ANY (bydaywd));
    ELSE
        is_first := EXISTS (SELECT FROM pgwork.recur_between(rule, dtstart, dtstart, dtstart));
    END IF;
    IF NOT is_first THEN
        -- The hint's search looks 8 years ahead (29 February is at most 8 years away).
        SELECT x INTO next_one
          FROM pgwork.recur_upcoming(rule || jsonb_build_object('until', least(coalesce((rule->>'until')::timestamp, 'infinity'),
                                                                                dtstart + interval '8 years')),
                                     dtstart, dtstart, 1) AS x;
        PERFORM pgwork.recur_error(
            format('due_local %s is not an occurrence of recur %s', dtstart, recur),
            CASE WHEN next_one IS NULL THEN 'The rule has no occurrence in the 8 years from due_local.'
                 ELSE format('Set due_local to the first deadline: the rule''s first occurrence from due_local is %s.', next_one) END,
            'due_local');
    END IF;
    IF cnt IS NOT NULL THEN
        SELECT max(x), count(*) INTO until, reached FROM pgwork.recur_upcoming(rule, dtstart, dtstart, cnt) AS x;
        IF reached < cnt THEN
            PERFORM pgwork.recur_error(
                format('recur COUNT=%s: the rule has %s occurrences in the 100 years from due_local', cnt, reached),
                'pgwork looks at most 100 years ahead: use a smaller COUNT, or UNTIL.');
        END IF;
        rule := rule || jsonb_build_object('until', until);
    END IF;
    RETURN rule;
END
$$;

CREATE OR REPLACE FUNCTION pgwork.materialise_series(ids bigint[], cutoff timestamptz)
RETURNS TABLE (id bigint, next_fire_at timestamptz, made bigint, made_due bigint, skipped bigint,
               made_ready bigint, earliest_made timestamptz)
-- Every table it reads is read by key (a reminder by id, a tombstone or a work row by its
-- reminder's key): no sequential scan, whatever the statistics say. Taken while renewal_work was
-- empty, they made the probe for other local deadlines on the same instant a scan of the whole
-- table, once per occurrence made (tests/test_series.py::
-- test_a_series_page_probes_by_key_whatever_the_statistics_say).
LANGUAGE plpgsql VOLATILE SET jit = off SET enable_seqscan = off SET enable_nestloop = off AS $$
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
        SELECT d.id, d.recur_rule, d.due_local, d.due_tz, b.longest, d.recur_skip, d.series_from, d.remind_before,
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
    ), keyed AS MATERIALIZED (
        -- What a window's deadlines depend on. With INTERVAL=1 and a window after the first
        -- deadline, the first deadline does not matter (every period is kept; the rule's parts
        -- were completed from it when it was compiled): the key says so with -infinity, and such
        -- series of one rule, one zone and one window share one evaluation below.
        SELECT w.id, w.recur_rule, w.due_tz, w.lo, least(w.hi, w.last_local) AS hi, w.recur_skip, w.series_from,
               w.remind_before,
               CASE WHEN (w.recur_rule->>'interval')::integer = 1 AND w.lo >= w.due_local
                    THEN '-infinity' ELSE w.due_local END AS anchor
          FROM windows w
    ), evaluated AS MATERIALIZED (
        -- Each distinct window's deadlines, each as an instant (pgwork.local_to_instant), with
        -- the instants of their sends (in remind_before's order): on rent day, a million series
        -- of "the 1st at 09:00 Berlin" cost one evaluation per page.
        SELECT e.recur_rule, e.due_tz, e.lo, e.hi, e.anchor, e.remind_before, x.dl, x.deadline_at,
               ARRAY(SELECT pgwork.fire_at(x.deadline_at, x.dl, e.due_tz, b.before)
                       FROM unnest(e.remind_before) WITH ORDINALITY AS b(before, i) ORDER BY b.i) AS fire_ats
          FROM (SELECT DISTINCT k.recur_rule, k.due_tz, k.lo, k.hi, k.anchor, k.remind_before FROM keyed k) AS e
         CROSS JOIN LATERAL (
               SELECT r.dl, pgwork.local_to_instant(r.dl, e.due_tz) AS deadline_at
                 FROM pgwork.recur_between(e.recur_rule, CASE WHEN e.anchor = '-infinity' THEN e.lo ELSE e.anchor END,
                                           e.lo, e.hi) AS r(dl)) AS x
    ), deadlines AS MATERIALIZED (
        -- Its deadlines in the window, without the skipped ones and the history before the
        -- series' start; two deadlines on one instant (a time shifted by a DST gap onto another
        -- of the series) are one: the one not shifted. (No join with due here: estimated at a
        -- few rows, it was made a nested loop, a page's series times its deadlines.)
        SELECT DISTINCT ON (k.id, e.deadline_at) k.id, e.dl, e.deadline_at, e.fire_ats
          FROM keyed k
          JOIN evaluated e
            ON e.recur_rule = k.recur_rule AND e.due_tz = k.due_tz AND e.lo = k.lo AND e.hi = k.hi AND e.anchor = k.anchor
           AND e.remind_before = k.remind_before
         WHERE e.dl <> ALL (coalesce(k.recur_skip, '{}')) AND e.deadline_at >= k.series_from
         ORDER BY k.id, e.deadline_at, (e.deadline_at AT TIME ZONE k.due_tz) <> e.dl, e.dl
    ), fires AS MATERIALIZED (
        -- Each deadline x remind_before entry; the channel's catch_up judges the sends that fired
        -- before the series was written or last edited (never a deadline before it: history).
        SELECT d.id, d.source, d.business_key, k.deadline_at AS due_at, d.channel, b.before,
               d.next_fire_at AS progress,
               b.fire_at,
               greatest(d.planned_at, d.series_from) AS planned_at, d.cutoff, d.traceparent, d.tracestate,
               k.dl, d.recur_version
          FROM deadlines k
          JOIN due d ON d.id = k.id
         CROSS JOIN LATERAL unnest(d.remind_before, k.fire_ats) AS b(before, fire_at)
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
        -- ... one that a new zone puts on the instant of a row sent or being sent (another
        -- local deadline) is that send, as a page would not make it: superseded (it broke
        -- work_occurrence_unique and the app's edit) ...
        UPDATE pgwork.renewal_work w
           SET status = 'superseded', finished_at = now()
          FROM (SELECT x.id, x.occurrence, pgwork.local_to_instant(x.deadline_local, NEW.due_tz) AS deadline
                  FROM pgwork.renewal_work x
                 WHERE x.reminder_id = NEW.id AND x.status IS NOT DISTINCT FROM 'ready') AS n
         WHERE w.id = n.id
           AND EXISTS (SELECT FROM pgwork.renewal_work o
                        WHERE o.reminder_id = NEW.id AND o.deadline = n.deadline AND o.occurrence = n.occurrence
                          AND o.status IN ('claimed', 'delivered', 'dead'));
        -- ... and the others follow the zone (same local deadline, same key) and the version.
        BEGIN
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
        EXCEPTION WHEN unique_violation THEN
            -- In the new zone an unsent deadline falls on the instant another row of the series
            -- holds (one in a DST gap shifted onto another, or one made and closed unsent before):
            -- refused, nothing changes, nothing is lost. (Rare: a zone edit while the series has
            -- made rows an hour apart around a DST change.)
            RAISE EXCEPTION 'pgwork: in %, an unsent deadline of reminder % falls on the instant of another of its occurrences (a DST gap shifts one onto the other)',
                            NEW.due_tz, NEW.id
                USING ERRCODE = 'check_violation', COLUMN = 'due_tz',
                      HINT = 'Change the zone once the occurrences made for the next hours are sent.';
        END;
    END IF;
    RETURN NULL;
END
$$;

UPDATE pgwork.schema_version SET version = 13, applied_at = now();
