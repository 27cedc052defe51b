-- pgwork schema 4 -> 5. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it adds: the claim shares each batch between the sources with due work (work_claimable
-- is keyed by source; pgwork.live_sources walks the sources); the group roles pgwork_daemon and
-- pgwork_cleanup, with the privileges the daemon and the retention timer need; where each
-- daemon serves its metrics (daemon.metrics_at); W3C trace context on reminders, carried to
-- their work rows (traceparent, tracestate).
--
-- Cost on a large database: work_claimable is rebuilt. It indexes live rows only (ready and
-- claimed), so it is as large as the backlog, not the table. The new reminder columns' CHECK
-- constraints are validated in one scan of pgwork.reminder (every row passes: the columns are
-- new and NULL).
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file require-concurrent-index-creation, require-concurrent-index-deletion

ALTER TABLE pgwork.reminder
    ADD COLUMN traceparent text
        CONSTRAINT reminder_traceparent_w3c
            CHECK (traceparent ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
                   AND traceparent !~ '^ff-' AND traceparent !~ '^..-0{32}-' AND traceparent !~ '-0{16}-..$'),
    ADD COLUMN tracestate text
        CONSTRAINT reminder_tracestate_valid CHECK (length(tracestate) <= 512 AND tracestate !~ '[[:cntrl:]]');
COMMENT ON COLUMN pgwork.reminder.traceparent IS
    'Optional W3C trace context of the request that scheduled (or last moved) the reminder; '
    'each occurrence materialised from then on carries it, and its webhook requests send it.';
COMMENT ON COLUMN pgwork.reminder.tracestate IS 'Optional W3C tracestate that goes with traceparent.';
ALTER TABLE pgwork.renewal_work ADD COLUMN traceparent text, ADD COLUMN tracestate text;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT INSERT (traceparent, tracestate), UPDATE (traceparent, tracestate) ON pgwork.reminder TO pgwork_app;
    END IF;
END
$$;

ALTER TABLE pgwork.daemon ADD COLUMN metrics_at text;
COMMENT ON COLUMN pgwork.daemon.metrics_at IS
    'HOST:PORT its Prometheus metrics are served on (the port it got, when metrics.listen names '
    'port 0 or a range); NULL: metrics off.';

DROP INDEX pgwork.work_claimable;
CREATE INDEX work_claimable ON pgwork.renewal_work (channel, source, available_at, id)
    WHERE status IN ('ready', 'claimed');

CREATE FUNCTION pgwork.live_sources(channel text) RETURNS SETOF text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- A loose scan of work_claimable: one index probe per source, however many rows each has.
    WITH RECURSIVE walk(source) AS (
        (SELECT w.source FROM pgwork.renewal_work w
          WHERE w.channel = live_sources.channel AND w.status IN ('ready', 'claimed')
          ORDER BY w.source LIMIT 1)
        UNION ALL
        SELECT (SELECT w.source FROM pgwork.renewal_work w
                 WHERE w.channel = live_sources.channel AND w.status IN ('ready', 'claimed')
                   AND w.source > walk.source
                 ORDER BY w.source LIMIT 1)
          FROM walk
         WHERE walk.source IS NOT NULL)
    SELECT source FROM walk WHERE source IS NOT NULL
$$;
COMMENT ON FUNCTION pgwork.live_sources(text) IS
    'The sources with live (ready or claimed) work in a channel: what the claim shares each batch '
    'between, so that one source''s flood cannot hold back another source''s due work.';

CREATE OR REPLACE FUNCTION pgwork.source_allowed(source text, who name) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pgwork
RETURN EXISTS (SELECT 1 FROM pgwork.app_source a WHERE a.role = who AND a.source = source_allowed.source)
    OR EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = who AND (r.rolsuper OR r.rolbypassrls))
    OR pg_has_role(who, (SELECT c.relowner FROM pg_class c WHERE c.oid = 'pgwork.reminder'::regclass), 'MEMBER')
    OR EXISTS (SELECT 1 FROM pg_roles r
                WHERE r.rolname IN ('pgwork_daemon', 'pgwork_cleanup') AND pg_has_role(who, r.oid, 'MEMBER'));
COMMENT ON FUNCTION pgwork.source_allowed(text, name) IS
    'Whether a role may see and write reminders of a source: listed in pgwork.app_source, or the '
    'tables'' owner, a member of pgwork_daemon or pgwork_cleanup, a superuser or a BYPASSRLS role.';

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
        GRANT SELECT, INSERT, UPDATE, DELETE ON pgwork.renewal_work, pgwork.attempt, pgwork.retired,
              pgwork.daemon TO pgwork_daemon;
        GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgwork TO pgwork_daemon;
        BEGIN
            -- The xmin-horizon gauge reads other sessions' backend_xmin.
            GRANT pg_read_all_stats TO pgwork_daemon;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'pgwork: could not grant pg_read_all_stats to pgwork_daemon; pgwork_xmin_horizon_age sees only its own sessions';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_cleanup;
        GRANT SELECT ON pgwork.schema_version, pgwork.reminder, pgwork.channel, pgwork.daemon TO pgwork_cleanup;
        -- materialiser_state: a batch locks its row (see retention_delete_batch).
        GRANT SELECT, UPDATE ON pgwork.config, pgwork.retention_state, pgwork.materialiser_state
           TO pgwork_cleanup;
        GRANT SELECT, DELETE ON pgwork.renewal_work, pgwork.attempt TO pgwork_cleanup;
        GRANT SELECT, INSERT ON pgwork.retired TO pgwork_cleanup;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 5, applied_at = now();
