-- Room gauges: the statements of gauges and status: lag, work counts, table health, the xmin horizon, lock holders.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/gauges.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

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

-- name: late_sources
-- The %(limit)s most overdue sources (a bounded family for the metrics and the web page's
-- overview, however many sources there are; `pgwork status` reads lag_by_source, every one):
-- from the live rows due (bounded by the live rows, as lag) and from the due reminders not
-- made yet, read in due order, at most 1,000 of them (a longer backlog of unmade reminders is
-- the materialiser's, which lag's unmaterialised part shows). Latest first; late ones only.
-- paused: the channel of the source's oldest overdue occurrence is paused (a deliberate pause,
-- which an alert's routing may tell from a fault).
WITH unmade AS (
    SELECT DISTINCT ON (d.source) d.source, d.at AS due_at, d.channel
      FROM (SELECT r.source, r.channel, coalesce(r.next_fire_at, r.due_at) AS at, r.id
              FROM pgwork.reminder r
             WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
               AND coalesce(r.next_fire_at, r.due_at) <= now()
             ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
             LIMIT 1000) AS d
     ORDER BY d.source, d.at, d.id
), live AS (
    SELECT DISTINCT ON (w.source) w.source, w.due_at, w.channel
      FROM pgwork.live_work(NULL) w
     WHERE w.due_at <= now()
     ORDER BY w.source, w.due_at
), late AS (
    SELECT coalesce(u.source, l.source) AS source,
           greatest(extract(epoch FROM now() - least(l.due_at, u.due_at)), 0)::float8 AS lag_seconds,
           coalesce(u.due_at < coalesce(l.due_at, 'infinity'), false) AS unmaterialised,
           CASE WHEN u.due_at < coalesce(l.due_at, 'infinity') THEN u.channel ELSE l.channel END AS channel
      FROM unmade u FULL JOIN live l ON l.source = u.source
)
SELECT t.source, t.lag_seconds, t.unmaterialised,
       coalesce((SELECT c.paused FROM pgwork.channel c WHERE c.name = t.channel), false) AS paused
  FROM late t
 ORDER BY t.lag_seconds DESC, t.source
 LIMIT %(limit)s

-- name: channel_lag
-- Per channel, how late its oldest overdue live row is (0: none), and whether it is paused:
-- its live rows only (the materialiser's backlog is lag's unmaterialised part).
SELECT c.name AS channel, c.paused,
       coalesce(greatest(extract(epoch FROM now() - w.due_at), 0), 0)::float8 AS lag_seconds
  FROM pgwork.channel c
  LEFT JOIN LATERAL (SELECT min(x.due_at) AS due_at FROM pgwork.live_work(c.name) x
                      WHERE x.due_at <= now()) w ON true
 ORDER BY c.name

-- name: dead_by_source
-- The %(limit)s sources with the most dead letters, from the dead letters' index.
SELECT w.source, count(*) AS n
  FROM pgwork.renewal_work w
 WHERE w.status = 'dead'
 GROUP BY w.source
 ORDER BY n DESC, w.source
 LIMIT %(limit)s

-- name: oldest_overdue_channel
-- The channel of the oldest overdue live row: what `status --max-lag` names when lag is too high
-- (bounded by the live rows, like lag).
SELECT w.channel FROM pgwork.live_work(NULL) w
 WHERE w.due_at <= now()
 ORDER BY w.due_at LIMIT 1

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
