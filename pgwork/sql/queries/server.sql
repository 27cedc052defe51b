-- Room server: the statements of the server itself: its clock, standby or primary, LISTEN, a ping.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/server.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: listen
LISTEN pgwork_reminder; LISTEN pgwork_work; LISTEN pgwork_channel; LISTEN pgwork_migrate

-- name: is_standby
SELECT pg_is_in_recovery() AS standby

-- name: ping
SELECT 1

-- name: db_now
SELECT now() AS now
