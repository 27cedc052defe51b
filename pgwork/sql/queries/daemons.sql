-- Room daemons: the statements of daemons and channels: registration, heartbeats, a channel's state, pause, resume, retire.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/daemons.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: register_channels
-- Make the configured channels known, so reminders naming them are accepted, with the settings
-- every daemon's claim and the materialiser read from the row (the last daemon started wins:
-- daemons sharing a database should share their channel config). Operator and receiver state
-- (paused, throttled) is kept. Returns the channels whose settings this changed.
WITH cfg AS (
    SELECT * FROM unnest(%(names)s::text[], %(kinds)s::text[], %(catch_up)s::text[],
                         %(global_concurrency)s::int[], %(rate_limit)s::float8[], %(rate_burst)s::float8[],
                         %(breaker_after)s::int[], %(breaker_probe)s::interval[])
        AS c(name, kind, catch_up, global_concurrency, rate_limit, rate_burst, breaker_after, breaker_probe)
), old AS (
    -- FOR NO KEY UPDATE, never FOR UPDATE: an app's open INSERT of a reminder holds FOR KEY
    -- SHARE on its channel's row (the foreign key), which FOR UPDATE would wait for (a daemon
    -- could not start while any app had such a transaction open). Every other daemon statement
    -- on pgwork.channel is an UPDATE that leaves the key alone, or pgwork.claim_lanes: the same mode.
    SELECT c.* FROM pgwork.channel c JOIN cfg USING (name) FOR NO KEY UPDATE OF c
), upserted AS (
    INSERT INTO pgwork.channel AS ch
           (name, kind, catch_up, global_concurrency, rate_limit, rate_burst, breaker_after, breaker_probe)
    SELECT name, kind, catch_up, global_concurrency, rate_limit, rate_burst, breaker_after, breaker_probe
      FROM cfg
        ON CONFLICT (name) DO UPDATE
       SET kind = excluded.kind, catch_up = excluded.catch_up,
           global_concurrency = excluded.global_concurrency,
           rate_limit = excluded.rate_limit, rate_burst = excluded.rate_burst,
           breaker_after = excluded.breaker_after, breaker_probe = excluded.breaker_probe,
           tokens = CASE WHEN ch.rate_limit IS NOT DISTINCT FROM excluded.rate_limit THEN ch.tokens END
    RETURNING ch.name
)
SELECT cfg.name
  FROM cfg JOIN old USING (name)
 WHERE (old.kind, old.catch_up, old.global_concurrency, old.rate_limit, old.rate_burst,
        old.breaker_after, old.breaker_probe)
       IS DISTINCT FROM (cfg.kind, cfg.catch_up, cfg.global_concurrency, cfg.rate_limit, cfg.rate_burst,
                         cfg.breaker_after, cfg.breaker_probe)

-- name: channel_states
-- Each channel's control state, what it holds now, and when its next retry is due. Throttled: the
-- throttle stops a claim now (held until its not_before, or its limit all taken by live leases);
-- a limit not reached only slows the channel while successes raise it (recovering).
SELECT c.name, c.kind, c.paused, c.paused_at, c.paused_by, c.paused_reason,
       coalesce(c.not_before > now(), false) OR coalesce(c.throttle_limit <= n.claimed, false) AS throttled,
       greatest(extract(epoch FROM c.not_before - now()), 0)::float8 AS throttled_for_seconds,
       c.throttle_limit, c.throttle_from, c.throttled_at, c.throttle_reason, c.global_concurrency, c.rate_limit, c.rate_burst,
       c.catch_up, n.claimed,
       (SELECT min(q.available_at) FROM pgwork.work_ready q JOIN pgwork.renewal_work w ON w.id = q.work_id
         WHERE q.channel = c.name AND w.attempts > w.attempts_base) AS next_retry_at
  FROM pgwork.channel c
 CROSS JOIN LATERAL (SELECT pgwork.claimed_now(c.name) AS claimed) n
 ORDER BY c.name

-- name: channel_pause
SELECT pgwork.pause_channel(%(channel)s, %(reason)s, %(actor)s) AS changed

-- name: channel_resume
SELECT pgwork.resume_channel(%(channel)s, %(actor)s) AS changed

-- name: daemon_register
INSERT INTO pgwork.daemon (id, host, pid, version, heartbeat_every, listener_up, metrics_at, schema_version,
                           channels)
VALUES (%(id)s, %(host)s, %(pid)s, %(version)s, %(heartbeat_every)s, %(listener_up)s, %(metrics_at)s,
        %(schema_version)s, %(channels)s)
    ON CONFLICT (id) DO UPDATE
   SET heartbeat_at = now(), heartbeat_every = excluded.heartbeat_every, listener_up = excluded.listener_up,
       metrics_at = excluded.metrics_at, schema_version = excluded.schema_version, channels = excluded.channels,
       session_pid = NULL

-- name: daemons_forget_gone
-- Daemons not alive (pgwork.daemon_alive) whose heartbeat is ten intervals old (and at least ten
-- minutes) are gone for good (killed, host lost): their rows go. Their claims come back through
-- lease expiry, not through this.
DELETE FROM pgwork.daemon d
 WHERE d.heartbeat_at < now() - greatest(10 * d.heartbeat_every, interval '10 minutes')
   AND NOT pgwork.daemon_alive(d)
RETURNING d.id

-- name: daemon_heartbeat
-- And whether `pgwork migrate` asks the daemons to step aside (see migration_pending; the
-- NOTIFY only wakes the heartbeat to look sooner).
UPDATE pgwork.daemon SET heartbeat_at = now(), listener_up = %(listener_up)s, session_pid = %(session_pid)s
 WHERE id = %(id)s
RETURNING (SELECT s.migration_requested_by FROM pgwork.schema_version s
             WHERE s.migration_requested_at IS NOT NULL
               AND EXISTS (SELECT FROM pg_stat_activity a
                            WHERE a.pid = s.migration_requester
                              AND right(s.migration_requested_by, length(a.application_name) + 10)
                        = '(session ' || a.application_name || ')'))
          AS migration_requested_by

-- name: daemon_session_lock
-- Taken by a daemon's LISTEN session once it listens (pgwork.daemon_alive): the session's pid,
-- or NULL when another session holds the lock (a previous session of this daemon not yet ended).
SELECT CASE WHEN pg_try_advisory_lock(pgwork.daemon_lock_class(), hashtext(%(id)s))
            THEN pg_backend_pid() END AS pid

-- name: daemon_unregister
DELETE FROM pgwork.daemon WHERE id = %(id)s

-- name: channel_retire_hold
-- Retiring a channel (pgwork channel retire), in one transaction: lock its row (a daemon starting
-- meanwhile waits to register it), and count what still uses it. NULL when there is no such
-- channel. Neither count has an index: an operator's rare command reads both tables.
-- live: the live rows it would close; moved: live rows on it whose reminder now names another
-- channel (made before the move, or in flight then), which go there instead. served_by: the live
-- daemons that registered it (id, host, pid), which stop claiming it once it is gone and
-- register it again when restarted with it.
SELECT (SELECT count(*) FROM pgwork.reminder r WHERE r.channel = c.name) AS reminders,
       (SELECT count(*) FROM pgwork.live_work(c.name) v
          JOIN pgwork.renewal_work w ON w.id = v.work_id
         WHERE NOT EXISTS (SELECT FROM pgwork.reminder r WHERE r.id = w.reminder_id AND r.channel <> c.name)) AS live,
       (SELECT count(*) FROM pgwork.live_work(c.name) v
          JOIN pgwork.renewal_work w ON w.id = v.work_id
          JOIN pgwork.reminder r ON r.id = w.reminder_id AND r.channel <> c.name) AS moved,
       coalesce((SELECT array_agg(format('%%s (%%s, pid %%s)', d.id, d.host, d.pid) ORDER BY d.started_at)
                   FROM pgwork.daemon d
                  WHERE c.name = ANY (d.channels) AND pgwork.daemon_alive(d)),
                '{}') AS served_by
  FROM pgwork.channel c
 WHERE c.name = %(channel)s
   FOR UPDATE OF c

-- name: channel_retire_cancel
-- Told to: delete the channel's reminders. The reminders' triggers cancel their unsent work (never
-- sent); a row in flight keeps its lease and its outcome is recorded as always.
DELETE FROM pgwork.reminder r WHERE r.channel = %(channel)s

-- name: channel_retire_close_work
-- ... and any live work still on the channel of no other channel's reminder (a row whose
-- reminder is gone): cancelled, never sent; a delivery in flight is fenced. A live row whose
-- reminder was moved to another channel is that reminder's send: it goes to its channel (one in
-- flight finishes; its retry, or its lease's expiry, lands there).
WITH live AS MATERIALIZED (
    SELECT v.work_id, v.held, w.reminder_id, r.channel AS moved_to
      FROM pgwork.live_work(%(channel)s) v
      JOIN pgwork.renewal_work w ON w.id = v.work_id
      LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id AND r.channel <> %(channel)s
), moved AS (
    UPDATE pgwork.renewal_work w
       SET channel = v.moved_to
      FROM live v
     WHERE w.id = v.work_id AND v.moved_to IS NOT NULL
), moved_lease AS (
    -- A lease in flight finishes; its expiry is reclaimed on the new channel ...
    UPDATE pgwork.work_lease l
       SET channel = v.moved_to
      FROM live v
     WHERE l.work_id = v.work_id AND v.held AND v.moved_to IS NOT NULL
), unmoved AS (
    -- ... which its note in pgwork.work_moved said; the note goes.
    DELETE FROM pgwork.work_moved m
     USING live v
     WHERE m.work_id = v.work_id
), unready AS (
    -- Ready rows leave this channel: moved ones to their new channel's queue (below), the rest
    -- with their record cancelled.
    DELETE FROM pgwork.work_ready q
     USING live v
     WHERE q.work_id = v.work_id AND NOT v.held
    RETURNING q.work_id, q.source, q.available_at, q.due_at
), requeued AS (
    INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
    SELECT u.work_id, v.moved_to, u.source, u.available_at, u.due_at
      FROM unready u JOIN live v ON v.work_id = u.work_id
     WHERE v.moved_to IS NOT NULL
), fenced AS (
    -- A delivery in flight of a reminder that is gone is fenced: its lease goes.
    DELETE FROM pgwork.work_lease l
     USING live v
     WHERE l.work_id = v.work_id AND v.held AND v.moved_to IS NULL
    RETURNING l.work_id, l.lease, l.attempts
)
UPDATE pgwork.renewal_work w
   SET status = 'cancelled', finished_at = now(),
       lease = coalesce(f.lease, w.lease), attempts = coalesce(f.attempts, w.attempts),
       last_error = 'cancelled: its channel was retired (pgwork channel retire --cancel)'
  FROM live v
  LEFT JOIN fenced f ON f.work_id = v.work_id
 WHERE w.id = v.work_id AND v.moved_to IS NULL

-- name: channel_retire
DELETE FROM pgwork.channel c WHERE c.name = %(channel)s

-- name: daemons
-- A daemon not alive (pgwork.daemon_alive) is shown as gone, and its listener as down (its row
-- kept what its last heartbeat said: "up", for a daemon killed since).
SELECT d.id, d.host, d.pid, d.version, d.started_at, d.heartbeat_at,
       CASE WHEN a.alive THEN d.listener_up ELSE false END AS listener_up,
       d.metrics_at,
       extract(epoch FROM now() - d.heartbeat_at)::float8 AS heartbeat_age_seconds,
       NOT a.alive AS gone
  FROM pgwork.daemon d
 CROSS JOIN LATERAL (SELECT pgwork.daemon_alive(d) AS alive) AS a
 ORDER BY d.started_at
