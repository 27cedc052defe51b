-- pgwork schema 23 -> 24. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The code it changes (the
-- daemon's grants) lives in pgwork/sql/code/, applied by migrate after this file.
--
-- What changes (issue 55): a reminder the materialiser sets aside was seen only in the log of
-- the daemon that set it aside; the daemon now records it in pgwork.set_aside, which `pgwork
-- status`, the web page and `pgwork reminder` read. A new table: nothing an app runs waits on
-- this step.

CREATE TABLE pgwork.set_aside (
    reminder_id  bigint PRIMARY KEY,
    source       text NOT NULL,
    business_key text NOT NULL,
    fire_at      timestamptz NOT NULL,
    daemon_id    text NOT NULL,
    since        timestamptz NOT NULL DEFAULT now(),
    tried_at     timestamptz NOT NULL DEFAULT now(),
    next_try_at  timestamptz NOT NULL,
    -- Failures on one reminder: at most one an hour after the first few.
    -- squawk-ignore prefer-bigint-over-int
    tries        integer NOT NULL DEFAULT 1,
    error        text NOT NULL
);
COMMENT ON TABLE pgwork.set_aside IS
    'Reminders a materialiser page failed on, left out of pages for a while: written by the daemon '
    'that set one aside, deleted once the reminder is made, deleted or moved past fire_at.';
COMMENT ON COLUMN pgwork.set_aside.fire_at IS 'The occurrence it failed on (coalesce(next_fire_at, due_at) then).';
COMMENT ON COLUMN pgwork.set_aside.daemon_id IS 'The daemon that last tried it (pgwork.daemon.id).';
COMMENT ON COLUMN pgwork.set_aside.next_try_at IS 'When that daemon tries it again (each failure doubles the wait, up to an hour).';
COMMENT ON COLUMN pgwork.set_aside.error IS 'The first line of the error its page failed with.';

ALTER TABLE pgwork.daemon ADD COLUMN channels text[];
COMMENT ON COLUMN pgwork.daemon.channels IS
    'The channels it serves (its config''s): `pgwork channel retire` names the daemons serving one. '
    'NULL: a daemon older than schema 24.';
