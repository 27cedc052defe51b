-- pgwork schema 25 -> 26. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The code it changes (the
-- daemon's grant) lives in pgwork/sql/code/, applied by migrate after this file.
--
-- What changes:
-- - (issue 55) the web page's channel view shows its trend, minute by minute, over the last
--   hours: deliveries, failures and how long attempts took. Each daemon writes what it recorded
--   per channel and minute into a new table.
-- - (issue 56) a channel's kind is no longer a closed list in the database: the kinds are the
--   modules of pgwork/channels/, checked by the daemon's config, so a new kind needs no
--   migration. Dropping the CHECK takes pgwork.channel's lock until the commit: an app's insert
--   of a reminder (its foreign key reads the channel row) waits that long, no longer.

-- Per channel and minute, what each daemon's sends came to: the web page's trend. Each daemon
-- counts the outcomes it made durable (the same rows as the ledger's) and writes its minutes
-- every few seconds, each value whole, so a write repeated after a lost reply counts nothing
-- twice; a daemon killed loses at most its last unwritten seconds of trend (the ledger keeps the
-- record). Read a channel's last hours by key; daemons prune minutes older than two days.
CREATE TABLE pgwork.channel_minute (
    channel    text NOT NULL,
    minute     timestamptz NOT NULL,
    written_by text NOT NULL,
    delivered  bigint NOT NULL DEFAULT 0,
    failed     bigint NOT NULL DEFAULT 0,
    dead       bigint NOT NULL DEFAULT 0,
    fenced     bigint NOT NULL DEFAULT 0,
    took_sum   double precision NOT NULL DEFAULT 0,
    took_max   double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (channel, minute, written_by)
);
COMMENT ON TABLE pgwork.channel_minute IS
    'Per channel, minute (by the database''s clock) and daemon: the attempts it recorded that minute. '
    'A trend for the web page, written by each daemon every few seconds; the ledger is the record.';
COMMENT ON COLUMN pgwork.channel_minute.written_by IS 'The daemon''s id and a token of its process (a restarted daemon writes minutes of its own).';
COMMENT ON COLUMN pgwork.channel_minute.delivered IS 'Attempts delivered (a duplicate answer included).';
COMMENT ON COLUMN pgwork.channel_minute.failed IS 'Attempts that did not deliver (to be retried, or dead).';
COMMENT ON COLUMN pgwork.channel_minute.dead IS 'Of the failed, those that made the row dead.';
COMMENT ON COLUMN pgwork.channel_minute.fenced IS 'Late outcomes refused: the lease had passed to another worker.';
COMMENT ON COLUMN pgwork.channel_minute.took_sum IS 'Seconds the attempts took, summed (the mean is took_sum / (delivered + failed)).';

-- No client relies on it: a kind no daemon delivers is refused by the daemon's config.
-- squawk-ignore ban-drop-constraint
ALTER TABLE pgwork.channel DROP CONSTRAINT channel_kind_check;
