-- Every statement pgwork runs, named. `pgwork.queries` loads this file once; runtime code holds
-- no other SQL. Parameters are psycopg named placeholders. Time always comes from the database
-- clock (now()), never from a daemon's clock.

-- name: schema_installed
-- Whether pgwork was ever installed here.
SELECT to_regclass('pgwork.schema_version') IS NOT NULL AS installed

-- name: schema_version
SELECT version FROM pgwork.schema_version

-- name: type_fields
-- The fields of one of pgwork's composite types, in order: pgwork.claimed (store.Claimed's) and
-- pgwork.outcome (the keys of an outcome record's JSON).
SELECT a.attname::text AS name
  FROM pg_attribute a
 WHERE a.attrelid = (SELECT t.typrelid FROM pg_type t WHERE t.oid = %(type)s::regtype)
   AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum

-- name: schema_version_set
-- The version a migrate leaves (pgwork.SCHEMA_VERSION): written here only.
INSERT INTO pgwork.schema_version (version) VALUES (%(version)s)
    ON CONFLICT (singleton) DO UPDATE SET version = excluded.version, applied_at = now()

-- name: schema_code
-- The checksum of the SQL code a migrate applied last, and those it replaced (schema 25 on).
SELECT code_checksum, code_replaced FROM pgwork.schema_version

-- name: schema_code_set
-- The code a migrate applied: its checksum, the one before it kept among the replaced.
UPDATE pgwork.schema_version
   SET code_replaced = CASE WHEN code_checksum IS NULL OR code_checksum = %(checksum)s THEN code_replaced
                            ELSE array_append(array_remove(code_replaced, %(checksum)s), code_checksum) END,
       code_checksum = %(checksum)s

-- name: migrate_daemons
-- The daemons alive now (a heartbeat within three intervals), as `pgwork migrate` sees them
-- before it changes a schema of any version: columns a version may lack are read by name from
-- the row (schema_version: NULL for a daemon that predates the handshake).
SELECT d.id, d.host, (d.pid)::bigint AS pid, d.version,
       (to_jsonb(d)->>'schema_version')::int AS schema_version
  FROM pgwork.daemon d
 WHERE d.heartbeat_at > now() - 3 * coalesce((to_jsonb(d)->>'heartbeat_every')::interval, interval '20 seconds')
 ORDER BY d.host, d.pid

-- name: migration_request_legacy
-- Ask the running daemons to step aside (kept while a request stands), and wake them: a schema
-- from 15 to 21, whose daemons read the request in pgwork.config.
WITH asked AS (
    UPDATE pgwork.config SET migration_requested_at = coalesce(migration_requested_at, now()),
                             migration_requested_by = coalesce(migration_requested_by, %(by)s)
    RETURNING migration_requested_by
)
SELECT a.migration_requested_by, pg_notify('pgwork_migrate', a.migration_requested_by) IS NOT NULL AS told
  FROM asked a

-- name: migration_clear_legacy
UPDATE pgwork.config SET migration_requested_at = NULL, migration_requested_by = NULL

-- name: migration_hold_legacy
-- Held by the `pgwork migrate` that asks a schema from 15 to 21, for as long as its request
-- stands (session-level): the daemons of those versions take a request whose migrate no longer
-- holds it (killed) for nobody's.
SELECT pg_advisory_lock(hashtext('pgwork.migration_request')) AS held
  FROM (SELECT set_config('lock_timeout', '0', true)) AS unbounded

-- name: migration_release_legacy
SELECT pg_advisory_unlock(hashtext('pgwork.migration_request'))

-- name: migration_claim
-- A `pgwork migrate` claims the schema's row for the whole of its run (its request, its
-- transaction, its indexes built after the commit), unless another live session holds it: the
-- version read here, under the row's lock, is the one it migrates from; no row returned: another
-- migrate holds it (migration_holder names it). Autocommit: the wait for another migrate is the
-- caller's pause between two claims, never a statement holding a snapshot.
UPDATE pgwork.schema_version s
   SET migration_requester = pg_backend_pid(), migration_requested_by = %(by)s,
       migration_requested_at = NULL
 WHERE s.migration_requester IS NULL OR s.migration_requester = pg_backend_pid()
    OR NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = s.migration_requester)
RETURNING s.version

-- name: migration_holder
-- Who holds the schema's row now (the migrate a second one waits for).
SELECT s.migration_requested_by, s.migration_requester FROM pgwork.schema_version s

-- name: migration_request
-- Ask the running daemons to step aside (this session holds the claim), and wake them; the
-- notification only makes them look at this row (see migration_pending).
UPDATE pgwork.schema_version SET migration_requested_at = now()
 WHERE migration_requester = pg_backend_pid()
RETURNING migration_requested_by, pg_notify('pgwork_migrate', migration_requested_by) IS NOT NULL AS told

-- name: migration_clear
-- The request ends (with the migration's commit, or when it does not happen); the claim stays
-- until migration_release.
UPDATE pgwork.schema_version SET migration_requested_at = NULL
 WHERE migration_requester = pg_backend_pid()

-- name: migration_release
UPDATE pgwork.schema_version
   SET migration_requester = NULL, migration_requested_by = NULL, migration_requested_at = NULL
 WHERE migration_requester = pg_backend_pid()

-- name: migration_pending
-- Who asks the daemons to step aside now: a request in the owner's row whose migrate's session
-- is alive (NULL: nobody; a schema before 22, whose row has no request: nobody).
SELECT j->>'migration_requested_by' AS migration_requested_by
  FROM (SELECT to_jsonb(s) AS j FROM pgwork.schema_version s) AS v
 WHERE j->>'migration_requested_at' IS NOT NULL
   AND EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = (j->>'migration_requester')::int)

-- name: migrate_lock_apps_tables
-- Before steps that change the apps' tables themselves (schemas before 12): every table an
-- app's statement locks, in the order it locks them (a reminder; through its triggers its work
-- rows, tombstones and lanes; its channel's row; the sources' roles), those this schema has.
-- No step then takes a lock an app holds while the app waits for one the step holds.
DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['pgwork.reminder', 'pgwork.work_ready', 'pgwork.renewal_work', 'pgwork.retired', 'pgwork.lane',
                             'pgwork.channel', 'pgwork.app_source'] LOOP
        IF to_regclass(t) IS NOT NULL THEN
            EXECUTE format('LOCK TABLE %%s IN ACCESS EXCLUSIVE MODE', t);
        END IF;
    END LOOP;
END
$$

-- name: migrate_attach_locks
-- Before the triggers, policies and views are attached: the apps' tables, in the order an app's
-- statement locks them (pgwork.reminder, then its work rows through the triggers).
LOCK TABLE pgwork.reminder, pgwork.work_ready, pgwork.renewal_work, pgwork.app_source IN ACCESS EXCLUSIVE MODE

-- name: index_valid
-- Whether pgwork's index of this name is valid (NULL: there is none).
SELECT (SELECT i.indisvalid FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid
         WHERE c.relnamespace = 'pgwork'::regnamespace AND c.relname = %(name)s) AS valid

-- name: index_drop_concurrently
SELECT format('DROP INDEX CONCURRENTLY IF EXISTS pgwork.%%I', %(name)s::text) AS statement

-- name: session_unbounded
-- A concurrent index build may take as long as its table needs, and waits for the
-- transactions already running (it stops no write meanwhile).
SELECT set_config('statement_timeout', '0', false), set_config('lock_timeout', '0', false)

-- name: session_bounded
RESET statement_timeout; RESET lock_timeout

-- name: migrate_lock
-- Serialises a migration's transaction with any other's: a lock on the schema's own table that
-- only a role that may write it can conflict with (a daemon's or an app's read does not). The
-- transaction's first statement: a LOCK waits without a snapshot. Bounded by the transaction's
-- lock_timeout, set just before (migrate_wait).
LOCK TABLE pgwork.schema_version IN EXCLUSIVE MODE

-- name: migrate_lock_install
-- The same for a database with no pgwork schema yet (no table to lock, no app role either).
SELECT pg_advisory_xact_lock(hashtext('pgwork.migrate'))

-- name: migrate_wait
-- How long a migration waits for another's transaction, before its own lock_timeout applies.
SELECT set_config('lock_timeout', %(wait)s, true)

-- name: migrate_lock_holders
-- The sessions holding a lock on one of pgwork's tables (an app's open transaction, another
-- migrate, an operator's session): who a migration that could not get its locks waited for.
SELECT a.pid, a.usename::text AS usename, a.application_name, a.client_addr::text AS client_addr,
       a.state, string_agg(DISTINCT c.relname || ' ' || l.mode, ', ') AS locks
  FROM pg_locks l
  JOIN pg_class c ON c.oid = l.relation AND c.relnamespace = to_regnamespace('pgwork')
  JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.granted AND l.locktype = 'relation' AND a.pid <> pg_backend_pid()
 GROUP BY a.pid, a.usename, a.application_name, a.client_addr, a.state
 ORDER BY a.pid

-- name: migrate_timeouts
-- For the migration's transaction: a bounded wait for each lock, no bound on a statement.
SELECT set_config('lock_timeout', %(lock_timeout)s, true), set_config('statement_timeout', '0', true)

-- name: code_drop_stale
-- In a migration, after the code's CREATE OR REPLACE FUNCTION statements ran: the statements that
-- drop each other overload of a name the code defines (one this transaction did not write). The
-- code is the one definition of its functions; an overload left by an older install (a signature
-- a commit changed within one schema version) would make every unqualified reference to the name
-- ambiguous. Quoted by the server (regprocedure).
SELECT format('DROP FUNCTION %%s', p.oid::regprocedure) AS statement
  FROM pg_proc p
 WHERE p.pronamespace = 'pgwork'::regnamespace AND p.proname = ANY (%(names)s::text[])
   AND p.xmin <> pg_current_xact_id()::xid
 ORDER BY p.oid

-- name: time_zones_refresh
-- The zone names local-time reminders may use, from the server's tz database (every migrate run:
-- a server upgrade can bring new zones). Names are never removed: reminders may use them.
INSERT INTO pgwork.time_zone
SELECT name FROM pg_timezone_names
 WHERE name !~ '^(posix|right)/' AND name NOT IN ('localtime', 'posixrules')
    ON CONFLICT DO NOTHING

-- name: materialise_page
-- One page of the materialiser in one statement: pgwork.materialise_page (schema.sql) takes the
-- coordination lock, then runs the page in a statement of its own (a younger snapshot than the lock:
-- see there why that matters), and returns the page's figures on every row with the rows it
-- inserted claimed, as claim_work returns them (none claimed: one row, claimed columns NULL).
-- No row: another materialiser holds the lock.
SELECT p.cutoff, p.scanned, p.made, p.made_due, p.skipped, p.notified, p.earliest_made,
       p.last_at, p.last_id, p.unfinished, (p.claimed).*
  FROM pgwork.materialise_page(
    %(coordinate)s::boolean, %(cutoff)s::timestamptz, %(lookahead)s::interval,
    %(after_at)s::timestamptz, %(after_id)s::bigint, %(limit)s::integer, %(origin)s::text,
    %(take)s::jsonb, %(lease)s::interval, %(daemon_id)s::text, %(aside)s::bigint[]) AS p

-- name: next_due_reminder
-- The reminder a page from this cursor would take first (not one set aside): what a page that
-- failed with a limit of one failed on, and its occurrence's time.
SELECT r.id, r.source, r.business_key, coalesce(r.next_fire_at, r.due_at) AS fire_at
  FROM pgwork.reminder r
 WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
   AND coalesce(r.next_fire_at, r.due_at) <= coalesce(%(cutoff)s::timestamptz, now() + %(lookahead)s::interval)
   AND (coalesce(r.next_fire_at, r.due_at), r.id)
       > (coalesce(%(after_at)s::timestamptz, '-infinity'), %(after_id)s::bigint)
   AND NOT r.id = ANY (%(aside)s::bigint[])
 ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
 LIMIT 1

-- name: set_aside_record
-- A reminder a page failed on, left out by this daemon until next_try_at: recorded for status,
-- the web page and `pgwork reminder`. Another failure counts a try and keeps since.
INSERT INTO pgwork.set_aside AS s
       (reminder_id, source, business_key, fire_at, daemon_id, next_try_at, error)
VALUES (%(reminder_id)s, %(source)s, %(business_key)s, %(fire_at)s, %(daemon_id)s,
        now() + make_interval(secs => %(wait)s), %(error)s)
ON CONFLICT (reminder_id) DO UPDATE
   SET fire_at = excluded.fire_at, daemon_id = excluded.daemon_id, tried_at = now(),
       next_try_at = excluded.next_try_at, tries = s.tries + 1, error = excluded.error

-- name: set_aside_forget
-- Forgets the reminders set aside that are no longer stuck: made (their next occurrence is past
-- the one they failed on), moved past it, or deleted. Returns how many are left (small: the
-- reminders set aside).
WITH gone AS (
    DELETE FROM pgwork.set_aside s
     WHERE NOT EXISTS (SELECT FROM pgwork.reminder r
                        WHERE r.id = s.reminder_id
                          AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                          AND coalesce(r.next_fire_at, r.due_at) <= s.fire_at)
    RETURNING 1
)
SELECT (SELECT count(*) FROM pgwork.set_aside) - (SELECT count(*) FROM gone) AS left_aside

-- name: set_aside_list
-- The reminders set aside and still not made, the earliest occurrence first (%(reminder_id)s:
-- one reminder's, or NULL for all).
SELECT s.reminder_id, s.source, s.business_key, s.fire_at, s.daemon_id, s.since, s.tried_at,
       s.next_try_at, s.tries, s.error
  FROM pgwork.set_aside s
 WHERE (%(reminder_id)s::bigint IS NULL OR s.reminder_id = %(reminder_id)s::bigint)
   AND EXISTS (SELECT FROM pgwork.reminder r
                WHERE r.id = s.reminder_id
                  AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                  AND coalesce(r.next_fire_at, r.due_at) <= s.fire_at)
 ORDER BY s.fire_at, s.reminder_id
 LIMIT %(limit)s

-- name: commit_synchronously
-- After materialise_page, in its transaction: commit after the WAL flush after all (the page
-- claimed rows for a channel whose claims are synchronous; database.synchronous_claims).
SELECT set_config('synchronous_commit', 'on', true)

-- name: materialise_record_pass
-- Evidence of a pass: everything firing at or before %(cutoff)s has its work row (the caller
-- passes less than the pass's cutoff when reminders locked by apps were skipped). Committed
-- without waiting for the WAL flush (one statement, its own transaction): a record lost in a
-- crash is written again by the next pass.
UPDATE pgwork.materialiser_state
   SET last_cutoff = greatest(last_cutoff, %(cutoff)s),
       last_pass_at = now(),
       last_inserted = %(made)s,
       last_duration_ms = %(duration_ms)s,
       total_inserted = total_inserted + %(made)s
  FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit

-- name: next_fire_at
-- The earliest occurrence not yet materialised of a reminder not set aside, and how far it is
-- past %(cutoff)s in seconds by the database clock (the materialiser sleeps until it enters the
-- window; at or before the cutoff means a reminder was skipped because an app held its row lock).
-- aside_at: the earliest of the reminders set aside (%(aside)s), where the pass's evidence stops.
SELECT n.at, n.id, extract(epoch FROM n.at - %(cutoff)s::timestamptz)::float8 AS after_cutoff_s,
       (SELECT min(coalesce(r.next_fire_at, r.due_at))
          FROM pgwork.reminder r
         WHERE r.id = ANY (%(aside)s::bigint[])
           AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')) AS aside_at
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (
        SELECT coalesce(r.next_fire_at, r.due_at) AS at, r.id
          FROM pgwork.reminder r
         WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
           AND NOT r.id = ANY (%(aside)s::bigint[])
         ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
         LIMIT 1) AS n ON true

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
       metrics_at = excluded.metrics_at, schema_version = excluded.schema_version, channels = excluded.channels

-- name: daemons_forget_gone
-- Daemons silent for ten heartbeat intervals (and at least ten minutes) are gone for good (killed,
-- host lost): their rows go. Their claims come back through lease expiry, not through this.
DELETE FROM pgwork.daemon
 WHERE heartbeat_at < now() - greatest(10 * heartbeat_every, interval '10 minutes')
RETURNING id

-- name: daemon_heartbeat
-- And whether `pgwork migrate` asks the daemons to step aside (see migration_pending; the
-- NOTIFY only wakes the heartbeat to look sooner).
UPDATE pgwork.daemon SET heartbeat_at = now(), listener_up = %(listener_up)s WHERE id = %(id)s
RETURNING (SELECT s.migration_requested_by FROM pgwork.schema_version s
             WHERE s.migration_requested_at IS NOT NULL
               AND EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = s.migration_requester))
          AS migration_requested_by

-- name: daemon_unregister
DELETE FROM pgwork.daemon WHERE id = %(id)s

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
           -- ... or the first lease to expire.
           (SELECT min(l.expires_at) FROM pgwork.work_lease l WHERE l.channel = %(channel)s)) - now())::float8 AS wait_s,
       -- A channel retired (`pgwork channel retire`) while this daemon serves it: nothing to
       -- claim, as if paused, until it is registered again.
       coalesce(c.paused, true) AS paused,
       c.name IS NULL AS retired,
       greatest(extract(epoch FROM c.not_before - now()), 0)::float8 AS hold_s,
       CASE WHEN c.rate_limit IS NOT NULL THEN greatest(0,
            (least(c.rate_burst, greatest(1, c.rate_limit * 0.05))
             - pgwork.tokens_now(c.rate_limit, c.rate_burst, c.tokens, c.tokens_at))
            / c.rate_limit)::float8 END AS tokens_s,
       CASE WHEN least(c.global_concurrency, c.throttle_limit) IS NULL THEN false  -- no count
            ELSE least(c.global_concurrency, c.throttle_limit) <= pgwork.claimed_now(c.name)
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
    -- The record's one write of this attempt: its outcome, with the lease settled.
    UPDATE pgwork.renewal_work w
       SET status = o.status,
           lease = h.lease,
           -- An attempt that paused the channel (a 410) is the channel's failure, not the
           -- occurrence's: it does not spend the row's budget (its ledger row stays).
           attempts = h.attempts - (o.pause IS NOT NULL AND o.status = 'ready')::int,
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
       AND w.id = ANY ((SELECT array_agg(work_id) FROM o)::bigint[])
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
-- uncounted, and the row is ready again at once.
WITH released AS (
    SELECT l.work_id, l.lease, l.attempts, l.claimed_at, l.claimed_by
      FROM pgwork.lease_end(%(work_id)s::bigint[], %(lease_no)s::int[]) AS l
), settled AS (
    UPDATE pgwork.renewal_work w
       SET lease = r.lease, attempts = r.attempts - 1, available_at = now(),
           claimed_at = r.claimed_at, claimed_by = r.claimed_by
      FROM released r
     WHERE w.id = r.work_id AND w.id = ANY ((SELECT array_agg(r2.work_id) FROM released r2)::bigint[])
    RETURNING w.id, w.channel, w.source, w.available_at, w.due_at
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

-- name: trend_write
-- A daemon's minutes per channel (pgwork/duties/trends.py), a JSON array of
-- {channel, minute (epoch seconds), delivered, failed, dead, fenced, took_sum, took_max}: each
-- value whole, so a write repeated after a lost reply counts nothing twice.
INSERT INTO pgwork.channel_minute AS m
       (channel, minute, written_by, delivered, failed, dead, fenced, took_sum, took_max)
SELECT t.channel, to_timestamp(t.minute), %(written_by)s, t.delivered, t.failed, t.dead, t.fenced,
       t.took_sum, t.took_max
  FROM jsonb_to_recordset(%(minutes)s::jsonb)
       AS t(channel text, minute bigint, delivered bigint, failed bigint, dead bigint, fenced bigint,
            took_sum float8, took_max float8)
ON CONFLICT (channel, minute, written_by) DO UPDATE
   SET delivered = excluded.delivered, failed = excluded.failed, dead = excluded.dead,
       fenced = excluded.fenced, took_sum = excluded.took_sum, took_max = excluded.took_max

-- name: trend_prune
-- Up to %(limit)s minutes older than %(keep_hours)s hours, deleted; rows another daemon's prune
-- holds are skipped (it deletes them). Returns how many went.
WITH old AS (
    SELECT m.channel, m.minute, m.written_by
      FROM pgwork.channel_minute m
     WHERE m.minute < now() - make_interval(hours => %(keep_hours)s)
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM pgwork.channel_minute m
     USING old
     WHERE (m.channel, m.minute, m.written_by) = (old.channel, old.minute, old.written_by)
    RETURNING 1
)
SELECT count(*) AS n FROM gone

-- name: dlq_list
-- Dead letters, newest first, optionally filtered.
SELECT w.id, w.source, w.business_key, w.channel, w.deadline, w.occurrence, w.due_at, w.attempts,
       w.dead_reason, w.finished_at, w.operation_id
  FROM pgwork.renewal_work w
 WHERE w.status = 'dead'
   AND (%(channel)s::text IS NULL OR w.channel = %(channel)s)
   AND (%(source)s::text IS NULL OR w.source = %(source)s)
   AND (%(older_than)s::interval IS NULL OR w.finished_at <= now() - %(older_than)s::interval)
 ORDER BY w.finished_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: work_get
-- A work row as it stands (pgwork.work_now: claimed while a lease row holds it).
SELECT n.*, r.id IS NOT NULL AS reminder_exists, r.due_at AS reminder_due_at, r.recipient, r.payload
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
  LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id
 WHERE w.id = %(id)s

-- name: work_attempts
SELECT lease, attempt, outcome, retry_at, daemon_id, host, pid, started_at, finished_at, http_status,
       error_class, error, receipt
  FROM pgwork.attempt
 WHERE work_id = %(id)s
 ORDER BY lease

-- name: history_reminder
-- What happened to a reminder (pgwork reminder, the web page's /reminder): the reminder as stored.
SELECT r.id, r.source, r.business_key, r.channel, r.recipient, r.due_at, r.due_local, r.due_tz,
       r.remind_before, r.recur, r.recur_until, r.recur_skip, r.paused, r.created_at, r.payload
  FROM pgwork.reminder r
 WHERE r.source = %(source)s AND r.business_key = %(business_key)s

-- name: history_upcoming
-- Its next occurrences, one per remind_before entry, and where each stands.
SELECT s.deadline, s.deadline_local, s.remind_before, s.send_at, s.status
  FROM pgwork.reminder_status s
 WHERE s.source = %(source)s AND s.business_key = %(business_key)s
 ORDER BY s.send_at

-- name: history_lockers
-- The sessions whose open transaction holds its row (an app's UPDATE or SELECT ... FOR UPDATE not
-- committed yet): the materialiser skips a reminder it cannot lock, so its due sends wait for them.
-- Read without taking a lock: while the holder runs, the row's xmax is its transaction id, on
-- which it holds a granted lock. A row held by several transactions at once has a MultiXact in
-- xmax, not resolved here (such a row is not named as held). Role, application, state and times
-- of another role's session show only to pg_read_all_stats (pgwork_daemon has it).
SELECT l.pid, a.usename::text AS role, a.application_name, a.client_addr::text AS client_addr,
       a.state, a.xact_start
  FROM pgwork.reminder r
  JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.transactionid = r.xmax
  LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE r.id = %(reminder_id)s AND r.xmax <> '0'::xid AND l.pid <> pg_backend_pid()
 ORDER BY l.pid

-- name: history_work_of_reminder
-- Its work rows, the latest send first (the occurrence key's index).
SELECT n.id, n.deadline, n.deadline_local, n.occurrence, n.due_at, n.channel, n.status,
       n.available_at, n.attempts - n.attempts_base AS attempts, n.created_at, n.finished_at,
       n.last_error, n.dead_reason, n.redriven_at, n.redriven_by, n.operation_id
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
 WHERE w.reminder_id = %(reminder_id)s
 ORDER BY w.due_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: history_work_of_key
-- The work rows left by a deleted reminder of this source and key (no index: reads the table).
SELECT n.id, n.deadline, n.deadline_local, n.occurrence, n.due_at, n.channel, n.status,
       n.available_at, n.attempts - n.attempts_base AS attempts, n.created_at, n.finished_at,
       n.last_error, n.dead_reason, n.redriven_at, n.redriven_by, n.operation_id
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
 WHERE w.source = %(source)s AND w.business_key = %(business_key)s
 ORDER BY w.due_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: history_attempts
-- The ledger of those work rows (its primary key).
SELECT a.work_id, a.lease, a.attempt, a.outcome, a.started_at, a.finished_at,
       a.finished_at - a.started_at AS took, a.http_status, a.error_class, a.error, a.retry_at,
       a.host, a.pid, a.receipt
  FROM pgwork.attempt a
 WHERE a.work_id = ANY (%(work_ids)s::bigint[])
 ORDER BY a.work_id, a.lease

-- name: history_retired
-- What retention left of its older occurrences: their identity and outcome.
SELECT t.deadline, t.deadline_local, t.occurrence, t.status, t.operation_id, t.finished_at, t.retired_at
  FROM pgwork.retired t
 WHERE t.reminder_id = %(reminder_id)s
 ORDER BY t.deadline DESC, t.occurrence
 LIMIT %(limit)s

-- name: dlq_redrive
-- Give dead rows a fresh attempt budget, same operation id: the ids given, or all (optionally of
-- one channel, one source, dead within the last `since`, with a dead_reason LIKE the pattern). Rows whose reminder was deleted or
-- moved since are not redriven (the caller reports them): that would resurrect a cancelled send.
WITH target AS (
    SELECT w.id,
           coalesce(pgwork.work_unwanted(r.id, r.due_at, r.remind_before, r.recur_rule, r.due_local, r.paused,
                                         r.recur_skip, r.recur_until, r.recur_version,
                                         w.deadline, w.deadline_local, w.occurrence, w.recur_version),
                    'ok') AS verdict
      FROM pgwork.renewal_work w
      LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id
     WHERE w.status = 'dead'
       AND (%(all)s OR w.id = ANY (%(ids)s::bigint[]))
       AND (%(channel)s::text IS NULL OR w.channel = %(channel)s)
       AND (%(source)s::text IS NULL OR w.source = %(source)s)
       AND (%(since)s::interval IS NULL OR w.finished_at >= now() - %(since)s::interval)
       AND (%(reason_like)s::text IS NULL OR w.dead_reason LIKE %(reason_like)s)
       FOR UPDATE OF w
), redriven AS (
    UPDATE pgwork.renewal_work w
       SET status = 'ready', available_at = now(), attempts_base = w.attempts, finished_at = NULL,
           dead_reason = NULL, redriven_at = now(), redriven_by = %(operator)s
      FROM target t
     WHERE w.id = t.id AND t.verdict = 'ok'
    RETURNING w.id, w.channel, w.source, w.available_at, w.due_at
), requeued AS (
    INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
    SELECT d.id, d.channel, d.source, d.available_at, d.due_at FROM redriven d
), notified AS (
    SELECT pg_notify('pgwork_work', '') FROM (SELECT 1 FROM redriven LIMIT 1) AS any_row
)
SELECT t.id, t.verdict, (SELECT count(*) FROM notified) AS notified FROM target t ORDER BY t.id

-- name: retrying
-- Rows that failed and wait for their next try (ready, with attempts since the last redrive),
-- the soonest first: read through work_ready (live rows only).
SELECT w.id, w.channel, w.source, w.business_key, w.attempts - w.attempts_base AS attempts,
       q.available_at AS retry_at, w.last_error
  FROM pgwork.work_ready q
  JOIN pgwork.renewal_work w ON w.id = q.work_id
 WHERE w.attempts > w.attempts_base
   AND (%(channel)s::text IS NULL OR q.channel = %(channel)s)
 ORDER BY q.available_at, q.work_id
 LIMIT %(limit)s

-- name: channel_trend
-- A channel's last %(minutes)s minutes (by this database's clock), every daemon's summed, oldest
-- first; minutes with nothing recorded are not returned. Read by key: at most that many minutes
-- times the daemons that wrote them.
SELECT m.minute,
       sum(m.delivered)::bigint AS delivered, sum(m.failed)::bigint AS failed,
       sum(m.dead)::bigint AS dead, sum(m.fenced)::bigint AS fenced,
       (sum(m.took_sum) / nullif(sum(m.delivered + m.failed), 0))::float8 AS took_mean,
       max(m.took_max)::float8 AS took_max
  FROM pgwork.channel_minute m
 WHERE m.channel = %(channel)s
   AND m.minute > date_trunc('minute', now()) - make_interval(mins => %(minutes)s)
 GROUP BY m.minute
 ORDER BY m.minute

-- name: work_statuses
-- The status of each work row named, for the ids a redrive did not find dead.
SELECT w.id, CASE WHEN l.work_id IS NOT NULL THEN 'claimed' ELSE w.status END AS status
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 WHERE w.id = ANY (%(ids)s::bigint[])
 ORDER BY w.id

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
                  WHERE c.name = ANY (d.channels) AND d.heartbeat_at >= now() - 3 * d.heartbeat_every),
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
    -- A lease in flight finishes; its expiry is reclaimed on the new channel.
    UPDATE pgwork.work_lease l
       SET channel = v.moved_to
      FROM live v
     WHERE l.work_id = v.work_id AND v.held AND v.moved_to IS NOT NULL
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

-- name: channel_exists
SELECT EXISTS (SELECT FROM pgwork.channel c WHERE c.name = %(name)s) AS exists

-- name: work_states
-- Live work rows (ready: claimable now; waiting: made ahead of its due time or a retry in its
-- backoff; claimed) and dead letters by channel and status (status command, metrics). Each part
-- reads only live rows or the dead letters' partial index: the cost grows with live and dead
-- rows, never with the delivered rows retention keeps. Terminal counts are in the attempt counters.
SELECT channel, CASE WHEN available_at <= now() THEN 'ready' ELSE 'waiting' END AS status, count(*) AS n
  FROM pgwork.work_ready
 GROUP BY 1, 2
UNION ALL
SELECT channel, 'claimed', count(*)
  FROM pgwork.work_lease
 GROUP BY channel
UNION ALL
SELECT channel, 'dead', count(*)
  FROM pgwork.renewal_work
 WHERE status = 'dead'
 GROUP BY channel
 ORDER BY 1, 2

-- name: lag
-- How late the oldest overdue occurrence is, now minus its due time (0 when none): due work not
-- yet delivered, and reminders whose next occurrence is due but has no work row yet (no daemon
-- running, or the materialiser behind). Both read an index from its start; the first is bounded by
-- the live rows.
SELECT greatest(w.lag, r.lag, 0)::float8 AS lag_seconds,
       greatest(w.oldest_ready, 0)::float8 AS oldest_ready_seconds,
       greatest(r.lag, 0)::float8 AS unmaterialised_seconds
  FROM (SELECT extract(epoch FROM now() - min(due_at)) AS lag,
               extract(epoch FROM now() - min(available_at) FILTER (WHERE NOT held)) AS oldest_ready
          FROM pgwork.live_work(NULL)
         WHERE due_at <= now()) AS w,
       (SELECT extract(epoch FROM now() - (
                   SELECT coalesce(next_fire_at, due_at)
                     FROM pgwork.reminder
                    WHERE next_fire_at IS NULL OR next_fire_at < 'infinity'
                    ORDER BY coalesce(next_fire_at, due_at), id
                    LIMIT 1)) AS lag) AS r

-- name: lag_by_source
-- lag, per source: how late each app's oldest due, undelivered occurrence is (0 when none), and
-- whether it has no work row yet. Each source with something left to materialise is found by a
-- loose scan of reminder_due_by_source (one probe per source, then its earliest occurrence); live
-- rows are read once, bounded by the live rows like lag. Latest first.
WITH RECURSIVE sources AS (
    (SELECT r.source FROM pgwork.reminder r
      WHERE r.next_fire_at IS NULL OR r.next_fire_at < 'infinity'
      ORDER BY r.source LIMIT 1)
    UNION ALL
    SELECT (SELECT r.source FROM pgwork.reminder r
             WHERE r.source > s.source AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
             ORDER BY r.source LIMIT 1)
      FROM sources s WHERE s.source IS NOT NULL
), unmade AS (
    SELECT s.source,
           (SELECT coalesce(r.next_fire_at, r.due_at) FROM pgwork.reminder r
             WHERE r.source = s.source AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
             ORDER BY coalesce(r.next_fire_at, r.due_at), r.id LIMIT 1) AS due_at
      FROM sources s WHERE s.source IS NOT NULL
), live AS (
    SELECT w.source, min(w.due_at) AS due_at FROM pgwork.live_work(NULL) w
     WHERE w.due_at <= now() GROUP BY w.source
)
SELECT coalesce(u.source, l.source) AS source,
       greatest(extract(epoch FROM now() - least(l.due_at, u.due_at)), 0)::float8 AS lag_seconds,
       coalesce(u.due_at <= now() AND u.due_at < coalesce(l.due_at, 'infinity'), false) AS unmaterialised
  FROM unmade u FULL JOIN live l ON l.source = u.source
 ORDER BY lag_seconds DESC, source

-- name: oldest_overdue_channel
-- The channel of the oldest overdue live row: what `status --max-lag` names when lag is too high
-- (bounded by the live rows, like lag).
SELECT w.channel FROM pgwork.live_work(NULL) w
 WHERE w.due_at <= now()
 ORDER BY w.due_at LIMIT 1

-- name: materialiser_state
SELECT last_cutoff, last_pass_at, last_inserted, last_duration_ms, total_inserted,
       extract(epoch FROM now() - last_cutoff)::float8 AS cutoff_age_seconds
  FROM pgwork.materialiser_state

-- name: daemons
-- A daemon silent for more than three heartbeat intervals is shown as gone.
SELECT id, host, pid, version, started_at, heartbeat_at, listener_up, metrics_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds,
       heartbeat_at < now() - 3 * heartbeat_every AS gone
  FROM pgwork.daemon ORDER BY started_at

-- name: listen
LISTEN pgwork_reminder; LISTEN pgwork_work; LISTEN pgwork_channel; LISTEN pgwork_migrate

-- name: is_standby
SELECT pg_is_in_recovery() AS standby

-- name: ping
SELECT 1

-- name: retention_paused
SELECT retention_paused AS paused FROM pgwork.config

-- name: retention_set_paused
UPDATE pgwork.config SET retention_paused = %(paused)s

-- name: retention_delete_batch
-- One keyset batch of terminal work older than its keep (dead letters have their own, longer
-- keep), deleted by primary key with its ledger rows. The terminal-status and age filters are in
-- the DELETE itself: a row that became live again (a superseded occurrence revived) between the
-- scan and the delete is left alone. A delivered, dead or expired occurrence of a reminder that still
-- exists leaves a tombstone (pgwork.retired) that the materialiser honours; the batch holds the
-- materialiser's coordination lock (see materialise_lock) exclusively, so no page can run on a
-- snapshot that misses the tombstone. Series tombstones that can no longer matter are pruned
-- in the same batch.
WITH lock AS MATERIALIZED (
    SELECT true AS got FROM pgwork.materialiser_state FOR UPDATE
), victims AS MATERIALIZED (
    SELECT w.id, w.finished_at
      FROM pgwork.renewal_work w
     WHERE (SELECT got FROM lock)
       AND pgwork.is_terminal(w.status)
       AND w.finished_at < greatest(%(done_before)s::timestamptz, %(dead_before)s::timestamptz)
       AND (w.finished_at, w.id) > (coalesce(%(after_at)s::timestamptz, '-infinity'), %(after_id)s::bigint)
     ORDER BY w.finished_at, w.id
     LIMIT %(limit)s
), gone AS (
    DELETE FROM pgwork.renewal_work w
     USING victims v
     WHERE w.id = v.id
       AND pgwork.is_terminal(w.status)
       AND w.finished_at < CASE WHEN w.status = 'dead' THEN %(dead_before)s::timestamptz
                                ELSE %(done_before)s::timestamptz END
    RETURNING w.id, w.reminder_id, w.deadline, w.occurrence, w.status, w.operation_id, w.finished_at,
              w.deadline_local
), tombstones AS (
    INSERT INTO pgwork.retired (reminder_id, deadline, occurrence, status, operation_id, finished_at, deadline_local)
    SELECT g.reminder_id, g.deadline, g.occurrence, g.status, g.operation_id, g.finished_at, g.deadline_local
      FROM gone g
     WHERE g.status IN ('delivered', 'dead', 'expired')
       AND EXISTS (SELECT 1 FROM pgwork.reminder r WHERE r.id = g.reminder_id)
       -- An occurrence of a series can only be made again while its deadline is ahead (an edit
       -- restarts a series from now, never earlier): one whose deadline passed (two days, for
       -- a zone edit) needs no tombstone, so a long-lived series leaves none behind.
       AND (g.deadline_local IS NULL OR g.deadline >= now() - interval '2 days')
        ON CONFLICT DO NOTHING
    RETURNING 1
), ledger AS (
    DELETE FROM pgwork.attempt a USING gone g WHERE a.work_id = g.id RETURNING 1
), pruned AS (
    -- A series' tombstone whose deadline passed two days ago guards nothing (the rule above):
    -- deleted, a batch's worth at a time, oldest first (retired_series_deadline).
    DELETE FROM pgwork.retired t
     WHERE t.ctid = ANY (ARRAY(SELECT o.ctid FROM pgwork.retired o
                                WHERE (SELECT got FROM lock)
                                  AND o.deadline_local IS NOT NULL AND o.deadline < now() - interval '2 days'
                                ORDER BY o.deadline
                                LIMIT %(limit)s))
    RETURNING 1
)
SELECT (SELECT count(*) FROM victims) AS scanned,
       (SELECT count(*) FROM gone) AS deleted,
       (SELECT count(*) FROM ledger) AS ledger_deleted,
       (SELECT count(*) FROM tombstones) AS retired,
       (SELECT count(*) FROM pruned) AS pruned,
       l.finished_at AS last_at, l.id AS last_id
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT finished_at, id FROM victims ORDER BY finished_at DESC, id DESC LIMIT 1) l ON true

-- name: retention_record_pass
UPDATE pgwork.retention_state
   SET last_pass_at = now(), last_deleted = %(deleted)s, total_deleted = total_deleted + %(deleted)s

-- name: retention_state
SELECT r.last_pass_at, r.last_deleted, r.total_deleted, c.retention_paused AS paused,
       extract(epoch FROM now() - (SELECT min(finished_at) FROM pgwork.renewal_work
                                    WHERE pgwork.is_terminal(status)))::float8
           AS oldest_terminal_age_seconds
  FROM pgwork.retention_state r, pgwork.config c

-- name: retention_backlog
-- Terminal rows already past their keep (what the next passes will delete), counted up to
-- %(limit)s: a status check must not scan a large backlog.
SELECT count(*) AS n
  FROM (SELECT 1
          FROM pgwork.renewal_work
         WHERE pgwork.is_terminal(status)
           AND finished_at < greatest(%(done_before)s::timestamptz, %(dead_before)s::timestamptz)
           AND finished_at < CASE WHEN status = 'dead' THEN %(dead_before)s::timestamptz ELSE %(done_before)s::timestamptz END
         LIMIT %(limit)s) AS b

-- name: db_now
SELECT now() AS now

-- name: table_health
-- Dead tuples of pgwork's own tables (bloat makes every queue crawl).
SELECT relname AS table, n_dead_tup AS dead_tuples, n_live_tup AS live_tuples
  FROM pg_stat_user_tables
 WHERE schemaname = 'pgwork'

-- name: xmin_horizon
-- The oldest transaction (or slot, or prepared transaction) holding back vacuum in this
-- database: a forgotten long transaction anywhere quietly ruins every Postgres queue.
SELECT greatest(
         (SELECT max(extract(epoch FROM now() - xact_start)) FROM pg_stat_activity
           WHERE backend_xmin IS NOT NULL AND datname = current_database()),
         (SELECT max(extract(epoch FROM now() - prepared)) FROM pg_prepared_xacts
           WHERE database = current_database()),
         0)::float8 AS age_seconds,
       greatest(
         (SELECT max(age(backend_xmin)) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL),
         (SELECT max(age(xmin)) FROM pg_replication_slots WHERE xmin IS NOT NULL),
         (SELECT max(age(catalog_xmin)) FROM pg_replication_slots WHERE catalog_xmin IS NOT NULL),
         0)::bigint AS age_xids

-- name: lock_holders
-- Sessions holding a lock that stops the daemon's statements: on a pgwork table, a lock that
-- conflicts with a write (Share and stronger: an app's LOCK TABLE, a non-concurrent CREATE INDEX,
-- most DDL) or, at AccessExclusive, with a read. Read from pg_locks and pg_stat_activity only, so
-- this answers while those tables are locked. Another role's session shows its pid and lock,
-- and its application, role and times only to pg_read_all_stats (pgwork_daemon has it).
SELECT l.relation::regclass::text AS relation, l.mode, l.pid,
       a.usename::text AS role, a.application_name, a.state,
       extract(epoch FROM now() - coalesce(a.xact_start, a.backend_start))::float8 AS held_s
  FROM pg_locks l
  LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'relation' AND l.granted
   AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
   AND l.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
   AND l.relation IN (SELECT c.oid FROM pg_class c WHERE c.relnamespace = 'pgwork'::regnamespace)
   AND l.pid <> pg_backend_pid()
UNION
-- And any lock a pgwork session (the daemon's, the cleanup's: application_name pgwork) waits for,
-- a row's above all (an app's or an operator's transaction over a work or lane row): the sessions
-- it waits on (pg_blocking_pids), other than pgwork's own short ones.
SELECT coalesce((SELECT t.relation::regclass::text FROM pg_locks t
                  WHERE t.pid = w.pid AND t.relation IS NOT NULL AND NOT t.granted LIMIT 1),
                (SELECT t.relation::regclass::text || ' (a row)' FROM pg_locks t
                  WHERE t.pid = w.pid AND t.locktype = 'tuple' LIMIT 1),
                'a row')
         || ' that pgwork session ' || w.pid || ' waits for' AS relation,
       'holds what it needs' AS mode, b.pid,
       a.usename::text AS role, a.application_name, a.state,
       extract(epoch FROM now() - coalesce(a.xact_start, a.backend_start))::float8 AS held_s
  FROM pg_stat_activity w
 CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS b(pid)
  LEFT JOIN pg_stat_activity a ON a.pid = b.pid
 WHERE w.datname = current_database() AND w.application_name = 'pgwork' AND w.wait_event_type = 'Lock'
   AND w.pid <> pg_backend_pid() AND b.pid <> pg_backend_pid()
   AND (a.application_name IS DISTINCT FROM 'pgwork' OR now() - a.xact_start > interval '5 seconds')
 ORDER BY held_s DESC NULLS LAST, pid, relation

-- name: batch_limits
-- A retention batch's own limits, local to its transaction (no session state: this works
-- through a transaction-pooling PgBouncer too).
SELECT set_config('statement_timeout', %(statement_timeout)s, true),
       set_config('lock_timeout', %(lock_timeout)s, true)

-- name: live_page
-- A channel's live rows (ready, claimed or both) for the web page: one keyset page in the order
-- of work_ready_order (a claimed row by its lease's expiry), so a page reads only live rows,
-- however many are retained.
SELECT w.id, v.source, w.business_key, v.status, w.due_at, v.available_at, coalesce(v.attempts, w.attempts) AS attempts,
       w.attempts_base, w.last_error
  FROM (SELECT * FROM (SELECT q.work_id, q.source, 'ready' AS status, q.available_at, NULL::int AS attempts
                         FROM pgwork.work_ready q
                        WHERE q.channel = %(channel)s AND 'ready' = ANY (%(statuses)s::text[])
                          AND (q.source, q.available_at, q.work_id)
                              > (%(after_source)s::text, %(after_at)s::timestamptz, %(after_id)s::bigint)
                        ORDER BY q.source, q.available_at, q.work_id
                        LIMIT %(limit)s) AS ready
        UNION ALL
        SELECT * FROM (SELECT l.work_id, l.source, 'claimed', l.expires_at, l.attempts
                         FROM pgwork.work_lease l
                        WHERE l.channel = %(channel)s AND 'claimed' = ANY (%(statuses)s::text[])
                          AND (l.source, l.expires_at, l.work_id)
                              > (%(after_source)s::text, %(after_at)s::timestamptz, %(after_id)s::bigint)
                        ORDER BY l.source, l.expires_at, l.work_id
                        LIMIT %(limit)s) AS held) AS v
  JOIN pgwork.renewal_work w ON w.id = v.work_id
 ORDER BY v.source, v.available_at, v.work_id
 LIMIT %(limit)s

-- name: dead_page
-- Dead letters for the web page, newest first, one keyset page: read from work_dead (dead rows
-- only); optionally one channel, one source, dead within the last `since`, a dead_reason LIKE a
-- pattern (the filter dlq_redrive takes).
SELECT w.id, w.source, w.business_key, w.channel, w.due_at, w.attempts, w.attempts_base,
       w.dead_reason, w.finished_at
  FROM pgwork.renewal_work w
 WHERE w.status = 'dead'
   AND (%(channel)s::text IS NULL OR w.channel = %(channel)s)
   AND (%(source)s::text IS NULL OR w.source = %(source)s)
   AND (%(since)s::interval IS NULL OR w.finished_at >= now() - %(since)s::interval)
   AND (%(reason_like)s::text IS NULL OR w.dead_reason LIKE %(reason_like)s)
   AND (w.finished_at, w.id) < (%(before_at)s::timestamptz, %(before_id)s::bigint)
 ORDER BY w.finished_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: reminders_page
-- A source's reminders for the web page, by key, one keyset page: from the prefix (inclusive) and
-- after the last key shown, through the unique index on (source, business_key), with each one's
-- latest work row. Reads at most `scan` keys: under a linguistic collation the keys that start
-- with a prefix need not sort together, so a page may then come short of those further on.
SELECT r.id, r.business_key, r.channel, r.due_at, r.due_local, r.due_tz, r.recur, r.paused,
       n.status AS last_status, n.due_at AS last_send_at
  FROM (SELECT r.*
          FROM pgwork.reminder r
         WHERE r.source = %(source)s AND r.business_key >= %(prefix)s AND r.business_key > %(after)s
         ORDER BY r.business_key
         LIMIT %(scan)s) r
  LEFT JOIN LATERAL (
        SELECT n.status, n.due_at
          FROM pgwork.renewal_work w
          LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
         CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
         WHERE w.reminder_id = r.id
         ORDER BY w.due_at DESC, w.id DESC
         LIMIT 1) n ON true
 WHERE starts_with(r.business_key, %(prefix)s)
 ORDER BY r.business_key
 LIMIT %(limit)s
