-- pgwork/sql/code/app_views.sql — What apps read: where each occurrence of each reminder stands.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- A security barrier: the view reads pgwork.reminder as its owner (row-level security does not
-- apply), so its own source filter runs before any condition of the caller's that is not
-- leakproof (a failing cast, a function that raises a NOTICE, an operator of the caller's own):
-- such a condition sees only the caller's rows. Equality on text is leakproof and still reaches
-- the index.
CREATE OR REPLACE VIEW pgwork.reminder_status WITH (security_barrier) AS
SELECT r.source, r.business_key, k.deadline, b.before AS remind_before,
       pgwork.fire_at(k.deadline, k.deadline_local, r.due_tz, b.before) AS send_at,
       coalesce(CASE WHEN l.work_id IS NOT NULL THEN 'claimed' END, w.status, t.status,
                CASE WHEN r.paused THEN 'paused' ELSE 'scheduled' END) AS status,
       coalesce(l.attempts, w.attempts, 0) AS attempts,
       coalesce(w.finished_at, t.finished_at) AS finished_at,
       coalesce(w.operation_id, t.operation_id) AS operation_id,
       (w.id IS NULL AND t.reminder_id IS NOT NULL) AS retired,
       k.deadline_local, r.recur
  FROM pgwork.reminder r
 -- A one-off reminder's deadline; a series' next deadline (the first from now that it still
 -- has: not skipped, not past its end, not before its start), none once it has ended.
 CROSS JOIN LATERAL (
       SELECT r.due_at AS deadline, CASE WHEN r.due_local IS NOT NULL THEN r.due_local END AS deadline_local
        WHERE r.recur_rule IS NULL
       UNION ALL
       SELECT pgwork.local_to_instant(x.dl, r.due_tz), x.dl
         -- From a day before now (DST), past the deadlines of that day (two dates' times of day
         -- at most: a dense series has many), to 64 more.
         FROM pgwork.recur_upcoming(r.recur_rule, r.due_local,
                                    greatest(now(), r.series_from) AT TIME ZONE r.due_tz - interval '1 day',
                                    64 + 2 * cardinality(pgwork.recur_list(r.recur_rule, 'byhour'))
                                           * cardinality(pgwork.recur_list(r.recur_rule, 'byminute'))) AS x(dl)
        WHERE r.recur_rule IS NOT NULL AND x.dl <> ALL (coalesce(r.recur_skip, '{}'))
          AND (r.recur_until IS NULL OR x.dl <= r.recur_until)
          AND pgwork.local_to_instant(x.dl, r.due_tz) >= greatest(now(), r.series_from)
        ORDER BY 2 LIMIT 1) AS k
 CROSS JOIN LATERAL unnest(r.remind_before) AS b(before)
  LEFT JOIN pgwork.renewal_work w
    ON w.reminder_id = r.id AND w.occurrence = b.before
   AND (CASE WHEN r.recur_rule IS NULL THEN w.deadline = k.deadline AND w.deadline_local IS NULL
             ELSE w.deadline_local = k.deadline_local END)
  -- Held by a worker: claimed (pgwork.work_lease).
  LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
  LEFT JOIN pgwork.retired t
    ON t.reminder_id = r.id AND t.occurrence = b.before
   AND (CASE WHEN r.recur_rule IS NULL THEN t.deadline = k.deadline AND t.deadline_local IS NULL
             ELSE t.deadline_local = k.deadline_local END)
 -- The view reads as its owner: with row-level security on, it shows an app only its sources.
 WHERE (SELECT NOT c.relrowsecurity FROM pg_class c WHERE c.oid = 'pgwork.reminder'::regclass)
    OR (SELECT pgwork.rls_exempt())
    OR r.source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]);
COMMENT ON VIEW pgwork.reminder_status IS
    'Each occurrence of each current reminder and where it stands: scheduled (not yet materialised), '
    'ready, claimed, delivered, dead. retired: its work row was removed by retention (status is the '
    'outcome it had; attempts are no longer known); it is never sent again. A recurring reminder '
    'shows its next deadline (deadline_local: as local time; paused while the series is).';
