-- pgwork/sql/code/migrate.sql — The migration handshake's one write a daemon may make: forgetting a killed migrate's claim.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- A `pgwork migrate` claims the owner's row (pgwork.schema_version) for its run, naming its
-- session by its pid and by the application_name it sets, which its name in the row ends with
-- (queries/schema.sql, migration_claim): both are shown to every role in pg_stat_activity. A
-- migrate killed leaves its claim, and perhaps its request to step aside: nobody obeys it (no
-- such session is alive), but it stood there until the next migrate. A daemon calls this as it
-- starts: the claim is cleared if, and only if, its session is gone. Returns whether it cleared
-- one. SECURITY DEFINER: the daemon's role may read the row, never write it; this writes only
-- a dead claim away.
CREATE OR REPLACE FUNCTION pgwork.migration_forget_stale() RETURNS boolean
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
    WITH cleared AS (
        UPDATE pgwork.schema_version s
           SET migration_requester = NULL, migration_requested_by = NULL, migration_requested_at = NULL
         WHERE s.migration_requester IS NOT NULL
           AND NOT EXISTS (SELECT FROM pg_stat_activity a
                            WHERE a.pid = s.migration_requester
                              AND right(s.migration_requested_by, length(a.application_name) + 10)
                                  = '(session ' || a.application_name || ')')
        RETURNING s.version
    )
    SELECT EXISTS (SELECT FROM cleared)
$$;
COMMENT ON FUNCTION pgwork.migration_forget_stale() IS
    'Clear a killed `pgwork migrate`''s claim and request in pgwork.schema_version (its session is gone); true if one was cleared. Daemons call it as they start.';
REVOKE EXECUTE ON FUNCTION pgwork.migration_forget_stale() FROM PUBLIC;
