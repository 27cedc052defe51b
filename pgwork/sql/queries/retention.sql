-- Room retention: the statements of retention: batches of old terminal rows, its pause and its passes.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/retention.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: retention_paused
SELECT retention_paused AS paused FROM pgwork.config

-- name: retention_set_paused
UPDATE pgwork.config SET retention_paused = %(paused)s

-- name: retention_lock
-- The materialiser's coordination lock (pgwork.materialise_page), held exclusively for the rest
-- of a batch's transaction, under the batch's lock_timeout: no page runs meanwhile, and the
-- next one's snapshot sees the batch's tombstones. A table lock writes nothing.
LOCK TABLE pgwork.materialiser_state IN EXCLUSIVE MODE

-- name: retention_delete_batch
-- One keyset batch of terminal work older than its keep (dead letters have their own, longer
-- keep), deleted by primary key with its ledger rows. The terminal-status and age filters are in
-- the DELETE itself: a row that became live again (a superseded occurrence revived) between the
-- scan and the delete is left alone. A delivered, dead or expired occurrence of a reminder that still
-- exists leaves a tombstone (pgwork.retired) that the materialiser honours; the batch holds the
-- materialiser's coordination lock (retention_lock, in the same transaction before it), so no
-- page can run on a snapshot that misses the tombstone. Series tombstones that can no longer
-- matter are pruned in the same batch.
WITH victims AS MATERIALIZED (
    SELECT w.id, w.finished_at
      FROM pgwork.renewal_work w
     WHERE pgwork.is_terminal(w.status)
       AND w.finished_at < greatest(%(done_before)s::timestamptz, %(dead_before)s::timestamptz)
       AND (w.finished_at, w.id) > (coalesce(%(after_at)s::timestamptz, '-infinity'), %(after_id)s::bigint)
     ORDER BY w.finished_at, w.id
     LIMIT %(limit)s
), gone AS (
    DELETE FROM pgwork.renewal_work w
     USING victims v
     WHERE w.id = v.id
       AND pgwork.is_terminal(w.status)
       AND w.finished_at < CASE WHEN w.status = 'dead' THEN %(dead_before)s::timestamptz
                                ELSE %(done_before)s::timestamptz END
    RETURNING w.id, w.reminder_id, w.deadline, w.occurrence, w.status, w.operation_id, w.finished_at,
              w.deadline_local
), tombstones AS (
    INSERT INTO pgwork.retired (reminder_id, deadline, occurrence, status, operation_id, finished_at, deadline_local)
    SELECT g.reminder_id, g.deadline, g.occurrence, g.status, g.operation_id, g.finished_at, g.deadline_local
      FROM gone g
     WHERE g.status IN ('delivered', 'dead', 'expired')
       AND EXISTS (SELECT 1 FROM pgwork.reminder r WHERE r.id = g.reminder_id)
       -- An occurrence of a series can only be made again while its deadline is ahead (an edit
       -- restarts a series from now, never earlier): one whose deadline passed (two days, for
       -- a zone edit) needs no tombstone, so a long-lived series leaves none behind.
       AND (g.deadline_local IS NULL OR g.deadline >= now() - interval '2 days')
        ON CONFLICT DO NOTHING
    RETURNING 1
), ledger AS (
    DELETE FROM pgwork.attempt a USING gone g WHERE a.work_id = g.id RETURNING 1
), pruned AS (
    -- A series' tombstone whose deadline passed two days ago guards nothing (the rule above):
    -- deleted, a batch's worth at a time, oldest first (retired_series_deadline).
    DELETE FROM pgwork.retired t
     WHERE t.ctid = ANY (ARRAY(SELECT o.ctid FROM pgwork.retired o
                                WHERE o.deadline_local IS NOT NULL AND o.deadline < now() - interval '2 days'
                                ORDER BY o.deadline
                                LIMIT %(limit)s))
    RETURNING 1
)
SELECT (SELECT count(*) FROM victims) AS scanned,
       (SELECT count(*) FROM gone) AS deleted,
       (SELECT count(*) FROM ledger) AS ledger_deleted,
       (SELECT count(*) FROM tombstones) AS retired,
       (SELECT count(*) FROM pruned) AS pruned,
       l.finished_at AS last_at, l.id AS last_id
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT finished_at, id FROM victims ORDER BY finished_at DESC, id DESC LIMIT 1) l ON true

-- name: retention_record_pass
-- A pass that deleted rows is recorded; one that found nothing only when the last record is
-- older than %(record_every)s (what status shows: an idle database is not written to on every
-- pass).
UPDATE pgwork.retention_state
   SET last_pass_at = now(), last_deleted = %(deleted)s, total_deleted = total_deleted + %(deleted)s
 WHERE %(deleted)s > 0 OR last_pass_at IS NULL
    OR last_pass_at < now() - %(record_every)s::interval

-- name: retention_state
SELECT r.last_pass_at, r.last_deleted, r.total_deleted, c.retention_paused AS paused,
       extract(epoch FROM now() - (SELECT min(finished_at) FROM pgwork.renewal_work
                                    WHERE pgwork.is_terminal(status)))::float8
           AS oldest_terminal_age_seconds
  FROM pgwork.retention_state r, pgwork.config c

-- name: retention_backlog
-- Terminal rows already past their keep (what the next passes will delete), counted up to
-- %(limit)s: a status check must not scan a large backlog.
SELECT count(*) AS n
  FROM (SELECT 1
          FROM pgwork.renewal_work
         WHERE pgwork.is_terminal(status)
           AND finished_at < greatest(%(done_before)s::timestamptz, %(dead_before)s::timestamptz)
           AND finished_at < CASE WHEN status = 'dead' THEN %(dead_before)s::timestamptz ELSE %(done_before)s::timestamptz END
         LIMIT %(limit)s) AS b

-- name: batch_limits
-- A retention batch's own limits, local to its transaction (no session state: this works
-- through a transaction-pooling PgBouncer too).
SELECT set_config('statement_timeout', %(statement_timeout)s, true),
       set_config('lock_timeout', %(lock_timeout)s, true)
