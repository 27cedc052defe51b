-- pgwork/sql/code/channel_control.sql — A channel's control state, honoured by every daemon: an
-- operator's pause and resume; its receiver's throttle, circuit breaker and pause after each flush.
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

CREATE OR REPLACE FUNCTION pgwork.channel_after_flush(
    c pgwork.channel, ok bigint, failed bigint, throttle float8, reason text, pause text,
    claimed integer, at timestamptz, actor text)
RETURNS TABLE (not_before timestamptz, failures integer, throttle_limit integer, throttle_from integer,
               throttled_at timestamptz, throttle_reason text, paused boolean, paused_at timestamptz,
               paused_by text, paused_reason text)
LANGUAGE sql IMMUTABLE AS $$
-- A channel's control state after an outcome flush brought it ok deliveries, failed attempts
-- (retries that were not throttling answers), a throttling answer (seconds to hold it, with its
-- reason; NULL: none) and a receiver's reason to pause it, at instant at; claimed: its live leases (read only
-- when a throttle or a trip starts). One function of its arguments, tested from a table
-- (tests/test_channel_state.py); record_outcomes applies it to the row it updates.
--   Throttle: hold the channel until the answer's Retry-After (or a second) and halve the rows
--   it may have claimed at once (at most once a second); each success raises the limit by one,
--   and it is lifted once back where it started.
--   Circuit breaker: failed attempts in a row (a batch with a success resets the count).
--   Reaching breaker_after trips it: held for breaker_probe, then probed one delivery at a time
--   (a limit of one); the count stays up, so a failed probe trips it again and a success starts
--   the recovery.
--   Pause: a receiver's reason (HTTP 410) pauses it, unless it is paused already.
SELECT CASE WHEN f.trips THEN greatest(c.not_before, at + c.breaker_probe)
            WHEN channel_after_flush.throttle IS NULL THEN c.not_before
            ELSE greatest(c.not_before, at + make_interval(secs => channel_after_flush.throttle)) END,
       f.failures,
       CASE WHEN f.trips THEN 1
            WHEN f.throttles AND (c.throttled_at IS NULL OR c.throttled_at < at - interval '1 second')
                THEN greatest(1, coalesce(c.throttle_limit, claimed) / 2)
            WHEN f.throttles OR c.throttle_limit IS NULL THEN c.throttle_limit
            WHEN f.recovered THEN NULL
            ELSE c.throttle_limit + ok::int END,
       CASE WHEN (f.throttles OR f.trips) AND c.throttle_limit IS NULL THEN greatest(2, claimed)
            WHEN NOT f.throttles AND f.recovered THEN NULL
            ELSE c.throttle_from END,
       CASE WHEN f.throttles OR f.trips THEN at ELSE c.throttled_at END,
       CASE WHEN f.trips THEN format('circuit breaker: %s failed attempts in a row; probing every %s',
                                     f.failures, c.breaker_probe)
            WHEN f.throttles THEN left(reason, 500)
            WHEN f.recovered THEN NULL
            ELSE c.throttle_reason END,
       c.paused OR f.pauses,
       CASE WHEN f.pauses AND NOT c.paused THEN at ELSE c.paused_at END,
       CASE WHEN f.pauses AND NOT c.paused THEN actor ELSE c.paused_by END,
       CASE WHEN f.pauses AND NOT c.paused THEN left(pause, 500) ELSE c.paused_reason END
  FROM (SELECT channel_after_flush.throttle IS NOT NULL AS throttles,
               pause IS NOT NULL AS pauses,
               ok = 0 AND c.failures + failed >= c.breaker_after AS trips,
               c.throttle_limit + ok >= c.throttle_from AS recovered,
               CASE WHEN c.breaker_after IS NULL OR ok > 0 THEN 0 ELSE c.failures + failed::int END AS failures) f
$$;
COMMENT ON FUNCTION pgwork.channel_after_flush(pgwork.channel, bigint, bigint, float8, text, text, integer, timestamptz, text) IS
    'A channel''s control state after an outcome flush (throttle and its recovery, circuit breaker, a '
    'receiver''s pause): applied by the daemon''s record_outcomes.';
