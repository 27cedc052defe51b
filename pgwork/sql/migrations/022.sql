-- pgwork schema 21 -> 22. Applied by `pgwork migrate` in one transaction; the result equals a
-- fresh install (tests/test_schema.py checks that). The functions it changes live in
-- pgwork/sql/code/, applied by migrate after this file.
--
-- What changes (issue 53):
-- 1. Only the schema's owner can step a daemon aside. The request to step aside moves from
--    pgwork.config (which the daemon role may update) to pgwork.schema_version, which only the
--    owner writes, with the backend pid of the migrate that asks: a daemon obeys a request whose
--    session is alive, and NOTIFY pgwork_migrate (open to any role) only makes it look.
--    Migrate's locks are no longer public advisory keys: its transaction locks
--    pgwork.schema_version (EXCLUSIVE: only a role that may write the table may take a lock that
--    conflicts with it), and a second migrate waits for the first's claim of the row without a
--    snapshot, so the first's CREATE INDEX CONCURRENTLY never waits for it.
--    This migration itself runs under the previous protocol (the request in pgwork.config, the
--    daemons of schema 21 read it there); its commit drops those columns.
-- 2. The payload's table constraint measured the binary jsonb before compression (an array of
--    6,000 ones, 18 KB of JSON text, was refused at 72 KB): the documented limit, 64 KiB of JSON
--    text, is the trigger's; the constraint now bounds only a row written around the triggers, at
--    1 MiB stored. Looser than the one it replaces: every row satisfies it, so it is added
--    NOT VALID (no scan of the table under the lock the drop takes).
-- 3. Fair making: a page that cannot take every due reminder serves the sources in turn
--    (pgwork.materialise_page), found through reminder_due_by_source, built after the commit.
-- What apps wait for: pgwork.reminder's ACCESS EXCLUSIVE lock (the constraint), until the commit.

ALTER TABLE pgwork.schema_version
    ADD COLUMN migration_requested_at timestamptz,
    ADD COLUMN migration_requested_by text;
-- A backend pid (pg_backend_pid() returns an integer).
-- squawk-ignore prefer-bigint-over-int
ALTER TABLE pgwork.schema_version ADD COLUMN migration_requester integer;
COMMENT ON TABLE pgwork.schema_version IS
    'The one schema version this database is at; pgwork refuses a newer one. Only the schema''s '
    'owner writes it (daemons read it), so that what it says of a migration is the owner''s word: '
    '`pgwork migrate` locks this table (EXCLUSIVE, a lock no other role may take) for its '
    'transaction, and holds the row''s migration columns while it runs.';
COMMENT ON COLUMN pgwork.schema_version.migration_requested_at IS
    '`pgwork migrate` asks the running daemons to step aside (set while it migrates): each stops '
    'claiming and materialising, finishes or gives back what it holds, and exits for its supervisor '
    'to start it again; a daemon starting meanwhile waits. Cleared by the migration''s commit. A '
    'daemon obeys it only while the session migration_requester is alive; NOTIFY pgwork_migrate '
    'only makes it look.';
COMMENT ON COLUMN pgwork.schema_version.migration_requested_by IS
    'Who migrates: host/pid of the `pgwork migrate`.';
COMMENT ON COLUMN pgwork.schema_version.migration_requester IS
    'The backend pid of the `pgwork migrate` that migrates, from its claim until its indexes are '
    'built: a second migrate waits for it (without a snapshot), and a request whose session is gone '
    'is nobody''s.';

-- Read by no daemon of this version; the request of this very migration stands in them until
-- the commit (the daemons of schema 21 have stepped aside by then).
-- squawk-ignore ban-drop-column
ALTER TABLE pgwork.config DROP COLUMN migration_requested_at, DROP COLUMN migration_requested_by;

-- Replaced by the looser bound below; the documented limit is the trigger's, unchanged.
-- squawk-ignore ban-drop-constraint
ALTER TABLE pgwork.reminder DROP CONSTRAINT reminder_payload_at_most_64kib;
-- Looser than the constraint it replaces (see above): every row already satisfies it.
-- squawk-ignore constraint-missing-not-valid
ALTER TABLE pgwork.reminder
    ADD CONSTRAINT reminder_payload_at_most_1mib_stored CHECK (pg_column_size(payload) <= 1048576) NOT VALID;

-- pgwork: concurrently
-- Built after the commit, without stopping the apps' writes; squawk reads the file as one
-- transaction, which this part is not.
-- squawk-ignore ban-concurrent-index-creation-in-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS reminder_due_by_source ON pgwork.reminder (source, (coalesce(next_fire_at, due_at)), id)
    WHERE next_fire_at IS NULL OR next_fire_at < 'infinity';
