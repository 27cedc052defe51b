-- Room materialise: the statements of the materialiser: pages of due reminders made into work, the reminders set aside.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/materialise.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: materialise_page
-- One page of the materialiser in one statement: pgwork.materialise_page (sql/code/page.sql) takes
-- the coordination lock, then runs the page in a statement of its own (a younger snapshot than the
-- lock: see there why that matters), and returns the page's figures on every row with the rows it
-- inserted claimed, as claim_work returns them (none claimed: one row, claimed columns NULL).
-- No row: another materialiser holds the lock.
SELECT p.cutoff, p.scanned, p.made, p.made_due, p.skipped, p.notified, p.earliest_made,
       p.last_at, p.last_id, p.unfinished, p.turn_source, (p.claimed).*
  FROM pgwork.materialise_page(
    %(coordinate)s::boolean, %(cutoff)s::timestamptz, %(lookahead)s::interval,
    %(after_at)s::timestamptz, %(after_id)s::bigint, %(limit)s::integer, %(origin)s::text,
    %(take)s::jsonb, %(lease)s::interval, %(daemon_id)s::text, %(aside)s::bigint[],
    %(turn_after)s::text) AS p

-- name: next_due_reminder
-- The reminder a page from this cursor would take first (not one set aside): what a page that
-- failed with a limit of one failed on, and its occurrence's time.
SELECT r.id, r.source, r.business_key, coalesce(r.next_fire_at, r.due_at) AS fire_at
  FROM pgwork.reminder r
 WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
   AND coalesce(r.next_fire_at, r.due_at) <= coalesce(%(cutoff)s::timestamptz, now() + %(lookahead)s::interval)
   AND (coalesce(r.next_fire_at, r.due_at), r.id)
       > (coalesce(%(after_at)s::timestamptz, '-infinity'), %(after_id)s::bigint)
   AND NOT r.id = ANY (%(aside)s::bigint[])
 ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
 LIMIT 1

-- name: set_aside_record
-- A reminder a page failed on, left out by this daemon until next_try_at: recorded for status,
-- the web page and `pgwork reminder`. Another failure counts a try and keeps since.
INSERT INTO pgwork.set_aside AS s
       (reminder_id, source, business_key, fire_at, daemon_id, next_try_at, error)
VALUES (%(reminder_id)s, %(source)s, %(business_key)s, %(fire_at)s, %(daemon_id)s,
        now() + make_interval(secs => %(wait)s), %(error)s)
ON CONFLICT (reminder_id) DO UPDATE
   SET fire_at = excluded.fire_at, daemon_id = excluded.daemon_id, tried_at = now(),
       next_try_at = excluded.next_try_at, tries = s.tries + 1, error = excluded.error

-- name: set_aside_forget
-- Forgets the reminders set aside that are no longer stuck: made (their next occurrence is past
-- the one they failed on), moved past it, or deleted. Returns how many are left (small: the
-- reminders set aside).
WITH gone AS (
    DELETE FROM pgwork.set_aside s
     WHERE NOT EXISTS (SELECT FROM pgwork.reminder r
                        WHERE r.id = s.reminder_id
                          AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                          AND coalesce(r.next_fire_at, r.due_at) <= s.fire_at)
    RETURNING 1
)
SELECT (SELECT count(*) FROM pgwork.set_aside) - (SELECT count(*) FROM gone) AS left_aside

-- name: set_aside_list
-- The reminders set aside and still not made, the earliest occurrence first (%(reminder_id)s:
-- one reminder's, or NULL for all).
SELECT s.reminder_id, s.source, s.business_key, s.fire_at, s.daemon_id, s.since, s.tried_at,
       s.next_try_at, s.tries, s.error
  FROM pgwork.set_aside s
 WHERE (%(reminder_id)s::bigint IS NULL OR s.reminder_id = %(reminder_id)s::bigint)
   AND EXISTS (SELECT FROM pgwork.reminder r
                WHERE r.id = s.reminder_id
                  AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                  AND coalesce(r.next_fire_at, r.due_at) <= s.fire_at)
 ORDER BY s.fire_at, s.reminder_id
 LIMIT %(limit)s

-- name: commit_synchronously
-- After materialise_page, in its transaction: commit after the WAL flush after all (the page
-- claimed rows for a channel whose claims are synchronous; database.synchronous_claims).
SELECT set_config('synchronous_commit', 'on', true)

-- name: record_without_waiting
-- A pass that made nothing records without waiting for the state table: a retention batch holds
-- it (the coordination lock) for its transaction, which may be waiting for an app's lock, and
-- such a record is optional (the next one writes it; the exported cutoff is this pass's own).
SELECT set_config('lock_timeout', '50ms', true)

-- name: materialise_record_pass
-- Evidence of a pass: everything firing at or before %(cutoff)s has its work row (the caller
-- passes less than the pass's cutoff when reminders locked by apps were skipped). Committed
-- without waiting for the WAL flush (one statement, its own transaction): a record lost in a
-- crash is written again by the next pass.
-- A pass that made nothing is recorded only when the last record is older than
-- %(record_every)s: an idle daemon does not write on every pass (status shows the record).
-- Returns the cutoff as recorded, or as this pass would have recorded it (the greatest of every
-- pass's evidence): what the daemon exports, which stays put and ages while a reminder set
-- aside holds it back.
WITH recorded AS (
    UPDATE pgwork.materialiser_state
       SET last_cutoff = greatest(last_cutoff, %(cutoff)s),
           last_pass_at = now(),
           last_inserted = %(made)s,
           last_duration_ms = %(duration_ms)s,
           total_inserted = total_inserted + %(made)s
      FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
     WHERE %(made)s > 0 OR last_pass_at IS NULL OR last_pass_at < now() - %(record_every)s::interval
    RETURNING last_cutoff
)
SELECT last_cutoff FROM recorded
UNION ALL
SELECT greatest(s.last_cutoff, %(cutoff)s) FROM pgwork.materialiser_state s
 WHERE NOT EXISTS (SELECT FROM recorded)

-- name: next_fire_at
-- The earliest occurrence not yet materialised of a reminder not set aside, and how far it is
-- past %(cutoff)s in seconds by the database clock (the materialiser sleeps until it enters the
-- window; at or before the cutoff means a reminder was skipped because an app held its row lock).
-- aside_at: the earliest of the reminders set aside (%(aside)s), where the pass's evidence stops.
SELECT n.at, n.id, extract(epoch FROM n.at - %(cutoff)s::timestamptz)::float8 AS after_cutoff_s,
       (SELECT min(coalesce(r.next_fire_at, r.due_at))
          FROM pgwork.reminder r
         WHERE r.id = ANY (%(aside)s::bigint[])
           AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')) AS aside_at
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (
        SELECT coalesce(r.next_fire_at, r.due_at) AS at, r.id
          FROM pgwork.reminder r
         WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
           AND NOT r.id = ANY (%(aside)s::bigint[])
         ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
         LIMIT 1) AS n ON true

-- name: materialiser_state
SELECT last_cutoff, last_pass_at, last_inserted, last_duration_ms, total_inserted,
       extract(epoch FROM now() - last_cutoff)::float8 AS cutoff_age_seconds
  FROM pgwork.materialiser_state
