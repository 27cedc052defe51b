-- pgwork/sql/code/daemons.sql — Whether a daemon is alive, as every reader of pgwork.daemon judges it.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.daemon_lock_class() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 1885828964 $$;  -- 'pgwd'
COMMENT ON FUNCTION pgwork.daemon_lock_class() IS
    'The first key of a daemon''s session lock (pg_try_advisory_lock(this, hashtext(daemon id))).';

-- A daemon is alive while its heartbeat is recent (three intervals), or while the session it
-- named holds its session lock: its LISTEN connection takes a session-level advisory lock keyed
-- by its id and writes that session's pid in its row, so an idle daemon need not write to be seen
-- alive. A killed daemon's session ends with it (the lock goes at once); a pid reused by another
-- session holds no such lock. pg_locks shows every session's locks to every role.
CREATE OR REPLACE FUNCTION pgwork.daemon_alive(d pgwork.daemon) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT d.heartbeat_at >= now() - 3 * d.heartbeat_every
        OR EXISTS (SELECT FROM pg_locks l
                    WHERE l.locktype = 'advisory' AND l.granted AND l.pid = d.session_pid
                      AND l.database = (SELECT b.oid FROM pg_database b WHERE b.datname = current_database())
                      AND l.classid = pgwork.daemon_lock_class()::oid AND l.objid = hashtext(d.id)::oid
                      AND l.objsubid = 2)
$$;
COMMENT ON FUNCTION pgwork.daemon_alive(pgwork.daemon) IS
    'Whether a daemon is alive: a heartbeat within three intervals, or its session lock held by the session its row names.';
