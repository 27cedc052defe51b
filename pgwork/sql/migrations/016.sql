-- pgwork schema 15 -> 16. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The functions it changes
-- live in pgwork/sql/code/, applied by migrate after this file.
--
-- What it adds (issue 39: one declaration per shape):
--   * pgwork.claimed, the row a claim hands a worker, declared once: claim_work returns it
--     (made by pgwork.as_claimed, new), and pgwork.materialise_page returns the rows it claims as
--     one column of it, so its result changes: the old function is dropped here and the code
--     file makes the new one in the same transaction (IF EXISTS: an upgrade from before 14
--     has none of this signature here, its steps carrying no code).
-- No table is changed; nothing an app runs waits on this step (a running daemon of schema 15
-- steps aside first: docs/operations.md, "Upgrades").

CREATE TYPE pgwork.claimed AS (
    id             bigint,
    reminder_id    bigint,
    source         text,
    business_key   text,
    deadline       timestamptz,
    occurrence     interval,
    due_at         timestamptz,
    channel        text,
    operation_id   uuid,
    status         text,
    attempts       integer,
    attempts_base  integer,
    lease          integer,
    retry_since    timestamptz,
    prev_status    text,
    recipient      text,
    payload        text,
    traceparent    text,
    tracestate     text,
    deadline_local timestamp,
    time_zone      text
);
COMMENT ON TYPE pgwork.claimed IS
    'A work row claimed (or closed instead of sent) as a worker gets it: the occurrence, its lease '
    'and attempts, the status it had (prev_status), the reminder''s recipient and payload (as text), '
    'and for an occurrence of a series its local deadline and zone.';

-- Its only client is the daemon, whose code of this version calls the new one; those of schema 15
-- step aside before this runs (the migration handshake).
-- squawk-ignore ban-drop-function
DROP FUNCTION IF EXISTS pgwork.materialise_page(boolean, timestamptz, interval, timestamptz, bigint, integer, text,
                                                jsonb, interval, text, bigint[]);
