-- pgwork schema 2 -> 3. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that). No table
-- changes: two functions so that the statements spell out the terminal statuses and the
-- "no longer wanted" decision once (both are inlined by the planner).

CREATE FUNCTION pgwork.is_terminal(status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN status IN ('delivered', 'dead', 'cancelled', 'superseded');

UPDATE pgwork.schema_version SET version = 3, applied_at = now();
