-- pgwork/sql/code/work.sql — Work rows: terminal statuses, why an occurrence is no longer wanted, the claim's helpers
-- (channel capacity, fair lanes and their trigger, the rate limit's tokens).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.is_terminal(status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired');
COMMENT ON FUNCTION pgwork.is_terminal(text) IS
    'Whether a work status is final (queries use this; inlined, it still matches the work_terminal index).';

CREATE OR REPLACE FUNCTION pgwork.unwanted(reminder_id bigint, reminder_due_at timestamptz,
                                remind_before interval[], deadline timestamptz, occurrence interval)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN reminder_due_at <> deadline OR NOT occurrence = ANY (remind_before) THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.unwanted(bigint, timestamptz, interval[], timestamptz, interval) IS
    'Why an occurrence is no longer wanted by its reminder (a missing reminder: cancelled; a moved deadline or a dropped remind_before entry: superseded), or NULL while it is.';

-- The channel's catch_up policy for a send that fired before its reminder (or series) was
-- written or last moved: all are sent; latest: only the most recent of them (latest_missed: the
-- reminder's latest send before planned_at); none: none. True: close it as expired instead.
CREATE OR REPLACE FUNCTION pgwork.skipped_by_catch_up(policy text, fire_at timestamptz, planned_at timestamptz,
                                           latest_missed timestamptz)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE coalesce(policy, 'all') WHEN 'none' THEN fire_at < planned_at
                                    WHEN 'latest' THEN fire_at < latest_missed
                                    ELSE false END;
COMMENT ON FUNCTION pgwork.skipped_by_catch_up(text, timestamptz, timestamptz, timestamptz) IS
    'Whether a channel''s catch_up policy skips a send that fired before its reminder was written or moved.';

CREATE OR REPLACE FUNCTION pgwork.claimed_now(channel text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN (SELECT count(*) FROM pgwork.renewal_work h
         WHERE h.channel = claimed_now.channel AND h.status = 'claimed' AND h.available_at > now());
COMMENT ON FUNCTION pgwork.claimed_now(text) IS
    'Rows of a channel claimed under live leases, by every daemon: what global_concurrency and a '
    'throttle limit count (an expired lease does not: its row is claimable again). Reads work_held.';

CREATE OR REPLACE FUNCTION pgwork.wake_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A statement made rows ready (a page, a retry, a give-back, a redrive, a revival): their
    -- lanes' turns come no later than the rows (or now, for a row ready earlier: it queues
    -- behind the lanes already waiting). Lanes are locked in key order by every writer, so two
    -- writers never wait for each other in a cycle; a claim never waits for a lane (SKIP
    -- LOCKED). ON CONFLICT DO UPDATE locks the lane before its WHERE is judged: a claim turning
    -- the lane meanwhile (it could not see these rows) is waited for, then corrected.
    -- The lane's ready_from comes forward to the first of them too, in work_claimable's order
    -- (the claim reads the lane from there).
    -- Most statements make no row ready (every claim, delivered and dead outcomes, the page that
    -- claims what it makes): they leave before the upsert, whose plan is not started for them.
    IF NOT EXISTS (SELECT FROM woken r WHERE r.status = 'ready') THEN
        RETURN NULL;
    END IF;
    INSERT INTO pgwork.lane AS l (channel, source, turn_at, ready_from, ready_from_id)
    SELECT DISTINCT ON (r.channel, r.source) r.channel, r.source, r.available_at, r.available_at, r.id
      FROM woken r
     WHERE r.status = 'ready'
     ORDER BY r.channel, r.source, r.available_at, r.id
        ON CONFLICT (channel, source) DO UPDATE
       SET turn_at = least(l.turn_at, greatest(excluded.turn_at, now())),
           ready_from = CASE WHEN (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id)
                             THEN excluded.ready_from ELSE l.ready_from END,
           ready_from_id = CASE WHEN (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id)
                                THEN excluded.ready_from_id ELSE l.ready_from_id END
     WHERE l.turn_at > greatest(excluded.turn_at, now())
        OR (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgwork.wake_lanes() IS
    'Statement trigger on renewal_work: the lanes of rows made ready are due no later than the rows.';
CREATE OR REPLACE TRIGGER work_wakes_lanes_on_insert AFTER INSERT ON pgwork.renewal_work
    REFERENCING NEW TABLE AS woken FOR EACH STATEMENT EXECUTE FUNCTION pgwork.wake_lanes();
CREATE OR REPLACE TRIGGER work_wakes_lanes_on_update AFTER UPDATE ON pgwork.renewal_work
    REFERENCING NEW TABLE AS woken FOR EACH STATEMENT EXECUTE FUNCTION pgwork.wake_lanes();

CREATE OR REPLACE FUNCTION pgwork.tokens_now(rate_limit double precision, rate_burst double precision,
                                  tokens double precision, tokens_at timestamptz)
RETURNS double precision LANGUAGE sql STABLE PARALLEL SAFE
RETURN least(rate_burst, coalesce(tokens, rate_burst) + rate_limit * greatest(extract(epoch FROM now() - tokens_at), 0));
COMMENT ON FUNCTION pgwork.tokens_now(double precision, double precision, double precision, timestamptz) IS
    'A rate-limited channel''s tokens now: what its row held at tokens_at, refilled at rate_limit per '
    'second, at most rate_burst (a full bucket before the first claim).';

CREATE OR REPLACE FUNCTION pgwork.series_unwanted(reminder_id bigint, recur_rule jsonb, due_local timestamp,
                                       paused boolean, recur_skip timestamp[], recur_until timestamp,
                                       remind_before interval[], recur_version integer,
                                       deadline_local timestamp, occurrence interval, made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why an occurrence of a series is no longer wanted (NULL while it is): the reminder is gone
-- (cancelled); or it is no longer a series, is paused, dropped the remind_before entry, skips or
-- ends before the deadline, or its rule no longer has it (superseded). The rule is evaluated only
-- when it changed since the occurrence was made (made_version: the reminder's recur_version then).
-- No subquery here (the rule is asked through pgwork.recur_has): a claim inlines this, where a
-- SQL function with one ran as a plan of its own for every series row claimed
-- (test_hot_path.py::test_a_claim_runs_no_sql_function_body_of_its_own).
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN recur_rule IS NULL OR paused OR deadline_local IS NULL OR NOT occurrence = ANY (remind_before)
                 OR deadline_local = ANY (coalesce(recur_skip, '{}')) OR deadline_local > recur_until
                THEN 'superseded'
            WHEN made_version IS DISTINCT FROM recur_version
                 AND NOT pgwork.recur_has(recur_rule, due_local, deadline_local)
                THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.series_unwanted(bigint, jsonb, timestamp, boolean, timestamp[], timestamp, interval[], integer, timestamp, interval, integer) IS
    'Why an occurrence of a recurring reminder is no longer wanted (cancelled, superseded), or NULL while it is.';

CREATE OR REPLACE FUNCTION pgwork.work_unwanted(reminder_id bigint, reminder_due_at timestamptz, remind_before interval[],
                                     recur_rule jsonb, due_local timestamp, paused boolean,
                                     recur_skip timestamp[], recur_until timestamp, recur_version integer,
                                     deadline timestamptz, deadline_local timestamp, occurrence interval,
                                     made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why a work row's occurrence is no longer wanted by its reminder, one-off (pgwork.unwanted) or of
-- a series (pgwork.series_unwanted), or NULL while it is: what a claim and a redrive ask.
RETURN CASE WHEN deadline_local IS NULL
            THEN pgwork.unwanted(reminder_id, reminder_due_at, remind_before, deadline, occurrence)
            ELSE pgwork.series_unwanted(reminder_id, recur_rule, due_local, paused, recur_skip, recur_until,
                                        remind_before, recur_version, deadline_local, occurrence, made_version)
       END;
COMMENT ON FUNCTION pgwork.work_unwanted(bigint, timestamptz, interval[], jsonb, timestamp, boolean, timestamp[], timestamp, integer, timestamptz, timestamp, interval, integer) IS
    'Why a work row''s occurrence is no longer wanted (cancelled, superseded), or NULL while it is.';

CREATE OR REPLACE FUNCTION pgwork.as_claimed(w pgwork.renewal_work, prev_status text, recipient text, payload text,
                                             time_zone text)
RETURNS pgwork.claimed LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- The row a worker gets (pgwork.claimed) from a work row as a claim left it (claim_work) or a page
-- made it claimed (pgwork.materialise_page): the status it had before, and the reminder's
-- recipient, payload and, for a series, zone, as the statement read them. Retries count from the
-- last redrive, or from the occurrence's due time (never before the row was made).
RETURN ROW(w.id, w.reminder_id, w.source, w.business_key, w.deadline, w.occurrence, w.due_at, w.channel,
           w.operation_id, w.status, w.attempts, w.attempts_base, w.lease,
           coalesce(w.redriven_at, greatest(w.due_at, w.created_at)),
           prev_status, recipient, payload, w.traceparent, w.tracestate, w.deadline_local,
           CASE WHEN w.deadline_local IS NOT NULL THEN time_zone END)::pgwork.claimed;
COMMENT ON FUNCTION pgwork.as_claimed(pgwork.renewal_work, text, text, text, text) IS
    'A work row as a worker gets it (pgwork.claimed), with the status it had and its reminder''s recipient, payload and zone.';
