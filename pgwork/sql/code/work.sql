-- pgwork/sql/code/work.sql — Work rows: terminal statuses, why an occurrence is no longer wanted, the claim's helpers
-- (channel capacity, fair lanes and their trigger, the rate limit's tokens).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.is_terminal(status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired');
COMMENT ON FUNCTION pgwork.is_terminal(text) IS
    'Whether a work status is final (queries use this; inlined, it still matches the work_terminal index).';

CREATE OR REPLACE FUNCTION pgwork.unwanted(reminder_id bigint, reminder_due_at timestamptz,
                                remind_before interval[], deadline timestamptz, occurrence interval)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN reminder_due_at <> deadline OR NOT occurrence = ANY (remind_before) THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.unwanted(bigint, timestamptz, interval[], timestamptz, interval) IS
    'Why an occurrence is no longer wanted by its reminder (a missing reminder: cancelled; a moved deadline or a dropped remind_before entry: superseded), or NULL while it is.';

-- The channel's catch_up policy for a send that fired before its reminder (or series) was
-- written or last moved: all are sent; latest: only the most recent of them (latest_missed: the
-- reminder's latest send before planned_at); none: none. True: close it as expired instead.
CREATE OR REPLACE FUNCTION pgwork.skipped_by_catch_up(policy text, fire_at timestamptz, planned_at timestamptz,
                                           latest_missed timestamptz)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE coalesce(policy, 'all') WHEN 'none' THEN fire_at < planned_at
                                    WHEN 'latest' THEN fire_at < latest_missed
                                    ELSE false END;
COMMENT ON FUNCTION pgwork.skipped_by_catch_up(text, timestamptz, timestamptz, timestamptz) IS
    'Whether a channel''s catch_up policy skips a send that fired before its reminder was written or moved.';

-- A limit is in force on a channel: a rate limit, a global concurrency, or a throttle limit (a
-- receiver's throttling answers, the circuit breaker's one probe at a time). Its claims are then
-- counted under the channel's row lock (pgwork.claim_lanes), and the materialiser's page claims
-- none for it. The one definition: the claim, the page and the gate's reading ask it (the daemon
-- skips the page's claim for a channel whose config sets one, before any throttle is known).
CREATE OR REPLACE FUNCTION pgwork.limited(c pgwork.channel) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN c.rate_limit IS NOT NULL OR c.global_concurrency IS NOT NULL OR c.throttle_limit IS NOT NULL;
COMMENT ON FUNCTION pgwork.limited(pgwork.channel) IS
    'Whether a limit is in force on a channel (rate limit, global concurrency, throttle limit): its claims are counted under its lock.';

-- How many rows of a channel may be claimed at once across daemons: its global concurrency or
-- a throttle's reduced limit, the lower; NULL when neither caps it.
CREATE OR REPLACE FUNCTION pgwork.claim_cap(c pgwork.channel) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN least(c.global_concurrency, c.throttle_limit);
COMMENT ON FUNCTION pgwork.claim_cap(pgwork.channel) IS
    'The most rows of a channel claimed at once (global concurrency or throttle limit, the lower); NULL: no cap.';

CREATE OR REPLACE FUNCTION pgwork.claimed_now(channel text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN (SELECT count(*) FROM pgwork.work_lease h
         WHERE h.channel = claimed_now.channel AND h.expires_at > now());
COMMENT ON FUNCTION pgwork.claimed_now(text) IS
    'Rows of a channel claimed under live leases, by every daemon: what global_concurrency and a '
    'throttle limit count (an expired lease does not: its row is claimable again). Reads work_lease_expiry.';

CREATE OR REPLACE FUNCTION pgwork.wake_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A statement made rows ready (a page, a retry, a give-back, a redrive, a revival: every
    -- insert into work_ready): their lanes' turns come no later than the rows (or now, for a row
    -- ready earlier: it queues behind the lanes already waiting, a new lane too: one made with
    -- its rows' old due time went ahead of every lane waiting since then, and a flood's sources,
    -- whose lanes come and go as their rows are made, kept another source's lane at the back). Lanes are locked in key order by
    -- every writer, so two writers never wait for each other in a cycle; a claim never waits for
    -- a lane (SKIP LOCKED). ON CONFLICT DO UPDATE locks the lane before its WHERE is judged: a
    -- claim turning the lane meanwhile (it could not see these rows) is waited for, then
    -- corrected. The lane's ready_from comes forward to the first of them too, in
    -- work_ready_order's order (the claim reads the lane from there).
    -- A statement that inserted no row (a flush with no retry, a page that claimed all it made)
    -- leaves before the upsert, whose plan is then not started.
    IF NOT EXISTS (SELECT FROM woken) THEN
        RETURN NULL;
    END IF;
    INSERT INTO pgwork.lane AS l (channel, source, turn_at, ready_from, ready_from_id)
    SELECT DISTINCT ON (r.channel, r.source) r.channel, r.source, greatest(r.available_at, now()),
           r.available_at, r.work_id
      FROM woken r
     ORDER BY r.channel, r.source, r.available_at, r.work_id
        ON CONFLICT (channel, source) DO UPDATE
       SET turn_at = least(l.turn_at, greatest(excluded.turn_at, now())),
           ready_from = CASE WHEN (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id)
                             THEN excluded.ready_from ELSE l.ready_from END,
           ready_from_id = CASE WHEN (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id)
                                THEN excluded.ready_from_id ELSE l.ready_from_id END
     WHERE l.turn_at > greatest(excluded.turn_at, now())
        OR (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgwork.wake_lanes() IS
    'Statement trigger on work_ready: the lanes of rows made ready are due no later than the rows.';
CREATE OR REPLACE TRIGGER work_ready_wakes_lanes AFTER INSERT ON pgwork.work_ready
    REFERENCING NEW TABLE AS woken FOR EACH STATEMENT EXECUTE FUNCTION pgwork.wake_lanes();

-- Leases are read by key, whatever the statistics: the outcome, the heartbeat and the release
-- name theirs as (work id, lease) arrays, and a plan made while work_lease was small (a daemon
-- starts, or PostgreSQL 15 on any small table) read all of it, and a session keeps its plan as
-- the table grows (test_hot_path.py::test_outcomes_leases_and_releases_read_only_the_rows_they_name).
-- Hence functions with sequential scans off, as the claim has.

-- End the leases named (an outcome, a release): their rows go, and are returned. A lease passed
-- on meanwhile (a reclaim: a new number) is re-checked on its new version and left alone.
CREATE OR REPLACE FUNCTION pgwork.lease_end(work_ids bigint[], leases integer[])
RETURNS SETOF pgwork.work_lease
LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    DELETE FROM pgwork.work_lease l
     USING unnest(lease_end.work_ids, lease_end.leases) AS h(work_id, lease)
     WHERE l.work_id = h.work_id AND l.lease = h.lease AND l.work_id = ANY (lease_end.work_ids)
    RETURNING l.*;
END
$$;
COMMENT ON FUNCTION pgwork.lease_end(bigint[], integer[]) IS
    'Delete the lease rows named by (work id, lease), returning them: the fence of an outcome or a release (the daemon''s only).';
REVOKE EXECUTE ON FUNCTION pgwork.lease_end(bigint[], integer[]) FROM PUBLIC;

-- The heartbeat: push the expiry of the leases named that are still held, passing over any row
-- locked right now (its outcome is being written, or another daemon reclaims it): it never waits,
-- so it cannot deadlock with an outcome flush; the next beat extends it. Returns every lease still
-- held as its snapshot sees them, extended or passed over: the others are lost.
CREATE OR REPLACE FUNCTION pgwork.lease_extend(work_ids bigint[], leases integer[], extend_by interval)
RETURNS TABLE (id bigint, lease integer)
LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH mine AS MATERIALIZED (
        SELECT l.work_id AS id, l.lease
          FROM pgwork.work_lease l
          JOIN unnest(lease_extend.work_ids, lease_extend.leases) AS h(work_id, lease)
            ON l.work_id = h.work_id AND l.lease = h.lease
         WHERE l.work_id = ANY (lease_extend.work_ids)
    ), locked AS (
        -- The conditions again: a row changed since the snapshot is judged on its new version.
        SELECT l.work_id
          FROM pgwork.work_lease l
          JOIN mine m ON m.id = l.work_id AND m.lease = l.lease
         WHERE l.work_id = ANY (lease_extend.work_ids)
           FOR UPDATE OF l SKIP LOCKED
    ), extended AS (
        UPDATE pgwork.work_lease l
           SET expires_at = now() + lease_extend.extend_by
          FROM locked k
         WHERE l.work_id = k.work_id
    )
    SELECT m.id, m.lease FROM mine m;
END
$$;
COMMENT ON FUNCTION pgwork.lease_extend(bigint[], integer[], interval) IS
    'The heartbeat: extend the leases named that are still held (the daemon''s only).';
REVOKE EXECUTE ON FUNCTION pgwork.lease_extend(bigint[], integer[], interval) FROM PUBLIC;

-- Live work: a row of work_ready (waiting) or of work_lease (held), one per live occurrence.
CREATE OR REPLACE FUNCTION pgwork.live_work(channel text)
RETURNS TABLE (work_id bigint, channel text, source text, due_at timestamptz, available_at timestamptz, held boolean)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT q.work_id, q.channel, q.source, q.due_at, q.available_at, false
      FROM pgwork.work_ready q
     WHERE live_work.channel IS NULL OR q.channel = live_work.channel
    UNION ALL
    SELECT l.work_id, l.channel, l.source, l.due_at, l.expires_at, true
      FROM pgwork.work_lease l
     WHERE live_work.channel IS NULL OR l.channel = live_work.channel
$$;
COMMENT ON FUNCTION pgwork.live_work(text) IS
    'The live occurrences of a channel (NULL: of every channel): ready ones (available_at: when '
    'claimable) and held ones (held; available_at: the lease''s expiry). Read by operators'' queries.';

-- A work record as it stands: "claimed" is not stored but a lease row (pgwork.work_lease), whose
-- lease, attempts, expiry and holder are then the row's.
CREATE OR REPLACE FUNCTION pgwork.work_now(w pgwork.renewal_work, l pgwork.work_lease)
RETURNS pgwork.renewal_work LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF l.work_id IS NOT NULL THEN
        w.status := 'claimed';
        w.lease := l.lease;
        w.attempts := l.attempts;
        w.available_at := l.expires_at;
        w.claimed_at := l.claimed_at;
        w.claimed_by := l.claimed_by;
    END IF;
    RETURN w;
END
$$;
COMMENT ON FUNCTION pgwork.work_now(pgwork.renewal_work, pgwork.work_lease) IS
    'A work record with its lease row applied (status claimed, the lease''s number, attempts, expiry and holder).';

-- The queue's invariant, which every fault test checks: a live record has exactly one ready or
-- lease row, a terminal one neither; queue rows name a record, on its channel and source; a lease
-- never numbers below the record's. Returns the rows that break it (none: it holds).
CREATE OR REPLACE FUNCTION pgwork.work_invariant()
RETURNS TABLE (work_id bigint, problem text)
LANGUAGE sql STABLE AS $$
    SELECT w.id, CASE WHEN q.work_id IS NOT NULL AND l.work_id IS NOT NULL THEN 'both ready and leased'
                      WHEN w.status = 'ready' AND q.work_id IS NULL AND l.work_id IS NULL THEN 'live but neither ready nor leased'
                      WHEN w.status <> 'ready' AND (q.work_id IS NOT NULL OR l.work_id IS NOT NULL) THEN 'terminal but queued'
                      WHEN q.channel <> w.channel OR q.source <> w.source THEN 'ready row on another channel or source'
                      WHEN l.channel <> w.channel OR l.source <> w.source THEN 'lease row on another channel or source'
                      WHEN l.lease <= w.lease THEN 'lease not above the settled one'
                      WHEN l.attempts <= w.attempts THEN 'lease attempts not above the settled ones'
                 END
      FROM pgwork.renewal_work w
      LEFT JOIN pgwork.work_ready q ON q.work_id = w.id
      LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
     WHERE (q.work_id IS NOT NULL AND l.work_id IS NOT NULL)
        OR (w.status = 'ready' AND q.work_id IS NULL AND l.work_id IS NULL)
        OR (w.status <> 'ready' AND (q.work_id IS NOT NULL OR l.work_id IS NOT NULL))
        OR q.channel <> w.channel OR q.source <> w.source
        OR l.channel <> w.channel OR l.source <> w.source
        OR l.lease <= w.lease OR l.attempts <= w.attempts
    UNION ALL
    SELECT q.work_id, 'ready row without a record' FROM pgwork.work_ready q
     WHERE NOT EXISTS (SELECT FROM pgwork.renewal_work w WHERE w.id = q.work_id)
    UNION ALL
    SELECT l.work_id, 'lease row without a record' FROM pgwork.work_lease l
     WHERE NOT EXISTS (SELECT FROM pgwork.renewal_work w WHERE w.id = l.work_id)
$$;
COMMENT ON FUNCTION pgwork.work_invariant() IS
    'The work rows that break the queue''s invariant (see docs/how-it-works.md); none while it holds. Reads every table: for tests and operators, not the hot path.';

CREATE OR REPLACE FUNCTION pgwork.tokens_now(rate_limit double precision, rate_burst double precision,
                                  tokens double precision, tokens_at timestamptz)
RETURNS double precision LANGUAGE sql STABLE PARALLEL SAFE
RETURN least(rate_burst, coalesce(tokens, rate_burst) + rate_limit * greatest(extract(epoch FROM now() - tokens_at), 0));
COMMENT ON FUNCTION pgwork.tokens_now(double precision, double precision, double precision, timestamptz) IS
    'A rate-limited channel''s tokens now: what its row held at tokens_at, refilled at rate_limit per '
    'second, at most rate_burst (a full bucket before the first claim).';

CREATE OR REPLACE FUNCTION pgwork.series_unwanted(reminder_id bigint, recur_rule jsonb, due_local timestamp,
                                       paused boolean, recur_skip timestamp[], recur_until timestamp,
                                       remind_before interval[], recur_version integer,
                                       deadline_local timestamp, occurrence interval, made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why an occurrence of a series is no longer wanted (NULL while it is): the reminder is gone
-- (cancelled); or it is no longer a series, is paused, dropped the remind_before entry, skips or
-- ends before the deadline, or its rule no longer has it (superseded). The rule is evaluated only
-- when it changed since the occurrence was made (made_version: the reminder's recur_version then).
-- No subquery here (the rule is asked through pgwork.recur_has): a claim inlines this, where a
-- SQL function with one ran as a plan of its own for every series row claimed
-- (test_hot_path.py::test_a_claim_runs_no_sql_function_body_of_its_own).
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN recur_rule IS NULL OR paused OR deadline_local IS NULL OR NOT occurrence = ANY (remind_before)
                 OR deadline_local = ANY (coalesce(recur_skip, '{}')) OR deadline_local > recur_until
                THEN 'superseded'
            WHEN made_version IS DISTINCT FROM recur_version
                 AND NOT pgwork.recur_has(recur_rule, due_local, deadline_local)
                THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.series_unwanted(bigint, jsonb, timestamp, boolean, timestamp[], timestamp, interval[], integer, timestamp, interval, integer) IS
    'Why an occurrence of a recurring reminder is no longer wanted (cancelled, superseded), or NULL while it is.';

CREATE OR REPLACE FUNCTION pgwork.work_unwanted(w pgwork.renewal_work, r pgwork.reminder)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why a work row's occurrence is no longer wanted by its reminder (r: NULL when it is gone),
-- one-off (pgwork.unwanted) or of a series (pgwork.series_unwanted), or NULL while it is: what a
-- claim and a redrive ask. Inlined where it is called, each field of the two rows a column of
-- the caller's (as if the fields had been passed one by one).
RETURN CASE WHEN w.deadline_local IS NULL
            THEN pgwork.unwanted(r.id, r.due_at, r.remind_before, w.deadline, w.occurrence)
            ELSE pgwork.series_unwanted(r.id, r.recur_rule, r.due_local, r.paused, r.recur_skip,
                                        r.recur_until, r.remind_before, r.recur_version,
                                        w.deadline_local, w.occurrence, w.recur_version)
       END;
COMMENT ON FUNCTION pgwork.work_unwanted(pgwork.renewal_work, pgwork.reminder) IS
    'Why a work row''s occurrence is no longer wanted by its reminder (cancelled, superseded), or NULL while it is.';

CREATE OR REPLACE FUNCTION pgwork.as_claimed(w pgwork.renewal_work, status text, lease integer, attempts integer,
                                             prev_status text, recipient text, payload text, time_zone text)
RETURNS pgwork.claimed LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- The row a worker gets (pgwork.claimed) from a work record, with the status, lease and attempts
-- a claim gave it (claim_rows: the lease row it wrote, or the record's own for a row it closed),
-- or a page that made it claimed (pgwork.materialise_page): the status it had before, and the
-- reminder's recipient, payload and, for a series, zone, as the statement read them. Retries
-- count from the last redrive, or from the occurrence's due time (never before the row was made).
RETURN ROW(w.id, w.reminder_id, w.source, w.business_key, w.deadline, w.occurrence, w.due_at, w.channel,
           w.operation_id, status, attempts, w.attempts_base, lease,
           coalesce(w.redriven_at, greatest(w.due_at, w.created_at)),
           prev_status, recipient, payload, w.traceparent, w.tracestate, w.deadline_local,
           CASE WHEN w.deadline_local IS NOT NULL THEN time_zone END)::pgwork.claimed;
COMMENT ON FUNCTION pgwork.as_claimed(pgwork.renewal_work, text, integer, integer, text, text, text, text) IS
    'A work row as a worker gets it (pgwork.claimed), with its status, lease and attempts, the status it had and its reminder''s recipient, payload and zone.';
