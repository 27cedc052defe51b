-- pgwork/sql/code/claim.sql — The claim: a channel's lanes and limit lock, then its rows, in one statement of the daemon.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.
--
-- The daemon claims with one statement (queries/delivery.sql, claim_work): pgwork.claim_lanes, then
-- pgwork.claim_rows with what it took, as parameters. Both are VOLATILE PL/pgSQL functions, so
-- each of their statements takes a new snapshot (READ COMMITTED): claim_rows' is taken after
-- claim_lanes' locks, so it sees every change made before them, and nobody can change what they
-- locked until the claim commits. One statement, not two in a pipeline with BEGIN and COMMIT:
-- the daemon's Python spends half as much on a claim of one row and a sixth less on a hundred,
-- Postgres about the same (bench/HISTORY.md, "The claim in one statement"). Their plans are kept
-- by the session, as a prepared statement's are (generic in the daemon's).

-- What a claim takes first, before the snapshot its rows are read with:
--  * the channel row, when a limit is in force (a rate limit, a global concurrency, or a
--    throttle limit: a receiver's throttling answers or the circuit breaker's one probe at a
--    time), which serialises the claims of such a channel across daemons so that each counts
--    what the previous one claimed; a channel with no limit is not locked. channel_locked names
--    it: a limit that came into force between the two steps gives that claim nothing, never an
--    uncounted row.
--  * up to a batch of the channel's lanes whose turn has come, oldest turn first, skipping
--    lanes another claim holds (two daemons serve different sources at once): lanes names them
--    in turn order, for claim_rows to serve and turn.
CREATE OR REPLACE FUNCTION pgwork.claim_lanes(channel text, claim_limit integer)
RETURNS TABLE (channel_locked text, lanes text[])
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT (SELECT c.name FROM pgwork.channel c
             WHERE c.name = claim_lanes.channel
               AND pgwork.limited(c)
               FOR NO KEY UPDATE) AS channel_locked,
           coalesce((SELECT array_agg(l.source ORDER BY l.turn_at, l.source)
                       FROM (SELECT l.source, l.turn_at FROM pgwork.lane l
                              WHERE l.channel = claim_lanes.channel AND l.turn_at <= now()
                              ORDER BY l.turn_at, l.source
                              LIMIT claim_lanes.claim_limit
                                FOR UPDATE SKIP LOCKED) AS l), '{}') AS lanes;
END
$$;
COMMENT ON FUNCTION pgwork.claim_lanes(text, integer) IS
    'A claim''s first step: its channel''s row when a limit is in force, and the lanes whose turn has come (called by the daemon''s claim only).';
REVOKE EXECUTE ON FUNCTION pgwork.claim_lanes(text, integer) FROM PUBLIC;

-- Claim up to claim_limit rows of one channel that are ready and available, or claimed under an
-- expired lease, after pgwork.claim_lanes took channel_locked and lanes. The reminder is re-read
-- in the same statement: work for a deleted reminder is cancelled and work for a moved deadline
-- (or a dropped remind_before entry) is superseded; neither is returned. A reclaimed lease was an
-- attempt: it is written to the ledger, and with the budget spent the row goes dead instead of
-- being claimed again.
-- The claim commits without waiting for the WAL flush unless commit_mode is 'on'
-- (database.synchronous_claims): a claim lost in a database crash is recovered like a killed
-- worker's (the row is claimable again, the late outcome is fenced, the retry carries the same
-- idempotency key, but the ledger has no row for the request that went out), and the next
-- synchronous commit flushes it anyway.
-- Outcomes (record_outcomes) commit synchronously: delivered is durable before it counts.
-- The channel's row decides how many rows may be claimed (the gate): none while it is paused
-- or throttled to a later instant; no more than its global concurrency or throttle limit minus
-- the rows claimed under live leases; no more than the rate limit's tokens, which the claimed
-- rows then spend.
-- Past expire_after, an occurrence is closed as expired instead of sent.
CREATE OR REPLACE FUNCTION pgwork.claim_rows(
    channel text, claim_limit integer, max_attempts integer, lease interval, daemon_id text,
    expire_after interval, commit_mode text, channel_locked text, lanes text[])
RETURNS SETOF pgwork.claimed
-- Every table it reads, it reads by key (a channel by name, lanes and work rows through their
-- indexes, candidates by id): no sequential scan, whatever the statistics say. A daemon plans
-- this once per session, and one that did so while renewal_work was empty (a fresh install, a
-- daemon idle before rent day) kept a plan that read and updated its candidates by scanning the
-- whole table (test_hot_path.py::test_a_page_planned_on_empty_tables_reads_by_key).
LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
#variable_conflict use_column
BEGIN
    -- What pgwork.claim_lanes took (see there) comes as channel_locked, the channel's row,
    -- locked when a limit is in force, and lanes, the lanes it locked, in turn order (empty: it
    -- took none).
    RETURN QUERY
    WITH gate AS MATERIALIZED (
        SELECT c.name,
               CASE WHEN c.paused OR c.not_before > now() THEN 0
                    -- A limit to count, and this transaction does not hold the lock (claim_lanes).
                    WHEN pgwork.limited(c) AND claim_rows.channel_locked IS DISTINCT FROM c.name THEN 0
                    ELSE greatest(0, least(
                        claim_rows.claim_limit,
                        -- least() skips NULLs: no cap, no limit from it.
                        pgwork.claim_cap(c)
                            - CASE WHEN pgwork.claim_cap(c) IS NULL THEN 0
                                   ELSE pgwork.claimed_now(c.name) END,
                        floor(t.tokens)))::int
               END AS budget,
               t.tokens
          FROM pgwork.channel c
         CROSS JOIN LATERAL (
               SELECT pgwork.tokens_now(c.rate_limit, c.rate_burst, c.tokens, c.tokens_at) AS tokens
               ) AS t
         WHERE c.name = claim_rows.channel
    ), due_lanes AS MATERIALIZED (
        -- claim_lanes took no lane: the due lanes as this snapshot sees them, in turn order.
        SELECT l.source, l.ready_from, l.ready_from_id, row_number() OVER (ORDER BY l.turn_at, l.source) AS n
          FROM pgwork.lane l
         WHERE l.channel = claim_rows.channel AND l.turn_at <= now()
           AND cardinality(claim_rows.lanes) = 0
         ORDER BY l.turn_at, l.source
         LIMIT claim_rows.claim_limit
    ), free_now AS MATERIALIZED (
        -- Those nobody holds appeared after claim_lanes' snapshot (their rows committed between the
        -- two steps): locked here and left for the next claim, which sees their rows and
        -- turns them (served now, unturned, such a lane would get an extra turn).
        SELECT l.source
          FROM pgwork.lane l
         WHERE l.channel = claim_rows.channel AND l.source IN (SELECT d.source FROM due_lanes d)
           FOR UPDATE SKIP LOCKED
    ), lanes AS MATERIALIZED (
        -- The lanes this claim serves, in turn order: those claim_lanes took; or, when other claims
        -- hold every lane whose turn has come (several daemons on one busy source), those lanes as
        -- this snapshot sees them, unlocked ("borrowed"): their rows are still taken with SKIP
        -- LOCKED, and the lanes are left for their holders to turn.
        -- Each with where its ready rows start (pgwork.lane.ready_from): no row this snapshot
        -- sees ready comes before (a statement that made one ready brought it forward before
        -- committing, waiting for the lane's holder if need be).
        SELECT o.source, o.n, true AS owned, l.ready_from, l.ready_from_id
          FROM unnest(claim_rows.lanes) WITH ORDINALITY AS o(source, n)
          JOIN pgwork.lane l ON l.channel = claim_rows.channel AND l.source = o.source
        UNION ALL
        SELECT d.source, row_number() OVER (ORDER BY d.n), false, d.ready_from, d.ready_from_id
          FROM due_lanes d
         WHERE d.source NOT IN (SELECT f.source FROM free_now f)
    ), reclaim AS MATERIALIZED (
        -- Rows whose lease expired (their worker died or lost its connection) come first: they
        -- are the oldest. Read through work_lease_expiry, where live leases are the later part.
        SELECT e.id, e.source, e.available_at, e.moved_in
          FROM (SELECT l.work_id AS id, l.source, l.expires_at AS available_at, false AS moved_in
                  FROM pgwork.work_lease l
                 WHERE l.channel = claim_rows.channel AND l.expires_at <= now()
                 ORDER BY l.expires_at, l.work_id
                 LIMIT coalesce((SELECT budget FROM gate), claim_rows.claim_limit)
                   FOR UPDATE SKIP LOCKED) AS e
        UNION ALL
        -- ... and sends an app moved to this channel while they were in flight on another one,
        -- whose lease expired there (pgwork.work_moved; usually no row): taken over here, whether
        -- or not a daemon serves the old channel. Its note is locked too (SKIP LOCKED: an app
        -- moving the reminder again right now is not waited for) and goes with the takeover.
        SELECT t.id, t.source, t.available_at, true
          FROM (SELECT l.work_id AS id, l.source, l.expires_at AS available_at
                  FROM pgwork.work_moved m
                  JOIN pgwork.work_lease l ON l.work_id = m.work_id
                 WHERE m.channel = claim_rows.channel AND l.channel <> claim_rows.channel
                   AND l.expires_at <= now()
                   FOR UPDATE OF l, m SKIP LOCKED) AS t
    ), unmoved AS (
        DELETE FROM pgwork.work_moved m
         WHERE m.work_id = ANY ((SELECT array_agg(x.id) FROM reclaim x WHERE x.moved_in)::bigint[])
    ), share AS MATERIALIZED (
        -- What is left of the budget, shared between the lanes served: a lane gets an equal share
        -- (rounded up), and no more lanes are served than the budget has rows (a budget of one
        -- serves the first lane in turn, and the next claim the next).
        SELECT b.budget,
               least(b.budget, (SELECT count(*) FROM lanes))::int AS served,
               ceil(b.budget::numeric / greatest(1, least(b.budget, (SELECT count(*) FROM lanes))))::int AS each
          FROM (SELECT greatest(0, coalesce((SELECT budget FROM gate), claim_rows.claim_limit)
                                   - (SELECT count(*) FROM reclaim))::int AS budget) AS b
    ), served AS MATERIALIZED (
        SELECT l.source, l.n, l.owned, l.ready_from, l.ready_from_id
          FROM lanes l WHERE l.n <= (SELECT served FROM share)
    ), head AS MATERIALIZED (
        SELECT h.id, h.source, h.available_at, s.n
          FROM served s
         CROSS JOIN LATERAL (
               SELECT w.work_id AS id, w.source, w.available_at
                 FROM pgwork.work_ready w
                WHERE w.channel = claim_rows.channel AND w.source = s.source
                  AND w.available_at <= now()
                  AND (w.available_at, w.work_id) >= (s.ready_from, s.ready_from_id)
                ORDER BY w.available_at, w.work_id
                LIMIT (SELECT each FROM share)
                  FOR UPDATE SKIP LOCKED) AS h
    ), head_end AS (
        -- Where each lane's head ended, and whether it filled its share.
        SELECT DISTINCT ON (source) source, n, available_at, id,
               count(*) OVER (PARTITION BY source) = (SELECT each FROM share) AS filled
          FROM head
         ORDER BY source, available_at DESC, id DESC
    ), tail AS MATERIALIZED (
        -- What the lanes with fewer due rows than their share left over goes to the others, past
        -- their heads.
        SELECT t.id, t.source, t.available_at, e.n
          FROM head_end e
         CROSS JOIN LATERAL (
               SELECT w.work_id AS id, w.source, w.available_at
                 FROM pgwork.work_ready w
                WHERE w.channel = claim_rows.channel AND w.source = e.source
                  AND w.available_at <= now()
                  AND (w.available_at, w.work_id) > (e.available_at, e.id)
                ORDER BY w.available_at, w.work_id
                -- Never negative: the heads may overshoot the budget (each share is rounded up).
                LIMIT greatest(0, (SELECT budget FROM share) - (SELECT count(*) FROM head))
                  FOR UPDATE SKIP LOCKED) AS t
         WHERE e.filled AND (SELECT budget FROM share) > (SELECT count(*) FROM head)
    ), candidate AS MATERIALIZED (
        -- Expired leases first, then round robin: every lane's first row in turn order, then
        -- every lane's second, ...
        SELECT x.id, x.source
          FROM (SELECT id, source, available_at, 0::bigint AS n, 0::bigint AS round FROM reclaim
                UNION ALL
                SELECT r.id, r.source, r.available_at, r.n,
                       row_number() OVER (PARTITION BY r.source ORDER BY r.available_at, r.id) AS round
                  FROM (SELECT id, source, available_at, n FROM head
                        UNION ALL
                        SELECT id, source, available_at, n FROM tail) AS r) AS x
         ORDER BY x.round, x.n, x.available_at, x.id
         LIMIT coalesce((SELECT budget FROM gate), claim_rows.claim_limit)
    ), turn AS MATERIALIZED (
        -- Each served lane this claim holds: its next ready row (past what this claim takes).
        -- Read by this statement's snapshot, taken after claim_lanes' lock: a row made ready
        -- since then waits on that lock to wake its lane (pgwork.wake_lanes). Part of this plan,
        -- not a SQL function: one with a subquery is never inlined, and PostgreSQL 15 planned its
        -- body again on every claim (test_hot_path.py::
        -- test_a_claim_runs_no_sql_function_body_of_its_own).
        SELECT s.source, n.available_at AS next_at, n.id AS next_id
          FROM served s
          LEFT JOIN (SELECT c.source, array_agg(c.id) AS ids FROM candidate c GROUP BY c.source) AS t
            ON t.source = s.source
          LEFT JOIN LATERAL (
               SELECT w.available_at, w.work_id AS id FROM pgwork.work_ready w
                WHERE w.channel = claim_rows.channel AND w.source = s.source
                  AND (w.available_at, w.work_id) >= (s.ready_from, s.ready_from_id)
                  AND NOT w.work_id = ANY (coalesce(t.ids, '{}'))
                ORDER BY w.available_at, w.work_id
                LIMIT 1) AS n ON true
         WHERE s.owned
    ), turned AS (
        -- A lane with a row still due goes to the back of the line (turn_at = now), one with a
        -- later row waits for it, and its next claim reads from that row on (the entries of the
        -- rows taken here stay in work_ready_order until a vacuum: read from the lane's start,
        -- every claim of a drain walked all those of the rows taken before it) ...
        UPDATE pgwork.lane l
           SET turn_at = greatest(t.next_at, now()), ready_from = t.next_at, ready_from_id = t.next_id
          FROM turn t
         WHERE t.next_at IS NOT NULL AND l.channel = claim_rows.channel AND l.source = t.source
    ), emptied AS (
        -- ... and one with no ready row left is removed.
        DELETE FROM pgwork.lane l
         USING turn t
         WHERE t.next_at IS NULL AND l.channel = claim_rows.channel AND l.source = t.source
    ), unreadied AS (
        -- The ready rows taken leave work_ready, whatever the verdict on them (one whose record is
        -- gone or closed, which only a migration's copy racing an app's edit leaves, is dropped).
        DELETE FROM pgwork.work_ready r
         WHERE r.work_id = ANY ((SELECT array_agg(c.id) FROM candidate c)::bigint[])
        RETURNING r.work_id
    ), judged AS (
        -- Each candidate's record, live, with the numbers its next lease counts from: the expired
        -- lease's for a reclaim, the record's own (the last settled) for a ready row.
        SELECT w, l.work_id IS NOT NULL AS reclaimed,
               coalesce(l.lease, w.lease) AS prev_lease, coalesce(l.attempts, w.attempts) AS prev_attempts,
               l.claimed_at AS prev_claimed_at, l.claimed_by AS prev_claimed_by,
               coalesce(pgwork.work_unwanted(w, r),
                        -- The reminder names another channel now (an app moved it while this
                        -- send was in flight, or raced a retry): the send goes there, to be
                        -- judged and claimed by that channel (below), never sent here.
                        CASE WHEN r.channel <> w.channel THEN 'moved'
                        -- Counted from the last redrive when there was one: a redrive says "send it".
                             WHEN greatest(w.due_at, w.redriven_at) + claim_rows.expire_after::interval < now() THEN 'expired'
                             WHEN coalesce(l.attempts, w.attempts) - w.attempts_base >= claim_rows.max_attempts THEN 'dead'
                             ELSE 'claimed' END) AS verdict,
               r.channel AS moved_to,
               -- The payload as text: nothing in the claim decodes it (one undecodable payload
               -- cannot fail a batch), and receivers get it exactly as stored.
               r.recipient, r.payload::text AS payload, r.due_tz
          -- The candidates as one array: read by primary key whatever the planner estimates
          -- (joined to candidate, a generic plan that took its LIMIT as a tenth of the table
          -- hashed the whole table: 40 ms for 100 rows).
          FROM pgwork.renewal_work w
          LEFT JOIN pgwork.work_lease l
            ON l.work_id = w.id AND l.work_id = ANY ((SELECT array_agg(x.id) FROM reclaim x)::bigint[])
          LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id
         WHERE w.id = ANY ((SELECT array_agg(c.id) FROM candidate c)::bigint[]) AND w.status = 'ready'
    ), leased AS (
        -- A new lease for a ready row ...
        INSERT INTO pgwork.work_lease (work_id, lease, attempts, channel, source, due_at, expires_at, claimed_by, claimed_at)
        SELECT (j.w).id, j.prev_lease + 1, j.prev_attempts + 1, (j.w).channel, (j.w).source, (j.w).due_at,
               now() + claim_rows.lease::interval, claim_rows.daemon_id, now()
          FROM judged j
         WHERE j.verdict = 'claimed' AND NOT j.reclaimed
    ), reissued AS (
        -- ... and the next number of an expired one.
        UPDATE pgwork.work_lease l
           SET lease = j.prev_lease + 1, attempts = j.prev_attempts + 1,
               expires_at = now() + claim_rows.lease::interval, claimed_by = claim_rows.daemon_id, claimed_at = now()
          FROM judged j
         WHERE l.work_id = (j.w).id AND j.verdict = 'claimed' AND j.reclaimed
    ), released AS (
        -- An expired lease whose row is closed instead (dead, expired, cancelled, superseded) or
        -- moved goes.
        DELETE FROM pgwork.work_lease l
         USING judged j
         WHERE l.work_id = (j.w).id AND j.verdict <> 'claimed' AND j.reclaimed
    ), handed AS (
        -- A moved send: its record goes to its reminder's channel, ready at once, the lease it
        -- last held settled (an expired one was an attempt: the ledger says so below) ...
        UPDATE pgwork.renewal_work w
           SET channel = j.moved_to, available_at = now(),
               lease = j.prev_lease, attempts = j.prev_attempts,
               claimed_at = coalesce(j.prev_claimed_at, w.claimed_at),
               claimed_by = coalesce(j.prev_claimed_by, w.claimed_by)
          FROM judged j
         WHERE w.id = (j.w).id AND j.verdict = 'moved'
        RETURNING w.id, w.channel, w.source, w.available_at, w.due_at
    ), requeued AS (
        -- ... and into that channel's queue (pgwork.wake_lanes wakes its lane there), once its
        -- row on this one is gone (read from unreadied: that DELETE runs first).
        INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
        SELECT h.id, h.channel, h.source, h.available_at, h.due_at
          FROM handed h
         WHERE (SELECT count(*) FROM unreadied) >= 0
    ), closed AS (
        -- The record is written only for a row closed instead of sent (rare): the lease it last
        -- held is settled with it.
        UPDATE pgwork.renewal_work w
           SET status = j.verdict,
               lease = j.prev_lease,
               attempts = j.prev_attempts,
               claimed_at = coalesce(j.prev_claimed_at, w.claimed_at),
               claimed_by = coalesce(j.prev_claimed_by, w.claimed_by),
               finished_at = now(),
               dead_reason = CASE WHEN j.verdict <> 'dead' THEN NULL
                                  WHEN j.reclaimed THEN 'attempt budget spent (the last lease expired)'
                                  ELSE 'attempt budget spent' END,
               last_error = CASE WHEN j.verdict <> 'expired' THEN w.last_error
                                 ELSE format('expired: not sent by %s (due %s, expire_after %s)',
                                             greatest(w.due_at, w.redriven_at) + claim_rows.expire_after::interval, w.due_at,
                                             claim_rows.expire_after::interval) END
          FROM judged j
         WHERE w.id = (j.w).id AND j.verdict NOT IN ('claimed', 'moved')
    ), updated AS (
        -- The row a worker gets (pgwork.claimed). pgwork.as_claimed is inlined and its fields
        -- taken from the row as the plan has it: nothing is built per row that a column list
        -- would not (test_hot_path.py::test_a_claim_runs_no_sql_function_body_of_its_own).
        SELECT (pgwork.as_claimed(j.w, j.verdict,
                                  j.prev_lease + (j.verdict = 'claimed')::int,
                                  j.prev_attempts + (j.verdict = 'claimed')::int,
                                  CASE WHEN j.reclaimed THEN 'claimed' ELSE 'ready' END,
                                  j.recipient, j.payload, j.due_tz)).*
          FROM judged j
         WHERE j.verdict <> 'moved'
    ), spent AS (
        -- The rate limit's tokens: what was there, minus the rows claimed for delivery.
        UPDATE pgwork.channel c
           SET tokens = g.tokens - (SELECT count(*) FROM judged j WHERE j.verdict = 'claimed'), tokens_at = now()
          FROM gate g
         WHERE c.name = g.name AND c.rate_limit IS NOT NULL
    ), expired AS (
        INSERT INTO pgwork.attempt
               (work_id, lease, attempt, daemon_id, host, pid, started_at, finished_at, outcome, error_class, error)
        SELECT (j.w).id, j.prev_lease, j.prev_attempts, j.prev_claimed_by, coalesce(d.host, 'unknown'),
               coalesce(d.pid, 0), j.prev_claimed_at, now(), 'lease_expired', 'LeaseExpired',
               'the worker holding the lease did not report before it expired'
          FROM judged j
          LEFT JOIN pgwork.daemon d ON d.id = j.prev_claimed_by
         WHERE j.reclaimed
            ON CONFLICT (work_id, lease) DO NOTHING
    )
    SELECT u.*
      FROM (SELECT set_config('synchronous_commit', claim_rows.commit_mode, true)) AS commit_mode,
           updated u
     ORDER BY u.due_at, u.id;
END
$$;
COMMENT ON FUNCTION pgwork.claim_rows(text, integer, integer, interval, text, interval, text, text, text[]) IS
    'A claim''s second step: the rows it takes, after pgwork.claim_lanes (called by the daemon''s claim only).';
REVOKE EXECUTE ON FUNCTION pgwork.claim_rows(text, integer, integer, interval, text, interval, text, text, text[]) FROM PUBLIC;
