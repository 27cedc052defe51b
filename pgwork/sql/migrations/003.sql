-- pgwork schema 2 -> 3. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that). No table
-- changes: two functions so that the statements spell out the terminal statuses and the
-- "no longer wanted" decision once (both are inlined by the planner).

CREATE FUNCTION pgwork.is_terminal(status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN status IN ('delivered', 'dead', 'cancelled', 'superseded');
COMMENT ON FUNCTION pgwork.is_terminal(text) IS
    'Whether a work status is final (queries use this; inlined, it still matches the work_terminal index).';

CREATE FUNCTION pgwork.unwanted(reminder_id bigint, reminder_due_at timestamptz,
                                remind_before interval[], deadline timestamptz, occurrence interval)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN reminder_due_at <> deadline OR NOT occurrence = ANY (remind_before) THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.unwanted(bigint, timestamptz, interval[], timestamptz, interval) IS
    'Why an occurrence is no longer wanted by its reminder (a missing reminder: cancelled; a moved deadline or a dropped remind_before entry: superseded), or NULL while it is.';

UPDATE pgwork.schema_version SET version = 3, applied_at = now();
