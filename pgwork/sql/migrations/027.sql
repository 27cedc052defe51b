-- pgwork schema 26 -> 27. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The code that writes and
-- reads it lives in pgwork/sql/code/, applied by migrate after this file.
--
-- What changes (issue 67): an app that moves a reminder to another channel while one of its sends
-- is in flight writes where that send goes next, in a table of its own: when the send's lease
-- expires (its daemon died), the new channel's claim finds it there and takes it over, whichever
-- channels the running daemons serve. A new table: nothing an app runs waits on this step.

CREATE TABLE pgwork.work_moved (
    work_id  bigint PRIMARY KEY,
    channel  text NOT NULL,
    moved_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE pgwork.work_moved IS
    'Sends in flight whose reminder an app moved to another channel: where each goes when its '
    'lease ends without an outcome (written by the reminder''s trigger, which never touches the '
    'lease a daemon holds; read and deleted by the claim of that channel, and by the outcome).';
COMMENT ON COLUMN pgwork.work_moved.channel IS 'The channel the reminder names now.';
-- Where a channel's claim finds the sends moved to it (the table holds a row per send moved
-- while in flight, gone with its lease).
CREATE INDEX work_moved_channel ON pgwork.work_moved (channel);
