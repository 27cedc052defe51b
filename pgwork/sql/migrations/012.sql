-- pgwork schema 11 -> 12. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it adds (issue 27, recurring deadlines, first step): the recurrence evaluator, in the
-- database, where local times become instants.
--   * pgwork.recur_rule / pgwork.recur_compile: an RFC 5545 RRULE subset (FREQ DAILY, WEEKLY,
--     MONTHLY, YEARLY; INTERVAL, BYMONTH, BYMONTHDAY, BYDAY with ordinals, BYSETPOS, BYHOUR,
--     BYMINUTE, WKST, COUNT or UNTIL) checked against its first deadline, refused with the
--     column named when it cannot be right.
--   * pgwork.recur_between / pgwork.recur_upcoming: the occurrences in a window of local time,
--     by matching the candidate days of whole periods (never by iterating from the start).
--   * pgwork.recur_preview(recur, due_local, due_tz, n): the first n deadlines of a series, local
--     and as instants (pgwork.local_to_instant's DST policy), for apps to show before they save.
-- Nothing existing changes; daemons of version 11 keep working while this runs.

-- ---------------------------------------------------------------------------------------------
-- Recurrence (issue 27): an RFC 5545 RRULE subset. A rule is compiled once against its first
-- deadline (pgwork.recur_compile: checked, RFC defaults filled in from the first deadline, COUNT
-- turned into its last occurrence) and evaluated by matching the candidate days of the whole
-- periods that overlap a bounded window of local wall-clock time (pgwork.recur_between): the
-- cost is the window's, never the series' history. Local times become instants only through
-- pgwork.local_to_instant (the DST policy of one-off deadlines).
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
RETURNS SETOF timestamp LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
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
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
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
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
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

UPDATE pgwork.schema_version SET version = 12, applied_at = now();
