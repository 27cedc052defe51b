-- pgwork schema 8 -> 9. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes: the two triggers that close a reminder's ready work rows when an app moves its
-- deadline or deletes it (pgwork.reminder_after_reschedule, pgwork.reminder_after_delete) test the
-- status with IS NOT DISTINCT FROM instead of '=' (the same result: status is NOT NULL). With '=',
-- statistics taken while little work was live let the planner add a scan of the whole claimable
-- index to the reminder's own rows, so each such write read every live work row. And the
-- materialiser's page (pgwork.materialise_page) probes pgwork.retired's key for each occurrence
-- instead of a NOT EXISTS that its generic plan could make a hash of every tombstone, read on
-- every page. Nothing else changes; the functions keep their names, signatures, attributes and
-- grants. A daemon of version 8 keeps working on this schema until it is restarted.

CREATE OR REPLACE FUNCTION pgwork.reminder_after_reschedule() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
BEGIN
    UPDATE pgwork.renewal_work
       SET status = 'superseded', finished_at = now()
     WHERE reminder_id = NEW.id AND status IS NOT DISTINCT FROM 'ready'
       AND (deadline <> NEW.due_at OR NOT occurrence = ANY (NEW.remind_before));
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION pgwork.materialise_page(
    coordinate boolean, cutoff_at timestamptz, lookahead interval, after_at timestamptz,
    after_id bigint, page_limit integer, origin text, take jsonb, claim_lease interval,
    daemon_id text)
RETURNS TABLE (
    cutoff timestamptz, scanned bigint, made bigint, made_due bigint, skipped bigint,
    notified bigint, earliest_made timestamptz, last_at timestamptz, last_id bigint,
    id bigint, reminder_id bigint, source text, business_key text, deadline timestamptz,
    occurrence interval, due_at timestamptz, channel text, operation_id uuid, status text,
    attempts integer, attempts_base integer, lease integer, retry_since timestamptz,
    prev_status text, recipient text, payload text, traceparent text, tracestate text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    got boolean;
BEGIN
    -- Under repeatable read or serializable, every statement here would share the snapshot taken
    -- before the lock: the ordering above, and with it "never sent twice", would not hold.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'pgwork.materialise_page needs transaction_isolation = read committed, not %',
                        current_setting('transaction_isolation')
              USING HINT = 'a default_transaction_isolation set on the database or role applies to '
                           'pgwork''s sessions too: set it to read committed for the daemon''s role';
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true),
            set_config('plan_cache_mode', 'force_generic_plan', true);
    got := CASE WHEN materialise_page.coordinate
                THEN (SELECT true FROM pgwork.materialiser_state FOR UPDATE SKIP LOCKED) IS NOT NULL
                ELSE (SELECT true FROM pgwork.materialiser_state FOR SHARE) IS NOT NULL END;
    IF NOT got THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH params AS MATERIALIZED (
        -- The first page of a pass fixes the cutoff; later pages pass it back.
        SELECT coalesce(materialise_page.cutoff_at, now() + materialise_page.lookahead) AS cutoff
    ), due AS MATERIALIZED (
        SELECT r.ctid AS row_ctid, r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz,
               r.remind_before, r.channel, coalesce(r.next_fire_at, r.due_at) AS next_fire_at,
               coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate
          FROM pgwork.reminder r
         WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
           AND coalesce(r.next_fire_at, r.due_at) <= (SELECT p.cutoff FROM params p)
           AND (coalesce(r.next_fire_at, r.due_at), r.id)
               > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
         ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
         LIMIT materialise_page.page_limit
           FOR UPDATE OF r SKIP LOCKED
    ), fires AS MATERIALIZED (
        SELECT d.id, d.source, d.business_key, d.due_at, d.channel, b.before, d.next_fire_at AS progress,
               pgwork.fire_at(d.due_at, d.due_local, d.due_tz, b.before) AS fire_at,
               d.planned_at, (SELECT p.cutoff FROM params p) AS cutoff, d.traceparent, d.tracestate
          FROM due d
         CROSS JOIN LATERAL unnest(d.remind_before) AS b(before)
    ), occ AS MATERIALIZED (
        -- The channel's catch_up policy for occurrences that fired before the schedule was
        -- written: all are sent; latest: only the most recent of them; none: none. The others
        -- are closed as expired, with the reason.
        SELECT f.*,
               CASE coalesce(ch.catch_up, 'all')
                    WHEN 'none' THEN f.fire_at < f.planned_at
                    WHEN 'latest' THEN f.fire_at < max(f.fire_at) FILTER (WHERE f.fire_at < f.planned_at)
                                                    OVER (PARTITION BY f.id)
                    ELSE false END AS skip,
               ch.catch_up
          FROM fires f
          LEFT JOIN pgwork.channel ch ON ch.name = f.channel
    ), rooms AS MATERIALIZED (
        SELECT t.channel, t.room, make_interval(secs => t.expire_after_s) AS expire_after
          FROM jsonb_to_recordset(materialise_page.take) AS t(channel text, room integer, expire_after_s float8)
    ), take AS MATERIALIZED (
        -- The occurrences claimed here (see above): each channel's oldest due ones, up to its room.
        SELECT o.id, o.before
          FROM (SELECT o.id, o.before, o.channel, o.fire_at,
                       row_number() OVER (PARTITION BY o.channel ORDER BY o.fire_at, o.id, o.before) AS n
                  FROM occ o
                 WHERE NOT o.skip AND o.fire_at <= now() AND o.fire_at >= o.progress
                   AND o.channel IN (SELECT t.channel FROM rooms t)) AS o
          JOIN rooms t ON t.channel = o.channel
          JOIN pgwork.channel c ON c.name = o.channel
         WHERE o.n <= t.room
           AND (t.expire_after IS NULL OR o.fire_at + t.expire_after >= now())
           AND NOT c.paused AND (c.not_before IS NULL OR c.not_before <= now())
           AND c.rate_limit IS NULL AND c.global_concurrency IS NULL AND c.throttle_limit IS NULL
    ), made AS (
        INSERT INTO pgwork.renewal_work AS w
               (reminder_id, source, business_key, deadline, occurrence, due_at, channel, operation_id,
                available_at, status, finished_at, last_error, traceparent, tracestate,
                lease, attempts, claimed_at, claimed_by)
        SELECT o.id, o.source, o.business_key, o.due_at, o.before, o.fire_at, o.channel,
               pgwork.operation_id(o.id, o.source, o.business_key, o.due_at, o.before),
               CASE WHEN k.id IS NULL THEN o.fire_at ELSE now() + materialise_page.claim_lease END,
               CASE WHEN o.skip THEN 'expired' WHEN k.id IS NULL THEN 'ready' ELSE 'claimed' END,
               CASE WHEN o.skip THEN now() END,
               CASE WHEN o.skip THEN format('skipped by catch_up = %s: due %s, before its reminder was written (%s)',
                                           o.catch_up, o.fire_at, o.planned_at) END,
               o.traceparent, o.tracestate,
               (k.id IS NOT NULL)::int, (k.id IS NOT NULL)::int,
               CASE WHEN k.id IS NOT NULL THEN now() END,
               CASE WHEN k.id IS NOT NULL THEN materialise_page.daemon_id END
          FROM occ o
          LEFT JOIN take k ON k.id = o.id AND k.before = o.before
         WHERE o.fire_at <= o.cutoff
           AND o.fire_at >= o.progress
           -- A probe of retired's key per occurrence (a scalar subquery with LIMIT, not NOT EXISTS,
           -- which the planner may make a hash anti-join: the generic plan, which cannot see the
           -- page's size, then read every tombstone on every page), and none while there is no
           -- tombstone at all (the first test, made once per page).
           AND (NOT EXISTS (SELECT FROM pgwork.retired)
                OR (SELECT true FROM pgwork.retired t
                     WHERE t.reminder_id = o.id AND t.deadline = o.due_at AND t.occurrence = o.before
                     LIMIT 1) IS NULL)
            ON CONFLICT (reminder_id, deadline, occurrence) DO UPDATE
           -- A revived row keeps its lease and attempts: it is made ready, never claimed here.
           SET status = CASE WHEN excluded.status = 'claimed' THEN 'ready' ELSE excluded.status END,
               available_at = CASE WHEN excluded.status = 'claimed' THEN excluded.due_at ELSE excluded.available_at END,
               finished_at = excluded.finished_at, last_error = excluded.last_error,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate
         WHERE w.status = 'superseded'
        RETURNING w.id, w.reminder_id, w.source, w.business_key, w.deadline, w.occurrence, w.due_at,
                  w.channel, w.operation_id, w.status, w.attempts, w.attempts_base, w.lease,
                  coalesce(w.redriven_at, greatest(w.due_at, w.created_at)) AS retry_since,
                  w.traceparent, w.tracestate
    ), nxt AS (
        SELECT o.id, coalesce(min(o.fire_at) FILTER (WHERE o.fire_at > o.cutoff), 'infinity') AS next_fire_at
          FROM occ o
         GROUP BY o.id
    ), advanced AS (
        -- By ctid: the rows are locked by this statement, and a join on id would scan the table.
        UPDATE pgwork.reminder r
           SET next_fire_at = n.next_fire_at
          FROM due d
          JOIN nxt n ON n.id = d.id
         WHERE r.ctid = d.row_ctid
    ), figures AS (
        SELECT (SELECT p.cutoff FROM params p) AS cutoff,
               (SELECT count(*) FROM due) AS scanned,
               (SELECT count(*) FROM made) AS made,
               (SELECT count(*) FROM made m WHERE m.due_at <= now() AND m.status IN ('ready', 'claimed')) AS made_due,
               (SELECT count(*) FROM made m WHERE m.status = 'expired') AS skipped,
               (SELECT count(*) FROM (SELECT pg_notify('pgwork_work', materialise_page.origin)
                                       WHERE EXISTS (SELECT 1 FROM made m WHERE m.status = 'ready')) AS n) AS notified,
               (SELECT min(m.due_at) FROM made m) AS earliest_made,
               l.next_fire_at AS last_at, l.id AS last_id
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (SELECT d.next_fire_at, d.id FROM due d ORDER BY d.next_fire_at DESC, d.id DESC LIMIT 1) l ON true
    ), claimed AS (
        -- The reminder as this statement's snapshot sees it (advanced changed only its progress).
        SELECT m.id, m.reminder_id, m.source, m.business_key, m.deadline, m.occurrence, m.due_at,
               m.channel, m.operation_id, m.status, m.attempts, m.attempts_base, m.lease, m.retry_since,
               'ready'::text AS prev_status, r.recipient, r.payload::text AS payload, m.traceparent, m.tracestate
          FROM made m
          JOIN pgwork.reminder r ON r.id = m.reminder_id
         WHERE m.status = 'claimed'
    )
    SELECT f.cutoff, f.scanned, f.made, f.made_due, f.skipped, f.notified, f.earliest_made,
           f.last_at, f.last_id,
           c.id, c.reminder_id, c.source, c.business_key, c.deadline, c.occurrence, c.due_at,
           c.channel, c.operation_id, c.status, c.attempts, c.attempts_base, c.lease, c.retry_since,
           c.prev_status, c.recipient, c.payload, c.traceparent, c.tracestate
      FROM figures f
      LEFT JOIN claimed c ON true
     ORDER BY c.due_at, c.id;
END
$$;

UPDATE pgwork.schema_version SET version = 9, applied_at = now();
