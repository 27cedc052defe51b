-- pgwork/sql/code/series.sql — The materialiser's series: a page's recurring reminders made into work, within a budget.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- The latest send of a series that fired before planned_at: what catch_up = latest keeps of the
-- sends that fell before the series was written or edited (the page's share of a series may end
-- before planned_at, so the page cannot see it among its own sends). For each remind_before
-- entry, the last deadline (not before series_from, not skipped, not past the end) whose send
-- fired before planned_at, searched backwards from planned_at in windows that double from a day:
-- a dense rule costs a day's deadlines, a sparse one a few windows. NULL: none.
CREATE OR REPLACE FUNCTION pgwork.series_latest_missed(rule jsonb, due_local timestamp, tz text, remind_before interval[],
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
CREATE OR REPLACE FUNCTION pgwork.materialise_series(ids bigint[], cutoff timestamptz, budget integer)
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
               greatest(16, materialise_series.budget / cardinality(materialise_series.ids))::float8 AS share,
               -- Its rule's deadlines a day at most, and times of day (inlined: expressions only).
               pgwork.recur_density(r.recur_rule) AS density, pgwork.recur_times(r.recur_rule) AS times
          FROM pgwork.reminder r
          LEFT JOIN pgwork.channel ch ON ch.name = r.channel
         WHERE r.id = ANY (materialise_series.ids) AND r.recur_rule IS NOT NULL
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
               least(d.span, greatest(interval '2 days', make_interval(days => 1440 / d.times))) AS probe,
               CASE WHEN d.catch_up = 'latest' AND d.next_fire_at < d.planned_at
                    THEN pgwork.series_latest_missed(d.recur_rule, d.due_local, d.due_tz, d.remind_before,
                                                     d.recur_skip, d.recur_until, d.series_from, d.planned_at)
               END AS latest_missed
          FROM due d
         CROSS JOIN LATERAL (SELECT make_interval(secs => 86400.0 * d.share / d.density) AS one) AS o
         CROSS JOIN LATERAL (
               SELECT CASE WHEN d.next_fire_at + o.one / cardinality(d.remind_before) >= d.cutoff
                           THEN o.one  -- not short of the cutoff, whichever entries count
                           ELSE o.one / greatest(1, (SELECT count(*) FROM unnest(d.remind_before) AS b(before)
                                                      WHERE d.series_from - b.before - interval '1 day'
                                                            < d.next_fire_at + o.one)) END AS step) AS s
    ), windows AS MATERIALIZED (
        -- The local deadlines whose sends may fall between the series' progress (never before its
        -- start) and upto, and the probe when the page goes to the cutoff: one window for all its
        -- remind_before entries when they lie close together (no further apart than the probe:
        -- rent's {7 days, 0}), so each deadline is evaluated once; one per entry when they are
        -- far apart, so that sends a year ahead of their deadlines cost no more than sends at
        -- them. A local time and the instant it becomes differ from a plain shift by the zone's
        -- offset changes near it (pgwork.offset_shift: none, most of the year), so the window
        -- reaches that much (and a minute) past the sends' span, not a day each side: a series
        -- every minute evaluated 2,880 deadlines a window for a share of 16. Past hi_main, the
        -- probe needs the first deadline only (the one after it sends later), unless an offset
        -- change is near or the probe is long: then the whole probe, as the order of local times
        -- may not hold (a DST gap shifts a time forward past the next).
        SELECT r.id, r.recur_rule, r.due_local, r.due_tz, e.befores, e.longest, r.recur_skip, r.series_from,
               r.last_local,
               greatest((r.next_fire_at AT TIME ZONE r.due_tz) + e.shortest
                          - pgwork.offset_shift(r.due_tz, r.next_fire_at),
                        (r.series_from AT TIME ZONE r.due_tz) - pgwork.offset_shift(r.due_tz, r.series_from))
                 - interval '1 minute' AS lo,
               (r.upto AT TIME ZONE r.due_tz) + e.longest + pgwork.offset_shift(r.due_tz, r.upto)
                 + interval '1 minute' AS hi_main,
               (r.upto AT TIME ZONE r.due_tz) + e.longest + pgwork.offset_shift(r.due_tz, r.upto)
                 + interval '1 minute' + CASE WHEN r.unfinished THEN interval '0' ELSE r.probe END AS hi,
               -- The probe's order holds with no offset change where its sends fall (a dense
               -- rule's probe: two days at most, and its entries as far apart at most).
               NOT r.unfinished AND r.probe <= interval '2 days'
                 AND pgwork.offset_shift(r.due_tz, r.upto) = '0'
                 AND pgwork.offset_shift(r.due_tz, r.upto + interval '48 hours') = '0'
                 AND pgwork.offset_shift(r.due_tz, r.upto + interval '96 hours') = '0' AS probe_first
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
        SELECT w.id, w.recur_rule, w.due_tz, w.befores, w.lo, least(w.hi, w.last_local) AS hi,
               least(w.hi_main, w.last_local) AS hi_main, w.probe_first, w.recur_skip, w.series_from,
               CASE WHEN (w.recur_rule->>'interval')::integer = 1 AND w.lo >= w.due_local
                    THEN '-infinity' ELSE w.due_local END AS anchor
          FROM windows w
    ), evaluated AS MATERIALIZED (
        -- Each distinct window's deadlines, each as an instant (pgwork.local_to_instant), with the
        -- instants of its entries' sends (in the order of befores): on rent day, a million series
        -- of "the 1st at 09:00 Berlin" cost one evaluation per page.
        -- Past hi_main, only the probe's first deadline when its order holds (probe_first).
        SELECT e.recur_rule, e.due_tz, e.lo, e.hi, e.hi_main, e.probe_first, e.anchor, e.befores, x.dl, x.deadline_at,
               ARRAY(SELECT pgwork.fire_at(x.deadline_at, x.dl, e.due_tz, b.before)
                       FROM unnest(e.befores) WITH ORDINALITY AS b(before, i) ORDER BY b.i) AS fire_ats
          FROM (SELECT DISTINCT k.recur_rule, k.due_tz, k.lo, k.hi, k.hi_main, k.probe_first, k.anchor, k.befores
                  FROM keyed k) AS e
         CROSS JOIN LATERAL (
               SELECT r.dl, pgwork.local_to_instant(r.dl, e.due_tz) AS deadline_at
                 FROM (SELECT d.dl
                         FROM pgwork.recur_between(e.recur_rule, CASE WHEN e.anchor = '-infinity' THEN e.lo ELSE e.anchor END,
                                                   e.lo, least(e.hi_main, e.hi)) AS d(dl)
                       UNION ALL
                       (SELECT d.dl
                          FROM pgwork.recur_between(e.recur_rule, CASE WHEN e.anchor = '-infinity' THEN e.lo ELSE e.anchor END,
                                                    e.lo, e.hi) AS d(dl)
                         WHERE d.dl > e.hi_main
                         ORDER BY d.dl
                         LIMIT CASE WHEN e.probe_first THEN 1 END)) AS r) AS x
    ), deadlines AS MATERIALIZED (
        -- Its deadlines in the window, without the skipped ones and the history before the
        -- series' start; two deadlines on one instant (a time shifted by a DST gap onto another
        -- of the series) are one: the one not shifted. (No join with due here: estimated at a
        -- few rows, it was made a nested loop, a page's series times its deadlines.)
        SELECT DISTINCT ON (k.id, k.befores, e.deadline_at) k.id, k.befores, e.dl, e.deadline_at, e.fire_ats
          FROM keyed k
          JOIN evaluated e
            ON e.recur_rule = k.recur_rule AND e.due_tz = k.due_tz AND e.lo = k.lo AND e.hi = k.hi
           AND e.hi_main = k.hi_main AND e.probe_first = k.probe_first
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
        -- again (its instant may have moved), on the reminder's channel now; one waiting for a
        -- retry keeps its retry time, and is never closed by catch_up (that send goes on).
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
           SET status = CASE WHEN w.attempts > 0 THEN 'ready' ELSE excluded.status END,
               available_at = CASE WHEN w.attempts > 0
                                   THEN greatest(w.available_at, excluded.available_at)
                                   ELSE excluded.available_at END,
               finished_at = CASE WHEN w.attempts > 0 THEN NULL ELSE excluded.finished_at END,
               last_error = CASE WHEN w.attempts > 0 THEN w.last_error ELSE excluded.last_error END,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate, channel = excluded.channel,
               deadline = excluded.deadline, due_at = excluded.due_at, recur_version = excluded.recur_version
         WHERE w.status = 'superseded'
        RETURNING w.id, w.reminder_id, w.status, w.due_at, w.channel, w.source, w.available_at
    ), queued AS (
        -- The rows made ready, in the claim's order (pgwork.wake_lanes wakes their lanes).
        INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
        SELECT m.id, m.channel, m.source, m.available_at, m.due_at FROM made m WHERE m.status = 'ready'
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
