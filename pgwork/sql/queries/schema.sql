-- Room schema: the statements of the schema: its version and code, migrate's locks and steps, the step-aside handshake.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/schema.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: schema_installed
-- Whether pgwork was ever installed here.
SELECT to_regclass('pgwork.schema_version') IS NOT NULL AS installed

-- name: schema_version
SELECT version FROM pgwork.schema_version

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
-- The daemons alive now, as `pgwork migrate` sees them before it changes a schema of any version
-- (so pgwork.daemon_alive, which a version may lack, written out here): a heartbeat within three
-- intervals, or the session lock held by the session the row names (schema 28 on). Columns a
-- version may lack are read by name from the row (schema_version: NULL for a daemon that
-- predates the handshake).
SELECT d.id, d.host, (d.pid)::bigint AS pid, d.version,
       (to_jsonb(d)->>'schema_version')::int AS schema_version
  FROM pgwork.daemon d
 WHERE d.heartbeat_at > now() - 3 * coalesce((to_jsonb(d)->>'heartbeat_every')::interval, interval '20 seconds')
    OR EXISTS (SELECT FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.granted AND l.pid = (to_jsonb(d)->>'session_pid')::bigint
                  AND l.database = (SELECT b.oid FROM pg_database b WHERE b.datname = current_database())
                  AND l.classid = 1885828964::oid AND l.objid = hashtext(d.id)::oid AND l.objsubid = 2)
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
-- Its session is named by its pid and by the application_name it set, which its name in the
-- row ends with ("host/pid (session pgwork migrate 5f2c…)"; pg_stat_activity shows both to every
-- role): a pid alone was trusted after the migrate was killed, when a new unrelated session got
-- that pid (a wrap of pid_max), and daemons stepped aside for nobody. A claim whose session is
-- gone is taken over (which clears its request).
UPDATE pgwork.schema_version s
   SET migration_requester = pg_backend_pid(), migration_requested_by = %(by)s,
       migration_requested_at = NULL
 WHERE s.migration_requester IS NULL OR s.migration_requester = pg_backend_pid()
    OR NOT EXISTS (SELECT FROM pg_stat_activity a
                    WHERE a.pid = s.migration_requester
                      AND right(s.migration_requested_by, length(a.application_name) + 10)
                        = '(session ' || a.application_name || ')')
RETURNING s.version

-- name: migration_session_name
-- Name this session (its application_name, for the rest of the session); returns the name it
-- had. A migrate's claim names its session so (see migration_claim).
SELECT p.previous, set_config('application_name', %(name)s, false) AS now
  FROM (SELECT current_setting('application_name') AS previous) AS p

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
-- is alive, by its pid and its application_name (see migration_claim; NULL: nobody; a schema
-- before 22, whose row has no request: nobody).
SELECT j->>'migration_requested_by' AS migration_requested_by
  FROM (SELECT to_jsonb(s) AS j FROM pgwork.schema_version s) AS v
 WHERE j->>'migration_requested_at' IS NOT NULL
   AND EXISTS (SELECT FROM pg_stat_activity a
                WHERE a.pid = (j->>'migration_requester')::int
                  AND right(j->>'migration_requested_by', length(a.application_name) + 10)
                      = '(session ' || a.application_name || ')')

-- name: migration_forget_stale
-- A claim (and request) left by a migrate that is gone: cleared by a daemon as it starts
-- (pgwork.migration_forget_stale, which writes the owner's row for that alone). True: one was.
SELECT pgwork.migration_forget_stale() AS cleared

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
SELECT format('DROP FUNCTION %%s', p.oid::regprocedure) AS statement, p.proname::text AS name
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
