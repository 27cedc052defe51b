-- pgwork schema 9 -> 10. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes (issue 25, many apps on one database):
--   * pgwork.reminder_status is a security barrier: an app's own conditions that are not
--     leakproof (a failing cast, a function raising a NOTICE, an operator of its own) no longer
--     see other sources' rows before the view's source filter.
--   * pgwork.source_allowed(source, who), which any role could call to learn which role may use
--     which source, is gone. The policy asks pgwork.rls_exempt() once per statement and reads
--     the app's own rows of pgwork.app_source (row-level security on it too) once per statement:
--     the daemon's reads no longer call a SECURITY DEFINER function per reminder row.
--   * Apps read only the channel columns they need (not throttle_reason, which quotes a
--     receiver's reply to another source's delivery).
--   * A send before a local deadline never fires after it (pgwork.fire_at clamps a time that a
--     DST gap shifted past the deadline to the deadline).
-- A daemon of version 9 keeps working on this schema until it is restarted.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-drop-function

ALTER TABLE pgwork.app_source ENABLE ROW LEVEL SECURITY;

-- Who row-level security does not restrict: a superuser or BYPASSRLS role, the tables' owner and
-- its members, and members of pgwork_daemon or pgwork_cleanup. It reads only what pg_roles and
-- pg_has_role show any role, runs with the caller's rights, and the policies call it in a scalar
-- subquery: an InitPlan, evaluated once per statement, never per row.
CREATE FUNCTION pgwork.rls_exempt() RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce((SELECT r.rolsuper OR r.rolbypassrls FROM pg_catalog.pg_roles r WHERE r.rolname = current_user), false)
    OR pg_catalog.pg_has_role(current_user,
                              (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = 'pgwork.reminder'::regclass),
                              'MEMBER')
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
                WHERE r.rolname IN ('pgwork_daemon', 'pgwork_cleanup')
                  AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER'));
COMMENT ON FUNCTION pgwork.rls_exempt() IS
    'Whether the current role sees every source: a superuser or BYPASSRLS role, the tables'' owner, '
    'or a member of pgwork_daemon or pgwork_cleanup.';

-- Both tests are uncorrelated scalar subqueries: evaluated once per statement (InitPlans), so
-- the daemon pays nothing per row, and an app's list of sources is read once, not per row.
DROP POLICY reminder_by_source ON pgwork.reminder;

-- A security barrier: the view reads pgwork.reminder as its owner (row-level security does not
-- apply), so its own source filter runs before any condition of the caller's that is not
-- leakproof (a failing cast, a function that raises a NOTICE, an operator of the caller's own):
-- such a condition sees only the caller's rows. Equality on text is leakproof and still reaches
-- the index.
CREATE OR REPLACE VIEW pgwork.reminder_status WITH (security_barrier) AS
SELECT r.source, r.business_key, r.due_at AS deadline, b.before AS remind_before,
       pgwork.fire_at(r.due_at, r.due_local, r.due_tz, b.before) AS send_at,
       coalesce(w.status, t.status, 'scheduled') AS status,
       coalesce(w.attempts, 0) AS attempts,
       coalesce(w.finished_at, t.finished_at) AS finished_at,
       coalesce(w.operation_id, t.operation_id) AS operation_id,
       (w.id IS NULL AND t.reminder_id IS NOT NULL) AS retired
  FROM pgwork.reminder r
 CROSS JOIN LATERAL unnest(r.remind_before) AS b(before)
  LEFT JOIN pgwork.renewal_work w
    ON w.reminder_id = r.id AND w.deadline = r.due_at AND w.occurrence = b.before
  LEFT JOIN pgwork.retired t
    ON t.reminder_id = r.id AND t.deadline = r.due_at AND t.occurrence = b.before
 -- The view reads as its owner: with row-level security on, it shows an app only its sources.
 WHERE (SELECT NOT c.relrowsecurity FROM pg_class c WHERE c.oid = 'pgwork.reminder'::regclass)
    OR (SELECT pgwork.rls_exempt())
    OR r.source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]);
DROP FUNCTION pgwork.source_allowed(text, name);

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        REVOKE SELECT ON pgwork.channel FROM pgwork_app;
        GRANT SELECT (name, kind, registered_at, paused, catch_up) ON pgwork.channel TO pgwork_app;
        GRANT SELECT ON pgwork.app_source TO pgwork_app;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        -- It reads reminders; the policy reads app_source (its own rows only).
        GRANT SELECT ON pgwork.app_source TO pgwork_cleanup;
    END IF;
END
$$;

-- Progress computed by the old fire_at past a deadline: every occurrence left now fires at it.
UPDATE pgwork.reminder SET next_fire_at = due_at
 WHERE due_local IS NOT NULL AND next_fire_at > due_at AND next_fire_at < 'infinity';

UPDATE pgwork.schema_version SET version = 10, applied_at = now();
