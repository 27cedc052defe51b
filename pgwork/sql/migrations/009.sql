-- pgwork schema 8 -> 9. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes: the two triggers that close a reminder's ready work rows when an app moves its
-- deadline or deletes it (pgwork.reminder_after_reschedule, pgwork.reminder_after_delete) test the
-- status with IS NOT DISTINCT FROM instead of '=' (the same result: status is NOT NULL). With '=',
-- statistics taken while little work was live let the planner add a scan of the whole claimable
-- index to the reminder's own rows, so each such write read every live work row. Nothing else
-- changes; the functions keep their names, attributes and grants. A daemon of version 8 keeps
-- working on this schema until it is restarted.

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

CREATE OR REPLACE FUNCTION pgwork.reminder_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
BEGIN
    UPDATE pgwork.renewal_work
       SET status = 'cancelled', finished_at = now()
     WHERE reminder_id = OLD.id AND status IS NOT DISTINCT FROM 'ready';
    DELETE FROM pgwork.retired WHERE reminder_id = OLD.id;
    RETURN NULL;
END
$$;

UPDATE pgwork.schema_version SET version = 9, applied_at = now();
