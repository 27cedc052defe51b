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
--   * pgwork.outcome, an attempt's outcome as the daemon sends it, declared once: record_outcomes
--     reads its JSON array as rows of it.
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

-- An attempt's outcome as the daemon sends it (a JSON array of these objects: json.dumps costs the
-- daemon far less than fifteen parameter arrays), declared once: record_outcomes reads the array
-- as rows of it, and a daemon starting checks the keys its records carry against it
-- (duties/outcomes.py, check_shape). Times are seconds before the statement, by the daemon's
-- clock; the statement turns them into this database's.
CREATE TYPE pgwork.outcome AS (
    work_id      bigint,
    lease        integer,           -- the lease the attempt claimed: a passed-on one is fenced
    attempt      integer,
    channel      text,
    outcome      text,              -- delivered, duplicate, retry, failed
    status       text,              -- what the row becomes: delivered, ready (a retry), dead
    started_ago  double precision,
    finished_ago double precision,
    retry_after  double precision,  -- seconds until the retry
    http_status  integer,
    error_class  text,
    error        text,
    receipt      jsonb,
    throttle     double precision,  -- seconds to hold the channel (a throttling answer)
    pause        text               -- why to pause the channel (e.g. HTTP 410)
);
COMMENT ON TYPE pgwork.outcome IS
    'An attempt''s outcome as a daemon sends it to record_outcomes (a JSON array of these objects).';

-- Its only client is the daemon, whose code of this version calls the new one; those of schema 15
-- step aside before this runs (the migration handshake).
-- squawk-ignore ban-drop-function
DROP FUNCTION IF EXISTS pgwork.materialise_page(boolean, timestamptz, interval, timestamptz, bigint, integer, text,
                                                jsonb, interval, text, bigint[]);
