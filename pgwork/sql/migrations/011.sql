-- pgwork schema 10 -> 11. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install of schema.sql (tests/test_schema.py checks that).
--
-- What it changes (issue 25, fair claiming at any number of sources):
--   * pgwork.lane: the sources with ready work in each channel, served in turn. A claim takes a
--     batch's worth of lanes whose turn has come (the oldest turns first, skipping lanes another
--     daemon's claim holds) instead of probing every source with live work: its cost and locks
--     no longer grow with the number of sources, and a small budget (a rate limit, a throttle)
--     serves the sources in turn instead of the oldest rows first.
--   * A statement trigger on pgwork.renewal_work (pgwork.wake_lanes) brings a lane's turn forward
--     whenever rows are made ready; the lanes are filled here from today's ready rows.
--   * pgwork.live_sources(channel) is gone.
--   * source and business_key refuse any Unicode space at either end (a no-break space, a line
--     separator), not only what the database's locale calls a space. Reminders that have one
--     stop the upgrade, which names them.
-- A daemon of version 10 must be stopped before this runs (it calls live_sources): upgrade by
-- stopping the daemons, `pgwork migrate`, starting the new version.
--
-- Landed: this step ran as written on users' databases; what the migration linter (squawk,
-- tests/test_schema.py) says of it is history, accepted here for the whole file. What each
-- statement locked and for how long is in docs/operations.md's upgrade notes.
-- squawk-ignore-file ban-alter-domain-with-add-constraint, ban-drop-constraint, ban-drop-function

DROP FUNCTION pgwork.live_sources(text);

CREATE FUNCTION pgwork.is_trimmed(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
-- Unicode's White_Space characters, named: what \s matches depends on the database's locale
-- (ASCII only under C).
RETURN value !~ '^[\s\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]|[\s\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$';
COMMENT ON FUNCTION pgwork.is_trimmed(text) IS
    'Whether a key has no Unicode space (White_Space: ASCII spaces, tab, line breaks, U+0085, no-break '
    'spaces, U+1680, U+2000-U+200A, U+2028, U+2029, U+205F, U+3000) at either end.';

-- Keys: "no space at either end" now means any Unicode space, whatever the locale.
DO $$
DECLARE
    bad bigint;
BEGIN
    SELECT count(*) INTO bad FROM pgwork.reminder r
     WHERE NOT pgwork.is_trimmed(r.source) OR NOT pgwork.is_trimmed(r.business_key);
    IF bad > 0 THEN
        RAISE EXCEPTION 'pgwork: % reminders have a source or business_key starting or ending with a Unicode space', bad
            USING HINT = 'Find them with: SELECT id, source, business_key FROM pgwork.reminder WHERE NOT pgwork.is_trimmed(source) OR NOT pgwork.is_trimmed(business_key); delete and insert them with trimmed keys, then migrate again.';
    END IF;
END
$$;
ALTER DOMAIN pgwork.reminder_source DROP CONSTRAINT reminder_source_valid;
ALTER DOMAIN pgwork.reminder_source
    ADD CONSTRAINT reminder_source_valid CHECK (length(VALUE) BETWEEN 1 AND 100 AND pgwork.is_trimmed(VALUE));
ALTER DOMAIN pgwork.reminder_business_key DROP CONSTRAINT reminder_business_key_valid;
ALTER DOMAIN pgwork.reminder_business_key
    ADD CONSTRAINT reminder_business_key_valid CHECK (length(VALUE) BETWEEN 1 AND 500 AND pgwork.is_trimmed(VALUE));

-- The sources with ready work in each channel, in the order they are to be served: a claim
-- takes the lanes whose turn has come (turn_at <= now, oldest turn first, a batch's worth at
-- most: its cost never grows with the number of sources), their oldest rows, and sends each
-- served lane to the back (turn_at = now) or to its next row's time, or deletes it when it has no
-- ready row left. Every statement that makes a row ready brings its lane's turn forward
-- (pgwork.wake_lanes, a trigger): a lane is never later than its ready rows.
-- Rows claimed under a lease are not in lanes: an expired lease is found through work_held.
CREATE TABLE pgwork.lane (
    channel text NOT NULL,
    source  text NOT NULL,
    turn_at timestamptz NOT NULL,
    PRIMARY KEY (channel, source)
);
CREATE INDEX lane_turn ON pgwork.lane (channel, turn_at, source);
COMMENT ON TABLE pgwork.lane IS
    'A channel''s sources with ready work, served in turn (fair claiming): written by the daemon only.';
COMMENT ON COLUMN pgwork.lane.turn_at IS
    'When the source is next served: its oldest ready row''s time, or when it was last served while '
    'more rows were due (the back of the line). Never later than its ready rows.';

INSERT INTO pgwork.lane (channel, source, turn_at)
SELECT w.channel, w.source, min(w.available_at)
  FROM pgwork.renewal_work w
 WHERE w.status = 'ready'
 GROUP BY w.channel, w.source;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON pgwork.lane TO pgwork_daemon;
    END IF;
END
$$;

UPDATE pgwork.schema_version SET version = 11, applied_at = now();
