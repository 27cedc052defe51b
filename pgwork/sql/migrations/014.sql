-- pgwork schema 13 -> 14. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes (issue 37: one app cannot stop another's deliveries):
--   * pgwork.reminder_after_reschedule: an app's edit of a series only closes or removes work
--     rows (those the series no longer has are superseded; those a new zone moves are removed
--     when never tried, superseded when waiting for a retry; the next page makes them again at
--     their new instant with the same key): it never keeps a row ready, so it takes no lane
--     lock that the daemon's pages, claims and outcome flushes would wait on until the app
--     commits. A zone edit is no longer refused when it shifts one unsent deadline onto
--     another (the page makes one send per instant), and one that moves a deadline before the
--     edit no longer sends it.
--   * pgwork.materialise_series (new signature: a budget) evaluates deadlines per remind_before
--     entry, in windows as wide as the page's span of fire time, and makes at most its share of
--     the page's sends; a series with more to make before the cutoff is left unfinished for the
--     next pass. pgwork.series_latest_missed (new) finds what catch_up = latest keeps.
--     pgwork.recur_density (new): a compiled rule's deadlines a day at most, the budget's measure.
--   * pgwork.materialise_page takes aside (reminders the daemon set aside after a page failed on
--     each) and returns unfinished (series left short of the cutoff).
--   * pgwork.retired gets retired_series_deadline: retention prunes a series' tombstones once
--     their deadline is two days past (they were kept as long as the reminder lived);
--     pgwork_cleanup gets DELETE on it.
--   * NULL in recur_skip is refused naming recur_skip (a series with one made nothing, silently);
--     existing NULLs are dropped. recur_preview names a NULL argument, gives n deadlines when
--     many fall in DST gaps, and none past its 100-year horizon (recur_upcoming);
--     reminder_status shows a dense series' next deadline. An UNTIL in UTC bounds the instant
--     (recur_rule, recur_between): series with one are compiled again.
-- Upgrade as always: stop the daemons, `pgwork migrate`, start the new version.

CREATE INDEX retired_series_deadline ON pgwork.retired (deadline) WHERE deadline_local IS NOT NULL;

DROP FUNCTION pgwork.materialise_page(boolean, timestamptz, interval, timestamptz, bigint, integer, text, jsonb, interval, text);
DROP FUNCTION pgwork.materialise_series(bigint[], timestamptz);

CREATE OR REPLACE FUNCTION pgwork.reminder_after_reschedule() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork SET jit = off AS $$
BEGIN
    -- An app's edit only ever closes or removes work rows: it never makes a row ready (or
    -- changes a ready one), so it takes no lane lock (pgwork.wake_lanes), which the daemon's
    -- pages, claims and outcome flushes of every source would otherwise wait on until the app's
    -- transaction ends.
    IF NEW.recur_rule IS NULL THEN
        UPDATE pgwork.renewal_work
           SET status = 'superseded', finished_at = now()
         WHERE reminder_id = NEW.id AND status IS NOT DISTINCT FROM 'ready'
           AND (deadline <> NEW.due_at OR NOT occurrence = ANY (NEW.remind_before) OR deadline_local IS NOT NULL);
    ELSE
        -- A new zone moves the instants of the series' local deadlines. Its occurrences made and
        -- never tried (ready, or closed unsent) that move are removed: the next page makes each
        -- again at its new instant, with the same key (its local deadline), if the series still
        -- has it then (a deadline the move put before now is history) and no other row holds
        -- that instant (one send per instant). Kept, they would hold their old instant against
        -- another local deadline that the new zone puts there.
        IF NEW.due_tz IS DISTINCT FROM OLD.due_tz THEN
            DELETE FROM pgwork.renewal_work w
             WHERE w.reminder_id = NEW.id
               AND coalesce(w.status, '') IN ('ready', 'superseded', 'expired') AND w.attempts = 0
               AND w.deadline IS DISTINCT FROM pgwork.local_to_instant(w.deadline_local, NEW.due_tz);
        END IF;
        -- Unsent occurrences the series no longer has, and those it moves that were tried
        -- (waiting for a retry: they keep their instant, as that send), are superseded.
        UPDATE pgwork.renewal_work w
           SET status = 'superseded', finished_at = now()
         WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
           AND (w.deadline IS DISTINCT FROM pgwork.local_to_instant(w.deadline_local, NEW.due_tz)
                OR pgwork.series_unwanted(NEW.id, NEW.recur_rule, NEW.due_local, NEW.paused, NEW.recur_skip,
                                          NEW.recur_until, NEW.remind_before, NEW.recur_version,
                                          w.deadline_local, w.occurrence, NULL) IS NOT NULL);
    END IF;
    RETURN NULL;
END
$$;

-- At most how many deadlines a compiled rule has a day, averaged over its period: an upper bound
-- from its parts (days a period may match x times of day, at most BYSETPOS's count a period),
-- which the materialiser's page budgets a series' work by.
CREATE FUNCTION pgwork.recur_density(rule jsonb) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN (SELECT least(d.days * cardinality(pgwork.recur_list(rule, 'byhour'))
                            * cardinality(pgwork.recur_list(rule, 'byminute')),
                     coalesce(nullif(cardinality(pgwork.recur_list(rule, 'bysetpos')), 0), 2147483647))::float8
               / (d.period * (rule->>'interval')::integer)
          FROM (SELECT CASE rule->>'freq' WHEN 'DAILY' THEN 1 WHEN 'WEEKLY' THEN 7 WHEN 'MONTHLY' THEN 28 ELSE 365 END
                         AS period,
                       CASE rule->>'freq'
                            WHEN 'DAILY' THEN 1
                            WHEN 'WEEKLY' THEN coalesce(nullif(cardinality(pgwork.recur_list(rule, 'bydaywd')), 0), 7)
                            ELSE CASE WHEN rule->>'freq' = 'YEARLY'
                                      THEN coalesce(nullif(cardinality(pgwork.recur_list(rule, 'bymonth')), 0), 12)
                                      ELSE 1 END
                                 * least(coalesce(nullif(cardinality(pgwork.recur_list(rule, 'bymonthday')), 0), 31),
                                         coalesce((SELECT nullif(sum(CASE WHEN n = 0 THEN 5 ELSE 1 END), 0)
                                                     FROM unnest(pgwork.recur_list(rule, 'bydayn')) AS n), 31))
                       END AS days) AS d);
COMMENT ON FUNCTION pgwork.recur_density(jsonb) IS
    'At most how many deadlines a compiled recurrence rule has a day (averaged over its period).';

-- The latest send of a series that fired before planned_at: what catch_up = latest keeps of the
-- sends that fell before the series was written or edited (the page's share of a series may end
-- before planned_at, so the page cannot see it among its own sends). For each remind_before
-- entry, the last deadline (not before series_from, not skipped, not past the end) whose send
-- fired before planned_at, searched backwards from planned_at in windows that double from a day:
-- a dense rule costs a day's deadlines, a sparse one a few windows. NULL: none.
CREATE FUNCTION pgwork.series_latest_missed(rule jsonb, due_local timestamp, tz text, remind_before interval[],
                                           recur_skip timestamp[], recur_until timestamp,
                                           series_from timestamptz, planned_at timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
DECLARE
    b       interval;
    best    timestamptz;
    got     timestamptz;
    hi      timestamp;
    size    interval;
    floor_l timestamp := (series_from AT TIME ZONE tz) - interval '1 day';
BEGIN
    FOREACH b IN ARRAY remind_before LOOP
        hi := (planned_at AT TIME ZONE tz) + b + interval '1 day';
        size := interval '1 day';
        got := NULL;
        WHILE got IS NULL AND hi >= floor_l LOOP
            SELECT max(f.fire) INTO got
              FROM (SELECT pgwork.fire_at(pgwork.local_to_instant(x.dl, tz), x.dl, tz, b) AS fire
                      FROM pgwork.recur_between(rule, due_local, greatest(hi - size, floor_l), hi) AS x(dl)
                     WHERE x.dl <> ALL (coalesce(recur_skip, '{}'))
                       AND (recur_until IS NULL OR x.dl <= recur_until)
                       AND pgwork.local_to_instant(x.dl, tz) >= series_from) AS f
             WHERE f.fire < planned_at;
            hi := hi - size - interval '1 microsecond';
            size := least(size * 2, interval '4 years');
        END LOOP;
        best := greatest(best, got);
    END LOOP;
    RETURN best;
END
$$;
COMMENT ON FUNCTION pgwork.series_latest_missed(jsonb, timestamp, text, interval[], timestamp[], timestamp, timestamptz, timestamptz) IS
    'The latest send of a recurring reminder that fired before planned_at (what catch_up = latest keeps).';

-- A page's recurring reminders (series), called by the page only when it has one (so the plan of
-- the one-off path stays what it was): for each, the sends that fall between its progress and
-- the cutoff, judged by the channel's catch_up, inserted keyed by their local deadline; returns
-- each reminder's new progress and what was made. Runs inside the page's statement and
-- transaction (the reminders are locked by it); never claims (a series' occurrence due now is
-- claimed by the next claim, one hop later).
--
-- Its work is bounded whatever a rule asks for. Deadlines are evaluated per remind_before entry,
-- in a window as wide as the page's span of fire time (plus a day each side for DST, and a probe
-- for the next deadline), never across the spread of the entries (sends a year ahead of their
-- deadlines cost no more than sends at them). And a series makes at most its share of the page
-- (budget sends, shared by the page's series, at least 16): when it could make more before the
-- cutoff (a dense rule, catch_up = all over a long past), the page goes only as far in fire time
-- as its share reaches, and leaves its progress there (unfinished): the next passes go on from
-- it, while every other reminder is served in each pass as usual.
CREATE FUNCTION pgwork.materialise_series(ids bigint[], cutoff timestamptz, budget integer)
RETURNS TABLE (id bigint, next_fire_at timestamptz, made bigint, made_due bigint, skipped bigint,
               made_ready bigint, earliest_made timestamptz, unfinished boolean)
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
               r.next_fire_at, greatest(coalesce(r.planned_at, r.created_at), r.series_from) AS planned_at,
               r.traceparent, r.tracestate, r.recur_rule, r.recur_skip, r.recur_until, r.series_from,
               r.recur_version, materialise_series.cutoff AS cutoff, ch.catch_up,
               least(coalesce((r.recur_rule->>'until')::timestamp, 'infinity'),
                     coalesce(r.recur_until, 'infinity')) AS last_local,
               (r.recur_rule->>'interval')::integer
                 * CASE r.recur_rule->>'freq' WHEN 'DAILY' THEN interval '2 days' WHEN 'WEEKLY' THEN interval '8 days'
                                              WHEN 'MONTHLY' THEN interval '32 days' ELSE interval '367 days' END AS span,
               greatest(16, materialise_series.budget / cardinality(materialise_series.ids))::float8 AS share
          FROM pgwork.reminder r
          LEFT JOIN pgwork.channel ch ON ch.name = r.channel
         WHERE r.id = ANY (materialise_series.ids) AND r.recur_rule IS NOT NULL
    ), rules AS MATERIALIZED (
        -- Per distinct rule (a page of rent series has one): its deadlines a day at most, and its
        -- times of day.
        SELECT x.recur_rule, pgwork.recur_density(x.recur_rule) AS density,
               cardinality(pgwork.recur_list(x.recur_rule, 'byhour'))
                 * cardinality(pgwork.recur_list(x.recur_rule, 'byminute')) AS times
          FROM (SELECT DISTINCT d.recur_rule FROM due d) AS x
    ), reach AS MATERIALIZED (
        -- How far in fire time this page goes for a series (upto): to the cutoff, or as far as
        -- its share of sends reaches at the rule's density, when that is short of the cutoff.
        -- Only the entries whose sends can fall in the range count (a send is never more than a
        -- day, for DST, before its deadline minus its entry, and no deadline is before the
        -- series' start): long before the start, only the longest entries have sends. The probe
        -- past the cutoff looks for the next deadline: a period of the rule (which has one then
        -- if it has one every period), two days for a rule with many times a day.
        SELECT d.*, s.step, d.next_fire_at + s.step < d.cutoff AS unfinished,
               least(d.cutoff, d.next_fire_at + s.step) AS upto,
               least(d.span, greatest(interval '2 days', make_interval(days => 1440 / u.times))) AS probe,
               CASE WHEN d.catch_up = 'latest' AND d.next_fire_at < d.planned_at
                    THEN pgwork.series_latest_missed(d.recur_rule, d.due_local, d.due_tz, d.remind_before,
                                                     d.recur_skip, d.recur_until, d.series_from, d.planned_at)
               END AS latest_missed
          FROM due d
          JOIN rules u ON u.recur_rule = d.recur_rule
         CROSS JOIN LATERAL (SELECT make_interval(secs => 86400.0 * d.share / u.density) AS one) AS o
         CROSS JOIN LATERAL (
               SELECT CASE WHEN d.next_fire_at + o.one / cardinality(d.remind_before) >= d.cutoff
                           THEN o.one  -- not short of the cutoff, whichever entries count
                           ELSE o.one / greatest(1, (SELECT count(*) FROM unnest(d.remind_before) AS b(before)
                                                      WHERE d.series_from - b.before - interval '1 day'
                                                            < d.next_fire_at + o.one)) END AS step) AS s
    ), windows AS MATERIALIZED (
        -- The local deadlines whose sends may fall between the series' progress (never before its
        -- start) and upto, a day more each side for DST, and the probe when the page goes to the
        -- cutoff: one window for all its remind_before entries when they lie close together (no
        -- further apart than the probe: rent's {7 days, 0}), so each deadline is evaluated once;
        -- one per entry when they are far apart, so that sends a year ahead of their deadlines
        -- cost no more than sends at them.
        SELECT r.id, r.recur_rule, r.due_local, r.due_tz, e.befores, e.longest, r.recur_skip, r.series_from,
               r.last_local,
               greatest((r.next_fire_at AT TIME ZONE r.due_tz) + e.shortest,
                        r.series_from AT TIME ZONE r.due_tz) - interval '1 day' AS lo,
               (r.upto AT TIME ZONE r.due_tz) + e.longest
                 + CASE WHEN r.unfinished THEN interval '1 day' ELSE r.probe END AS hi
          FROM reach r
         CROSS JOIN LATERAL (SELECT min(x) AS shortest, max(x) AS longest FROM unnest(r.remind_before) AS x) AS m
         CROSS JOIN LATERAL (
               SELECT r.remind_before AS befores, m.shortest, m.longest
                WHERE m.longest - m.shortest <= r.probe
               UNION ALL
               SELECT ARRAY[x], x, x
                 FROM unnest(r.remind_before) AS x
                WHERE m.longest - m.shortest > r.probe) AS e
    ), keyed AS MATERIALIZED (
        -- What a window's deadlines depend on. With INTERVAL=1 and a window after the first
        -- deadline, the first deadline does not matter (every period is kept; the rule's parts
        -- were completed from it when it was compiled): the key says so with -infinity, and such
        -- series of one rule, one zone, one window and its entries share one evaluation below.
        SELECT w.id, w.recur_rule, w.due_tz, w.befores, w.lo, least(w.hi, w.last_local) AS hi, w.recur_skip,
               w.series_from,
               CASE WHEN (w.recur_rule->>'interval')::integer = 1 AND w.lo >= w.due_local
                    THEN '-infinity' ELSE w.due_local END AS anchor
          FROM windows w
    ), evaluated AS MATERIALIZED (
        -- Each distinct window's deadlines, each as an instant (pgwork.local_to_instant), with the
        -- instants of its entries' sends (in the order of befores): on rent day, a million series
        -- of "the 1st at 09:00 Berlin" cost one evaluation per page.
        SELECT e.recur_rule, e.due_tz, e.lo, e.hi, e.anchor, e.befores, x.dl, x.deadline_at,
               ARRAY(SELECT pgwork.fire_at(x.deadline_at, x.dl, e.due_tz, b.before)
                       FROM unnest(e.befores) WITH ORDINALITY AS b(before, i) ORDER BY b.i) AS fire_ats
          FROM (SELECT DISTINCT k.recur_rule, k.due_tz, k.lo, k.hi, k.anchor, k.befores FROM keyed k) AS e
         CROSS JOIN LATERAL (
               SELECT r.dl, pgwork.local_to_instant(r.dl, e.due_tz) AS deadline_at
                 FROM pgwork.recur_between(e.recur_rule, CASE WHEN e.anchor = '-infinity' THEN e.lo ELSE e.anchor END,
                                           e.lo, e.hi) AS r(dl)) AS x
    ), deadlines AS MATERIALIZED (
        -- Its deadlines in the window, without the skipped ones and the history before the
        -- series' start; two deadlines on one instant (a time shifted by a DST gap onto another
        -- of the series) are one: the one not shifted. (No join with due here: estimated at a
        -- few rows, it was made a nested loop, a page's series times its deadlines.)
        SELECT DISTINCT ON (k.id, k.befores, e.deadline_at) k.id, k.befores, e.dl, e.deadline_at, e.fire_ats
          FROM keyed k
          JOIN evaluated e
            ON e.recur_rule = k.recur_rule AND e.due_tz = k.due_tz AND e.lo = k.lo AND e.hi = k.hi
           AND e.anchor = k.anchor AND e.befores = k.befores
         WHERE e.dl <> ALL (coalesce(k.recur_skip, '{}')) AND e.deadline_at >= k.series_from
         ORDER BY k.id, k.befores, e.deadline_at, (e.deadline_at AT TIME ZONE k.due_tz) <> e.dl, e.dl
    ), occ AS MATERIALIZED (
        -- Each deadline x remind_before entry; the channel's catch_up judges the sends that fired
        -- before the series was written or last edited (never a deadline before it: history).
        SELECT r.id, r.source, r.business_key, k.deadline_at AS due_at, r.channel, b.before,
               r.next_fire_at AS progress, b.fire_at, r.planned_at, r.cutoff, r.upto, r.unfinished,
               r.traceparent, r.tracestate, k.dl, r.recur_version, r.catch_up,
               pgwork.skipped_by_catch_up(r.catch_up, b.fire_at, r.planned_at,
                                          CASE WHEN r.catch_up = 'latest' THEN r.latest_missed END) AS skip
          FROM deadlines k
          JOIN reach r ON r.id = k.id
         CROSS JOIN LATERAL unnest(k.befores, k.fire_ats) AS b(before, fire_at)
    ), made AS (
        -- A series' occurrences, identified by their local deadline (work_series_occurrence_unique),
        -- so a zone edit or a time zone data update never makes a second one. A tombstone of the
        -- same local deadline stops it, and so does a row of another local deadline on the same
        -- instant (the same send, made before an edit). An occurrence an edit superseded is made
        -- again (its instant may have moved); one waiting for a retry keeps its retry time.
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
         WHERE o.fire_at >= o.progress
           AND CASE WHEN o.unfinished THEN o.fire_at < o.upto ELSE o.fire_at <= o.cutoff END
           AND (SELECT true FROM pgwork.retired t
                 WHERE t.reminder_id = o.id AND t.deadline_local = o.dl AND t.occurrence = o.before
                 LIMIT 1) IS NULL
           AND (SELECT true FROM pgwork.renewal_work x
                 WHERE x.reminder_id = o.id AND x.deadline = o.due_at AND x.occurrence = o.before
                   AND x.deadline_local IS DISTINCT FROM o.dl
                 LIMIT 1) IS NULL
            ON CONFLICT (reminder_id, deadline_local, occurrence) WHERE deadline_local IS NOT NULL DO UPDATE
           SET status = excluded.status,
               available_at = CASE WHEN w.attempts > 0 AND excluded.status = 'ready'
                                   THEN greatest(w.available_at, excluded.available_at)
                                   ELSE excluded.available_at END,
               finished_at = excluded.finished_at, last_error = excluded.last_error,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate,
               deadline = excluded.deadline, due_at = excluded.due_at, recur_version = excluded.recur_version
         WHERE w.status = 'superseded'
        RETURNING w.reminder_id, w.status, w.due_at
    ), nxt AS (
        -- Unfinished: its progress is how far the page went. Else its first send past the
        -- cutoff in the windows, but never later than the earliest send of a deadline past a
        -- window (not looked at yet), less a day for DST; with nothing in the windows, that
        -- bound is a probe. 'infinity' once every window reached the series' end.
        SELECT r.id, r.unfinished,
               CASE WHEN r.unfinished THEN r.upto
                    WHEN b.ended THEN coalesce(f.next_at, 'infinity')
                    ELSE least(f.next_at, b.bound) END AS next_fire_at
          FROM reach r
          JOIN (SELECT w.id, bool_and(w.hi >= w.last_local) AS ended,
                       min(pgwork.local_to_instant(w.hi - w.longest, w.due_tz)) - interval '1 day' AS bound
                  FROM windows w
                 GROUP BY w.id) AS b ON b.id = r.id
          LEFT JOIN (SELECT o.id, min(o.fire_at) FILTER (WHERE o.fire_at > o.cutoff) AS next_at
                       FROM occ o
                      GROUP BY o.id) AS f ON f.id = r.id
    )
    SELECT n.id, n.next_fire_at,
           count(m.reminder_id),
           count(m.reminder_id) FILTER (WHERE m.due_at <= now() AND m.status = 'ready'),
           count(m.reminder_id) FILTER (WHERE m.status = 'expired'),
           count(m.reminder_id) FILTER (WHERE m.status = 'ready'),
           min(m.due_at),
           n.unfinished
      FROM nxt n
      LEFT JOIN made m ON m.reminder_id = n.id
     GROUP BY n.id, n.next_fire_at, n.unfinished;
END
$$;
COMMENT ON FUNCTION pgwork.materialise_series(bigint[], timestamptz, integer) IS
    'The materialiser''s page for its recurring reminders (called by materialise_page only).';
REVOKE EXECUTE ON FUNCTION pgwork.materialise_series FROM PUBLIC;

CREATE FUNCTION pgwork.materialise_page(
    coordinate boolean, cutoff_at timestamptz, lookahead interval, after_at timestamptz,
    after_id bigint, page_limit integer, origin text, take jsonb, claim_lease interval,
    daemon_id text, aside bigint[])
RETURNS TABLE (
    cutoff timestamptz, scanned bigint, made bigint, made_due bigint, skipped bigint,
    notified bigint, earliest_made timestamptz, last_at timestamptz, last_id bigint,
    unfinished bigint, id bigint, reminder_id bigint, source text, business_key text, deadline timestamptz,
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
           AND NOT r.id = ANY (materialise_page.aside)
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
         CROSS JOIN LATERAL pgwork.materialise_series(a.ids, (SELECT p.cutoff FROM params p),
                                                      materialise_page.page_limit) AS s
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
               l.next_fire_at AS last_at, l.id AS last_id,
               (SELECT count(*) FROM series s WHERE s.unfinished) AS unfinished
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
           f.last_at, f.last_id, f.unfinished,
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

CREATE OR REPLACE VIEW pgwork.reminder_status WITH (security_barrier) AS
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
         -- From a day before now (DST), past the deadlines of that day (two dates' times of day
         -- at most: a dense series has many), to 64 more.
         FROM pgwork.recur_upcoming(r.recur_rule, r.due_local,
                                    greatest(now(), r.series_from) AT TIME ZONE r.due_tz - interval '1 day',
                                    64 + 2 * cardinality(pgwork.recur_list(r.recur_rule, 'byhour'))
                                           * cardinality(pgwork.recur_list(r.recur_rule, 'byminute'))) AS x(dl)
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

-- A series whose recur_skip holds a NULL made nothing (every deadline compared NULL with it):
-- the NULLs are dropped, which restarts each such series from now, as any edit does.
UPDATE pgwork.reminder SET recur_skip = array_remove(recur_skip, NULL)
 WHERE array_position(recur_skip, NULL) IS NOT NULL;

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

-- A series whose rule has an UNTIL in UTC is compiled again: UNTIL now bounds the instant.
UPDATE pgwork.reminder SET recur_rule = pgwork.recur_compile(recur, due_local, due_tz)
 WHERE recur ~* 'UNTIL=[0-9]{8}T[0-9]{6}Z';

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        GRANT EXECUTE ON FUNCTION pgwork.materialise_page TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_series TO pgwork_daemon;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        GRANT DELETE ON pgwork.retired TO pgwork_cleanup;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 14, applied_at = now();
