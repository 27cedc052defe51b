-- pgwork schema 13 -> 14. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The functions, triggers and
-- views it changed live in pgwork/sql/code/, applied by migrate after the tables change.
--
-- What it changes (issue 37: one app cannot stop another's deliveries):
--   * pgwork.reminder_after_reschedule: an app's edit of a series only closes or removes work
--     rows (those the series no longer has are superseded; those a new zone moves are removed
--     when never tried, superseded when waiting for a retry; the next page makes them again at
--     their new instant with the same key): it never keeps a row ready, so it takes no lane
--     lock that the daemon's pages, claims and outcome flushes would wait on until the app
--     commits. A zone edit is no longer refused when it shifts one unsent deadline onto
--     another (the page makes one send per instant), and one that moves a deadline before the
--     edit no longer sends it.
--   * pgwork.materialise_series (new signature: a budget) evaluates deadlines per remind_before
--     entry, in windows as wide as the page's span of fire time, and makes at most its share of
--     the page's sends; a series with more to make before the cutoff is left unfinished for the
--     next pass. pgwork.series_latest_missed (new) finds what catch_up = latest keeps.
--     pgwork.recur_density (new): a compiled rule's deadlines a day at most, the budget's measure.
--   * pgwork.materialise_page takes aside (reminders the daemon set aside after a page failed on
--     each) and returns unfinished (series left short of the cutoff).
--   * pgwork.retired gets retired_series_deadline: retention prunes a series' tombstones once
--     their deadline is two days past (they were kept as long as the reminder lived);
--     pgwork_cleanup gets DELETE on it.
--   * NULL in recur_skip is refused naming recur_skip (a series with one made nothing, silently);
--     existing NULLs are dropped. recur_preview names a NULL argument, gives n deadlines when
--     many fall in DST gaps, and none past its 100-year horizon (recur_upcoming);
--     reminder_status shows a dense series' next deadline. An UNTIL in UTC bounds the instant
--     (recur_rule, recur_between): series with one are compiled again.
-- Upgrade as always: stop the daemons, `pgwork migrate`, start the new version.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-drop-function, require-concurrent-index-creation


DROP FUNCTION IF EXISTS pgwork.materialise_page(boolean, timestamptz, interval, timestamptz, bigint, integer, text, jsonb, interval, text);
DROP FUNCTION IF EXISTS pgwork.materialise_series(bigint[], timestamptz);

-- pgwork: after the code
-- A series whose recur_skip holds a NULL made nothing (every deadline compared NULL with it):
-- the NULLs are dropped, which restarts each such series from now, as any edit does.
UPDATE pgwork.reminder SET recur_skip = array_remove(recur_skip, NULL)
 WHERE array_position(recur_skip, NULL) IS NOT NULL;

-- A series whose rule has an UNTIL in UTC is compiled again: UNTIL now bounds the instant.
UPDATE pgwork.reminder SET recur_rule = pgwork.recur_compile(recur, due_local, due_tz)
 WHERE recur ~* 'UNTIL=[0-9]{8}T[0-9]{6}Z';

-- pgwork: concurrently
-- Built after the commit, without stopping the apps' deletes of reminders (which delete their
-- tombstones); squawk reads the file as one transaction, which this part is not.
-- squawk-ignore ban-concurrent-index-creation-in-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS retired_series_deadline ON pgwork.retired (deadline) WHERE deadline_local IS NOT NULL;
