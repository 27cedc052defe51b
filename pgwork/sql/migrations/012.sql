-- pgwork schema 11 -> 12. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The functions, triggers and
-- views it changed live in pgwork/sql/code/, applied by migrate after the tables change.
--
-- What it adds (issue 27): recurring deadlines.
--   * pgwork.reminder.recur (an RFC 5545 RRULE subset anchored at due_local in due_tz, the first
--     deadline), with recur_until, recur_skip and paused, all plain SQL for apps; recur_rule,
--     recur_version and series_from are maintained by pgwork.
--   * The recurrence evaluator, in the database where local times become instants:
--     pgwork.recur_rule / recur_compile (a rule checked against its first deadline, refused with
--     the column named), recur_between / recur_upcoming (the occurrences in a window of local
--     time, by matching whole periods, never by iterating from the start), recur_preview.
--   * renewal_work.deadline_local (and retired.deadline_local): an occurrence of a series is
--     identified by its local deadline (work_series_occurrence_unique, series_operation_id), so
--     a zone edit or a time zone data update never makes a second one.
--   * The materialiser's page makes a series' occurrences as they come due (nothing beyond its
--     look-ahead), through pgwork.materialise_series, called only for a page that has a series; claims and redrives ask pgwork.series_unwanted whether one is still wanted;
--     pgwork.reminder_status shows a series' next deadline; the claim and the page return the
--     occurrence's local deadline and zone.
-- A daemon of version 11 must be stopped before this runs (its claim and page statements read
-- columns that change): upgrade by stopping the daemons, `pgwork migrate`, starting the new version.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-drop-function, ban-drop-view, prefer-bigint-over-int, prefer-timestamp-tz, require-concurrent-index-creation

ALTER TABLE pgwork.reminder
    ADD COLUMN recur         text,
    ADD COLUMN recur_until   timestamp,
    ADD COLUMN recur_skip    timestamp[]
        CONSTRAINT reminder_recur_skip_at_most_366 CHECK (cardinality(recur_skip) <= 366),
    ADD COLUMN paused        boolean NOT NULL DEFAULT false,
    ADD COLUMN recur_rule    jsonb,
    ADD COLUMN recur_version integer NOT NULL DEFAULT 0,
    ADD COLUMN series_from   timestamptz;
COMMENT ON COLUMN pgwork.reminder.recur IS
    'A recurring deadline: an RFC 5545 RRULE (e.g. FREQ=MONTHLY;BYMONTHDAY=1) anchored at due_local in '
    'due_tz, the first deadline. Each occurrence x remind_before entry is sent once, with its own key.';
COMMENT ON COLUMN pgwork.reminder.recur_until IS 'The last local deadline a series may have (inclusive); NULL: none.';
COMMENT ON COLUMN pgwork.reminder.recur_skip IS 'Local deadlines of the series not to send (at most 366).';
COMMENT ON COLUMN pgwork.reminder.paused IS
    'A paused series makes nothing; resumed, it starts from the moment it resumes (what fell in the pause is skipped).';
COMMENT ON COLUMN pgwork.reminder.recur_rule IS 'Maintained by pgwork: recur compiled against the first deadline (pgwork.recur_compile).';
COMMENT ON COLUMN pgwork.reminder.recur_version IS 'Maintained by pgwork: counts the edits of the series'' rule, zone, end, skips and pauses.';
COMMENT ON COLUMN pgwork.reminder.series_from IS
    'Maintained by pgwork: when the series was written, last edited or resumed; its deadlines before this are '
    'history and never sent.';

ALTER TABLE pgwork.renewal_work
    ADD COLUMN deadline_local timestamp,
    ADD COLUMN recur_version integer;
COMMENT ON COLUMN pgwork.renewal_work.deadline_local IS
    'For an occurrence of a recurring reminder: its deadline as local wall-clock time, its identity in the '
    'series (a zone edit or a time zone data update moves deadline, never this). NULL for a one-off.';
COMMENT ON COLUMN pgwork.renewal_work.recur_version IS 'The reminder''s recur_version when this occurrence was made.';
-- A recurring reminder's occurrences are identified by their local deadline.
CREATE UNIQUE INDEX work_series_occurrence_unique ON pgwork.renewal_work (reminder_id, deadline_local, occurrence)
    WHERE deadline_local IS NOT NULL;

ALTER TABLE pgwork.retired ADD COLUMN deadline_local timestamp;

DROP TRIGGER reminder_before_insert ON pgwork.reminder;
DROP TRIGGER reminder_before_update ON pgwork.reminder;
DROP TRIGGER reminder_after_reschedule ON pgwork.reminder;

DROP TRIGGER reminder_notify ON pgwork.reminder;

DROP VIEW pgwork.reminder_status;

DROP FUNCTION IF EXISTS pgwork.materialise_page;
