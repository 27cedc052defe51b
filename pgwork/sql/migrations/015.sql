-- pgwork schema 14 -> 15. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that).
--
-- What it adds (issue 40: upgrades while deliveries run): the migration handshake.
--   * pgwork.config.migration_requested_at / _by: `pgwork migrate` asks the running daemons to
--     step aside while it migrates; a daemon starting meanwhile waits.
--   * pgwork.daemon.schema_version: the schema a daemon's code runs, so migrate can tell the
--     daemons that take part in the handshake from those that predate it.
-- Both are nullable columns without a default: added without rewriting or scanning a table.
-- The daemons of version 14 predate the handshake: migrate names them and refuses (or waits
-- for them to stop, with --wait).

ALTER TABLE pgwork.config
    ADD COLUMN migration_requested_at timestamptz,
    ADD COLUMN migration_requested_by text;
COMMENT ON COLUMN pgwork.config.migration_requested_at IS
    '`pgwork migrate` asks the running daemons to step aside (set while it migrates): each stops '
    'claiming and materialising, finishes or gives back what it holds, and exits for its supervisor '
    'to start it again; a daemon starting meanwhile waits. Cleared by the migration''s commit.';
COMMENT ON COLUMN pgwork.config.migration_requested_by IS 'Who asked: host/pid of the `pgwork migrate`.';

-- A schema version is a small count, like pgwork.schema_version.version (an integer too).
-- squawk-ignore prefer-bigint-over-int
ALTER TABLE pgwork.daemon ADD COLUMN schema_version integer;
COMMENT ON COLUMN pgwork.daemon.schema_version IS
    'The schema version its code runs (NULL: a daemon older than the migration handshake, which '
    '`pgwork migrate` cannot ask to step aside).';
