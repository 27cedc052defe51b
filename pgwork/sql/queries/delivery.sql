-- Room delivery: the statements of delivery: the claim, a channel's gate, the outcomes, leases.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/delivery.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: type_fields
-- The fields of one of pgwork's composite types, in order: pgwork.claimed (store.Claimed's) and
-- pgwork.outcome (the keys of an outcome record's JSON).
SELECT a.attname::text AS name
  FROM pg_attribute a
 WHERE a.attrelid = (SELECT t.typrelid FROM pg_type t WHERE t.oid = %(type)s::regtype)
   AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum

-- name: claim_work
-- Claim up to %(limit)s rows of one channel (pgwork/sql/code/claim.sql): its lanes and limit
-- lock first, then its rows with what that step took, in one statement and transaction. The
-- rows come as pgwork.claimed, oldest due first.
SELECT r.*
  FROM pgwork.claim_lanes(%(channel)s, %(limit)s) AS l
 CROSS JOIN LATERAL pgwork.claim_rows(%(channel)s, %(limit)s, %(max_attempts)s, %(lease)s, %(daemon_id)s,
                                      %(expire_after)s, %(synchronous_commit)s, l.channel_locked, l.lanes) AS r

-- name: next_available
-- Seconds (by this database's clock) until the next row of a channel becomes claimable (ready
-- rows) or reclaimable (claimed rows); negative when one is claimable now; NULL when none. And
-- the channel's gate: paused; seconds until a throttle's not_before passes (hold_s); seconds
-- until the rate limit has tokens for a small batch (tokens_s); whether a global concurrency or
-- throttle limit is reached (full).
SELECT extract(epoch FROM least(
           -- The first lane's turn (its ready rows are no earlier) ...
           (SELECT min(l.turn_at) FROM pgwork.lane l WHERE l.channel = %(channel)s),
           -- ... or the first lease to expire, or to expire of a send moved here in flight.
           (SELECT min(l.expires_at) FROM pgwork.work_lease l WHERE l.channel = %(channel)s),
           (SELECT min(l.expires_at) FROM pgwork.work_moved m
              JOIN pgwork.work_lease l ON l.work_id = m.work_id
             WHERE m.channel = %(channel)s AND l.channel <> %(channel)s)) - now())::float8 AS wait_s,
       -- A channel retired (`pgwork channel retire`) while this daemon serves it: nothing to
       -- claim, as if paused, until it is registered again.
       coalesce(c.paused, true) AS paused,
       c.name IS NULL AS retired,
       greatest(extract(epoch FROM c.not_before - now()), 0)::float8 AS hold_s,
       CASE WHEN c.rate_limit IS NOT NULL THEN greatest(0,
            (least(c.rate_burst, greatest(1, c.rate_limit * 0.05))
             - pgwork.tokens_now(c.rate_limit, c.rate_burst, c.tokens, c.tokens_at))
            / c.rate_limit)::float8 END AS tokens_s,
       CASE WHEN pgwork.claim_cap(c) IS NULL THEN false  -- no count
            ELSE pgwork.claim_cap(c) <= pgwork.claimed_now(c.name)
       END AS full
  FROM (SELECT 1) AS one
  LEFT JOIN pgwork.channel c ON c.name = %(channel)s

-- name: record_outcomes
-- Record a batch of attempt outcomes in one statement (a JSON array of pgwork.outcome records).
-- Every record names the lease it claimed, and everything is matched on (work id, lease): a row
-- whose lease passed to another worker is left alone and the ledger says so, even when two
-- leases of one row are in the same batch.
-- Times come from this database's clock: the daemon sends how many seconds ago the attempt
-- started and finished. Returns only the records not applied now: fenced, or already applied by
-- an earlier run of this same write whose commit reply was lost (already = true).
WITH o AS (
    SELECT *
      FROM jsonb_populate_recordset(NULL::pgwork.outcome, %(outcomes)s::jsonb) AS o
), held AS (
    -- The fence: an outcome is applied only while its lease row is there, and applying it
    -- deletes that row (pgwork.lease_end: by key, whatever the estimates). No row lock taken
    -- first (it cost a WAL record and ~6 us of Postgres per job): the DELETE locks its rows in
    -- whatever order its plan reads them, and the heartbeat (extend_leases) skips rows locked by
    -- anyone, so the two never wait for each other in a cycle. A lease reissued meanwhile (a
    -- reclaim) is re-checked on its new version (READ COMMITTED) and left alone.
    SELECT l.work_id, l.lease, l.attempts, l.claimed_at, l.claimed_by
      FROM (SELECT array_agg(o.work_id) AS ids, array_agg(o.lease) AS leases FROM o) AS a
     CROSS JOIN LATERAL pgwork.lease_end(a.ids, a.leases) AS l
), done AS (
    -- The record's one write of this attempt: its outcome, with the lease settled. Each record
    -- is probed by its key alone: a probe that also named the flush's ids (w.id = ANY (...))
    -- sorted that array again for every record: a flush of 1,000 cost 1.7 times as much
    -- (test_hot_path.py::test_a_flush_probes_each_record_by_its_key_alone).
    UPDATE pgwork.renewal_work w
       SET status = o.status,
           lease = h.lease,
           -- An attempt that paused the channel (a 410) is the channel's failure, not the
           -- occurrence's: it counts as an attempt (its number goes to no other request: a
           -- receiver never sees one twice) but not against the row's budget, which counts from
           -- attempts_base (as a redrive's fresh budget does).
           attempts = h.attempts,
           attempts_base = w.attempts_base + (o.pause IS NOT NULL AND o.status = 'ready')::int,
           claimed_at = h.claimed_at, claimed_by = h.claimed_by,
           available_at = CASE WHEN o.status = 'ready' THEN now() + make_interval(secs => o.retry_after) ELSE w.available_at END,
           -- A retry goes where its reminder points now: an app that moved the reminder to
           -- another channel while this attempt was in flight moved its send too.
           channel = CASE WHEN o.status = 'ready'
                          THEN coalesce((SELECT r.channel FROM pgwork.reminder r WHERE r.id = w.reminder_id), w.channel)
                          ELSE w.channel END,
           finished_at = CASE WHEN pgwork.is_terminal(o.status) THEN now() END,
           last_error = o.error,
           dead_reason = CASE WHEN o.status = 'dead' THEN coalesce(o.error, o.outcome) END
      FROM held h
      JOIN o ON o.work_id = h.work_id AND o.lease = h.lease
     WHERE w.id = h.work_id
    RETURNING w.id, w.lease, w.status, w.channel, w.source, w.available_at, w.due_at
), retried AS (
    -- A retry waits in work_ready again (pgwork.wake_lanes brings its lane's turn to its time).
    INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
    SELECT d.id, d.channel, d.source, d.available_at, d.due_at FROM done d WHERE d.status = 'ready'
), news AS (
    -- What the applied outcomes say about their channels: a throttling answer (seconds to hold
    -- the channel), successes (a throttle recovers by one step each), a reason to pause.
    SELECT o.channel, max(o.throttle) AS throttle, max(o.error) FILTER (WHERE o.throttle IS NOT NULL) AS throttle_reason,
           count(*) FILTER (WHERE o.status = 'delivered') AS ok, max(o.pause) AS pause,
           count(*) FILTER (WHERE o.outcome = 'retry' AND o.throttle IS NULL AND o.pause IS NULL) AS failed
      FROM o
      JOIN done d ON d.id = o.work_id AND d.lease = o.lease
     WHERE o.throttle IS NOT NULL OR o.pause IS NOT NULL OR o.status = 'delivered' OR o.outcome = 'retry'
     GROUP BY o.channel
), channel_news AS (
    -- The channel's state after this flush: one function of the row it updates (c) and the
    -- flush's counts (pgwork.channel_after_flush: throttle, breaker, a receiver's pause), from
    -- that row, not this statement's snapshot: a concurrent flush's failures are counted, never
    -- overwritten. Its live leases are counted only when a throttle or a trip may start.
    UPDATE pgwork.channel c
       SET (not_before, failures, throttle_limit, throttle_from, throttled_at, throttle_reason,
            paused, paused_at, paused_by, paused_reason)
         = (SELECT a.* FROM pgwork.channel_after_flush(
                c, n.ok, n.failed, n.throttle, n.throttle_reason, n.pause,
                CASE WHEN n.throttle IS NOT NULL OR n.ok = 0 THEN pgwork.claimed_now(c.name)::int END,
                now(), 'pgwork:' || %(daemon_id)s) a)
      FROM news n
     WHERE c.name = n.channel
       AND (n.throttle IS NOT NULL OR n.pause IS NOT NULL OR c.throttle_limit IS NOT NULL
            OR (c.breaker_after IS NOT NULL AND (n.failed > 0 OR c.failures > 0)))
    -- Every daemon holds its queued rows of a newly throttled or paused channel at once (in a
    -- RETURNING list: a data-modifying CTE always runs, a plain one only when read). RETURNING
    -- reads the updated row: its failures already count this batch's.
    RETURNING c.name, CASE WHEN n.throttle IS NOT NULL OR n.pause IS NOT NULL OR (n.ok = 0 AND c.failures >= c.breaker_after)
                           THEN pg_notify('pgwork_channel', c.name)::text END AS told
), unmoved AS (
    -- A send an app moved to another channel while it was in flight ended here (its outcome is
    -- written; a retry went to its reminder's channel above): its note in pgwork.work_moved goes.
    -- Read only when the table has a row at all (the first test, made once per flush), and one an
    -- app's transaction holds is passed over (its next claim or outcome takes it).
    DELETE FROM pgwork.work_moved m
     WHERE m.work_id IN (SELECT x.work_id FROM pgwork.work_moved x
                          WHERE EXISTS (SELECT FROM pgwork.work_moved)
                            AND x.work_id = ANY ((SELECT array_agg(h.work_id) FROM held h)::bigint[])
                            FOR UPDATE SKIP LOCKED)
), judged AS (
    -- Joins, not correlated EXISTS: a flush holds up to a thousand records, and a scan of
    -- `done` per record was quadratic (it halved the burn-down rate).
    SELECT o.*, d.id IS NOT NULL AS applied,
           -- A retried write whose first run committed (reply lost): its ledger row is there.
           -- Looked up only for a record not applied now (fenced, or such a retry): an applied
           -- one cannot have been applied before. Joined to every record, the ledger was
           -- hashed whole on every flush by a plan made while it was small (25 ms a flush at
           -- 100k attempts on PostgreSQL 15, against 6 ms).
           -- (A scalar subquery with LIMIT, not EXISTS, which may become a hash of the ledger.)
           CASE WHEN d.id IS NULL
                THEN (SELECT true FROM pgwork.attempt a
                       WHERE a.work_id = o.work_id AND a.lease = o.lease
                         AND a.outcome = o.outcome AND a.daemon_id = %(daemon_id)s
                       LIMIT 1) IS NOT NULL
                ELSE false END AS already
      FROM o
      LEFT JOIN done d ON d.id = o.work_id AND d.lease = o.lease
), ledger AS (
    INSERT INTO pgwork.attempt AS a
           (work_id, lease, attempt, daemon_id, host, pid, started_at, finished_at, outcome,
            http_status, error_class, error, receipt, retry_at)
    SELECT j.work_id, j.lease, j.attempt, %(daemon_id)s, %(host)s, %(pid)s,
           now() - make_interval(secs => coalesce(j.started_ago, 0)),
           now() - make_interval(secs => coalesce(j.finished_ago, 0)),
           CASE WHEN j.applied THEN j.outcome ELSE 'fenced' END,
           j.http_status, j.error_class,
           CASE WHEN j.applied THEN j.error
                ELSE left('late outcome ' || j.outcome || coalesce(': ' || j.error, ''), 2000) END,
           j.receipt,
           CASE WHEN j.applied AND j.status = 'ready' THEN now() + make_interval(secs => j.retry_after) END
      FROM judged j
     WHERE NOT j.already
        ON CONFLICT (work_id, lease) DO UPDATE
       SET outcome = excluded.outcome, finished_at = excluded.finished_at, http_status = excluded.http_status,
           error_class = excluded.error_class, error = excluded.error, receipt = excluded.receipt,
           retry_at = excluded.retry_at
     -- An applied outcome also replaces a fenced one of the same lease number: that can only be
     -- a claim lost with a database crash (committed asynchronously, then claimed again under
     -- the same number), whose late answer was refused first. The ledger then shows the claim
     -- that holds the row, as it would had the answers come the other way round.
     WHERE a.outcome = 'lease_expired' OR (a.outcome = 'fenced' AND excluded.outcome <> 'fenced')
)
SELECT j.work_id AS fenced_id, j.lease, j.already FROM judged j WHERE NOT j.applied

-- name: extend_leases
-- Heartbeat for long deliveries: push the lease of rows still held, matched on (work id, lease),
-- passing over a row locked right now (pgwork.lease_extend). Returns every row this daemon still
-- holds, extended now or passed over as busy: the others are lost.
SELECT e.id, e.lease
  FROM pgwork.lease_extend(%(work_id)s::bigint[], %(lease_no)s::int[], %(lease)s::interval) AS e

-- name: release_leases
-- Clean shutdown: give back rows we hold without counting the attempt (fenced by lease): the
-- lease row goes (pgwork.lease_end), the record settles that lease number with the attempt
-- uncounted, and the row is ready again at once, on the channel its reminder names now (an app
-- may have moved it while it was held).
WITH released AS (
    SELECT l.work_id, l.lease, l.attempts, l.claimed_at, l.claimed_by
      FROM pgwork.lease_end(%(work_id)s::bigint[], %(lease_no)s::int[]) AS l
), settled AS (
    UPDATE pgwork.renewal_work w
       SET lease = r.lease, attempts = r.attempts - 1, available_at = now(),
           claimed_at = r.claimed_at, claimed_by = r.claimed_by,
           channel = coalesce((SELECT m.channel FROM pgwork.reminder m WHERE m.id = w.reminder_id), w.channel)
      FROM released r
     WHERE w.id = r.work_id AND w.id = ANY ((SELECT array_agg(r2.work_id) FROM released r2)::bigint[])
    RETURNING w.id, w.channel, w.source, w.available_at, w.due_at
), unmoved AS (
    DELETE FROM pgwork.work_moved m
     WHERE m.work_id IN (SELECT x.work_id FROM pgwork.work_moved x
                          WHERE EXISTS (SELECT FROM pgwork.work_moved)
                            AND x.work_id = ANY ((SELECT array_agg(r.work_id) FROM released r)::bigint[])
                            FOR UPDATE SKIP LOCKED)
), requeued AS (
    INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
    SELECT s.id, s.channel, s.source, s.available_at, s.due_at FROM settled s
), ledger AS (
    INSERT INTO pgwork.attempt
           (work_id, lease, attempt, daemon_id, host, pid, started_at, finished_at, outcome, error_class, error)
    SELECT r.work_id, r.lease, r.attempts, %(daemon_id)s, %(host)s, %(pid)s, r.claimed_at, now(),
           'released', 'Shutdown', 'released on shutdown before an outcome; not counted as an attempt'
      FROM released r
        ON CONFLICT (work_id, lease) DO NOTHING
)
SELECT work_id AS id FROM released
