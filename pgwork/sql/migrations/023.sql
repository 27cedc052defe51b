-- pgwork schema 22 -> 23. Applied by `pgwork migrate` in one transaction; the result equals a
-- fresh install (tests/test_schema.py checks that). The functions it changes live in
-- pgwork/sql/code/, applied by migrate after this file.
--
-- What changes (issue 54): the queue moves beside the record. A claim rewrote the wide
-- renewal_work row (non-HOT: status is in four partial indexes' predicates, available_at a key
-- of two), and its outcome rewrote it again. Now the claim order lives in pgwork.work_ready and
-- leases in pgwork.work_lease, two small tables of live rows: a claim deletes ready rows and
-- inserts leases, writing nothing to renewal_work; an outcome deletes its lease (no row: fenced)
-- and updates the record once. "claimed" is no longer stored: it is a work_lease row.
--
-- The live rows are copied once: ready ones to work_ready; claimed ones (a daemon killed while
-- holding them; the others gave theirs back when asked to step aside) to work_lease with their
-- lease number and expiry, so a late outcome of theirs is still fenced, and their record goes
-- back to 'ready' (live). work_claimable and work_held are dropped after the commit.
-- What apps wait for: renewal_work's ACCESS EXCLUSIVE lock (its two triggers are dropped at the
-- end of this file), until the commit. A reminder edit whose trigger closed a ready row while the
-- copy ran leaves a ready row for a closed record: the claim that finds it drops it.

CREATE TABLE pgwork.work_ready (
    work_id      bigint PRIMARY KEY,
    channel      text NOT NULL,
    source       text NOT NULL,
    available_at timestamptz NOT NULL,
    due_at       timestamptz NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 200,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
COMMENT ON TABLE pgwork.work_ready IS
    'Live occurrences no worker holds, in claim order per channel and source: inserted when an '
    'occurrence is made, retried, given back, redriven or revived; deleted by the claim that takes '
    'it or the edit that closes it. Written only by pgwork.';
COMMENT ON COLUMN pgwork.work_ready.available_at IS
    'Not claimable before this instant (due time or retry backoff); renewal_work.available_at too.';
COMMENT ON COLUMN pgwork.work_ready.due_at IS 'The occurrence''s due time (renewal_work.due_at): lag is read here.';

CREATE TABLE pgwork.work_lease (
    work_id    bigint PRIMARY KEY,
    -- Lease numbers and attempts are renewal_work's integers.
    -- squawk-ignore prefer-bigint-over-int
    lease      integer NOT NULL CHECK (lease > 0),
    -- squawk-ignore prefer-bigint-over-int
    attempts   integer NOT NULL CHECK (attempts > 0),
    channel    text NOT NULL,
    source     text NOT NULL,
    due_at     timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    claimed_by text NOT NULL,
    claimed_at timestamptz NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 200,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
COMMENT ON TABLE pgwork.work_lease IS
    'Occurrences a worker holds (their status is "claimed"): inserted by the claim, deleted by the '
    'outcome, a release or a close. No row for (work_id, lease): that lease is fenced.';
COMMENT ON COLUMN pgwork.work_lease.lease IS
    'The fencing number this claim holds: renewal_work.lease + 1 (the record keeps the last settled).';
COMMENT ON COLUMN pgwork.work_lease.attempts IS 'renewal_work.attempts with this attempt counted.';
COMMENT ON COLUMN pgwork.work_lease.expires_at IS 'The lease''s end: past it, the row is claimable again (a reclaim).';

-- The live rows, read through the partial indexes that are about to go (O(live), not O(retained)).
INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
SELECT w.id, w.channel, w.source, w.available_at, w.due_at
  FROM pgwork.renewal_work w
 WHERE w.status = 'ready';
-- A claimed row's lease number and attempts move to its lease row, so an outcome under that
-- number is still applied and a late one after a reclaim fenced; its record keeps the numbers
-- settled before that claim (one less each), as a claim of this version leaves it.
INSERT INTO pgwork.work_lease (work_id, lease, attempts, channel, source, due_at, expires_at, claimed_by, claimed_at)
SELECT w.id, w.lease, w.attempts, w.channel, w.source, w.due_at, w.available_at, w.claimed_by, w.claimed_at
  FROM pgwork.renewal_work w
 WHERE w.status = 'claimed';
UPDATE pgwork.renewal_work w
   SET status = 'ready', lease = w.lease - 1, attempts = w.attempts - 1
 WHERE w.status = 'claimed';

CREATE INDEX work_ready_order ON pgwork.work_ready (channel, source, available_at, work_id);
CREATE INDEX work_lease_expiry ON pgwork.work_lease (channel, expires_at);

COMMENT ON COLUMN pgwork.renewal_work.status IS
    'ready: live, to be sent (claimable from available_at when it has a pgwork.work_ready row, '
    'held by a worker when it has a pgwork.work_lease row: "claimed" is that row, never stored here); '
    'delivered, dead, cancelled, superseded, expired: terminal (expired: past the channel''s '
    'expire_after, or skipped by its catch_up policy; never sent; last_error says why).';
COMMENT ON COLUMN pgwork.renewal_work.available_at IS
    'ready: not claimable before this instant (due time or retry backoff); a lease''s expiry is '
    'pgwork.work_lease.expires_at.';
COMMENT ON COLUMN pgwork.renewal_work.lease IS
    'Fencing token of the last lease settled (an outcome, a release, a close): a claim takes the '
    'next number in pgwork.work_lease, and every later change must name it, so a worker whose lease '
    'expired cannot overwrite its successor''s outcome.';
COMMENT ON COLUMN pgwork.lane.ready_from IS
    'With ready_from_id, where the source''s ready rows start in work_ready_order''s order: none has '
    'an (available_at, work_id) below (ready_from, ready_from_id) (-infinity: not known). Its claims '
    'read from here, past the entries the rows taken before them left behind until a vacuum. Set by '
    'the claim that serves the lane (its next ready row), brought forward by pgwork.wake_lanes.';

-- Lanes are woken by work_ready's inserts now (pgwork/sql/code/work.sql).
DROP TRIGGER IF EXISTS work_wakes_lanes_on_insert ON pgwork.renewal_work;
DROP TRIGGER IF EXISTS work_wakes_lanes_on_update ON pgwork.renewal_work;

-- pgwork: concurrently
-- Dropped after the commit, without stopping the apps' writes; squawk reads the file as one
-- transaction, which this part is not.
-- A concurrent drop outside any transaction, after the commit: it waits for the statements
-- using the index and blocks none.
-- squawk-ignore ban-concurrent-index-creation-in-transaction
DROP INDEX CONCURRENTLY IF EXISTS pgwork.work_claimable;
-- A concurrent drop outside any transaction, after the commit (as above).
-- squawk-ignore ban-concurrent-index-creation-in-transaction
DROP INDEX CONCURRENTLY IF EXISTS pgwork.work_held;
