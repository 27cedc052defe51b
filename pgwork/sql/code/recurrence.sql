-- pgwork/sql/code/recurrence.sql — Recurring deadlines: the RRULE subset, compiled once and evaluated over bounded windows.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.
--
-- An RFC 5545 RRULE subset. A rule is compiled once against its first
-- deadline (pgwork.recur_compile: checked, RFC defaults filled in from the first deadline, COUNT
-- turned into its last occurrence) and evaluated by matching the candidate days of the whole
-- periods that overlap a bounded window of local wall-clock time (pgwork.recur_between): the
-- cost is the window's, never the series' history. Local times become instants only through
-- pgwork.local_to_instant (the DST policy of one-off deadlines). What evaluates rules in an app's
-- session runs with jit off: generate_series' default row estimates make the planner compile
-- these small queries (0.8 s a call on PostgreSQL 15 built with LLVM; pgwork's own sessions
-- have jit off already).

-- Every refusal says what to write instead: its own hint, or what a rule is made of.
CREATE OR REPLACE FUNCTION pgwork.recur_error(message text, hint text DEFAULT NULL, col text DEFAULT 'recur')
RETURNS void LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RAISE EXCEPTION 'pgwork: %', message
        USING ERRCODE = 'check_violation', COLUMN = col,
              HINT = coalesce(hint, 'A rule is NAME=VALUE parts joined by ";": FREQ=DAILY, WEEKLY, MONTHLY '
                                    'or YEARLY, then any of INTERVAL (1-1000), BYMONTH, BYMONTHDAY (±1-31), '
                                    'BYDAY (MO..SU, ordinals like -1FR for MONTHLY and YEARLY), BYSETPOS, '
                                    'BYHOUR, BYMINUTE, WKST, and COUNT (1-1000) or UNTIL (YYYYMMDD, '
                                    'YYYYMMDDTHHMMSS, or with Z in UTC); e.g. FREQ=MONTHLY;BYMONTHDAY=1.');
END
$$;
COMMENT ON FUNCTION pgwork.recur_error(text, text, text) IS
    'Refuses a recurrence rule with a message naming the column (recur unless said otherwise) and a hint.';

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
COMMENT ON FUNCTION pgwork.recur_ints(text, text, integer, integer, boolean) IS
    'A recurrence part''s list of whole numbers, checked against its range.';

CREATE OR REPLACE FUNCTION pgwork.recur_period(freq text, wkst integer, t timestamp) RETURNS timestamp
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- The start of the period (day, week from wkst, month, year) that holds t.
RETURN CASE freq WHEN 'DAILY' THEN date_trunc('day', t)
                 WHEN 'WEEKLY' THEN date_trunc('day', t) - ((extract(isodow FROM t)::integer - wkst + 7) % 7) * interval '1 day'
                 WHEN 'MONTHLY' THEN date_trunc('month', t)
                 ELSE date_trunc('year', t) END;
COMMENT ON FUNCTION pgwork.recur_period(text, integer, timestamp) IS
    'The start of the recurrence period (day, week starting on wkst, month or year) that holds t.';

CREATE OR REPLACE FUNCTION pgwork.recur_index(freq text, first timestamp, p timestamp) RETURNS integer
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

CREATE OR REPLACE FUNCTION pgwork.recur_list(rule jsonb, part text) RETURNS integer[]
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
               (rule->>'until_at')::timestamptz AS until_at, rule->>'tz' AS tz,
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
       -- An UNTIL in UTC bounds the instant (its local bound, above, is a day later).
       AND (w.until_at IS NULL OR pgwork.local_to_instant(k.t, w.tz) <= w.until_at)
     ORDER BY k.t
$$;
COMMENT ON FUNCTION pgwork.recur_between(jsonb, timestamp, timestamp, timestamp) IS
    'The occurrences (local wall-clock times) of a compiled recurrence rule in [lo, hi], in order.';

CREATE OR REPLACE FUNCTION pgwork.recur_has(rule jsonb, dtstart timestamp, at timestamp) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
-- Whether a compiled rule anchored at dtstart has a deadline at the local time at. A function of
-- its own, so that an expression that asks only now and then (pgwork.series_unwanted) holds no
-- subquery and is inlined where it is used.
RETURN EXISTS (SELECT FROM pgwork.recur_between(rule, dtstart, at, at));
COMMENT ON FUNCTION pgwork.recur_has(jsonb, timestamp, timestamp) IS
    'Whether a compiled recurrence rule anchored at dtstart has a deadline at the local time at.';

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
        FOR t IN SELECT x FROM pgwork.recur_between(rule, dtstart, lo, least(lo + span, stop)) AS x LOOP
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

CREATE OR REPLACE FUNCTION pgwork.recur_rule(recur text, dtstart timestamp, tz text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
-- The rule as pgwork evaluates it, anchored at its first deadline dtstart (local, in tz):
--   {freq, interval, wkst, second, bymonth, bymonthday, bydayn, bydaywd, bysetpos, byhour,
--    byminute, count, until[, until_at, tz]}
-- (until_at and tz for an UNTIL in UTC, which bounds the instant) with RFC 5545's defaults taken from dtstart (the time of day; the weekday of a WEEKLY rule;
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
    until_at timestamptz;
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
                -- In UTC, UNTIL bounds the instant (RFC 5545): a deadline is in the series when
                -- its instant is at or before it (recur_between compares them). The local bound
                -- kept with it is a day later: around a DST change a deadline whose instant is in
                -- may have a later local time than UNTIL's (00:30 twice in an overlap: the earlier).
                until_at := until AT TIME ZONE 'UTC';
                until := (until_at AT TIME ZONE tz) + interval '1 day';
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
    IF (until_at IS NOT NULL AND until_at < pgwork.local_to_instant(dtstart, tz))
       OR (until_at IS NULL AND until < dtstart) THEN
        PERFORM pgwork.recur_error(format('recur UNTIL %s is before due_local %s',
            coalesce(to_char(until_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS"Z"'), until::text), dtstart));
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
    IF until_at IS NOT NULL THEN
        rule := rule || jsonb_build_object('until_at', until_at, 'tz', tz);
    END IF;
    RETURN rule;
END
$$;
COMMENT ON FUNCTION pgwork.recur_rule(text, timestamp, text) IS
    'A recurrence rule (RFC 5545 RRULE subset) parsed and checked, with its defaults from the first deadline.';

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
        is_first := pgwork.recur_has(rule, dtstart, dtstart);
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
COMMENT ON FUNCTION pgwork.recur_compile(text, timestamp, text) IS
    'A recurrence rule (RFC 5545 RRULE subset) checked and compiled against its first deadline; '
    'refuses a wrong rule naming the column.';

CREATE OR REPLACE FUNCTION pgwork.recur_preview(recur text, due_local timestamp, due_tz text, n integer DEFAULT 10)
RETURNS TABLE (deadline_local timestamp, deadline timestamptz)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- The first n deadlines of a series from its first one: what an app shows before it saves.
-- Each local deadline becomes an instant by pgwork.local_to_instant (ambiguous: the earlier
-- instant; in a DST gap: shifted forward by the gap); a shifted deadline that lands on the
-- instant of another of the series is the same send, shown once.
DECLARE
    rule jsonb;
BEGIN
    IF recur IS NULL THEN
        RAISE EXCEPTION 'pgwork: recur_preview needs recur (the rule), not NULL'
            USING ERRCODE = 'null_value_not_allowed', COLUMN = 'recur',
                  HINT = 'recur_preview(recur, due_local, due_tz, n): the rule, its first deadline as local time, its zone.';
    END IF;
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
              -- Two local deadlines share an instant at most (one shifted by a DST gap).
              FROM pgwork.recur_upcoming(rule, due_local, due_local, 2 * n + 64) AS u(l)
             ORDER BY pgwork.local_to_instant(u.l, due_tz),
                      (pgwork.local_to_instant(u.l, due_tz) AT TIME ZONE due_tz) <> u.l, u.l) AS s
     ORDER BY s.i
     LIMIT n;
END
$$;
COMMENT ON FUNCTION pgwork.recur_preview(text, timestamp, text, integer) IS
    'The first n deadlines (local, and as instants) of a recurring series from its first deadline.';

-- How many times of day a compiled rule has (its hours x its minutes).
CREATE OR REPLACE FUNCTION pgwork.recur_times(rule jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN jsonb_array_length(rule->'byhour') * jsonb_array_length(rule->'byminute');
COMMENT ON FUNCTION pgwork.recur_times(jsonb) IS
    'How many times of day a compiled recurrence rule has.';

-- At most how many deadlines a compiled rule has a day, averaged over its period: an upper bound
-- from its parts (days a period may match x times of day, at most BYSETPOS's count a period),
-- which the materialiser's page budgets a series' work by. Expressions only, so the page inlines
-- it for each series it makes (with a subquery it ran as a function of its own per call), and
-- the rule's JSON lists are counted where they are, not made arrays first (an ordinal BYDAY
-- counts 1, an every-week one, 0, counts 5).
CREATE OR REPLACE FUNCTION pgwork.recur_density(rule jsonb) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN least(CASE rule->>'freq'
                  WHEN 'DAILY' THEN 1
                  WHEN 'WEEKLY' THEN coalesce(nullif(jsonb_array_length(rule->'bydaywd'), 0), 7)
                  ELSE CASE WHEN rule->>'freq' = 'YEARLY'
                            THEN coalesce(nullif(jsonb_array_length(rule->'bymonth'), 0), 12)
                            ELSE 1 END
                       * least(coalesce(nullif(jsonb_array_length(rule->'bymonthday'), 0), 31),
                               coalesce(nullif(jsonb_array_length(rule->'bydayn')
                                               + 4 * jsonb_array_length(jsonb_path_query_array(rule->'bydayn', '$[*] ? (@ == 0)')),
                                               0),
                                        31))
             END
             * pgwork.recur_times(rule),
             coalesce(nullif(jsonb_array_length(rule->'bysetpos'), 0), 2147483647))::float8
       / (CASE rule->>'freq' WHEN 'DAILY' THEN 1 WHEN 'WEEKLY' THEN 7 WHEN 'MONTHLY' THEN 28 ELSE 365 END
          * (rule->>'interval')::integer);
COMMENT ON FUNCTION pgwork.recur_density(jsonb) IS
    'At most how many deadlines a compiled recurrence rule has a day (averaged over its period).';
