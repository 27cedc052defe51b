-- pgwork schema 1 -> 2. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--   * pgwork.retired: what retention leaves of a delivered or dead occurrence of a live reminder,
--     so that deleting old work can never cause a second send;
--   * reminder_status shows retired occurrences with their outcome;
--   * a reminder's delete removes its tombstones;
--   * daemons record their heartbeat interval (status shows the gone ones; they are cleaned up);
--   * an index for dead letters (gauges and listings cost O(dead rows)).

CREATE TABLE pgwork.retired (
    reminder_id  bigint NOT NULL,
    deadline     timestamptz NOT NULL,
    occurrence   interval NOT NULL,
    status       text NOT NULL CHECK (status IN ('delivered', 'dead')),
    operation_id uuid NOT NULL,
    finished_at  timestamptz NOT NULL,
    retired_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (reminder_id, deadline, occurrence)
);
COMMENT ON TABLE pgwork.retired IS
    'What retention leaves of a delivered or dead occurrence of a reminder that still exists: its '
    'identity and outcome. The materialiser never inserts an occurrence listed here, so deleting old '
    'work can never cause a second send (not even after the deadline moves away and back). Removed '
    'with the reminder.';

-- Occurrences delivered or dead-lettered before this upgrade whose rows retention already deleted
-- cannot be recovered here; from now on none is lost.

ALTER TABLE pgwork.daemon ADD COLUMN heartbeat_every interval NOT NULL DEFAULT '20 seconds';
COMMENT ON TABLE pgwork.daemon IS
    'Running (or recently running) daemons, refreshed by their heartbeat. A row whose heartbeat is '
    'older than three heartbeat_every is shown as gone; after ten it is deleted by the others.';

CREATE INDEX work_dead ON pgwork.renewal_work (channel, finished_at, id) WHERE status = 'dead';

CREATE OR REPLACE FUNCTION pgwork.reminder_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
BEGIN
    UPDATE pgwork.renewal_work
       SET status = 'cancelled', finished_at = now()
     WHERE reminder_id = OLD.id AND status = 'ready';
    DELETE FROM pgwork.retired WHERE reminder_id = OLD.id;
    RETURN NULL;
END
$$;

DROP VIEW pgwork.reminder_status;
CREATE VIEW pgwork.reminder_status AS
SELECT r.source, r.business_key, r.due_at AS deadline, b.before AS remind_before,
       pgwork.fire_at(r.due_at, r.due_local, r.due_tz, b.before) AS send_at,
       coalesce(w.status, t.status, 'scheduled') AS status,
       coalesce(w.attempts, 0) AS attempts,
       coalesce(w.finished_at, t.finished_at) AS finished_at,
       coalesce(w.operation_id, t.operation_id) AS operation_id,
       (w.id IS NULL AND t.reminder_id IS NOT NULL) AS retired
  FROM pgwork.reminder r
 CROSS JOIN LATERAL unnest(r.remind_before) AS b(before)
  LEFT JOIN pgwork.renewal_work w
    ON w.reminder_id = r.id AND w.deadline = r.due_at AND w.occurrence = b.before
  LEFT JOIN pgwork.retired t
    ON t.reminder_id = r.id AND t.deadline = r.due_at AND t.occurrence = b.before;
COMMENT ON VIEW pgwork.reminder_status IS
    'Each occurrence of each current reminder and where it stands: scheduled (not yet materialised), '
    'ready, claimed, delivered, dead. retired: its work row was removed by retention (status is the '
    'outcome it had; attempts are no longer known); it is never sent again.';
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT SELECT ON pgwork.reminder_status TO pgwork_app;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 2, applied_at = now();
