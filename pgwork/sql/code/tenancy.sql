-- pgwork/sql/code/tenancy.sql — Many apps, one database: row-level security by source (off until an operator enables it).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- Who row-level security does not restrict: a superuser or BYPASSRLS role, the tables' owner and
-- its members, and members of pgwork_daemon or pgwork_cleanup. It reads only what pg_roles and
-- pg_has_role show any role, runs with the caller's rights, and the policies call it in a scalar
-- subquery: an InitPlan, evaluated once per statement, never per row.
CREATE OR REPLACE FUNCTION pgwork.rls_exempt() RETURNS boolean
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

-- An app reads its own rows of app_source (the policy below needs them), nobody else's.
DROP POLICY IF EXISTS app_source_own ON pgwork.app_source;
CREATE POLICY app_source_own ON pgwork.app_source
    USING (role = current_user OR (SELECT pgwork.rls_exempt()));

-- Both tests are uncorrelated scalar subqueries: evaluated once per statement (InitPlans), so
-- the daemon pays nothing per row, and an app's list of sources is read once, not per row.
DROP POLICY IF EXISTS reminder_by_source ON pgwork.reminder;
CREATE POLICY reminder_by_source ON pgwork.reminder
    USING ((SELECT pgwork.rls_exempt())
           OR source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]))
    WITH CHECK ((SELECT pgwork.rls_exempt())
                OR source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]));
