-- pgwork/sql/code/roles.sql — The group roles and what each may do (created where migrate may create roles).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.
--
-- pgwork_app may schedule, move, cancel and read reminders, and nothing else.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        CREATE ROLE pgwork_app NOLOGIN;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'pgwork: could not create role pgwork_app (no CREATEROLE); grants to it are skipped';
END
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_app;
        GRANT SELECT, DELETE ON pgwork.reminder TO pgwork_app;
        -- UPDATE of source and business_key is granted so that the trigger, not a bare
        -- "permission denied", tells an app they cannot change.
        GRANT INSERT (source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                      traceparent, tracestate, recur, recur_until, recur_skip, paused),
              UPDATE (source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                      traceparent, tracestate, recur, recur_until, recur_skip, paused)
              ON pgwork.reminder TO pgwork_app;
        GRANT SELECT ON pgwork.reminder_status, pgwork.time_zone, pgwork.app_source TO pgwork_app;
        -- Of a channel, what an app needs to pick one: not the receiver's state (throttle_reason
        -- quotes a receiver's reply to another source's delivery), nor the breaker's counts.
        GRANT SELECT (name, kind, registered_at, paused, catch_up) ON pgwork.channel TO pgwork_app;
        GRANT EXECUTE ON FUNCTION pgwork.reminder_notify() TO pgwork_app;
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Roles: pgwork_daemon runs the daemon and the operator commands (status, dlq, channel);
-- pgwork_cleanup runs `pgwork cleanup` (the retention timer). Group roles: GRANT one to the
-- login role that connects. Neither can change the schema or delete a reminder; only the
-- schema's owner runs `pgwork migrate`.
-- ---------------------------------------------------------------------------------------------

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        CREATE ROLE pgwork_daemon NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        CREATE ROLE pgwork_cleanup NOLOGIN;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'pgwork: could not create roles pgwork_daemon, pgwork_cleanup (no CREATEROLE); grants to them are skipped';
END
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_daemon;
        GRANT SELECT ON pgwork.schema_version, pgwork.time_zone, pgwork.app_source, pgwork.reminder_status
           TO pgwork_daemon;
        -- reminder: the materialiser's progress (next_fire_at); never INSERT or DELETE.
        GRANT SELECT, UPDATE ON pgwork.config, pgwork.reminder, pgwork.materialiser_state,
              pgwork.retention_state TO pgwork_daemon;
        GRANT SELECT, INSERT, UPDATE ON pgwork.channel TO pgwork_daemon;
        GRANT SELECT, INSERT, UPDATE, DELETE ON pgwork.renewal_work, pgwork.work_ready, pgwork.work_lease,
              pgwork.attempt, pgwork.retired, pgwork.daemon, pgwork.lane, pgwork.set_aside,
              pgwork.channel_minute, pgwork.work_moved TO pgwork_daemon;
        GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgwork TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_page TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.claim_lanes, pgwork.claim_rows, pgwork.lease_end, pgwork.lease_extend
           TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_series TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.migration_forget_stale() TO pgwork_daemon;
        BEGIN
            -- The xmin-horizon gauge reads other sessions' backend_xmin.
            GRANT pg_read_all_stats TO pgwork_daemon;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'pgwork: could not grant pg_read_all_stats to pgwork_daemon; pgwork_xmin_horizon_age sees only its own sessions';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_cleanup;
        GRANT SELECT ON pgwork.schema_version, pgwork.reminder, pgwork.channel, pgwork.daemon,
              pgwork.app_source TO pgwork_cleanup;
        -- materialiser_state: a batch locks its row (see retention_delete_batch).
        GRANT SELECT, UPDATE ON pgwork.config, pgwork.retention_state, pgwork.materialiser_state
           TO pgwork_cleanup;
        GRANT SELECT, DELETE ON pgwork.renewal_work, pgwork.attempt TO pgwork_cleanup;
        -- retired: tombstones are written, and a series' pruned once they guard nothing.
        GRANT SELECT, INSERT, DELETE ON pgwork.retired TO pgwork_cleanup;
    END IF;
END
$$;
