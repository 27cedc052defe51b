-- Room inspect: the statements of what an operator reads and redrives: dead letters, rows, a reminder's history, pages of the web view.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/inspect.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: dlq_list
-- Dead letters, newest first, optionally filtered.
SELECT w.id, w.source, w.business_key, w.channel, w.deadline, w.occurrence, w.due_at, w.attempts,
       w.attempts_base, w.dead_reason, w.finished_at, w.operation_id
  FROM pgwork.renewal_work w
 WHERE w.status = 'dead'
   AND (%(channel)s::text IS NULL OR w.channel = %(channel)s)
   AND (%(source)s::text IS NULL OR w.source = %(source)s)
   AND (%(older_than)s::interval IS NULL OR w.finished_at <= now() - %(older_than)s::interval)
 ORDER BY w.finished_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: work_get
-- A work row as it stands (pgwork.work_now: claimed while a lease row holds it).
-- The payload as the text the receiver gets (never through a client's numbers).
SELECT n.*, r.id IS NOT NULL AS reminder_exists, r.due_at AS reminder_due_at, r.recipient,
       r.payload::text AS payload
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
  LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id
 WHERE w.id = %(id)s

-- name: work_attempts
SELECT lease, attempt, outcome, retry_at, daemon_id, host, pid, started_at, finished_at, http_status,
       error_class, error, receipt
  FROM pgwork.attempt
 WHERE work_id = %(id)s
 ORDER BY lease

-- name: history_reminder
-- What happened to a reminder (pgwork reminder, the web page's /reminder): the reminder as stored.
SELECT r.id, r.source, r.business_key, r.channel, r.recipient, r.due_at, r.due_local, r.due_tz,
       r.remind_before, r.recur, r.recur_until, r.recur_skip, r.paused, r.created_at,
       r.payload::text AS payload
  FROM pgwork.reminder r
 WHERE r.source = %(source)s AND r.business_key = %(business_key)s

-- name: history_upcoming
-- Its next occurrences, one per remind_before entry, and where each stands.
SELECT s.deadline, s.deadline_local, s.remind_before, s.send_at, s.status
  FROM pgwork.reminder_status s
 WHERE s.source = %(source)s AND s.business_key = %(business_key)s
 ORDER BY s.send_at

-- name: history_lockers
-- The sessions whose open transaction holds its row (an app's UPDATE or SELECT ... FOR UPDATE not
-- committed yet): the materialiser skips a reminder it cannot lock, so its due sends wait for them.
-- Read without taking a lock: while the holder runs, the row's xmax is its transaction id, on
-- which it holds a granted lock. A row held by several transactions at once has a MultiXact in
-- xmax, not resolved here (such a row is not named as held). Role, application, state and times
-- of another role's session show only to pg_read_all_stats (pgwork_daemon has it).
SELECT l.pid, a.usename::text AS role, a.application_name, a.client_addr::text AS client_addr,
       a.state, a.xact_start
  FROM pgwork.reminder r
  JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.transactionid = r.xmax
  LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE r.id = %(reminder_id)s AND r.xmax <> '0'::xid AND l.pid <> pg_backend_pid()
 ORDER BY l.pid

-- name: history_work_of_reminder
-- Its work rows, the latest send first (the occurrence key's index).
SELECT n.id, n.deadline, n.deadline_local, n.occurrence, n.due_at, n.channel, n.status,
       n.available_at, n.attempts - n.attempts_base AS attempts, n.created_at, n.finished_at,
       n.last_error, n.dead_reason, n.redriven_at, n.redriven_by, n.operation_id
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
 WHERE w.reminder_id = %(reminder_id)s
 ORDER BY w.due_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: history_work_of_key
-- The work rows left by a deleted reminder of this source and key (no index: reads the table).
SELECT n.id, n.deadline, n.deadline_local, n.occurrence, n.due_at, n.channel, n.status,
       n.available_at, n.attempts - n.attempts_base AS attempts, n.created_at, n.finished_at,
       n.last_error, n.dead_reason, n.redriven_at, n.redriven_by, n.operation_id
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
 WHERE w.source = %(source)s AND w.business_key = %(business_key)s
 ORDER BY w.due_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: history_attempts
-- The ledger of those work rows (its primary key).
SELECT a.work_id, a.lease, a.attempt, a.outcome, a.started_at, a.finished_at,
       a.finished_at - a.started_at AS took, a.http_status, a.error_class, a.error, a.retry_at,
       a.host, a.pid, a.receipt
  FROM pgwork.attempt a
 WHERE a.work_id = ANY (%(work_ids)s::bigint[])
 ORDER BY a.work_id, a.lease

-- name: history_retired
-- What retention left of its older occurrences: their identity and outcome.
SELECT t.deadline, t.deadline_local, t.occurrence, t.status, t.operation_id, t.finished_at, t.retired_at
  FROM pgwork.retired t
 WHERE t.reminder_id = %(reminder_id)s
 ORDER BY t.deadline DESC, t.occurrence
 LIMIT %(limit)s

-- name: dlq_redrive
-- Give dead rows a fresh attempt budget, same operation id: the ids given, or all (optionally of
-- one channel, one source, dead within the last `since`, with a dead_reason LIKE the pattern). Rows whose reminder was deleted or
-- moved since are not redriven (the caller reports them): that would resurrect a cancelled send.
-- A row goes to the channel its reminder names now (an app may have moved it since it went dead).
WITH target AS (
    SELECT w.id,
           coalesce(pgwork.work_unwanted(w, r), 'ok') AS verdict,
           coalesce(r.channel, w.channel) AS channel
      FROM pgwork.renewal_work w
      LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id
     WHERE w.status = 'dead'
       AND (%(all)s OR w.id = ANY (%(ids)s::bigint[]))
       AND (%(channel)s::text IS NULL OR w.channel = %(channel)s)
       AND (%(source)s::text IS NULL OR w.source = %(source)s)
       AND (%(since)s::interval IS NULL OR w.finished_at >= now() - %(since)s::interval)
       AND (%(reason_like)s::text IS NULL OR w.dead_reason LIKE %(reason_like)s)
       FOR UPDATE OF w
), redriven AS (
    UPDATE pgwork.renewal_work w
       SET status = 'ready', available_at = now(), attempts_base = w.attempts, finished_at = NULL,
           dead_reason = NULL, redriven_at = now(), redriven_by = %(operator)s, channel = t.channel
      FROM target t
     WHERE w.id = t.id AND t.verdict = 'ok'
    RETURNING w.id, w.channel, w.source, w.available_at, w.due_at
), requeued AS (
    INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
    SELECT d.id, d.channel, d.source, d.available_at, d.due_at FROM redriven d
), notified AS (
    SELECT pg_notify('pgwork_work', '') FROM (SELECT 1 FROM redriven LIMIT 1) AS any_row
)
SELECT t.id, t.verdict, (SELECT count(*) FROM notified) AS notified FROM target t ORDER BY t.id

-- name: retrying
-- Rows that failed and wait for their next try (ready, with attempts since the last redrive),
-- the soonest first: read through work_ready (live rows only).
SELECT w.id, w.channel, w.source, w.business_key, w.attempts - w.attempts_base AS attempts,
       q.available_at AS retry_at, w.last_error
  FROM pgwork.work_ready q
  JOIN pgwork.renewal_work w ON w.id = q.work_id
 WHERE w.attempts > w.attempts_base
   AND (%(channel)s::text IS NULL OR q.channel = %(channel)s)
 ORDER BY q.available_at, q.work_id
 LIMIT %(limit)s

-- name: work_statuses
-- The status of each work row named, for the ids a redrive did not find dead.
SELECT w.id, CASE WHEN l.work_id IS NOT NULL THEN 'claimed' ELSE w.status END AS status
  FROM pgwork.renewal_work w
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
 WHERE w.id = ANY (%(ids)s::bigint[])
 ORDER BY w.id

-- name: channel_exists
SELECT EXISTS (SELECT FROM pgwork.channel c WHERE c.name = %(name)s) AS exists

-- name: live_page
-- A channel's live rows (ready: claimable now; waiting: made ahead of their time, or a retry in
-- its backoff; claimed; any of them) for the web page: one keyset page in the order of
-- work_ready_order (a claimed row by its lease's expiry), so a page reads only live rows,
-- however many are retained.
SELECT w.id, v.source, w.business_key, v.status, w.due_at, v.available_at, coalesce(v.attempts, w.attempts) AS attempts,
       w.attempts_base, w.last_error
  FROM (SELECT * FROM (SELECT q.work_id, q.source,
                              CASE WHEN q.available_at <= now() THEN 'ready' ELSE 'waiting' END AS status,
                              q.available_at, NULL::int AS attempts
                         FROM pgwork.work_ready q
                        WHERE q.channel = %(channel)s
                          AND ('ready' = ANY (%(statuses)s::text[]) AND q.available_at <= now()
                               OR 'waiting' = ANY (%(statuses)s::text[]) AND q.available_at > now())
                          AND (q.source, q.available_at, q.work_id)
                              > (%(after_source)s::text, %(after_at)s::timestamptz, %(after_id)s::bigint)
                        ORDER BY q.source, q.available_at, q.work_id
                        LIMIT %(limit)s) AS ready
        UNION ALL
        SELECT * FROM (SELECT l.work_id, l.source, 'claimed', l.expires_at, l.attempts
                         FROM pgwork.work_lease l
                        WHERE l.channel = %(channel)s AND 'claimed' = ANY (%(statuses)s::text[])
                          AND (l.source, l.expires_at, l.work_id)
                              > (%(after_source)s::text, %(after_at)s::timestamptz, %(after_id)s::bigint)
                        ORDER BY l.source, l.expires_at, l.work_id
                        LIMIT %(limit)s) AS held) AS v
  JOIN pgwork.renewal_work w ON w.id = v.work_id
 ORDER BY v.source, v.available_at, v.work_id
 LIMIT %(limit)s

-- name: dead_page
-- Dead letters for the web page, newest first, one keyset page: read from work_dead (dead rows
-- only); optionally one channel, one source, dead within the last `since`, a dead_reason LIKE a
-- pattern (the filter dlq_redrive takes).
SELECT w.id, w.source, w.business_key, w.channel, w.due_at, w.attempts, w.attempts_base,
       w.dead_reason, w.finished_at
  FROM pgwork.renewal_work w
 WHERE w.status = 'dead'
   AND (%(channel)s::text IS NULL OR w.channel = %(channel)s)
   AND (%(source)s::text IS NULL OR w.source = %(source)s)
   AND (%(since)s::interval IS NULL OR w.finished_at >= now() - %(since)s::interval)
   AND (%(reason_like)s::text IS NULL OR w.dead_reason LIKE %(reason_like)s)
   AND (w.finished_at, w.id) < (%(before_at)s::timestamptz, %(before_id)s::bigint)
 ORDER BY w.finished_at DESC, w.id DESC
 LIMIT %(limit)s

-- name: reminders_page
-- A source's reminders for the web page, by key, one keyset page: from the prefix (inclusive) and
-- after the last key shown, through the unique index on (source, business_key), with each one's
-- latest work row. Reads at most `scan` keys: under a linguistic collation the keys that start
-- with a prefix need not sort together, so a page may then come short of those further on.
SELECT r.id, r.business_key, r.channel, r.due_at, r.due_local, r.due_tz, r.recur, r.paused,
       n.status AS last_status, n.due_at AS last_send_at
  FROM (SELECT r.*
          FROM pgwork.reminder r
         WHERE r.source = %(source)s AND r.business_key >= %(prefix)s AND r.business_key > %(after)s
         ORDER BY r.business_key
         LIMIT %(scan)s) r
  LEFT JOIN LATERAL (
        SELECT n.status, n.due_at
          FROM pgwork.renewal_work w
          LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
         CROSS JOIN LATERAL pgwork.work_now(w, l) AS n
         WHERE w.reminder_id = r.id
         ORDER BY w.due_at DESC, w.id DESC
         LIMIT 1) n ON true
 WHERE starts_with(r.business_key, %(prefix)s)
 ORDER BY r.business_key
 LIMIT %(limit)s

-- name: sources_unknown
-- Of the sources named, those with no reminder at all: a health check's misspelt name
-- (`pgwork status --source`), which must not read as "not late". One probe of the reminders'
-- (source, business_key) key each.
SELECT s.source
  FROM unnest(%(sources)s::text[]) AS s(source)
 WHERE NOT EXISTS (SELECT FROM pgwork.reminder r WHERE r.source = s.source)
 ORDER BY s.source
