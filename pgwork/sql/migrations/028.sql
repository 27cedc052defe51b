-- pgwork schema 27 -> 28. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The code that writes and
-- reads it lives in pgwork/sql/code/, applied by migrate after this file.
--
-- What changes (issue 70): an idle daemon is seen alive by its LISTEN session's lock instead of a
-- heartbeat written every 20 s; its row names that session. A nullable column: no table rewrite.

ALTER TABLE pgwork.daemon ADD COLUMN session_pid bigint;
COMMENT ON COLUMN pgwork.daemon.session_pid IS
    'The backend pid of its LISTEN session, which holds its session lock: while that lock is held '
    'the daemon is alive without writing (pgwork.daemon_alive). NULL: no such session.';
COMMENT ON TABLE pgwork.daemon IS
    'Running (or recently running) daemons. One is alive while its heartbeat is recent or its '
    'session lock is held (pgwork.daemon_alive); one not alive is shown as gone, and once its '
    'heartbeat is ten intervals old it is deleted by the others.';
