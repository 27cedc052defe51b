-- pgwork/sql/code/page.sql — The materialiser's page: one call makes the due work rows and claims what the daemons asked for.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- One page of the materialiser, as two statements run here, so that the daemon sends one:
--
-- 1. The materialiser's coordination lock: a table lock on pgwork.materialiser_state, which no
--    app role can take (any mode but ACCESS SHARE needs UPDATE, DELETE or TRUNCATE on the
--    table), unlike an advisory lock, whose key any session can hold; and which, unlike the row
--    lock it replaces, writes nothing (a row lock marks the row in the heap: a WAL record and a
--    transaction id on every pass, idle or not). Taken in a statement of its own, before the
--    page's: this function is VOLATILE, so each statement takes a new snapshot (READ COMMITTED),
--    and the page's is younger than any retention batch that retired work rows (retention
--    takes the table in EXCLUSIVE mode too): a page can never miss a tombstone and re-insert an
--    occurrence already sent. With coordinate, only one materialiser pages at a time (EXCLUSIVE,
--    without waiting: the others get no row and retry shortly); without (tests racing two
--    passes), materialisers share the lock (SHARE mode, which waits for retention). Without the
--    lock, the function returns no row.
--
-- 2. One keyset page of reminders with an occurrence firing at or before the cutoff: insert
--    their work rows, advance each reminder's next_fire_at past the cutoff ('infinity' when
--    nothing is left), and NOTIFY the workers of every daemon when it made rows left for a
--    claim (ready: due now, or later, which their claim timers must learn of; the payload names
--    the daemon whose materialiser made them: its own workers know already). Rows the page
--    claimed or closed as expired are no other daemon's business: told of them, every other
--    daemon would run a claim that finds nothing, once per reminder due now. Only occurrences
--    at or after the reminder's progress (next_fire_at) are inserted, and never one that
--    retention retired: an occurrence is materialised once per deadline, whatever retention
--    deleted since. A repeat is a no-op; a superseded row for the same deadline is revived
--    because the deadline came back.
--    Reminders locked by an app's transaction are skipped (their progress is unchanged, so the
--    next pass takes them); the caller sees that in next_fire_at. So are those in aside: the
--    daemon sets aside a reminder a page failed on, for a while, so that the others go on.
--    One hop for work due now: up to room occurrences due now of each of the daemon's channels
--    in take (those with idle workers: [{"channel", "room", "expire_after_s"}, ...]) are
--    inserted already claimed, under a lease for daemon_id, as the claim would (a work_lease
--    row with lease and attempts 1; the record keeps 0, the last settled). Only for a channel whose gate is open and that has nothing to count (no rate
--    limit, global concurrency or throttle limit: their claims go through claim_work) and for
--    an occurrence not past its expire_after; the others are inserted ready.
--    A series makes at most its share of the page (pgwork.materialise_series): unfinished
--    counts those whose progress the page left short of the cutoff, for the next pass.
--    It returns the page's figures on every row, with the rows it inserted claimed, one per
--    row, as claim_work returns them (pgwork.claimed; a page that claimed none returns one row
--    whose claimed is NULL).
--
-- The page commits without waiting for the WAL flush: one lost in a crash is redone by the next
-- pass (the progress is in the same transaction), and work due now reaches a worker one disk
-- flush sooner. It always runs its generic plan: with many reminders the planner judged it worse
-- than a custom one (it cannot see the cutoff) and planned the page again on every pass, 1.4 ms
-- of a 7 ms idle latency with a million far-future reminders; the page reads its index in key
-- order up to a LIMIT either way. And it never scans a table: every row it reads, it reads by
-- key (reminders through their index, by ctid once locked; work rows and tombstones by their
-- keys), whatever the statistics said when its plan was made. A plan made while the tables were
-- empty or small, and kept, advanced the page's reminders by a sequential scan of all of them
-- on every pass (tests/test_hot_path.py::test_a_page_planned_on_empty_tables_reads_by_key).
-- The planner settings are the function's own (SET below), as the claim's and the lease
-- functions' are: they hold in any session that calls it (a daemon's, an operator's, one behind
-- PgBouncer), and in none after. synchronous_commit is the transaction's: it must hold at the
-- commit, after the function returned.
CREATE OR REPLACE FUNCTION pgwork.materialise_page(
    coordinate boolean, cutoff_at timestamptz, lookahead interval, after_at timestamptz,
    after_id bigint, page_limit integer, origin text, take jsonb, claim_lease interval,
    daemon_id text, aside bigint[], turn_after text)
RETURNS TABLE (
    cutoff timestamptz, scanned bigint, made bigint, made_due bigint, skipped bigint,
    notified bigint, earliest_made timestamptz, last_at timestamptz, last_id bigint,
    unfinished bigint, turn_source text, claimed pgwork.claimed)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan SET enable_seqscan = off AS $$
#variable_conflict use_column
DECLARE
    got boolean;
    cut timestamptz;
    -- Fair turns (see below): the page's reminders (their row versions), and where its cursor
    -- moves.
    fair tid[];
    fair_at timestamptz;
    fair_id bigint;
    fair_turn text;
BEGIN
    -- Under repeatable read or serializable, every statement here would share the snapshot taken
    -- before the lock: the ordering above, and with it "never sent twice", would not hold.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgwork.materialise_page needs transaction_isolation = read committed, not %',
                        current_setting('transaction_isolation')
              USING HINT = 'a default_transaction_isolation set on the database or role applies to '
                           'pgwork''s sessions too: set it to read committed for the daemon''s role';
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    IF materialise_page.coordinate THEN
        BEGIN
            LOCK TABLE pgwork.materialiser_state IN EXCLUSIVE MODE NOWAIT;
            got := true;
        EXCEPTION WHEN lock_not_available THEN
            got := false;
        END;
    ELSE
        LOCK TABLE pgwork.materialiser_state IN SHARE MODE;
        got := true;
    END IF;
    IF NOT got THEN
        RETURN;
    END IF;
    cut := coalesce(materialise_page.cutoff_at, now() + materialise_page.lookahead);
    -- Fair turns. A page takes the due reminders in due order; when more are due after the
    -- cursor than it can take (one app's flood, a catch-up), that order would make every other
    -- source's reminders wait behind them. Such a page serves the sources with due reminders in
    -- turn instead: half the page goes to the next of them in name order, after the last one a
    -- page served (turn_after, which the daemon carries from page to page and pass to pass), round
    -- to the first and on, at most half a page of sources, each its earliest ones (its share: that
    -- half over their number, at least one). The rest goes to due order, which moves the cursor
    -- (the rows served out of turn leave the due set as they are made). A source with a due
    -- reminder waits for at most (due sources) / (half a page) pages, whatever the others have
    -- due and however many they are; turn_source says where the next page's turn starts. Sources
    -- are found by a skip scan of reminder_due_by_source, a probe or two per source, up to half
    -- a page of due ones: only for a page that is full, never for an idle one. A page of one
    -- reminder (bisecting a failed page) is in due order. The page takes the rows chosen by their
    -- row versions (a TID scan, whatever the statistics said when its plan was made: by id, a plan
    -- made while the table was empty read a whole index per page, 6 s with 200,000 reminders on
    -- PostgreSQL 15); one an app changed meanwhile is left for the next page.
    IF materialise_page.page_limit > 1
       AND (SELECT count(*) FROM (
                SELECT FROM pgwork.reminder r
                 WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                   AND coalesce(r.next_fire_at, r.due_at) <= cut
                   AND (coalesce(r.next_fire_at, r.due_at), r.id)
                       > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                   AND NOT r.id = ANY (materialise_page.aside)
                 ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                 LIMIT materialise_page.page_limit + 1) AS c) > materialise_page.page_limit THEN
        WITH RECURSIVE walk (source, lap, n) AS (
            -- The sources with reminders left to make, in name order from the one after
            -- turn_after (lap 0) round to it again (lap 1): one probe of the index per source.
            SELECT s.source, s.lap, 1
              FROM (SELECT coalesce(a.source, b.source)::text AS source, (a.source IS NULL)::int AS lap
                      FROM (SELECT (SELECT r.source FROM pgwork.reminder r
                                     WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                                       AND r.source > coalesce(materialise_page.turn_after, '')
                                     ORDER BY r.source LIMIT 1) AS source) AS a,
                           (SELECT (SELECT r.source FROM pgwork.reminder r
                                     WHERE r.next_fire_at IS NULL OR r.next_fire_at < 'infinity'
                                     ORDER BY r.source LIMIT 1) AS source) AS b) AS s
             WHERE s.source IS NOT NULL
               AND (s.lap = 0 OR s.source <= coalesce(materialise_page.turn_after, ''))
            UNION ALL
            SELECT x.source, x.lap, w.n + 1
              FROM walk w
             CROSS JOIN LATERAL (
                   SELECT CASE WHEN nx.source IS NOT NULL THEN nx.source
                               WHEN w.lap = 0 THEN (SELECT r.source FROM pgwork.reminder r
                                                     WHERE r.next_fire_at IS NULL OR r.next_fire_at < 'infinity'
                                                     ORDER BY r.source LIMIT 1) END::text AS source,
                          w.lap + (nx.source IS NULL)::int AS lap
                     FROM (SELECT (SELECT r.source FROM pgwork.reminder r
                                    WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                                      AND r.source > w.source
                                    ORDER BY r.source LIMIT 1) AS source) AS nx) AS x
             WHERE x.source IS NOT NULL
               AND (x.lap = 0 OR x.source <= coalesce(materialise_page.turn_after, ''))
        ), due_src AS MATERIALIZED (
            -- The first half page of them with a reminder due after the cursor (a probe per
            -- source: a scalar subquery with LIMIT, not EXISTS, which a plan made on stale
            -- statistics turned into a hash of every due reminder, on every page); the walk
            -- stops there.
            SELECT w.source, w.n
              FROM walk w
             WHERE (SELECT true FROM pgwork.reminder r
                     WHERE r.source = w.source
                       AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                       AND coalesce(r.next_fire_at, r.due_at) <= cut
                       AND (coalesce(r.next_fire_at, r.due_at), r.id)
                           > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                       AND NOT r.id = ANY (materialise_page.aside)
                     ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                     LIMIT 1) IS NOT NULL
             LIMIT greatest(1, materialise_page.page_limit / 2)
        ), share AS MATERIALIZED (
            SELECT greatest(1, (materialise_page.page_limit / 2) / count(*))::int AS n, count(*) AS sources,
                   (SELECT d.source FROM due_src d ORDER BY d.n DESC LIMIT 1) AS last_source
              FROM due_src
        ), picks AS MATERIALIZED (
            SELECT p.id, p.row_ctid
              FROM due_src s
             CROSS JOIN share h
             CROSS JOIN LATERAL (
                   SELECT r.id, r.ctid AS row_ctid
                     FROM pgwork.reminder r
                    WHERE r.source = s.source
                      AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                      AND coalesce(r.next_fire_at, r.due_at) <= cut
                      AND (coalesce(r.next_fire_at, r.due_at), r.id)
                          > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                      AND NOT r.id = ANY (materialise_page.aside)
                    ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                    LIMIT h.n) AS p
             WHERE h.sources > 1
        ), fill AS MATERIALIZED (
            SELECT r.id, r.ctid AS row_ctid, coalesce(r.next_fire_at, r.due_at) AS at
              FROM pgwork.reminder r
             WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
               AND coalesce(r.next_fire_at, r.due_at) <= cut
               AND (coalesce(r.next_fire_at, r.due_at), r.id)
                   > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
               AND NOT r.id = ANY (materialise_page.aside)
               AND NOT r.id = ANY ((SELECT coalesce(array_agg(k.id), '{}') FROM picks k)::bigint[])
             ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
             LIMIT materialise_page.page_limit - (SELECT count(*) FROM picks)
        )
        SELECT (SELECT array_agg(k.row_ctid) FROM picks k) || (SELECT array_agg(f.row_ctid) FROM fill f),
               l.at, l.id, (SELECT h.last_source FROM share h)
          INTO fair, fair_at, fair_id, fair_turn
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (SELECT f.at, f.id FROM fill f ORDER BY f.at DESC, f.id DESC LIMIT 1) AS l ON true
         WHERE (SELECT count(*) FROM picks) > 0;
    END IF;
    RETURN QUERY
    WITH params AS MATERIALIZED (
        -- The first page of a pass fixes the cutoff; later pages pass it back.
        SELECT cut AS cutoff
    ), due AS MATERIALIZED (
        SELECT *
          FROM (SELECT r.ctid AS row_ctid, r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz,
                       r.remind_before, r.channel, coalesce(r.next_fire_at, r.due_at) AS next_fire_at,
                       coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate,
                       r.series_from
                  FROM pgwork.reminder r
                 WHERE fair IS NULL
                   AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                   AND coalesce(r.next_fire_at, r.due_at) <= cut
                   AND (coalesce(r.next_fire_at, r.due_at), r.id)
                       > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                   AND NOT r.id = ANY (materialise_page.aside)
                 ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                 LIMIT materialise_page.page_limit
                   FOR UPDATE OF r SKIP LOCKED) AS in_order
        UNION ALL
        -- Only the row versions in the inner query: a TID scan is then its one plan (with
        -- sequential scans off); whether each is still due is checked on the version it locked.
        SELECT t.row_ctid, t.id, t.source, t.business_key, t.due_at, t.due_local, t.due_tz,
               t.remind_before, t.channel, coalesce(t.next_fire_at, t.due_at), t.planned_at,
               t.traceparent, t.tracestate, t.series_from
          FROM (SELECT r.ctid AS row_ctid, r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz,
                       r.remind_before, r.channel, r.next_fire_at,
                       coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate,
                       r.series_from
                  FROM pgwork.reminder r
                 WHERE fair IS NOT NULL AND r.ctid = ANY (fair)
                OFFSET 0  -- a fence: no qual of the outer query is pushed into this one
                   FOR UPDATE OF r SKIP LOCKED) AS t
         WHERE (t.next_fire_at IS NULL OR t.next_fire_at < 'infinity')
           AND coalesce(t.next_fire_at, t.due_at) <= cut
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
           AND NOT pgwork.limited(c)
    ), made AS (
        INSERT INTO pgwork.renewal_work AS w
               (reminder_id, source, business_key, deadline, occurrence, due_at, channel, operation_id,
                available_at, status, finished_at, last_error, traceparent, tracestate,
                lease, attempts, claimed_at, claimed_by)
        SELECT o.id, o.source, o.business_key, o.due_at, o.before, o.fire_at, o.channel,
               pgwork.operation_id(o.id, o.source, o.business_key, o.due_at, o.before),
               o.fire_at,
               CASE WHEN o.skip THEN 'expired' ELSE 'ready' END,
               CASE WHEN o.skip THEN now() END,
               CASE WHEN o.skip THEN format('skipped by catch_up = %s: due %s, before its reminder was written (%s)',
                                           o.catch_up, o.fire_at, o.planned_at) END,
               o.traceparent, o.tracestate,
               0, 0,
               -- Claimed here: its lease row follows (leased), and claimed_at = now() tells them apart.
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
           -- A revived row keeps its lease and attempts: it is made ready, never claimed here, on
           -- the reminder's channel now. One that was tried (waiting for a retry when an edit
           -- closed it) is that send going on: never closed by catch_up, its retry time kept.
           SET status = CASE WHEN w.attempts > 0 THEN 'ready' ELSE excluded.status END,
               available_at = CASE WHEN w.attempts > 0 THEN greatest(w.available_at, excluded.due_at)
                                   ELSE excluded.available_at END,
               finished_at = CASE WHEN w.attempts > 0 THEN NULL ELSE excluded.finished_at END,
               last_error = CASE WHEN w.attempts > 0 THEN w.last_error ELSE excluded.last_error END,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate, channel = excluded.channel
         WHERE w.status = 'superseded'
        -- The whole row only for those claimed here (pgwork.as_claimed below): a row revived by
        -- the upsert keeps the claimed_at of an earlier statement.
        RETURNING w.id, w.reminder_id, w.status, w.due_at, w.channel, w.source, w.available_at,
                  w.status = 'ready' AND w.claimed_at IS NOT DISTINCT FROM now() AS taken,
                  CASE WHEN w.status = 'ready' AND w.claimed_at IS NOT DISTINCT FROM now() THEN w END AS work
    ), queued AS (
        -- The rows made ready (pgwork.wake_lanes wakes their lanes) ...
        INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
        SELECT m.id, m.channel, m.source, m.available_at, m.due_at FROM made m WHERE m.status = 'ready' AND NOT m.taken
    ), leased AS (
        -- ... and the leases of those claimed here: the first, one attempt.
        INSERT INTO pgwork.work_lease (work_id, lease, attempts, channel, source, due_at, expires_at, claimed_by, claimed_at)
        SELECT m.id, 1, 1, m.channel, m.source, m.due_at, now() + materialise_page.claim_lease,
               materialise_page.daemon_id, now()
          FROM made m WHERE m.taken
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
        -- One aggregate over each of made, series and due (each scalar subquery over a CTE was
        -- nodes of its own for every page to start and end).
        SELECT p.cutoff, CASE WHEN fair IS NULL THEN c.scanned ELSE cardinality(fair) END AS scanned,
               m.made + s.made AS made, m.made_due + s.made_due AS made_due, m.skipped + s.skipped AS skipped,
               (SELECT count(*) FROM (SELECT pg_notify('pgwork_work', materialise_page.origin)
                                       WHERE m.ready OR s.ready) AS n) AS notified,
               least(m.earliest, s.earliest) AS earliest_made,
               CASE WHEN fair IS NULL THEN l.next_fire_at ELSE coalesce(fair_at, materialise_page.after_at) END AS last_at,
               CASE WHEN fair IS NULL THEN l.id ELSE coalesce(fair_id, materialise_page.after_id) END AS last_id,
               s.unfinished,
               CASE WHEN fair IS NULL THEN materialise_page.turn_after ELSE fair_turn END AS turn_source
          FROM params p
         CROSS JOIN (SELECT count(*) AS made,
                            count(*) FILTER (WHERE m.due_at <= now() AND m.status = 'ready') AS made_due,
                            count(*) FILTER (WHERE m.status = 'expired') AS skipped,
                            coalesce(bool_or(m.status = 'ready' AND NOT m.taken), false) AS ready,
                            min(m.due_at) AS earliest
                       FROM made m) AS m
         CROSS JOIN (SELECT coalesce(sum(s.made), 0)::bigint AS made, coalesce(sum(s.made_due), 0)::bigint AS made_due,
                            coalesce(sum(s.skipped), 0)::bigint AS skipped, coalesce(bool_or(s.made_ready > 0), false) AS ready,
                            min(s.earliest_made) AS earliest, count(*) FILTER (WHERE s.unfinished) AS unfinished
                       FROM series s) AS s
         CROSS JOIN (SELECT count(*) AS scanned FROM due) AS c
          LEFT JOIN LATERAL (SELECT d.next_fire_at, d.id FROM due d ORDER BY d.next_fire_at DESC, d.id DESC LIMIT 1) l ON true
    ), claimed AS (
        -- The reminder as this statement's snapshot sees it (advanced changed only its progress).
        SELECT pgwork.as_claimed(m.work, 'claimed', 1, 1, 'ready', r.recipient, r.payload::text, NULL) AS claimed,
               m.due_at, m.id
          FROM made m
          JOIN pgwork.reminder r ON r.id = m.reminder_id
         WHERE m.taken
    )
    SELECT f.cutoff, f.scanned, f.made, f.made_due, f.skipped, f.notified, f.earliest_made,
           f.last_at, f.last_id, f.unfinished, f.turn_source, c.claimed
      FROM figures f
      LEFT JOIN claimed c ON true
     ORDER BY c.due_at, c.id;
END
$$;
COMMENT ON FUNCTION pgwork.materialise_page IS
    'The materialiser''s page (lock, page, the rows it claimed), called by the daemon only.';
REVOKE EXECUTE ON FUNCTION pgwork.materialise_page FROM PUBLIC;
