-- pgwork/sql/code/channel_control.sql — Channel control for operators: pause and resume, honoured by every daemon.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.pause_channel(channel_name text, reason text DEFAULT NULL, actor text DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
-- Pause a channel: every daemon stops claiming its work at once (a NOTIFY tells them) and gives
-- back rows it claimed but has not started. Returns false when it was already paused.
BEGIN
    UPDATE pgwork.channel
       SET paused = true, paused_at = now(), paused_by = coalesce(actor, session_user), paused_reason = reason
     WHERE name = channel_name AND NOT paused;
    IF FOUND THEN
        PERFORM pg_notify('pgwork_channel', channel_name);
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pgwork.channel WHERE name = channel_name) THEN
        RAISE EXCEPTION 'pgwork: no channel named "%"', channel_name
            USING ERRCODE = 'no_data_found', HINT = 'SELECT name FROM pgwork.channel lists them.';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pgwork.pause_channel(text, text, text) IS
    'Pause a channel (its work waits; nothing is dropped or counted). Returns false if already paused.';

CREATE OR REPLACE FUNCTION pgwork.resume_channel(channel_name text, actor text DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
-- Resume a paused channel, and lift a throttle: the operator says the receiver is ready.
-- Returns false when it was neither paused nor throttled.
BEGIN
    UPDATE pgwork.channel
       SET paused = false, paused_at = now(), paused_by = coalesce(actor, session_user), paused_reason = NULL,
           not_before = NULL, throttle_limit = NULL, throttle_from = NULL, throttle_reason = NULL
     WHERE name = channel_name AND (paused OR not_before IS NOT NULL OR throttle_limit IS NOT NULL);
    IF FOUND THEN
        PERFORM pg_notify('pgwork_channel', channel_name);
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pgwork.channel WHERE name = channel_name) THEN
        RAISE EXCEPTION 'pgwork: no channel named "%"', channel_name
            USING ERRCODE = 'no_data_found', HINT = 'SELECT name FROM pgwork.channel lists them.';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pgwork.resume_channel(text, text) IS
    'Resume a paused channel and lift any throttle. Returns false if it was neither.';
