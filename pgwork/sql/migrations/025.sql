-- pgwork schema 24 -> 25. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that).
--
-- What changes (issue 56): the database learnt of pgwork's SQL code (pgwork/sql/code/) only
-- through the schema version, so a change to a function cost a version, a migration and a
-- snapshot. The code's checksum now stands beside the version, with the checksums it replaced:
-- migrate applies the code again when this build's differs, and a build whose code was replaced
-- refuses, as a build older than the version does. Two columns of the owner's one-row table:
-- nothing an app runs waits on this step.

ALTER TABLE pgwork.schema_version
    ADD COLUMN code_checksum text,
    ADD COLUMN code_replaced text[] NOT NULL DEFAULT '{}';
COMMENT ON COLUMN pgwork.schema_version.code_checksum IS
    'The checksum of the SQL code (pgwork/sql/code/) `pgwork migrate` applied last: a build whose '
    'code differs at the same version migrates by applying its code again.';
COMMENT ON COLUMN pgwork.schema_version.code_replaced IS
    'The checksums of the code applied before, oldest first: a build whose code is among them is '
    'older than the database, and refuses to run or migrate here.';
