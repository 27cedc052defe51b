-- pgwork schema 19 -> 20. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The functions it changes
-- live in pgwork/sql/code/, applied by migrate after this file.
--
-- What it adds (issue 41: Postgres CPU per delivery): pgwork.lane.ready_from and ready_from_id,
-- where a lane's ready rows start in work_claimable's order (available_at, id). A row a claim
-- takes leaves its ready entry in work_claimable until a vacuum; claims that read a lane from
-- its start walked every entry the rows taken before them had left (25,000 rows into a drain
-- claimed ten at a time, without a vacuum, a claim read 272 pages of the index, against 24 at
-- its start). The claim that turns a lane sets them, pgwork.wake_lanes brings them
-- forward, and claims read the lane from there.
-- Columns with a constant default: added without rewriting or scanning the table. The lanes
-- that exist get -infinity (read from their start, as before) until their next turn.

ALTER TABLE pgwork.lane
    ADD COLUMN ready_from timestamptz NOT NULL DEFAULT '-infinity',
    ADD COLUMN ready_from_id bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN pgwork.lane.ready_from IS
    'With ready_from_id, where the source''s ready rows start in work_claimable''s order: none has '
    'an (available_at, id) below (ready_from, ready_from_id) (-infinity: not known). Its claims '
    'read from here, past the entries the rows taken before them left behind until a vacuum. Set by '
    'the claim that serves the lane (its next ready row), brought forward by pgwork.wake_lanes.';
COMMENT ON COLUMN pgwork.lane.ready_from_id IS 'See ready_from.';
