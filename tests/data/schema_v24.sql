-- pgwork schema version 24 as a fresh install made it (schema.sql, then pgwork/sql/code/ in order,
-- then the version): a snapshot for tests/test_schema.py's upgrade tests.

-- pgwork's tables: the schema, its tables, indexes, types, domains and the value rules the
-- domains check. This file and the files of pgwork/sql/code/ (functions, triggers, views, policies and
-- grants, one file per concern) are a fresh install; `pgwork migrate` applies them to an empty
-- database in one transaction under an advisory lock, and brings an older schema to the same
-- result with the pending pgwork/sql/migrations/ (table changes only) and the same code files.
-- The version is pgwork.SCHEMA_VERSION (pgwork/__init__.py), written by migrate.
--
-- Two clocks, two tables:
--   pgwork.reminder      calendar time: business deadlines, written by other apps with plain SQL.
--   pgwork.renewal_work  attempt time: one row per due (or nearly due) reminder occurrence,
--                        written only by the daemon.
-- The daemon owns every transition between them.

CREATE SCHEMA pgwork;
COMMENT ON SCHEMA pgwork IS 'pgwork: business deadlines in, exactly one reminder out per occurrence.';

CREATE TABLE pgwork.schema_version (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version    integer NOT NULL CHECK (version > 0),
    applied_at timestamptz NOT NULL DEFAULT now(),
    migration_requested_at timestamptz,
    migration_requested_by text,
    migration_requester    integer
);
COMMENT ON TABLE pgwork.schema_version IS
    'The one schema version this database is at; pgwork refuses a newer one. Only the schema''s '
    'owner writes it (daemons read it), so that what it says of a migration is the owner''s word: '
    '`pgwork migrate` locks this table (EXCLUSIVE, a lock no other role may take) for its '
    'transaction, and holds the row''s migration columns while it runs.';
COMMENT ON COLUMN pgwork.schema_version.migration_requested_at IS
    '`pgwork migrate` asks the running daemons to step aside (set while it migrates): each stops '
    'claiming and materialising, finishes or gives back what it holds, and exits for its supervisor '
    'to start it again; a daemon starting meanwhile waits. Cleared by the migration''s commit. A '
    'daemon obeys it only while the session migration_requester is alive; NOTIFY pgwork_migrate '
    'only makes it look.';
COMMENT ON COLUMN pgwork.schema_version.migration_requested_by IS
    'Who migrates: host/pid of the `pgwork migrate`.';
COMMENT ON COLUMN pgwork.schema_version.migration_requester IS
    'The backend pid of the `pgwork migrate` that migrates, from its claim until its indexes are '
    'built: a second migrate waits for it (without a snapshot), and a request whose session is gone '
    'is nobody''s.';

CREATE TABLE pgwork.config (
    singleton        boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    retention_paused boolean NOT NULL DEFAULT false
);
COMMENT ON TABLE pgwork.config IS 'Settings shared by every daemon, changed at runtime.';
COMMENT ON COLUMN pgwork.config.retention_paused IS
    'Pauses every retention duty (in daemons and `pgwork cleanup`) at its next batch, without a restart: '
    '`pgwork cleanup --pause` / `--resume`.';
INSERT INTO pgwork.config DEFAULT VALUES;

CREATE TABLE pgwork.channel (
    name          text PRIMARY KEY CONSTRAINT channel_name_valid CHECK (name ~ '^[a-z][a-z0-9_-]{0,62}$'),
    kind          text NOT NULL CHECK (kind IN ('log', 'webhook', 'python')),
    registered_at timestamptz NOT NULL DEFAULT now(),
    -- Operator control (pgwork.pause_channel / pgwork.resume_channel, `pgwork channel pause`).
    paused        boolean NOT NULL DEFAULT false,
    paused_at     timestamptz,
    paused_by     text,
    paused_reason text,
    -- Backpressure from the receiver (429, 502, 503, 504), set by the outcome writer.
    not_before    timestamptz,
    throttle_limit integer CHECK (throttle_limit > 0),
    throttle_from integer,
    throttled_at  timestamptz,
    throttle_reason text,
    -- From the daemons' config, written at their start.
    global_concurrency integer CHECK (global_concurrency > 0),
    rate_limit    double precision CHECK (rate_limit > 0),
    rate_burst    double precision CHECK (rate_burst >= 1),
    catch_up      text NOT NULL DEFAULT 'all' CHECK (catch_up IN ('all', 'latest', 'none')),
    breaker_after integer CHECK (breaker_after > 0),
    breaker_probe interval,
    -- The circuit breaker's count: attempts in a row that failed (any daemon); a success resets it.
    failures      integer NOT NULL DEFAULT 0,
    -- The rate limit's token bucket: tokens left at tokens_at.
    tokens        double precision,
    tokens_at     timestamptz
);
COMMENT ON TABLE pgwork.channel IS
    'Delivery channels known to the daemons (registered from their config at start), and the '
    'state every daemon''s claim honours: paused, throttled (not_before, throttle_limit), '
    'global_concurrency and rate_limit. A reminder naming any other channel is refused.';
COMMENT ON COLUMN pgwork.channel.paused IS
    'No work of this channel is claimed while true; its rows wait (nothing dropped, no attempt counted).';
COMMENT ON COLUMN pgwork.channel.not_before IS
    'Throttled: no claim before this instant (a receiver answered 429/502/503/504; Retry-After if it gave one).';
COMMENT ON COLUMN pgwork.channel.throttle_limit IS
    'Throttled: rows claimed across all daemons at most; halved by a throttling answer, grown by each '
    'success, cleared once back at throttle_from.';
COMMENT ON COLUMN pgwork.channel.breaker_after IS
    'Circuit breaker: after this many failed attempts in a row (any daemon) the channel is held for '
    'breaker_probe, then one delivery at a time probes it: a success lifts it step by step, a '
    'failure holds it again. NULL: off.';
COMMENT ON COLUMN pgwork.channel.catch_up IS
    'Occurrences already past when their reminder was written or moved: all are sent; latest: only the '
    'most recent; none: none (the others are closed as expired).';

-- ---------------------------------------------------------------------------------------------
-- Business state: one row per reminder, written by apps.
-- ---------------------------------------------------------------------------------------------

-- The value rules of reminder columns are domains, not table CHECK constraints: a domain's
-- check runs where a value is written (an app's INSERT, or an UPDATE that sets the column), while
-- a table's CHECK constraints all run again on every UPDATE of the row, whatever it changed. The
-- materialiser's progress update (next_fire_at) ran all of them, regular expressions included,
-- for every reminder it materialised. Table constraints remain for rules over several columns
-- and for some of one: due_at's range (an indexed expression reads it), recipient's length (the
-- page returns it as text), remind_before's (the trigger's clearer refusals come first) and the
-- payload's stored, compressed size.
CREATE FUNCTION pgwork.is_trimmed(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
-- Unicode's White_Space characters, named: what \s matches depends on the database's locale
-- (ASCII only under C).
RETURN value !~ '^[\s\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]|[\s\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$';
COMMENT ON FUNCTION pgwork.is_trimmed(text) IS
    'Whether a key has no Unicode space (White_Space: ASCII spaces, tab, line breaks, U+0085, no-break '
    'spaces, U+1680, U+2000-U+200A, U+2028, U+2029, U+205F, U+3000) at either end.';
CREATE DOMAIN pgwork.reminder_source AS text
    CONSTRAINT reminder_source_valid CHECK (length(VALUE) BETWEEN 1 AND 100 AND pgwork.is_trimmed(VALUE));
CREATE DOMAIN pgwork.reminder_business_key AS text
    CONSTRAINT reminder_business_key_valid CHECK (length(VALUE) BETWEEN 1 AND 500 AND pgwork.is_trimmed(VALUE));
CREATE DOMAIN pgwork.reminder_payload AS jsonb
    CONSTRAINT reminder_payload_is_object CHECK (jsonb_typeof(VALUE) = 'object');
CREATE DOMAIN pgwork.reminder_traceparent AS text
    CONSTRAINT reminder_traceparent_w3c
        CHECK (VALUE ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
               AND VALUE !~ '^ff-' AND VALUE !~ '^..-0{32}-' AND VALUE !~ '-0{16}-..$');
CREATE DOMAIN pgwork.reminder_tracestate AS text
    CONSTRAINT reminder_tracestate_valid CHECK (length(VALUE) <= 512 AND VALUE !~ '[[:cntrl:]]');

CREATE TABLE pgwork.reminder (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source        pgwork.reminder_source NOT NULL,
    business_key  pgwork.reminder_business_key NOT NULL,
    due_at        timestamptz NOT NULL
        CONSTRAINT reminder_due_at_sane CHECK (due_at > '1970-01-01 00:00+00' AND due_at < '9999-01-01 00:00+00'),
    due_local     timestamp,
    due_tz        text,
    -- Table constraints, checked after the trigger, which refuses a list of lists or an entry
    -- with a negative part first, naming the column.
    remind_before interval[] NOT NULL DEFAULT '{0}'
        CONSTRAINT reminder_remind_before_1_to_16_entries CHECK (cardinality(remind_before) BETWEEN 1 AND 16)
        CONSTRAINT reminder_remind_before_between_0_and_400_days
            CHECK (array_position(remind_before, NULL) IS NULL
                   AND '0'::interval <= ALL (remind_before) AND '400 days'::interval >= ALL (remind_before)),
    channel       text NOT NULL CONSTRAINT reminder_channel_known REFERENCES pgwork.channel (name),
    -- A table constraint (and plain text): the materialiser's page returns it as text.
    recipient     text NOT NULL
        CONSTRAINT reminder_recipient_valid CHECK (length(recipient) BETWEEN 1 AND 1000),
    -- At most 64 KiB as JSON text: the trigger's rule (pgwork.reminder_check); the table
    -- constraint reminder_payload_at_most_1mib_stored, below, bounds a row written around it.
    payload       pgwork.reminder_payload NOT NULL DEFAULT '{}',
    next_fire_at  timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    planned_at    timestamptz DEFAULT now(),
    traceparent   pgwork.reminder_traceparent,
    tracestate    pgwork.reminder_tracestate,
    recur         text,
    recur_until   timestamp,
    recur_skip    timestamp[]
        CONSTRAINT reminder_recur_skip_at_most_366 CHECK (cardinality(recur_skip) <= 366),
    paused        boolean NOT NULL DEFAULT false,
    recur_rule    jsonb,
    recur_version integer NOT NULL DEFAULT 0,
    series_from   timestamptz,
    CONSTRAINT reminder_business_key_unique UNIQUE (source, business_key),
    CONSTRAINT reminder_local_time_complete CHECK ((due_local IS NULL) = (due_tz IS NULL))
);
COMMENT ON TABLE pgwork.reminder IS
    'One row per business reminder, written by other apps with plain SQL: INSERT to schedule, '
    'UPDATE due_at (or due_local/due_tz) to move, DELETE to cancel.';
-- The stored size of a payload, the bound for a row written around the triggers (which hold a
-- payload to 64 KiB of JSON text): measured by a table constraint before compression, the binary
-- form of 64 KiB of JSON text is up to about four times as large (an array of small numbers).
-- NOT VALID: checked on every write; an upgrade from schema 21 found every row within a tighter
-- bound, so the table is not scanned for it (nor, for the same catalog, in a fresh install).
ALTER TABLE pgwork.reminder
    ADD CONSTRAINT reminder_payload_at_most_1mib_stored CHECK (pg_column_size(payload) <= 1048576) NOT VALID;
COMMENT ON COLUMN pgwork.reminder.source IS 'The app or domain that owns the key, e.g. lease-renewal.';
COMMENT ON COLUMN pgwork.reminder.business_key IS 'Stable key within source, e.g. property:7/lease:42.';
COMMENT ON COLUMN pgwork.reminder.due_at IS
    'The deadline as an instant. For local-time reminders pgwork computes it from due_local and '
    'due_tz (see pgwork.local_to_instant for the DST policy); apps then leave it out.';
COMMENT ON COLUMN pgwork.reminder.due_local IS 'The deadline as a wall-clock time in due_tz (the intent, kept as written).';
COMMENT ON COLUMN pgwork.reminder.due_tz IS 'IANA time zone name for due_local, e.g. Europe/London.';
COMMENT ON COLUMN pgwork.reminder.remind_before IS
    'One send per entry, that long before the deadline: {0} sends at the deadline; '
    '{30 days,7 days,1 day} sends three times. Each entry is its own occurrence.';
COMMENT ON COLUMN pgwork.reminder.planned_at IS
    'Maintained by pgwork: when the schedule was last written (insert, or a move of due_at or '
    'remind_before); the channel''s catch_up policy judges occurrences that fired before it. NULL '
    '(rows from before schema 4): created_at.';
COMMENT ON COLUMN pgwork.reminder.traceparent IS
    'Optional W3C trace context of the request that scheduled (or last moved) the reminder; '
    'each occurrence materialised from then on carries it, and its webhook requests send it.';
COMMENT ON COLUMN pgwork.reminder.tracestate IS 'Optional W3C tracestate that goes with traceparent.';
COMMENT ON COLUMN pgwork.reminder.recur IS
    'A recurring deadline: an RFC 5545 RRULE (e.g. FREQ=MONTHLY;BYMONTHDAY=1) anchored at due_local in '
    'due_tz, the first deadline. Each occurrence x remind_before entry is sent once, with its own key.';
COMMENT ON COLUMN pgwork.reminder.recur_until IS 'The last local deadline a series may have (inclusive); NULL: none.';
COMMENT ON COLUMN pgwork.reminder.recur_skip IS 'Local deadlines of the series not to send (at most 366).';
COMMENT ON COLUMN pgwork.reminder.paused IS
    'A paused series makes nothing; resumed, it starts from the moment it resumes (what fell in the pause is skipped).';
COMMENT ON COLUMN pgwork.reminder.recur_rule IS 'Maintained by pgwork: recur compiled against the first deadline (pgwork.recur_compile).';
COMMENT ON COLUMN pgwork.reminder.recur_version IS 'Maintained by pgwork: counts the edits of the series'' rule, zone, end, skips and pauses.';
COMMENT ON COLUMN pgwork.reminder.series_from IS
    'Maintained by pgwork: when the series was written, last edited or resumed; its deadlines before this are '
    'history and never sent.';
COMMENT ON COLUMN pgwork.reminder.next_fire_at IS
    'Maintained by pgwork: when the earliest occurrence not yet materialised fires; ''infinity'' '
    'when all are; NULL means due_at (the common reminder: one send at the deadline, written without '
    'any trigger call). This is the materialiser''s progress; retention never resets it, so deleting '
    'old work rows can never cause a second send.';

-- The materialiser's eligibility predicate, exactly: coalesce(next_fire_at, due_at) <= cutoff for
-- reminders with something left to materialise, paged by (that instant, id).
CREATE INDEX reminder_next_fire ON pgwork.reminder ((coalesce(next_fire_at, due_at)), id)
    WHERE next_fire_at IS NULL OR next_fire_at < 'infinity';
-- The same per source: a page that cannot take every due reminder serves the sources in turn
-- (pgwork.materialise_page), finding them by a skip scan of this index.
CREATE INDEX reminder_due_by_source ON pgwork.reminder (source, (coalesce(next_fire_at, due_at)), id)
    WHERE next_fire_at IS NULL OR next_fire_at < 'infinity';

-- ---------------------------------------------------------------------------------------------
-- Attempt time: one row per materialised occurrence, written only by the daemon.
-- ---------------------------------------------------------------------------------------------

CREATE TABLE pgwork.renewal_work (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    reminder_id   bigint NOT NULL,
    source        text NOT NULL,
    business_key  text NOT NULL,
    deadline      timestamptz NOT NULL,
    occurrence    interval NOT NULL CHECK (occurrence >= '0'),
    due_at        timestamptz NOT NULL,
    channel       text NOT NULL,
    operation_id  uuid NOT NULL,
    status        text NOT NULL DEFAULT 'ready'
        CHECK (status IN ('ready', 'claimed', 'delivered', 'dead', 'cancelled', 'superseded', 'expired')),
    available_at  timestamptz NOT NULL,
    attempts      integer NOT NULL DEFAULT 0,
    attempts_base integer NOT NULL DEFAULT 0,
    lease         integer NOT NULL DEFAULT 0,
    claimed_at    timestamptz,
    claimed_by    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    last_error    text,
    dead_reason   text,
    redriven_at   timestamptz,
    redriven_by   text,
    traceparent   text,
    tracestate    text,
    deadline_local timestamp,
    recur_version integer,
    -- operation_id is a function of this key, so it is unique too; it has no index of its own
    -- (every status change is a non-HOT update that pays for each index).
    CONSTRAINT work_occurrence_unique UNIQUE (reminder_id, deadline, occurrence),
    CONSTRAINT work_counters_valid CHECK (0 <= attempts_base AND attempts_base <= attempts AND attempts <= lease),
    CONSTRAINT work_finished_iff_terminal
        CHECK ((finished_at IS NOT NULL) = (status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired'))),
    CONSTRAINT work_dead_has_reason CHECK ((status = 'dead') = (dead_reason IS NOT NULL)),
    CONSTRAINT work_claimed_has_owner CHECK (status <> 'claimed' OR (claimed_by IS NOT NULL AND claimed_at IS NOT NULL))
) WITH (
    -- A queue table churns: vacuum it after ~1% of rows change, without cost-based sleeping.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0,
    fillfactor = 85
);
COMMENT ON TABLE pgwork.renewal_work IS
    'One row per reminder occurrence that is due or nearly due; created by the materialiser with '
    'INSERT ... ON CONFLICT on (reminder_id, deadline, occurrence), so repeated ticks are harmless.';
COMMENT ON COLUMN pgwork.renewal_work.deadline IS 'The reminder''s deadline this occurrence was made for; a moved deadline supersedes it.';
COMMENT ON COLUMN pgwork.renewal_work.deadline_local IS
    'For an occurrence of a recurring reminder: its deadline as local wall-clock time, its identity in the '
    'series (a zone edit or a time zone data update moves deadline, never this). NULL for a one-off.';
COMMENT ON COLUMN pgwork.renewal_work.recur_version IS 'The reminder''s recur_version when this occurrence was made.';
COMMENT ON COLUMN pgwork.renewal_work.occurrence IS 'How long before the deadline this send is (an entry of remind_before).';
COMMENT ON COLUMN pgwork.renewal_work.due_at IS 'When this occurrence should be delivered: deadline minus occurrence.';
COMMENT ON COLUMN pgwork.renewal_work.operation_id IS
    'Stable idempotency key of this occurrence: the same on every attempt and after redrive.';
COMMENT ON COLUMN pgwork.renewal_work.status IS
    'ready: live, to be sent (claimable from available_at when it has a pgwork.work_ready row, '
    'held by a worker when it has a pgwork.work_lease row: "claimed" is that row, never stored here); '
    'delivered, dead, cancelled, superseded, expired: terminal (expired: past the channel''s '
    'expire_after, or skipped by its catch_up policy; never sent; last_error says why).';
COMMENT ON COLUMN pgwork.renewal_work.available_at IS
    'ready: not claimable before this instant (due time or retry backoff); a lease''s expiry is '
    'pgwork.work_lease.expires_at.';
COMMENT ON COLUMN pgwork.renewal_work.attempts IS 'Attempts counted against the budget (a clean release on shutdown does not count).';
COMMENT ON COLUMN pgwork.renewal_work.attempts_base IS 'Attempts made before the last redrive; the budget applies to attempts - attempts_base.';
COMMENT ON COLUMN pgwork.renewal_work.lease IS
    'Fencing token of the last lease settled (an outcome, a release, a close): a claim takes the '
    'next number in pgwork.work_lease, and every later change must name it, so a worker whose lease '
    'expired cannot overwrite its successor''s outcome.';

-- No index of renewal_work depends on a live row's status or time (the claim's order is
-- pgwork.work_ready's, leases are pgwork.work_lease's): an outcome's update writes the keys
-- below and, for a terminal row, work_terminal.
-- A recurring reminder's occurrences are identified by their local deadline.
CREATE UNIQUE INDEX work_series_occurrence_unique ON pgwork.renewal_work (reminder_id, deadline_local, occurrence)
    WHERE deadline_local IS NOT NULL;
-- Retention and DLQ listings.
CREATE INDEX work_terminal ON pgwork.renewal_work (finished_at, id)
    WHERE status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired');
-- Dead letters: their count (a gauge) and listing cost O(dead rows), not O(retained rows).
CREATE INDEX work_dead ON pgwork.renewal_work (channel, finished_at, id) WHERE status = 'dead';

-- The queue beside the record: a live occurrence of renewal_work has exactly one row in
-- work_ready (waiting for its turn) or in work_lease (held by a worker), a terminal one neither
-- (pgwork.work_invariant checks it). A claim moves rows from the one to the other and writes
-- nothing to renewal_work; an outcome deletes the lease and updates the record once. Both are
-- small (live rows only) and churn: vacuumed after a few hundred changes.
CREATE TABLE pgwork.work_ready (
    work_id      bigint PRIMARY KEY,
    channel      text NOT NULL,
    source       text NOT NULL,
    available_at timestamptz NOT NULL,
    due_at       timestamptz NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 200,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
COMMENT ON TABLE pgwork.work_ready IS
    'Live occurrences no worker holds, in claim order per channel and source: inserted when an '
    'occurrence is made, retried, given back, redriven or revived; deleted by the claim that takes '
    'it or the edit that closes it. Written only by pgwork.';
COMMENT ON COLUMN pgwork.work_ready.available_at IS
    'Not claimable before this instant (due time or retry backoff); renewal_work.available_at too.';
COMMENT ON COLUMN pgwork.work_ready.due_at IS 'The occurrence''s due time (renewal_work.due_at): lag is read here.';
-- The claim's order (the lanes' ready_from is a position in it).
CREATE INDEX work_ready_order ON pgwork.work_ready (channel, source, available_at, work_id);

CREATE TABLE pgwork.work_lease (
    work_id    bigint PRIMARY KEY,
    lease      integer NOT NULL CHECK (lease > 0),
    attempts   integer NOT NULL CHECK (attempts > 0),
    channel    text NOT NULL,
    source     text NOT NULL,
    due_at     timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    claimed_by text NOT NULL,
    claimed_at timestamptz NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 200,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
COMMENT ON TABLE pgwork.work_lease IS
    'Occurrences a worker holds (their status is "claimed"): inserted by the claim, deleted by the '
    'outcome, a release or a close. No row for (work_id, lease): that lease is fenced.';
COMMENT ON COLUMN pgwork.work_lease.lease IS
    'The fencing number this claim holds: renewal_work.lease + 1 (the record keeps the last settled).';
COMMENT ON COLUMN pgwork.work_lease.attempts IS 'renewal_work.attempts with this attempt counted.';
COMMENT ON COLUMN pgwork.work_lease.expires_at IS 'The lease''s end: past it, the row is claimable again (a reclaim).';
-- Leases per channel by expiry: what global_concurrency and a throttle count (live ones), and
-- where a claim finds expired ones.
CREATE INDEX work_lease_expiry ON pgwork.work_lease (channel, expires_at);

-- The row a claim hands a worker, declared once: claim_work returns it, and so does the page for
-- the rows it inserts claimed (pgwork.as_claimed makes one from a work row); store.Claimed is
-- checked against it when a daemon starts (db.check_schema).
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

CREATE TABLE pgwork.attempt (
    work_id     bigint NOT NULL,
    lease       integer NOT NULL,
    attempt     integer NOT NULL,
    daemon_id   text NOT NULL,
    host        text NOT NULL,
    pid         integer NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    outcome     text NOT NULL CHECK (outcome IN
        ('delivered', 'duplicate', 'retry', 'failed', 'lease_expired', 'released', 'fenced')),
    http_status integer,
    error_class text,
    error       text CHECK (length(error) <= 2000),
    receipt     jsonb,
    retry_at    timestamptz,
    PRIMARY KEY (work_id, lease)
) WITH (autovacuum_vacuum_insert_scale_factor = 0.02);
COMMENT ON TABLE pgwork.attempt IS 'The attempt ledger: one row per claim of a work row, with its outcome.';
COMMENT ON COLUMN pgwork.attempt.outcome IS
    'delivered; duplicate (receiver said it already had it); retry; failed (permanent); '
    'lease_expired (the worker vanished); released (clean shutdown, not counted); '
    'fenced (a late completion refused because the lease had passed to another worker).';
COMMENT ON COLUMN pgwork.attempt.retry_at IS 'For outcome retry: when the next try is due.';
COMMENT ON COLUMN pgwork.attempt.receipt IS 'What the receiver returned as proof of delivery, if anything (truncated).';

CREATE TABLE pgwork.retired (
    reminder_id  bigint NOT NULL,
    deadline     timestamptz NOT NULL,
    occurrence   interval NOT NULL,
    status       text NOT NULL CHECK (status IN ('delivered', 'dead', 'expired')),
    operation_id uuid NOT NULL,
    finished_at  timestamptz NOT NULL,
    retired_at   timestamptz NOT NULL DEFAULT now(),
    deadline_local timestamp,
    PRIMARY KEY (reminder_id, deadline, occurrence)
);
-- Retention prunes a series' tombstones once their deadline is two days past (no edit can make
-- that deadline again): oldest first, a batch at a time.
CREATE INDEX retired_series_deadline ON pgwork.retired (deadline) WHERE deadline_local IS NOT NULL;
COMMENT ON TABLE pgwork.retired IS
    'What retention leaves of a delivered, dead or expired occurrence of a reminder that still exists: its '
    'identity and outcome. The materialiser never inserts an occurrence listed here, so deleting old '
    'work can never cause a second send (not even after the deadline moves away and back). Removed '
    'with the reminder.';

CREATE TABLE pgwork.materialiser_state (
    singleton        boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last_cutoff      timestamptz,
    last_pass_at     timestamptz,
    last_inserted    bigint NOT NULL DEFAULT 0,
    last_duration_ms double precision NOT NULL DEFAULT 0,
    total_inserted   bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE pgwork.materialiser_state IS
    'Evidence of the materialiser: every occurrence firing at or before last_cutoff had its work row '
    'when the last complete pass finished.';
INSERT INTO pgwork.materialiser_state DEFAULT VALUES;

-- Reminders a materialiser's page failed on and left out for a while (a zone the server does not
-- know, a row written around the triggers): what `pgwork status`, the web page and `pgwork
-- reminder` show. A report, not a lock: each daemon decides in memory when it tries again, and
-- forgets a row here once the reminder is made, deleted or moved past the occurrence it failed on.
-- No foreign key: an app's DELETE of a reminder never waits on this table.
CREATE TABLE pgwork.set_aside (
    reminder_id  bigint PRIMARY KEY,
    source       text NOT NULL,
    business_key text NOT NULL,
    fire_at      timestamptz NOT NULL,
    daemon_id    text NOT NULL,
    since        timestamptz NOT NULL DEFAULT now(),
    tried_at     timestamptz NOT NULL DEFAULT now(),
    next_try_at  timestamptz NOT NULL,
    tries        integer NOT NULL DEFAULT 1,
    error        text NOT NULL
);
COMMENT ON TABLE pgwork.set_aside IS
    'Reminders a materialiser page failed on, left out of pages for a while: written by the daemon '
    'that set one aside, deleted once the reminder is made, deleted or moved past fire_at.';
COMMENT ON COLUMN pgwork.set_aside.fire_at IS 'The occurrence it failed on (coalesce(next_fire_at, due_at) then).';
COMMENT ON COLUMN pgwork.set_aside.daemon_id IS 'The daemon that last tried it (pgwork.daemon.id).';
COMMENT ON COLUMN pgwork.set_aside.next_try_at IS 'When that daemon tries it again (each failure doubles the wait, up to an hour).';
COMMENT ON COLUMN pgwork.set_aside.error IS 'The first line of the error its page failed with.';

CREATE TABLE pgwork.retention_state (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    last_pass_at  timestamptz,
    last_deleted  bigint NOT NULL DEFAULT 0,
    total_deleted bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE pgwork.retention_state IS 'Evidence of retention: when it last completed a pass and what it deleted.';
INSERT INTO pgwork.retention_state DEFAULT VALUES;

CREATE TABLE pgwork.daemon (
    id           text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    version      text NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    listener_up  boolean DEFAULT false,
    heartbeat_every interval NOT NULL DEFAULT '20 seconds',
    metrics_at   text,
    schema_version integer,
    channels     text[]
);
COMMENT ON TABLE pgwork.daemon IS
    'Running (or recently running) daemons, refreshed by their heartbeat. A row whose heartbeat is '
    'older than three heartbeat_every is shown as gone; after ten it is deleted by the others.';
COMMENT ON COLUMN pgwork.daemon.listener_up IS
    'Whether its LISTEN connection is up; NULL: it runs without one by configuration (behind a '
    'transaction pooler with no listen_dsn: the tick alone finds new work).';
COMMENT ON COLUMN pgwork.daemon.metrics_at IS
    'HOST:PORT its Prometheus metrics are served on (the port it got, when metrics.listen names '
    'port 0 or a range); NULL: metrics off.';
COMMENT ON COLUMN pgwork.daemon.channels IS
    'The channels it serves (its config''s): `pgwork channel retire` names the daemons serving one. '
    'NULL: a daemon older than schema 24.';
COMMENT ON COLUMN pgwork.daemon.schema_version IS
    'The schema version its code runs (NULL: a daemon older than the migration handshake, which '
    '`pgwork migrate` cannot ask to step aside).';


-- The sources with ready work in each channel, in the order they are to be served: a claim
-- takes the lanes whose turn has come (turn_at <= now, oldest turn first, a batch's worth at
-- most: its cost never grows with the number of sources), their oldest rows, and sends each
-- served lane to the back (turn_at = now) or to its next row's time, or deletes it when it has no
-- ready row left. Every statement that makes a row ready brings its lane's turn forward
-- (pgwork.wake_lanes, a trigger): a lane is never later than its ready rows.
-- Rows claimed under a lease are not in lanes: an expired lease is found through work_lease_expiry.
CREATE TABLE pgwork.lane (
    channel text NOT NULL,
    source  text NOT NULL,
    turn_at timestamptz NOT NULL,
    ready_from timestamptz NOT NULL DEFAULT '-infinity',
    ready_from_id bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (channel, source)
);
CREATE INDEX lane_turn ON pgwork.lane (channel, turn_at, source);
COMMENT ON TABLE pgwork.lane IS
    'A channel''s sources with ready work, served in turn (fair claiming): written by the daemon only.';
COMMENT ON COLUMN pgwork.lane.turn_at IS
    'When the source is next served: its oldest ready row''s time, or when it was last served while '
    'more rows were due (the back of the line). Never later than its ready rows.';
COMMENT ON COLUMN pgwork.lane.ready_from IS
    'With ready_from_id, where the source''s ready rows start in work_ready_order''s order: none has '
    'an (available_at, work_id) below (ready_from, ready_from_id) (-infinity: not known). Its claims '
    'read from here, past the entries the rows taken before them left behind until a vacuum. Set by '
    'the claim that serves the lane (its next ready row), brought forward by pgwork.wake_lanes.';
COMMENT ON COLUMN pgwork.lane.ready_from_id IS 'See ready_from.';

CREATE TABLE pgwork.time_zone (
    name text PRIMARY KEY
);
COMMENT ON TABLE pgwork.time_zone IS
    'The IANA zone names a local-time reminder may use: the server''s pg_timezone_names without '
    'the posix/ and right/ trees, copied by `pgwork migrate` (a lookup here is cheap; the view is not).';
INSERT INTO pgwork.time_zone
SELECT name FROM pg_timezone_names
 WHERE name !~ '^(posix|right)/' AND name NOT IN ('localtime', 'posixrules')
    ON CONFLICT DO NOTHING;

-- ---------------------------------------------------------------------------------------------
-- Many apps, one database: row-level security by source (off until an operator enables it)
-- ---------------------------------------------------------------------------------------------

CREATE TABLE pgwork.app_source (
    role   name NOT NULL,
    source text NOT NULL,
    PRIMARY KEY (role, source)
);
COMMENT ON TABLE pgwork.app_source IS
    'Which database role may write and read reminders of which source, once row-level security '
    'is enabled on pgwork.reminder (ALTER TABLE pgwork.reminder ENABLE ROW LEVEL SECURITY).';

ALTER TABLE pgwork.app_source ENABLE ROW LEVEL SECURITY;
-- pgwork/sql/code/occurrence.sql — Instants and identities of occurrences: the DST policy (local_to_instant), when a send fires,
-- and the operation id every attempt of one occurrence carries.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.local_to_instant(local_time timestamp, tz text) RETURNS timestamptz
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE AS $$
-- The DST policy, in one place:
--   * a wall time that happens once maps to that instant;
--   * an ambiguous wall time (clocks go back, it happens twice) maps to the EARLIER instant;
--   * a nonexistent wall time (clocks go forward, it never happens) is shifted forward by the
--     length of the gap: 02:30 on a 02:00->03:00 night becomes 03:30.
DECLARE
    guess      timestamptz;
    off_before interval;
    off_after  interval;
    a          timestamptz;
    b          timestamptz;
BEGIN
    guess := local_time AT TIME ZONE tz;
    -- UTC offsets in force a day before and a day after (local minus UTC).
    off_before := ((guess - interval '24 hours') AT TIME ZONE tz) - ((guess - interval '24 hours') AT TIME ZONE 'UTC');
    off_after  := ((guess + interval '24 hours') AT TIME ZONE tz) - ((guess + interval '24 hours') AT TIME ZONE 'UTC');
    a := (local_time - off_before) AT TIME ZONE 'UTC';
    b := (local_time - off_after) AT TIME ZONE 'UTC';
    IF (a AT TIME ZONE tz) = local_time AND (b AT TIME ZONE tz) = local_time THEN
        RETURN least(a, b);
    ELSIF (a AT TIME ZONE tz) = local_time THEN
        RETURN a;
    ELSIF (b AT TIME ZONE tz) = local_time THEN
        RETURN b;
    END IF;
    RETURN a;  -- in the gap: read with the offset in force before it, i.e. shifted forward
END
$$;
COMMENT ON FUNCTION pgwork.local_to_instant(timestamp, text) IS
    'Wall-clock time in an IANA zone to an instant. DST policy: ambiguous -> earlier instant; '
    'nonexistent -> shifted forward by the gap.';

-- How far a local time and the instant it becomes can stray from a plain shift near an instant:
-- the changes of the zone's UTC offset within a day either side of it (a DST change: an hour;
-- none most of the year). Windows of local deadlines reach this much past the instants they
-- stand for (pgwork.materialise_series); local_to_instant looks a day either side too.
CREATE OR REPLACE FUNCTION pgwork.offset_shift(tz text, at timestamptz) RETURNS interval
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT greatest(d.later, -d.later) + greatest(d.earlier, -d.earlier)
      FROM (SELECT (((at + interval '24 hours') AT TIME ZONE tz) - ((at + interval '24 hours') AT TIME ZONE 'UTC'))
                   - ((at AT TIME ZONE tz) - (at AT TIME ZONE 'UTC')) AS later,
                   ((at AT TIME ZONE tz) - (at AT TIME ZONE 'UTC'))
                   - (((at - interval '24 hours') AT TIME ZONE tz) - ((at - interval '24 hours') AT TIME ZONE 'UTC')) AS earlier) AS d
$$;
COMMENT ON FUNCTION pgwork.offset_shift(text, timestamptz) IS
    'The changes of a zone''s UTC offset within a day either side of an instant (0 most of the year).';

CREATE OR REPLACE FUNCTION pgwork.fire_at(due_at timestamptz, due_local timestamp, due_tz text, before interval)
RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- Offsets count in the reminder's own calendar: in its zone for local-time reminders
    -- ("7 days before 09:00 London" is 09:00 London), in UTC otherwise. A send before the
    -- deadline never fires after it: a local time in a DST gap is shifted forward by the gap,
    -- which can carry it past the deadline (02:29 before a 02:30 deadline, on a night whose
    -- clocks jump from 02:00 to 02:30); it then fires at the deadline.
    SELECT CASE WHEN due_local IS NULL
                THEN ((due_at AT TIME ZONE 'UTC') - before) AT TIME ZONE 'UTC'
                ELSE least(pgwork.local_to_instant(due_local - before, due_tz), due_at) END
$$;
COMMENT ON FUNCTION pgwork.fire_at(timestamptz, timestamp, text, interval) IS
    'When the occurrence "before" ahead of a deadline fires.';

-- STABLE, as extract() from a timestamptz is: so the planner inlines it into the page (an
-- IMMUTABLE function whose body is STABLE is called through the SQL-function executor, once per
-- row: a third of a bare INSERT ... SELECT's time). The value depends on its arguments only.
CREATE OR REPLACE FUNCTION pgwork.operation_id(reminder_id bigint, source text, business_key text,
                                    deadline timestamptz, occurrence interval)
RETURNS uuid LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT md5(reminder_id::text || E'\x1f' || source || E'\x1f' || business_key || E'\x1f'
               || extract(epoch FROM deadline)::text || E'\x1f' || extract(epoch FROM occurrence)::text)::uuid
$$;
COMMENT ON FUNCTION pgwork.operation_id(bigint, text, text, timestamptz, interval) IS
    'The stable idempotency key of one occurrence; a function of its identity only.';

-- An occurrence of a series is identified by its local deadline (its position in the series), so
-- its key survives a zone edit and a time zone data update; the tag keeps it apart from one-offs.
CREATE OR REPLACE FUNCTION pgwork.series_operation_id(reminder_id bigint, source text, business_key text,
                                           deadline_local timestamp, occurrence interval)
RETURNS uuid LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT md5('series' || E'\x1f' || reminder_id::text || E'\x1f' || source || E'\x1f' || business_key
               || E'\x1f' || to_char(deadline_local, 'YYYY-MM-DD"T"HH24:MI:SS.US')
               || E'\x1f' || extract(epoch FROM occurrence)::text)::uuid
$$;
COMMENT ON FUNCTION pgwork.series_operation_id(bigint, text, text, timestamp, interval) IS
    'The stable idempotency key of one occurrence of a recurring reminder (by its local deadline).';
-- pgwork/sql/code/recurrence.sql — Recurring deadlines: the RRULE subset, compiled once and evaluated over bounded windows.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.
--
-- An RFC 5545 RRULE subset. A rule is compiled once against its first
-- deadline (pgwork.recur_compile: checked, RFC defaults filled in from the first deadline, COUNT
-- turned into its last occurrence) and evaluated by matching the candidate days of the whole
-- periods that overlap a bounded window of local wall-clock time (pgwork.recur_between): the
-- cost is the window's, never the series' history. Local times become instants only through
-- pgwork.local_to_instant (the DST policy of one-off deadlines). What evaluates rules in an app's
-- session runs with jit off: generate_series' default row estimates make the planner compile
-- these small queries (0.8 s a call on PostgreSQL 15 built with LLVM; pgwork's own sessions
-- have jit off already).

-- Every refusal says what to write instead: its own hint, or what a rule is made of.
CREATE OR REPLACE FUNCTION pgwork.recur_error(message text, hint text DEFAULT NULL, col text DEFAULT 'recur')
RETURNS void LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RAISE EXCEPTION 'pgwork: %', message
        USING ERRCODE = 'check_violation', COLUMN = col,
              HINT = coalesce(hint, 'A rule is NAME=VALUE parts joined by ";": FREQ=DAILY, WEEKLY, MONTHLY '
                                    'or YEARLY, then any of INTERVAL (1-1000), BYMONTH, BYMONTHDAY (±1-31), '
                                    'BYDAY (MO..SU, ordinals like -1FR for MONTHLY and YEARLY), BYSETPOS, '
                                    'BYHOUR, BYMINUTE, WKST, and COUNT (1-1000) or UNTIL (YYYYMMDD, '
                                    'YYYYMMDDTHHMMSS, or with Z in UTC); e.g. FREQ=MONTHLY;BYMONTHDAY=1.');
END
$$;
COMMENT ON FUNCTION pgwork.recur_error(text, text, text) IS
    'Refuses a recurrence rule with a message naming the column (recur unless said otherwise) and a hint.';

CREATE OR REPLACE FUNCTION pgwork.recur_ints(part text, value text, lo integer, hi integer, signed boolean)
RETURNS integer[] LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
-- A comma-separated list of whole numbers in lo..hi (also -hi..-lo when signed), sorted, once each.
-- Written with expressions only (no query): a query here is a statement started for each row an
-- app inserts, and cost a series' insert ~10 us.
DECLARE
    item text;
    n    integer;
    i    integer;
    got  integer[] := '{}';
BEGIN
    FOREACH item IN ARRAY string_to_array(value, ',') LOOP
        item := btrim(item);
        IF item !~ '^[+-]?[0-9]{1,4}$' THEN
            PERFORM pgwork.recur_error(format('recur %s has "%s", not a whole number', part, item));
        END IF;
        n := item::integer;
        IF NOT (n BETWEEN lo AND hi OR (signed AND n BETWEEN -hi AND -lo)) THEN
            PERFORM pgwork.recur_error(format('recur %s %s is out of range (%s)', part, item,
                CASE WHEN signed THEN format('%s..%s or -%s..-%s', lo, hi, hi, lo)
                     ELSE format('%s..%s', lo, hi) END));
        END IF;
        IF NOT n = ANY (got) THEN
            i := 1;
            WHILE i <= cardinality(got) AND got[i] < n LOOP
                i := i + 1;
            END LOOP;
            got := got[1:i - 1] || n || got[i:];
        END IF;
    END LOOP;
    RETURN got;
END
$$;
COMMENT ON FUNCTION pgwork.recur_ints(text, text, integer, integer, boolean) IS
    'A recurrence part''s list of whole numbers, checked against its range.';

CREATE OR REPLACE FUNCTION pgwork.recur_period(freq text, wkst integer, t timestamp) RETURNS timestamp
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- The start of the period (day, week from wkst, month, year) that holds t.
RETURN CASE freq WHEN 'DAILY' THEN date_trunc('day', t)
                 WHEN 'WEEKLY' THEN date_trunc('day', t) - ((extract(isodow FROM t)::integer - wkst + 7) % 7) * interval '1 day'
                 WHEN 'MONTHLY' THEN date_trunc('month', t)
                 ELSE date_trunc('year', t) END;
COMMENT ON FUNCTION pgwork.recur_period(text, integer, timestamp) IS
    'The start of the recurrence period (day, week starting on wkst, month or year) that holds t.';

CREATE OR REPLACE FUNCTION pgwork.recur_index(freq text, first timestamp, p timestamp) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- How many periods period p starts after period first (both period starts): INTERVAL keeps
-- the periods whose index it divides, counted by arithmetic, never by iteration.
RETURN CASE freq WHEN 'DAILY' THEN p::date - first::date
                 WHEN 'WEEKLY' THEN (p::date - first::date) / 7
                 WHEN 'MONTHLY' THEN (extract(year FROM p) - extract(year FROM first))::integer * 12
                                     + (extract(month FROM p) - extract(month FROM first))::integer
                 ELSE (extract(year FROM p) - extract(year FROM first))::integer END;
COMMENT ON FUNCTION pgwork.recur_index(text, timestamp, timestamp) IS
    'How many recurrence periods period p starts after period first.';

CREATE OR REPLACE FUNCTION pgwork.recur_list(rule jsonb, part text) RETURNS integer[]
LANGUAGE sql STABLE PARALLEL SAFE
-- A compiled rule's list (a JSON array of whole numbers) as an array, by one cast: no query, and
-- the planner inlines it (a query per list was a statement per row).
RETURN translate((rule -> part)::text, '[]', '{}')::integer[];
COMMENT ON FUNCTION pgwork.recur_list(jsonb, text) IS
    'One of a compiled recurrence rule''s lists (bymonth, bymonthday, bydayn, bydaywd, bysetpos, byhour, byminute).';

CREATE OR REPLACE FUNCTION pgwork.recur_between(rule jsonb, dtstart timestamp, lo timestamp, hi timestamp)
RETURNS SETOF timestamp LANGUAGE sql STABLE PARALLEL SAFE AS $$
    -- The occurrences of a compiled rule (pgwork.recur_compile) anchored at dtstart, as local
    -- wall-clock times in [lo, hi], in order. Every period (of FREQ, INTERVAL apart from
    -- dtstart's) that overlaps the window is taken whole, so BYSETPOS ranks all of a period's
    -- candidates; its days are matched against the BY parts and crossed with the times of day.
    WITH r AS MATERIALIZED (
        SELECT rule->>'freq' AS freq, (rule->>'interval')::integer AS ival,
               (rule->>'wkst')::integer AS wkst, (rule->>'second')::float8 AS sec,
               pgwork.recur_list(rule, 'bymonth') AS bymonth,
               pgwork.recur_list(rule, 'bymonthday') AS bymonthday,
               pgwork.recur_list(rule, 'bydayn') AS bydayn,
               pgwork.recur_list(rule, 'bydaywd') AS bydaywd,
               pgwork.recur_list(rule, 'bysetpos') AS bysetpos,
               pgwork.recur_list(rule, 'byhour') AS byhour,
               pgwork.recur_list(rule, 'byminute') AS byminute,
               greatest(lo, dtstart) AS lo,
               least(hi, coalesce((rule->>'until')::timestamp, 'infinity')) AS hi,
               (rule->>'until_at')::timestamptz AS until_at, rule->>'tz' AS tz,
               CASE rule->>'freq' WHEN 'DAILY' THEN interval '1 day' WHEN 'WEEKLY' THEN interval '7 days'
                                  WHEN 'MONTHLY' THEN interval '1 month' ELSE interval '1 year' END AS unit
    ), bounds AS MATERIALIZED (
        SELECT r.*, pgwork.recur_period(r.freq, r.wkst, dtstart) AS first,
               pgwork.recur_period(r.freq, r.wkst, r.lo) AS p_lo, pgwork.recur_period(r.freq, r.wkst, r.hi) AS p_hi
          FROM r
         WHERE r.lo <= r.hi
    ), w AS MATERIALIZED (
        -- recur_index's arguments are columns here: an argument it uses twice that is itself an
        -- expression keeps the planner from inlining it, and each call then ran through the
        -- SQL-function executor (most of a call's fixed cost).
        SELECT b.*, pgwork.recur_index(b.freq, b.first, b.p_lo) AS k_lo,
               pgwork.recur_index(b.freq, b.first, b.p_hi) AS k_hi
          FROM bounds b
    ), periods AS (
        -- The periods INTERVAL keeps, from the first at or after the window's.
        SELECT w.first + k * w.unit AS p
          FROM w, generate_series(((greatest(w.k_lo, 0) + w.ival - 1) / w.ival) * w.ival, w.k_hi, w.ival) AS k
    ), spans AS (
        -- A YEARLY rule with BYMONTH looks only at those months.
        SELECT p.p, s.s, s.e
          FROM periods p, w
         CROSS JOIN LATERAL (
               SELECT p.p AS s, p.p + w.unit AS e
                WHERE w.freq <> 'YEARLY' OR cardinality(w.bymonth) = 0
               UNION ALL
               SELECT p.p + (mo - 1) * interval '1 month', p.p + mo * interval '1 month'
                 FROM unnest(w.bymonth) AS mo
                WHERE w.freq = 'YEARLY') AS s
    ), days AS (
        SELECT s.p, d.d,
               extract(day FROM d.d)::integer AS dom,
               extract(day FROM date_trunc('month', d.d) + interval '1 month - 1 day')::integer AS mlen,
               extract(doy FROM d.d)::integer AS doy,
               extract(doy FROM date_trunc('year', d.d) + interval '1 year - 1 day')::integer AS ylen,
               extract(isodow FROM d.d)::integer AS dow
          FROM spans s, w
         CROSS JOIN LATERAL (
               -- With BYMONTHDAY, only the days it names can match: they are computed, month by
               -- month (a 31st or a -31st that a month lacks is not a day of it), instead of
               -- trying every day of the period (a monthly rule's period cost ~20 us that way).
               SELECT DISTINCT x.d
                 FROM generate_series(date_trunc('month', s.s), s.e - interval '1 day', interval '1 month') AS m(m)
                CROSS JOIN unnest(w.bymonthday) AS md
                CROSS JOIN LATERAL (SELECT CASE WHEN md > 0 THEN m.m + (md - 1) * interval '1 day'
                                                ELSE m.m + interval '1 month' + md * interval '1 day' END AS d) AS x
                WHERE cardinality(w.bymonthday) > 0
                  AND date_trunc('month', x.d) = m.m AND x.d >= s.s AND x.d < s.e
               UNION ALL
               SELECT g FROM generate_series(s.s, s.e - interval '1 day', interval '1 day') AS g
                WHERE cardinality(w.bymonthday) = 0) AS d(d)
    ), matched AS (
        SELECT d.p, d.d + make_interval(hours => h, mins => mi, secs => w.sec) AS t
          FROM days d, w, unnest(w.byhour) AS h, unnest(w.byminute) AS mi
         WHERE (cardinality(w.bymonth) = 0 OR extract(month FROM d.d)::integer = ANY (w.bymonth))
           AND (cardinality(w.bymonthday) = 0 OR d.dom = ANY (w.bymonthday)
                OR d.dom - d.mlen - 1 = ANY (w.bymonthday))
           -- BYDAY: a weekday (n = 0), or its n-th (from the end when negative) in the month
           -- (MONTHLY, or YEARLY with BYMONTH) or the year (YEARLY).
           AND (cardinality(w.bydaywd) = 0
                OR EXISTS (SELECT FROM unnest(w.bydayn, w.bydaywd) AS b(n, wd)
                            WHERE b.wd = d.dow
                              AND (b.n = 0
                                   OR (CASE WHEN w.freq = 'MONTHLY' OR cardinality(w.bymonth) > 0
                                            THEN b.n IN ((d.dom - 1) / 7 + 1, -((d.mlen - d.dom) / 7 + 1))
                                            ELSE b.n IN ((d.doy - 1) / 7 + 1, -((d.ylen - d.doy) / 7 + 1)) END))))
    ), ranked AS (
        SELECT m.t, row_number() OVER (PARTITION BY m.p ORDER BY m.t) AS pos,
               count(*) OVER (PARTITION BY m.p) AS n
          FROM matched m
    )
    SELECT k.t
      FROM ranked k, w
     WHERE k.t BETWEEN w.lo AND w.hi
       AND (cardinality(w.bysetpos) = 0 OR k.pos = ANY (w.bysetpos) OR k.pos - k.n - 1 = ANY (w.bysetpos))
       -- An UNTIL in UTC bounds the instant (its local bound, above, is a day later).
       AND (w.until_at IS NULL OR pgwork.local_to_instant(k.t, w.tz) <= w.until_at)
     ORDER BY k.t
$$;
COMMENT ON FUNCTION pgwork.recur_between(jsonb, timestamp, timestamp, timestamp) IS
    'The occurrences (local wall-clock times) of a compiled recurrence rule in [lo, hi], in order.';

CREATE OR REPLACE FUNCTION pgwork.recur_has(rule jsonb, dtstart timestamp, at timestamp) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
-- Whether a compiled rule anchored at dtstart has a deadline at the local time at. A function of
-- its own, so that an expression that asks only now and then (pgwork.series_unwanted) holds no
-- subquery and is inlined where it is used.
RETURN EXISTS (SELECT FROM pgwork.recur_between(rule, dtstart, at, at));
COMMENT ON FUNCTION pgwork.recur_has(jsonb, timestamp, timestamp) IS
    'Whether a compiled recurrence rule anchored at dtstart has a deadline at the local time at.';

CREATE OR REPLACE FUNCTION pgwork.recur_upcoming(rule jsonb, dtstart timestamp, from_local timestamp, n integer)
RETURNS SETOF timestamp LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- The first n occurrences at or after from_local, searched window by window (a window holds a
-- few periods; a rule that matches rarely, e.g. 29 February, costs a few windows), at most 100
-- years ahead: a daily rule that matches once in four years would otherwise be searched to the
-- year 9999 (seconds of an app's statement).
DECLARE
    lo   timestamp := greatest(from_local, dtstart);
    span interval;
    t    timestamp;
    got  integer := 0;
    stop timestamp := least(coalesce((rule->>'until')::timestamp, 'infinity'),
                            greatest(from_local, dtstart) + interval '100 years', '9999-12-31');
BEGIN
    span := (rule->>'interval')::integer
            * CASE rule->>'freq' WHEN 'DAILY' THEN interval '32 days' WHEN 'WEEKLY' THEN interval '35 days'
                                 WHEN 'MONTHLY' THEN interval '3 months' ELSE interval '4 years' END;
    WHILE got < n AND lo <= stop LOOP
        FOR t IN SELECT x FROM pgwork.recur_between(rule, dtstart, lo, least(lo + span, stop)) AS x LOOP
            RETURN NEXT t;
            got := got + 1;
            EXIT WHEN got >= n;
        END LOOP;
        lo := lo + span + interval '1 microsecond';
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgwork.recur_upcoming(jsonb, timestamp, timestamp, integer) IS
    'The first n occurrences of a compiled recurrence rule at or after a local time.';

CREATE OR REPLACE FUNCTION pgwork.recur_rule(recur text, dtstart timestamp, tz text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
-- The rule as pgwork evaluates it, anchored at its first deadline dtstart (local, in tz):
--   {freq, interval, wkst, second, bymonth, bymonthday, bydayn, bydaywd, bysetpos, byhour,
--    byminute, count, until[, until_at, tz]}
-- (until_at and tz for an UNTIL in UTC, which bounds the instant) with RFC 5545's defaults taken from dtstart (the time of day; the weekday of a WEEKLY rule;
-- the day of a MONTHLY one; the day and month of a YEARLY one). A rule that cannot be right is
-- refused here, naming the column. (pgwork.recur_compile also checks dtstart against it.)
DECLARE
    names constant text[] := '{MO,TU,WE,TH,FR,SA,SU}';
    parts constant text := 'pgwork takes FREQ, INTERVAL, BYMONTH, BYMONTHDAY, BYDAY, BYSETPOS, BYHOUR, BYMINUTE, WKST, COUNT and UNTIL.';
    body  text;
    part  text;
    key   text;
    val   text;
    seen  text[] := '{}';
    freq  text;
    ival  integer := 1;
    cnt   integer;
    until timestamp;
    until_at timestamptz;
    bymonth integer[] := '{}';
    bymonthday integer[] := '{}';
    bydayn integer[] := '{}';
    bydaywd integer[] := '{}';
    byday_text text;
    byday_seen integer[] := '{}';  -- ordinal * 8 + weekday: each BYDAY entry once
    bysetpos integer[] := '{}';
    byhour integer[];
    byminute integer[];
    wkst integer := 1;
    item text;
    m text[];
    rule jsonb;
BEGIN
    IF dtstart IS NULL OR tz IS NULL THEN
        PERFORM pgwork.recur_error('recur needs due_local and due_tz (the first deadline and its zone)',
                                   'Use due_tz = ''UTC'' for a series in UTC.', 'due_local');
    END IF;
    body := regexp_replace(btrim(recur), '^RRULE:', '', 'i');
    IF body = '' THEN
        PERFORM pgwork.recur_error('recur is empty', 'Write e.g. ''FREQ=MONTHLY;BYMONTHDAY=1'', or leave recur NULL.');
    END IF;
    FOREACH part IN ARRAY string_to_array(body, ';') LOOP
        CONTINUE WHEN btrim(part) = '';
        IF position('=' IN part) = 0 THEN
            PERFORM pgwork.recur_error(format('recur part "%s" is not NAME=VALUE', part));
        END IF;
        key := upper(btrim(split_part(part, '=', 1)));
        val := upper(btrim(substr(part, position('=' IN part) + 1)));
        IF key = ANY (seen) THEN
            PERFORM pgwork.recur_error(format('recur gives %s twice', key));
        END IF;
        seen := seen || key;
        IF val = '' THEN
            PERFORM pgwork.recur_error(format('recur %s has no value', key));
        END IF;
        CASE key
        WHEN 'FREQ' THEN
            IF val IN ('SECONDLY', 'MINUTELY', 'HOURLY') THEN
                PERFORM pgwork.recur_error(format('recur has FREQ=%s; pgwork recurs DAILY, WEEKLY, MONTHLY or YEARLY', val),
                    'A reminder is a deadline, not a job: give several times a day with BYHOUR and BYMINUTE.');
            ELSIF val NOT IN ('DAILY', 'WEEKLY', 'MONTHLY', 'YEARLY') THEN
                PERFORM pgwork.recur_error(format('recur FREQ=%s is not DAILY, WEEKLY, MONTHLY or YEARLY', val));
            END IF;
            freq := val;
        WHEN 'INTERVAL', 'COUNT' THEN
            IF val LIKE '%,%' THEN
                PERFORM pgwork.recur_error(format('recur %s takes one number', key));
            END IF;
            IF key = 'INTERVAL' THEN
                ival := (pgwork.recur_ints('INTERVAL', val, 1, 1000, false))[1];
            ELSE
                cnt := (pgwork.recur_ints('COUNT', val, 1, 1000, false))[1];
            END IF;
        WHEN 'UNTIL' THEN
            m := regexp_match(val, '^([0-9]{8})(T([0-9]{6})(Z?))?$');
            IF m IS NULL THEN
                PERFORM pgwork.recur_error(format('recur UNTIL=%s is neither a date (YYYYMMDD) nor a time (YYYYMMDDTHHMMSS, local; with Z, UTC)', val));
            END IF;
            BEGIN
                until := to_timestamp(m[1] || coalesce(m[3], '235959'), 'YYYYMMDDHH24MISS')::timestamp;
            EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow THEN
                until := NULL;
            END;
            IF until IS NULL OR to_char(until, 'YYYYMMDDHH24MISS') <> m[1] || coalesce(m[3], '235959') THEN
                PERFORM pgwork.recur_error(format('recur UNTIL=%s is not a valid date', val));
            END IF;
            IF m[4] = 'Z' THEN
                -- In UTC, UNTIL bounds the instant (RFC 5545): a deadline is in the series when
                -- its instant is at or before it (recur_between compares them). The local bound
                -- kept with it is a day later: around a DST change a deadline whose instant is in
                -- may have a later local time than UNTIL's (00:30 twice in an overlap: the earlier).
                until_at := until AT TIME ZONE 'UTC';
                until := (until_at AT TIME ZONE tz) + interval '1 day';
            END IF;
        WHEN 'BYMONTH' THEN
            bymonth := pgwork.recur_ints('BYMONTH', val, 1, 12, false);
        WHEN 'BYMONTHDAY' THEN
            bymonthday := pgwork.recur_ints('BYMONTHDAY', val, 1, 31, true);
        WHEN 'BYSETPOS' THEN
            bysetpos := pgwork.recur_ints('BYSETPOS', val, 1, 366, true);
        WHEN 'BYHOUR' THEN
            byhour := pgwork.recur_ints('BYHOUR', val, 0, 23, false);
        WHEN 'BYMINUTE' THEN
            byminute := pgwork.recur_ints('BYMINUTE', val, 0, 59, false);
        WHEN 'WKST' THEN
            wkst := array_position(names, val);
            IF wkst IS NULL THEN
                PERFORM pgwork.recur_error(format('recur WKST=%s is not a weekday (MO, TU, WE, TH, FR, SA, SU)', val));
            END IF;
        WHEN 'BYDAY' THEN
            byday_text := val;
            FOREACH item IN ARRAY string_to_array(val, ',') LOOP
                m := regexp_match(btrim(item), '^([+-]?[0-9]{1,2})?(MO|TU|WE|TH|FR|SA|SU)$');
                IF m IS NULL OR m[1]::integer = 0 THEN
                    PERFORM pgwork.recur_error(format('recur BYDAY has "%s", not a weekday with an optional ordinal (MO, -1FR, 2TU)', item));
                END IF;
                IF NOT coalesce(m[1]::integer, 0) * 8 + array_position(names, m[2]) = ANY (byday_seen) THEN
                    byday_seen := byday_seen || (coalesce(m[1]::integer, 0) * 8 + array_position(names, m[2]));
                    bydayn := bydayn || coalesce(m[1]::integer, 0);
                    bydaywd := bydaywd || array_position(names, m[2]);
                END IF;
            END LOOP;
        WHEN 'BYWEEKNO', 'BYYEARDAY', 'BYSECOND', 'BYEASTER', 'RSCALE', 'SKIP' THEN
            PERFORM pgwork.recur_error(format('recur part %s is not supported', key), parts);
        ELSE
            PERFORM pgwork.recur_error(format('recur has unknown part %s', key), parts);
        END CASE;
    END LOOP;

    IF freq IS NULL THEN
        PERFORM pgwork.recur_error('recur has no FREQ', 'Start the rule with FREQ=DAILY, WEEKLY, MONTHLY or YEARLY.');
    END IF;
    IF cnt IS NOT NULL AND until IS NOT NULL THEN
        PERFORM pgwork.recur_error('recur gives both COUNT and UNTIL', 'End a series by one of them.');
    END IF;
    -- (Array operators, not queries over unnest: each query is a statement started per insert.)
    IF NOT bydayn <@ '{0}'::integer[] THEN
        IF freq IN ('DAILY', 'WEEKLY') THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s has an ordinal, which needs FREQ=MONTHLY or YEARLY', byday_text),
                'An ordinal counts in a month or a year; with FREQ=WEEKLY write the weekday alone.');
        END IF;
        IF 0 = ANY (bydayn) THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s mixes weekdays with and without an ordinal', byday_text),
                'Use one kind per rule (or two reminders).');
        END IF;
        IF (freq = 'MONTHLY' OR cardinality(bymonth) > 0)
           AND NOT bydayn <@ '{-5,-4,-3,-2,-1,1,2,3,4,5}'::integer[] THEN
            PERFORM pgwork.recur_error(format('recur BYDAY=%s has an ordinal past 5 in a month', byday_text));
        END IF;
    END IF;
    IF freq = 'WEEKLY' AND cardinality(bymonthday) > 0 THEN
        PERFORM pgwork.recur_error('recur BYMONTHDAY cannot go with FREQ=WEEKLY (RFC 5545)',
            'Use FREQ=MONTHLY with BYMONTHDAY, or FREQ=WEEKLY with BYDAY.');
    END IF;
    IF cardinality(bysetpos) > 0 AND cardinality(bymonth) = 0 AND cardinality(bymonthday) = 0
       AND cardinality(bydaywd) = 0 AND byhour IS NULL AND byminute IS NULL THEN
        PERFORM pgwork.recur_error('recur BYSETPOS needs BYDAY, BYMONTHDAY or BYMONTH',
            'BYSETPOS picks among the candidates the other BY parts give a period.');
    END IF;
    IF (until_at IS NOT NULL AND until_at < pgwork.local_to_instant(dtstart, tz))
       OR (until_at IS NULL AND until < dtstart) THEN
        PERFORM pgwork.recur_error(format('recur UNTIL %s is before due_local %s',
            coalesce(to_char(until_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS"Z"'), until::text), dtstart));
    END IF;

    -- RFC 5545's defaults, from the first deadline.
    IF cardinality(bymonthday) = 0 AND cardinality(bydaywd) = 0 THEN
        IF freq = 'YEARLY' THEN
            IF cardinality(bymonth) = 0 THEN
                bymonth := ARRAY[extract(month FROM dtstart)::integer];
            END IF;
            bymonthday := ARRAY[extract(day FROM dtstart)::integer];
        ELSIF freq = 'MONTHLY' THEN
            bymonthday := ARRAY[extract(day FROM dtstart)::integer];
        ELSIF freq = 'WEEKLY' THEN
            bydayn := '{0}';
            bydaywd := ARRAY[extract(isodow FROM dtstart)::integer];
        END IF;
    END IF;
    rule := jsonb_build_object(
        'freq', freq, 'interval', ival, 'wkst', wkst,
        'second', extract(second FROM dtstart),
        'bymonth', to_jsonb(bymonth), 'bymonthday', to_jsonb(bymonthday),
        'bydayn', to_jsonb(bydayn), 'bydaywd', to_jsonb(bydaywd), 'bysetpos', to_jsonb(bysetpos),
        'byhour', to_jsonb(coalesce(byhour, ARRAY[extract(hour FROM dtstart)::integer])),
        'byminute', to_jsonb(coalesce(byminute, ARRAY[extract(minute FROM dtstart)::integer])),
        'count', cnt, 'until', until);
    IF until_at IS NOT NULL THEN
        rule := rule || jsonb_build_object('until_at', until_at, 'tz', tz);
    END IF;
    RETURN rule;
END
$$;
COMMENT ON FUNCTION pgwork.recur_rule(text, timestamp, text) IS
    'A recurrence rule (RFC 5545 RRULE subset) parsed and checked, with its defaults from the first deadline.';

CREATE OR REPLACE FUNCTION pgwork.recur_compile(recur text, dtstart timestamp, tz text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- pgwork.recur_rule, and then: the first deadline must be one of the rule's occurrences, and
-- COUNT becomes until, the rule's last occurrence (so no evaluation ever counts from the start).
DECLARE
    rule       jsonb := pgwork.recur_rule(recur, dtstart, tz);
    cnt        integer := (rule->>'count')::integer;
    bymonth    integer[] := pgwork.recur_list(rule, 'bymonth');
    bymonthday integer[] := pgwork.recur_list(rule, 'bymonthday');
    bydaywd    integer[] := pgwork.recur_list(rule, 'bydaywd');
    until      timestamp;
    next_one   timestamp;
    is_first   boolean;
    reached    bigint;  -- occurrences found for COUNT
BEGIN
    -- The first deadline must be an occurrence (RFC 5545 leaves any other start undefined; this
    -- also gives every series at least one). A rule without BYSETPOS and without an ordinal
    -- BYDAY (most: "the 1st at 09:00", "Mondays") is one whose occurrences are the days and times
    -- that pass each of its parts, so its first deadline is tested part by part, as
    -- recur_between's match does: evaluating its period here cost an app ~60 us more per insert
    -- (a statement of its own, started for each row).
    IF cardinality(pgwork.recur_list(rule, 'bysetpos')) = 0 AND pgwork.recur_list(rule, 'bydayn') <@ '{0}' THEN
        is_first := dtstart <= coalesce((rule->>'until')::timestamp, 'infinity')
            AND extract(hour FROM dtstart)::integer = ANY (pgwork.recur_list(rule, 'byhour'))
            AND extract(minute FROM dtstart)::integer = ANY (pgwork.recur_list(rule, 'byminute'))
            AND extract(second FROM dtstart) = (rule->>'second')::numeric
            AND (cardinality(bymonth) = 0 OR extract(month FROM dtstart)::integer = ANY (bymonth))
            AND (cardinality(bymonthday) = 0 OR extract(day FROM dtstart)::integer = ANY (bymonthday)
                 OR extract(day FROM dtstart)::integer
                    - extract(day FROM date_trunc('month', dtstart) + interval '1 month - 1 day')::integer - 1
                    = ANY (bymonthday))
            AND (cardinality(bydaywd) = 0 OR extract(isodow FROM dtstart)::integer = ANY (bydaywd));
    ELSE
        is_first := pgwork.recur_has(rule, dtstart, dtstart);
    END IF;
    IF NOT is_first THEN
        -- The hint's search looks 8 years ahead (29 February is at most 8 years away).
        SELECT x INTO next_one
          FROM pgwork.recur_upcoming(rule || jsonb_build_object('until', least(coalesce((rule->>'until')::timestamp, 'infinity'),
                                                                                dtstart + interval '8 years')),
                                     dtstart, dtstart, 1) AS x;
        PERFORM pgwork.recur_error(
            format('due_local %s is not an occurrence of recur %s', dtstart, recur),
            CASE WHEN next_one IS NULL THEN 'The rule has no occurrence in the 8 years from due_local.'
                 ELSE format('Set due_local to the first deadline: the rule''s first occurrence from due_local is %s.', next_one) END,
            'due_local');
    END IF;
    IF cnt IS NOT NULL THEN
        SELECT max(x), count(*) INTO until, reached FROM pgwork.recur_upcoming(rule, dtstart, dtstart, cnt) AS x;
        IF reached < cnt THEN
            PERFORM pgwork.recur_error(
                format('recur COUNT=%s: the rule has %s occurrences in the 100 years from due_local', cnt, reached),
                'pgwork looks at most 100 years ahead: use a smaller COUNT, or UNTIL.');
        END IF;
        rule := rule || jsonb_build_object('until', until);
    END IF;
    RETURN rule;
END
$$;
COMMENT ON FUNCTION pgwork.recur_compile(text, timestamp, text) IS
    'A recurrence rule (RFC 5545 RRULE subset) checked and compiled against its first deadline; '
    'refuses a wrong rule naming the column.';

CREATE OR REPLACE FUNCTION pgwork.recur_preview(recur text, due_local timestamp, due_tz text, n integer DEFAULT 10)
RETURNS TABLE (deadline_local timestamp, deadline timestamptz)
LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
-- The first n deadlines of a series from its first one: what an app shows before it saves.
-- Each local deadline becomes an instant by pgwork.local_to_instant (ambiguous: the earlier
-- instant; in a DST gap: shifted forward by the gap); a shifted deadline that lands on the
-- instant of another of the series is the same send, shown once.
DECLARE
    rule jsonb;
BEGIN
    IF recur IS NULL THEN
        RAISE EXCEPTION 'pgwork: recur_preview needs recur (the rule), not NULL'
            USING ERRCODE = 'null_value_not_allowed', COLUMN = 'recur',
                  HINT = 'recur_preview(recur, due_local, due_tz, n): the rule, its first deadline as local time, its zone.';
    END IF;
    IF n IS NULL OR n NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'pgwork: recur_preview takes n between 1 and 1000, not %', n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF due_tz IS NOT NULL AND NOT EXISTS (SELECT FROM pgwork.time_zone z WHERE z.name = due_tz) THEN
        RAISE EXCEPTION 'pgwork: unknown time zone "%"', due_tz
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'due_tz',
                  HINT = 'Use an IANA zone name as the server knows it (pgwork.time_zone), e.g. Europe/London or UTC.';
    END IF;
    rule := pgwork.recur_compile(recur, due_local, due_tz);
    RETURN QUERY
    SELECT s.l, s.i
      FROM (SELECT DISTINCT ON (i) u.l, pgwork.local_to_instant(u.l, due_tz) AS i
              -- Two local deadlines share an instant at most (one shifted by a DST gap).
              FROM pgwork.recur_upcoming(rule, due_local, due_local, 2 * n + 64) AS u(l)
             ORDER BY pgwork.local_to_instant(u.l, due_tz),
                      (pgwork.local_to_instant(u.l, due_tz) AT TIME ZONE due_tz) <> u.l, u.l) AS s
     ORDER BY s.i
     LIMIT n;
END
$$;
COMMENT ON FUNCTION pgwork.recur_preview(text, timestamp, text, integer) IS
    'The first n deadlines (local, and as instants) of a recurring series from its first deadline.';

-- How many times of day a compiled rule has (its hours x its minutes).
CREATE OR REPLACE FUNCTION pgwork.recur_times(rule jsonb) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN jsonb_array_length(rule->'byhour') * jsonb_array_length(rule->'byminute');
COMMENT ON FUNCTION pgwork.recur_times(jsonb) IS
    'How many times of day a compiled recurrence rule has.';

-- At most how many deadlines a compiled rule has a day, averaged over its period: an upper bound
-- from its parts (days a period may match x times of day, at most BYSETPOS's count a period),
-- which the materialiser's page budgets a series' work by. Expressions only, so the page inlines
-- it for each series it makes (with a subquery it ran as a function of its own per call), and
-- the rule's JSON lists are counted where they are, not made arrays first (an ordinal BYDAY
-- counts 1, an every-week one, 0, counts 5).
CREATE OR REPLACE FUNCTION pgwork.recur_density(rule jsonb) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN least(CASE rule->>'freq'
                  WHEN 'DAILY' THEN 1
                  WHEN 'WEEKLY' THEN coalesce(nullif(jsonb_array_length(rule->'bydaywd'), 0), 7)
                  ELSE CASE WHEN rule->>'freq' = 'YEARLY'
                            THEN coalesce(nullif(jsonb_array_length(rule->'bymonth'), 0), 12)
                            ELSE 1 END
                       * least(coalesce(nullif(jsonb_array_length(rule->'bymonthday'), 0), 31),
                               coalesce(nullif(jsonb_array_length(rule->'bydayn')
                                               + 4 * jsonb_array_length(jsonb_path_query_array(rule->'bydayn', '$[*] ? (@ == 0)')),
                                               0),
                                        31))
             END
             * pgwork.recur_times(rule),
             coalesce(nullif(jsonb_array_length(rule->'bysetpos'), 0), 2147483647))::float8
       / (CASE rule->>'freq' WHEN 'DAILY' THEN 1 WHEN 'WEEKLY' THEN 7 WHEN 'MONTHLY' THEN 28 ELSE 365 END
          * (rule->>'interval')::integer);
COMMENT ON FUNCTION pgwork.recur_density(jsonb) IS
    'At most how many deadlines a compiled recurrence rule has a day (averaged over its period).';
-- pgwork/sql/code/work.sql — Work rows: terminal statuses, why an occurrence is no longer wanted, the claim's helpers
-- (channel capacity, fair lanes and their trigger, the rate limit's tokens).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.is_terminal(status text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN status IN ('delivered', 'dead', 'cancelled', 'superseded', 'expired');
COMMENT ON FUNCTION pgwork.is_terminal(text) IS
    'Whether a work status is final (queries use this; inlined, it still matches the work_terminal index).';

CREATE OR REPLACE FUNCTION pgwork.unwanted(reminder_id bigint, reminder_due_at timestamptz,
                                remind_before interval[], deadline timestamptz, occurrence interval)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN reminder_due_at <> deadline OR NOT occurrence = ANY (remind_before) THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.unwanted(bigint, timestamptz, interval[], timestamptz, interval) IS
    'Why an occurrence is no longer wanted by its reminder (a missing reminder: cancelled; a moved deadline or a dropped remind_before entry: superseded), or NULL while it is.';

-- The channel's catch_up policy for a send that fired before its reminder (or series) was
-- written or last moved: all are sent; latest: only the most recent of them (latest_missed: the
-- reminder's latest send before planned_at); none: none. True: close it as expired instead.
CREATE OR REPLACE FUNCTION pgwork.skipped_by_catch_up(policy text, fire_at timestamptz, planned_at timestamptz,
                                           latest_missed timestamptz)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE coalesce(policy, 'all') WHEN 'none' THEN fire_at < planned_at
                                    WHEN 'latest' THEN fire_at < latest_missed
                                    ELSE false END;
COMMENT ON FUNCTION pgwork.skipped_by_catch_up(text, timestamptz, timestamptz, timestamptz) IS
    'Whether a channel''s catch_up policy skips a send that fired before its reminder was written or moved.';

CREATE OR REPLACE FUNCTION pgwork.claimed_now(channel text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN (SELECT count(*) FROM pgwork.work_lease h
         WHERE h.channel = claimed_now.channel AND h.expires_at > now());
COMMENT ON FUNCTION pgwork.claimed_now(text) IS
    'Rows of a channel claimed under live leases, by every daemon: what global_concurrency and a '
    'throttle limit count (an expired lease does not: its row is claimable again). Reads work_lease_expiry.';

CREATE OR REPLACE FUNCTION pgwork.wake_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A statement made rows ready (a page, a retry, a give-back, a redrive, a revival: every
    -- insert into work_ready): their lanes' turns come no later than the rows (or now, for a row
    -- ready earlier: it queues behind the lanes already waiting). Lanes are locked in key order by
    -- every writer, so two writers never wait for each other in a cycle; a claim never waits for
    -- a lane (SKIP LOCKED). ON CONFLICT DO UPDATE locks the lane before its WHERE is judged: a
    -- claim turning the lane meanwhile (it could not see these rows) is waited for, then
    -- corrected. The lane's ready_from comes forward to the first of them too, in
    -- work_ready_order's order (the claim reads the lane from there).
    -- A statement that inserted no row (a flush with no retry, a page that claimed all it made)
    -- leaves before the upsert, whose plan is then not started.
    IF NOT EXISTS (SELECT FROM woken) THEN
        RETURN NULL;
    END IF;
    INSERT INTO pgwork.lane AS l (channel, source, turn_at, ready_from, ready_from_id)
    SELECT DISTINCT ON (r.channel, r.source) r.channel, r.source, r.available_at, r.available_at, r.work_id
      FROM woken r
     ORDER BY r.channel, r.source, r.available_at, r.work_id
        ON CONFLICT (channel, source) DO UPDATE
       SET turn_at = least(l.turn_at, greatest(excluded.turn_at, now())),
           ready_from = CASE WHEN (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id)
                             THEN excluded.ready_from ELSE l.ready_from END,
           ready_from_id = CASE WHEN (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id)
                                THEN excluded.ready_from_id ELSE l.ready_from_id END
     WHERE l.turn_at > greatest(excluded.turn_at, now())
        OR (l.ready_from, l.ready_from_id) > (excluded.ready_from, excluded.ready_from_id);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgwork.wake_lanes() IS
    'Statement trigger on work_ready: the lanes of rows made ready are due no later than the rows.';
CREATE OR REPLACE TRIGGER work_ready_wakes_lanes AFTER INSERT ON pgwork.work_ready
    REFERENCING NEW TABLE AS woken FOR EACH STATEMENT EXECUTE FUNCTION pgwork.wake_lanes();

-- Leases are read by key, whatever the statistics: the outcome, the heartbeat and the release
-- name theirs as (work id, lease) arrays, and a plan made while work_lease was small (a daemon
-- starts, or PostgreSQL 15 on any small table) read all of it, and a session keeps its plan as
-- the table grows (test_hot_path.py::test_outcomes_leases_and_releases_read_only_the_rows_they_name).
-- Hence functions with sequential scans off, as the claim has.

-- End the leases named (an outcome, a release): their rows go, and are returned. A lease passed
-- on meanwhile (a reclaim: a new number) is re-checked on its new version and left alone.
CREATE OR REPLACE FUNCTION pgwork.lease_end(work_ids bigint[], leases integer[])
RETURNS SETOF pgwork.work_lease
LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    DELETE FROM pgwork.work_lease l
     USING unnest(lease_end.work_ids, lease_end.leases) AS h(work_id, lease)
     WHERE l.work_id = h.work_id AND l.lease = h.lease AND l.work_id = ANY (lease_end.work_ids)
    RETURNING l.*;
END
$$;
COMMENT ON FUNCTION pgwork.lease_end(bigint[], integer[]) IS
    'Delete the lease rows named by (work id, lease), returning them: the fence of an outcome or a release (the daemon''s only).';
REVOKE EXECUTE ON FUNCTION pgwork.lease_end(bigint[], integer[]) FROM PUBLIC;

-- The heartbeat: push the expiry of the leases named that are still held, passing over any row
-- locked right now (its outcome is being written, or another daemon reclaims it): it never waits,
-- so it cannot deadlock with an outcome flush; the next beat extends it. Returns every lease still
-- held as its snapshot sees them, extended or passed over: the others are lost.
CREATE OR REPLACE FUNCTION pgwork.lease_extend(work_ids bigint[], leases integer[], extend_by interval)
RETURNS TABLE (id bigint, lease integer)
LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH mine AS MATERIALIZED (
        SELECT l.work_id AS id, l.lease
          FROM pgwork.work_lease l
          JOIN unnest(lease_extend.work_ids, lease_extend.leases) AS h(work_id, lease)
            ON l.work_id = h.work_id AND l.lease = h.lease
         WHERE l.work_id = ANY (lease_extend.work_ids)
    ), locked AS (
        -- The conditions again: a row changed since the snapshot is judged on its new version.
        SELECT l.work_id
          FROM pgwork.work_lease l
          JOIN mine m ON m.id = l.work_id AND m.lease = l.lease
         WHERE l.work_id = ANY (lease_extend.work_ids)
           FOR UPDATE OF l SKIP LOCKED
    ), extended AS (
        UPDATE pgwork.work_lease l
           SET expires_at = now() + lease_extend.extend_by
          FROM locked k
         WHERE l.work_id = k.work_id
    )
    SELECT m.id, m.lease FROM mine m;
END
$$;
COMMENT ON FUNCTION pgwork.lease_extend(bigint[], integer[], interval) IS
    'The heartbeat: extend the leases named that are still held (the daemon''s only).';
REVOKE EXECUTE ON FUNCTION pgwork.lease_extend(bigint[], integer[], interval) FROM PUBLIC;

-- Live work: a row of work_ready (waiting) or of work_lease (held), one per live occurrence.
CREATE OR REPLACE FUNCTION pgwork.live_work(channel text)
RETURNS TABLE (work_id bigint, channel text, source text, due_at timestamptz, available_at timestamptz, held boolean)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT q.work_id, q.channel, q.source, q.due_at, q.available_at, false
      FROM pgwork.work_ready q
     WHERE live_work.channel IS NULL OR q.channel = live_work.channel
    UNION ALL
    SELECT l.work_id, l.channel, l.source, l.due_at, l.expires_at, true
      FROM pgwork.work_lease l
     WHERE live_work.channel IS NULL OR l.channel = live_work.channel
$$;
COMMENT ON FUNCTION pgwork.live_work(text) IS
    'The live occurrences of a channel (NULL: of every channel): ready ones (available_at: when '
    'claimable) and held ones (held; available_at: the lease''s expiry). Read by operators'' queries.';

-- A work record as it stands: "claimed" is not stored but a lease row (pgwork.work_lease), whose
-- lease, attempts, expiry and holder are then the row's.
CREATE OR REPLACE FUNCTION pgwork.work_now(w pgwork.renewal_work, l pgwork.work_lease)
RETURNS pgwork.renewal_work LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    IF l.work_id IS NOT NULL THEN
        w.status := 'claimed';
        w.lease := l.lease;
        w.attempts := l.attempts;
        w.available_at := l.expires_at;
        w.claimed_at := l.claimed_at;
        w.claimed_by := l.claimed_by;
    END IF;
    RETURN w;
END
$$;
COMMENT ON FUNCTION pgwork.work_now(pgwork.renewal_work, pgwork.work_lease) IS
    'A work record with its lease row applied (status claimed, the lease''s number, attempts, expiry and holder).';

-- The queue's invariant, which every fault test checks: a live record has exactly one ready or
-- lease row, a terminal one neither; queue rows name a record, on its channel and source; a lease
-- never numbers below the record's. Returns the rows that break it (none: it holds).
CREATE OR REPLACE FUNCTION pgwork.work_invariant()
RETURNS TABLE (work_id bigint, problem text)
LANGUAGE sql STABLE AS $$
    SELECT w.id, CASE WHEN q.work_id IS NOT NULL AND l.work_id IS NOT NULL THEN 'both ready and leased'
                      WHEN w.status = 'ready' AND q.work_id IS NULL AND l.work_id IS NULL THEN 'live but neither ready nor leased'
                      WHEN w.status <> 'ready' AND (q.work_id IS NOT NULL OR l.work_id IS NOT NULL) THEN 'terminal but queued'
                      WHEN q.channel <> w.channel OR q.source <> w.source THEN 'ready row on another channel or source'
                      WHEN l.channel <> w.channel OR l.source <> w.source THEN 'lease row on another channel or source'
                      WHEN l.lease <= w.lease THEN 'lease not above the settled one'
                      WHEN l.attempts <= w.attempts THEN 'lease attempts not above the settled ones'
                 END
      FROM pgwork.renewal_work w
      LEFT JOIN pgwork.work_ready q ON q.work_id = w.id
      LEFT JOIN pgwork.work_lease l ON l.work_id = w.id
     WHERE (q.work_id IS NOT NULL AND l.work_id IS NOT NULL)
        OR (w.status = 'ready' AND q.work_id IS NULL AND l.work_id IS NULL)
        OR (w.status <> 'ready' AND (q.work_id IS NOT NULL OR l.work_id IS NOT NULL))
        OR q.channel <> w.channel OR q.source <> w.source
        OR l.channel <> w.channel OR l.source <> w.source
        OR l.lease <= w.lease OR l.attempts <= w.attempts
    UNION ALL
    SELECT q.work_id, 'ready row without a record' FROM pgwork.work_ready q
     WHERE NOT EXISTS (SELECT FROM pgwork.renewal_work w WHERE w.id = q.work_id)
    UNION ALL
    SELECT l.work_id, 'lease row without a record' FROM pgwork.work_lease l
     WHERE NOT EXISTS (SELECT FROM pgwork.renewal_work w WHERE w.id = l.work_id)
$$;
COMMENT ON FUNCTION pgwork.work_invariant() IS
    'The work rows that break the queue''s invariant (see docs/how-it-works.md); none while it holds. Reads every table: for tests and operators, not the hot path.';

CREATE OR REPLACE FUNCTION pgwork.tokens_now(rate_limit double precision, rate_burst double precision,
                                  tokens double precision, tokens_at timestamptz)
RETURNS double precision LANGUAGE sql STABLE PARALLEL SAFE
RETURN least(rate_burst, coalesce(tokens, rate_burst) + rate_limit * greatest(extract(epoch FROM now() - tokens_at), 0));
COMMENT ON FUNCTION pgwork.tokens_now(double precision, double precision, double precision, timestamptz) IS
    'A rate-limited channel''s tokens now: what its row held at tokens_at, refilled at rate_limit per '
    'second, at most rate_burst (a full bucket before the first claim).';

CREATE OR REPLACE FUNCTION pgwork.series_unwanted(reminder_id bigint, recur_rule jsonb, due_local timestamp,
                                       paused boolean, recur_skip timestamp[], recur_until timestamp,
                                       remind_before interval[], recur_version integer,
                                       deadline_local timestamp, occurrence interval, made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why an occurrence of a series is no longer wanted (NULL while it is): the reminder is gone
-- (cancelled); or it is no longer a series, is paused, dropped the remind_before entry, skips or
-- ends before the deadline, or its rule no longer has it (superseded). The rule is evaluated only
-- when it changed since the occurrence was made (made_version: the reminder's recur_version then).
-- No subquery here (the rule is asked through pgwork.recur_has): a claim inlines this, where a
-- SQL function with one ran as a plan of its own for every series row claimed
-- (test_hot_path.py::test_a_claim_runs_no_sql_function_body_of_its_own).
RETURN CASE WHEN reminder_id IS NULL THEN 'cancelled'
            WHEN recur_rule IS NULL OR paused OR deadline_local IS NULL OR NOT occurrence = ANY (remind_before)
                 OR deadline_local = ANY (coalesce(recur_skip, '{}')) OR deadline_local > recur_until
                THEN 'superseded'
            WHEN made_version IS DISTINCT FROM recur_version
                 AND NOT pgwork.recur_has(recur_rule, due_local, deadline_local)
                THEN 'superseded'
       END;
COMMENT ON FUNCTION pgwork.series_unwanted(bigint, jsonb, timestamp, boolean, timestamp[], timestamp, interval[], integer, timestamp, interval, integer) IS
    'Why an occurrence of a recurring reminder is no longer wanted (cancelled, superseded), or NULL while it is.';

CREATE OR REPLACE FUNCTION pgwork.work_unwanted(reminder_id bigint, reminder_due_at timestamptz, remind_before interval[],
                                     recur_rule jsonb, due_local timestamp, paused boolean,
                                     recur_skip timestamp[], recur_until timestamp, recur_version integer,
                                     deadline timestamptz, deadline_local timestamp, occurrence interval,
                                     made_version integer)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
-- Why a work row's occurrence is no longer wanted by its reminder, one-off (pgwork.unwanted) or of
-- a series (pgwork.series_unwanted), or NULL while it is: what a claim and a redrive ask.
RETURN CASE WHEN deadline_local IS NULL
            THEN pgwork.unwanted(reminder_id, reminder_due_at, remind_before, deadline, occurrence)
            ELSE pgwork.series_unwanted(reminder_id, recur_rule, due_local, paused, recur_skip, recur_until,
                                        remind_before, recur_version, deadline_local, occurrence, made_version)
       END;
COMMENT ON FUNCTION pgwork.work_unwanted(bigint, timestamptz, interval[], jsonb, timestamp, boolean, timestamp[], timestamp, integer, timestamptz, timestamp, interval, integer) IS
    'Why a work row''s occurrence is no longer wanted (cancelled, superseded), or NULL while it is.';

CREATE OR REPLACE FUNCTION pgwork.as_claimed(w pgwork.renewal_work, status text, lease integer, attempts integer,
                                             prev_status text, recipient text, payload text, time_zone text)
RETURNS pgwork.claimed LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- The row a worker gets (pgwork.claimed) from a work record, with the status, lease and attempts
-- a claim gave it (claim_rows: the lease row it wrote, or the record's own for a row it closed),
-- or a page that made it claimed (pgwork.materialise_page): the status it had before, and the
-- reminder's recipient, payload and, for a series, zone, as the statement read them. Retries
-- count from the last redrive, or from the occurrence's due time (never before the row was made).
RETURN ROW(w.id, w.reminder_id, w.source, w.business_key, w.deadline, w.occurrence, w.due_at, w.channel,
           w.operation_id, status, attempts, w.attempts_base, lease,
           coalesce(w.redriven_at, greatest(w.due_at, w.created_at)),
           prev_status, recipient, payload, w.traceparent, w.tracestate, w.deadline_local,
           CASE WHEN w.deadline_local IS NOT NULL THEN time_zone END)::pgwork.claimed;
COMMENT ON FUNCTION pgwork.as_claimed(pgwork.renewal_work, text, integer, integer, text, text, text, text) IS
    'A work row as a worker gets it (pgwork.claimed), with its status, lease and attempts, the status it had and its reminder''s recipient, payload and zone.';
-- pgwork/sql/code/claim.sql — The claim: a channel's lanes and limit lock, then its rows, in one statement of the daemon.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.
--
-- The daemon claims with one statement (queries.sql, claim_work): pgwork.claim_lanes, then
-- pgwork.claim_rows with what it took, as parameters. Both are VOLATILE PL/pgSQL functions, so
-- each of their statements takes a new snapshot (READ COMMITTED): claim_rows' is taken after
-- claim_lanes' locks, so it sees every change made before them, and nobody can change what they
-- locked until the claim commits. One statement, not two in a pipeline with BEGIN and COMMIT:
-- the daemon's Python spends half as much on a claim of one row and a sixth less on a hundred,
-- Postgres about the same (bench/HISTORY.md, "The claim in one statement"). Their plans are kept
-- by the session, as a prepared statement's are (generic in the daemon's).

-- What a claim takes first, before the snapshot its rows are read with:
--  * the channel row, when a limit is in force (a rate limit, a global concurrency, or a
--    throttle limit: a receiver's throttling answers or the circuit breaker's one probe at a
--    time), which serialises the claims of such a channel across daemons so that each counts
--    what the previous one claimed; a channel with no limit is not locked. channel_locked names
--    it: a limit that came into force between the two steps gives that claim nothing, never an
--    uncounted row.
--  * up to a batch of the channel's lanes whose turn has come, oldest turn first, skipping
--    lanes another claim holds (two daemons serve different sources at once): lanes names them
--    in turn order, for claim_rows to serve and turn.
CREATE OR REPLACE FUNCTION pgwork.claim_lanes(channel text, claim_limit integer)
RETURNS TABLE (channel_locked text, lanes text[])
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT (SELECT c.name FROM pgwork.channel c
             WHERE c.name = claim_lanes.channel
               AND (c.rate_limit IS NOT NULL OR c.global_concurrency IS NOT NULL OR c.throttle_limit IS NOT NULL)
               FOR NO KEY UPDATE) AS channel_locked,
           coalesce((SELECT array_agg(l.source ORDER BY l.turn_at, l.source)
                       FROM (SELECT l.source, l.turn_at FROM pgwork.lane l
                              WHERE l.channel = claim_lanes.channel AND l.turn_at <= now()
                              ORDER BY l.turn_at, l.source
                              LIMIT claim_lanes.claim_limit
                                FOR UPDATE SKIP LOCKED) AS l), '{}') AS lanes;
END
$$;
COMMENT ON FUNCTION pgwork.claim_lanes(text, integer) IS
    'A claim''s first step: its channel''s row when a limit is in force, and the lanes whose turn has come (called by the daemon''s claim only).';
REVOKE EXECUTE ON FUNCTION pgwork.claim_lanes(text, integer) FROM PUBLIC;

-- Claim up to claim_limit rows of one channel that are ready and available, or claimed under an
-- expired lease, after pgwork.claim_lanes took channel_locked and lanes. The reminder is re-read
-- in the same statement: work for a deleted reminder is cancelled and work for a moved deadline
-- (or a dropped remind_before entry) is superseded; neither is returned. A reclaimed lease was an
-- attempt: it is written to the ledger, and with the budget spent the row goes dead instead of
-- being claimed again.
-- The claim commits without waiting for the WAL flush unless commit_mode is 'on'
-- (database.synchronous_claims): a claim lost in a database crash is recovered like a killed
-- worker's (the row is claimable again, the late outcome is fenced, the retry carries the same
-- idempotency key, but the ledger has no row for the request that went out), and the next
-- synchronous commit flushes it anyway.
-- Outcomes (record_outcomes) commit synchronously: delivered is durable before it counts.
-- The channel's row decides how many rows may be claimed (the gate): none while it is paused
-- or throttled to a later instant; no more than its global concurrency or throttle limit minus
-- the rows claimed under live leases; no more than the rate limit's tokens, which the claimed
-- rows then spend.
-- Past expire_after, an occurrence is closed as expired instead of sent.
CREATE OR REPLACE FUNCTION pgwork.claim_rows(
    channel text, claim_limit integer, max_attempts integer, lease interval, daemon_id text,
    expire_after interval, commit_mode text, channel_locked text, lanes text[])
RETURNS SETOF pgwork.claimed
-- Every table it reads, it reads by key (a channel by name, lanes and work rows through their
-- indexes, candidates by id): no sequential scan, whatever the statistics say. A daemon plans
-- this once per session, and one that did so while renewal_work was empty (a fresh install, a
-- daemon idle before rent day) kept a plan that read and updated its candidates by scanning the
-- whole table (test_hot_path.py::test_a_page_planned_on_empty_tables_reads_by_key).
LANGUAGE plpgsql VOLATILE SET enable_seqscan = off AS $$
#variable_conflict use_column
BEGIN
    -- What pgwork.claim_lanes took (see there) comes as channel_locked, the channel's row,
    -- locked when a limit is in force, and lanes, the lanes it locked, in turn order (empty: it
    -- took none).
    RETURN QUERY
    WITH gate AS MATERIALIZED (
        SELECT c.name,
               CASE WHEN c.paused OR c.not_before > now() THEN 0
                    -- A limit to count, and this transaction does not hold the lock (claim_lanes).
                    WHEN (c.rate_limit IS NOT NULL OR c.global_concurrency IS NOT NULL OR c.throttle_limit IS NOT NULL)
                         AND claim_rows.channel_locked IS DISTINCT FROM c.name THEN 0
                    ELSE greatest(0, least(
                        claim_rows.claim_limit,
                        -- least() skips NULLs: no cap, no limit from it.
                        least(c.global_concurrency, c.throttle_limit)
                            - CASE WHEN c.global_concurrency IS NULL AND c.throttle_limit IS NULL THEN 0
                                   ELSE pgwork.claimed_now(c.name) END,
                        floor(t.tokens)))::int
               END AS budget,
               t.tokens
          FROM pgwork.channel c
         CROSS JOIN LATERAL (
               SELECT pgwork.tokens_now(c.rate_limit, c.rate_burst, c.tokens, c.tokens_at) AS tokens
               ) AS t
         WHERE c.name = claim_rows.channel
    ), due_lanes AS MATERIALIZED (
        -- claim_lanes took no lane: the due lanes as this snapshot sees them, in turn order.
        SELECT l.source, l.ready_from, l.ready_from_id, row_number() OVER (ORDER BY l.turn_at, l.source) AS n
          FROM pgwork.lane l
         WHERE l.channel = claim_rows.channel AND l.turn_at <= now()
           AND cardinality(claim_rows.lanes) = 0
         ORDER BY l.turn_at, l.source
         LIMIT claim_rows.claim_limit
    ), free_now AS MATERIALIZED (
        -- Those nobody holds appeared after claim_lanes' snapshot (their rows committed between the
        -- two steps): locked here and left for the next claim, which sees their rows and
        -- turns them (served now, unturned, such a lane would get an extra turn).
        SELECT l.source
          FROM pgwork.lane l
         WHERE l.channel = claim_rows.channel AND l.source IN (SELECT d.source FROM due_lanes d)
           FOR UPDATE SKIP LOCKED
    ), lanes AS MATERIALIZED (
        -- The lanes this claim serves, in turn order: those claim_lanes took; or, when other claims
        -- hold every lane whose turn has come (several daemons on one busy source), those lanes as
        -- this snapshot sees them, unlocked ("borrowed"): their rows are still taken with SKIP
        -- LOCKED, and the lanes are left for their holders to turn.
        -- Each with where its ready rows start (pgwork.lane.ready_from): no row this snapshot
        -- sees ready comes before (a statement that made one ready brought it forward before
        -- committing, waiting for the lane's holder if need be).
        SELECT o.source, o.n, true AS owned, l.ready_from, l.ready_from_id
          FROM unnest(claim_rows.lanes) WITH ORDINALITY AS o(source, n)
          JOIN pgwork.lane l ON l.channel = claim_rows.channel AND l.source = o.source
        UNION ALL
        SELECT d.source, row_number() OVER (ORDER BY d.n), false, d.ready_from, d.ready_from_id
          FROM due_lanes d
         WHERE d.source NOT IN (SELECT f.source FROM free_now f)
    ), reclaim AS MATERIALIZED (
        -- Rows whose lease expired (their worker died or lost its connection) come first: they
        -- are the oldest. Read through work_lease_expiry, where live leases are the later part.
        SELECT l.work_id AS id, l.source, l.expires_at AS available_at
          FROM pgwork.work_lease l
         WHERE l.channel = claim_rows.channel AND l.expires_at <= now()
         ORDER BY l.expires_at, l.work_id
         LIMIT coalesce((SELECT budget FROM gate), claim_rows.claim_limit)
           FOR UPDATE SKIP LOCKED
    ), share AS MATERIALIZED (
        -- What is left of the budget, shared between the lanes served: a lane gets an equal share
        -- (rounded up), and no more lanes are served than the budget has rows (a budget of one
        -- serves the first lane in turn, and the next claim the next).
        SELECT b.budget,
               least(b.budget, (SELECT count(*) FROM lanes))::int AS served,
               ceil(b.budget::numeric / greatest(1, least(b.budget, (SELECT count(*) FROM lanes))))::int AS each
          FROM (SELECT greatest(0, coalesce((SELECT budget FROM gate), claim_rows.claim_limit)
                                   - (SELECT count(*) FROM reclaim))::int AS budget) AS b
    ), served AS MATERIALIZED (
        SELECT l.source, l.n, l.owned, l.ready_from, l.ready_from_id
          FROM lanes l WHERE l.n <= (SELECT served FROM share)
    ), head AS MATERIALIZED (
        SELECT h.id, h.source, h.available_at, s.n
          FROM served s
         CROSS JOIN LATERAL (
               SELECT w.work_id AS id, w.source, w.available_at
                 FROM pgwork.work_ready w
                WHERE w.channel = claim_rows.channel AND w.source = s.source
                  AND w.available_at <= now()
                  AND (w.available_at, w.work_id) >= (s.ready_from, s.ready_from_id)
                ORDER BY w.available_at, w.work_id
                LIMIT (SELECT each FROM share)
                  FOR UPDATE SKIP LOCKED) AS h
    ), head_end AS (
        -- Where each lane's head ended, and whether it filled its share.
        SELECT DISTINCT ON (source) source, n, available_at, id,
               count(*) OVER (PARTITION BY source) = (SELECT each FROM share) AS filled
          FROM head
         ORDER BY source, available_at DESC, id DESC
    ), tail AS MATERIALIZED (
        -- What the lanes with fewer due rows than their share left over goes to the others, past
        -- their heads.
        SELECT t.id, t.source, t.available_at, e.n
          FROM head_end e
         CROSS JOIN LATERAL (
               SELECT w.work_id AS id, w.source, w.available_at
                 FROM pgwork.work_ready w
                WHERE w.channel = claim_rows.channel AND w.source = e.source
                  AND w.available_at <= now()
                  AND (w.available_at, w.work_id) > (e.available_at, e.id)
                ORDER BY w.available_at, w.work_id
                -- Never negative: the heads may overshoot the budget (each share is rounded up).
                LIMIT greatest(0, (SELECT budget FROM share) - (SELECT count(*) FROM head))
                  FOR UPDATE SKIP LOCKED) AS t
         WHERE e.filled AND (SELECT budget FROM share) > (SELECT count(*) FROM head)
    ), candidate AS MATERIALIZED (
        -- Expired leases first, then round robin: every lane's first row in turn order, then
        -- every lane's second, ...
        SELECT x.id, x.source
          FROM (SELECT id, source, available_at, 0::bigint AS n, 0::bigint AS round FROM reclaim
                UNION ALL
                SELECT r.id, r.source, r.available_at, r.n,
                       row_number() OVER (PARTITION BY r.source ORDER BY r.available_at, r.id) AS round
                  FROM (SELECT id, source, available_at, n FROM head
                        UNION ALL
                        SELECT id, source, available_at, n FROM tail) AS r) AS x
         ORDER BY x.round, x.n, x.available_at, x.id
         LIMIT coalesce((SELECT budget FROM gate), claim_rows.claim_limit)
    ), turn AS MATERIALIZED (
        -- Each served lane this claim holds: its next ready row (past what this claim takes).
        -- Read by this statement's snapshot, taken after claim_lanes' lock: a row made ready
        -- since then waits on that lock to wake its lane (pgwork.wake_lanes). Part of this plan,
        -- not a SQL function: one with a subquery is never inlined, and PostgreSQL 15 planned its
        -- body again on every claim (test_hot_path.py::
        -- test_a_claim_runs_no_sql_function_body_of_its_own).
        SELECT s.source, n.available_at AS next_at, n.id AS next_id
          FROM served s
          LEFT JOIN (SELECT c.source, array_agg(c.id) AS ids FROM candidate c GROUP BY c.source) AS t
            ON t.source = s.source
          LEFT JOIN LATERAL (
               SELECT w.available_at, w.work_id AS id FROM pgwork.work_ready w
                WHERE w.channel = claim_rows.channel AND w.source = s.source
                  AND (w.available_at, w.work_id) >= (s.ready_from, s.ready_from_id)
                  AND NOT w.work_id = ANY (coalesce(t.ids, '{}'))
                ORDER BY w.available_at, w.work_id
                LIMIT 1) AS n ON true
         WHERE s.owned
    ), turned AS (
        -- A lane with a row still due goes to the back of the line (turn_at = now), one with a
        -- later row waits for it, and its next claim reads from that row on (the entries of the
        -- rows taken here stay in work_ready_order until a vacuum: read from the lane's start,
        -- every claim of a drain walked all those of the rows taken before it) ...
        UPDATE pgwork.lane l
           SET turn_at = greatest(t.next_at, now()), ready_from = t.next_at, ready_from_id = t.next_id
          FROM turn t
         WHERE t.next_at IS NOT NULL AND l.channel = claim_rows.channel AND l.source = t.source
    ), emptied AS (
        -- ... and one with no ready row left is removed.
        DELETE FROM pgwork.lane l
         USING turn t
         WHERE t.next_at IS NULL AND l.channel = claim_rows.channel AND l.source = t.source
    ), unreadied AS (
        -- The ready rows taken leave work_ready, whatever the verdict on them (one whose record is
        -- gone or closed, which only a migration's copy racing an app's edit leaves, is dropped).
        DELETE FROM pgwork.work_ready r
         WHERE r.work_id = ANY ((SELECT array_agg(c.id) FROM candidate c)::bigint[])
    ), judged AS (
        -- Each candidate's record, live, with the numbers its next lease counts from: the expired
        -- lease's for a reclaim, the record's own (the last settled) for a ready row.
        SELECT w, l.work_id IS NOT NULL AS reclaimed,
               coalesce(l.lease, w.lease) AS prev_lease, coalesce(l.attempts, w.attempts) AS prev_attempts,
               l.claimed_at AS prev_claimed_at, l.claimed_by AS prev_claimed_by,
               coalesce(pgwork.work_unwanted(r.id, r.due_at, r.remind_before, r.recur_rule, r.due_local, r.paused,
                                             r.recur_skip, r.recur_until, r.recur_version,
                                             w.deadline, w.deadline_local, w.occurrence, w.recur_version),
                        -- Counted from the last redrive when there was one: a redrive says "send it".
                        CASE WHEN greatest(w.due_at, w.redriven_at) + claim_rows.expire_after::interval < now() THEN 'expired'
                             WHEN coalesce(l.attempts, w.attempts) - w.attempts_base >= claim_rows.max_attempts THEN 'dead'
                             ELSE 'claimed' END) AS verdict,
               -- The payload as text: nothing in the claim decodes it (one undecodable payload
               -- cannot fail a batch), and receivers get it exactly as stored.
               r.recipient, r.payload::text AS payload, r.due_tz
          -- The candidates as one array: read by primary key whatever the planner estimates
          -- (joined to candidate, a generic plan that took its LIMIT as a tenth of the table
          -- hashed the whole table: 40 ms for 100 rows).
          FROM pgwork.renewal_work w
          LEFT JOIN pgwork.work_lease l
            ON l.work_id = w.id AND l.work_id = ANY ((SELECT array_agg(x.id) FROM reclaim x)::bigint[])
          LEFT JOIN pgwork.reminder r ON r.id = w.reminder_id
         WHERE w.id = ANY ((SELECT array_agg(c.id) FROM candidate c)::bigint[]) AND w.status = 'ready'
    ), leased AS (
        -- A new lease for a ready row ...
        INSERT INTO pgwork.work_lease (work_id, lease, attempts, channel, source, due_at, expires_at, claimed_by, claimed_at)
        SELECT (j.w).id, j.prev_lease + 1, j.prev_attempts + 1, (j.w).channel, (j.w).source, (j.w).due_at,
               now() + claim_rows.lease::interval, claim_rows.daemon_id, now()
          FROM judged j
         WHERE j.verdict = 'claimed' AND NOT j.reclaimed
    ), reissued AS (
        -- ... and the next number of an expired one.
        UPDATE pgwork.work_lease l
           SET lease = j.prev_lease + 1, attempts = j.prev_attempts + 1,
               expires_at = now() + claim_rows.lease::interval, claimed_by = claim_rows.daemon_id, claimed_at = now()
          FROM judged j
         WHERE l.work_id = (j.w).id AND j.verdict = 'claimed' AND j.reclaimed
    ), released AS (
        -- An expired lease whose row is closed instead (dead, expired, cancelled, superseded) goes.
        DELETE FROM pgwork.work_lease l
         USING judged j
         WHERE l.work_id = (j.w).id AND j.verdict <> 'claimed' AND j.reclaimed
    ), closed AS (
        -- The record is written only for a row closed instead of sent (rare): the lease it last
        -- held is settled with it.
        UPDATE pgwork.renewal_work w
           SET status = j.verdict,
               lease = j.prev_lease,
               attempts = j.prev_attempts,
               claimed_at = coalesce(j.prev_claimed_at, w.claimed_at),
               claimed_by = coalesce(j.prev_claimed_by, w.claimed_by),
               finished_at = now(),
               dead_reason = CASE WHEN j.verdict <> 'dead' THEN NULL
                                  WHEN j.reclaimed THEN 'attempt budget spent (the last lease expired)'
                                  ELSE 'attempt budget spent' END,
               last_error = CASE WHEN j.verdict <> 'expired' THEN w.last_error
                                 ELSE format('expired: not sent by %s (due %s, expire_after %s)',
                                             greatest(w.due_at, w.redriven_at) + claim_rows.expire_after::interval, w.due_at,
                                             claim_rows.expire_after::interval) END
          FROM judged j
         WHERE w.id = (j.w).id AND j.verdict <> 'claimed'
    ), updated AS (
        -- The row a worker gets (pgwork.claimed). pgwork.as_claimed is inlined and its fields
        -- taken from the row as the plan has it: nothing is built per row that a column list
        -- would not (test_hot_path.py::test_a_claim_runs_no_sql_function_body_of_its_own).
        SELECT (pgwork.as_claimed(j.w, j.verdict,
                                  j.prev_lease + (j.verdict = 'claimed')::int,
                                  j.prev_attempts + (j.verdict = 'claimed')::int,
                                  CASE WHEN j.reclaimed THEN 'claimed' ELSE 'ready' END,
                                  j.recipient, j.payload, j.due_tz)).*
          FROM judged j
    ), spent AS (
        -- The rate limit's tokens: what was there, minus the rows claimed for delivery.
        UPDATE pgwork.channel c
           SET tokens = g.tokens - (SELECT count(*) FROM judged j WHERE j.verdict = 'claimed'), tokens_at = now()
          FROM gate g
         WHERE c.name = g.name AND c.rate_limit IS NOT NULL
    ), expired AS (
        INSERT INTO pgwork.attempt
               (work_id, lease, attempt, daemon_id, host, pid, started_at, finished_at, outcome, error_class, error)
        SELECT (j.w).id, j.prev_lease, j.prev_attempts, j.prev_claimed_by, coalesce(d.host, 'unknown'),
               coalesce(d.pid, 0), j.prev_claimed_at, now(), 'lease_expired', 'LeaseExpired',
               'the worker holding the lease did not report before it expired'
          FROM judged j
          LEFT JOIN pgwork.daemon d ON d.id = j.prev_claimed_by
         WHERE j.reclaimed
            ON CONFLICT (work_id, lease) DO NOTHING
    )
    SELECT u.*
      FROM (SELECT set_config('synchronous_commit', claim_rows.commit_mode, true)) AS commit_mode,
           updated u
     ORDER BY u.due_at, u.id;
END
$$;
COMMENT ON FUNCTION pgwork.claim_rows(text, integer, integer, interval, text, interval, text, text, text[]) IS
    'A claim''s second step: the rows it takes, after pgwork.claim_lanes (called by the daemon''s claim only).';
REVOKE EXECUTE ON FUNCTION pgwork.claim_rows(text, integer, integer, interval, text, interval, text, text, text[]) FROM PUBLIC;
-- pgwork/sql/code/reminder_triggers.sql — What an app's INSERT, UPDATE and DELETE of a reminder do: check and normalise the row,
-- close the work of a schedule that no longer holds, and NOTIFY the daemons.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.jsonb_nesting_within(doc jsonb, max_depth integer) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    -- Walks containers only, and no deeper than max_depth + 1: cheap for any document.
    WITH RECURSIVE walk(v, depth) AS (
        SELECT doc, 1
        UNION ALL
        SELECT c.v, w.depth + 1
          FROM walk w
         CROSS JOIN LATERAL (
               SELECT value FROM jsonb_each(CASE WHEN jsonb_typeof(w.v) = 'object' THEN w.v END)
               UNION ALL
               SELECT value FROM jsonb_array_elements(CASE WHEN jsonb_typeof(w.v) = 'array' THEN w.v END)
         ) AS c(v)
         WHERE w.depth <= max_depth AND jsonb_typeof(c.v) IN ('object', 'array')
    )
    SELECT max(depth) <= max_depth FROM walk
$$;
COMMENT ON FUNCTION pgwork.jsonb_nesting_within(jsonb, integer) IS
    'Whether a JSON document nests containers at most max_depth levels deep.';

CREATE OR REPLACE FUNCTION pgwork.reminder_before_write() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    what text;
    bad  interval;
    size integer;
BEGIN
    what := format('reminder (%s, %s)', NEW.source, NEW.business_key);
    IF TG_OP = 'UPDATE' AND (NEW.source IS DISTINCT FROM OLD.source OR NEW.business_key IS DISTINCT FROM OLD.business_key) THEN
        RAISE EXCEPTION 'pgwork: source and business_key identify a reminder and cannot change'
            USING ERRCODE = 'check_violation', COLUMN = 'business_key',
                  HINT = 'Delete the reminder and insert a new one.';
    END IF;

    -- The deadline: an instant, or a wall-clock time plus an IANA zone.
    IF (NEW.due_local IS NULL) <> (NEW.due_tz IS NULL) THEN
        RAISE EXCEPTION 'pgwork: % gives only one of due_local and due_tz', what
            USING ERRCODE = 'check_violation', COLUMN = 'due_tz',
                  HINT = 'A local deadline needs both the wall-clock time and the IANA zone.';
    END IF;
    IF NEW.due_local IS NOT NULL THEN
        IF TG_OP = 'INSERT' AND NEW.due_at IS NOT NULL THEN
            RAISE EXCEPTION 'pgwork: % gives both due_at and due_local/due_tz', what
                USING ERRCODE = 'check_violation', COLUMN = 'due_at',
                      HINT = 'Give the deadline either as an instant or as local time plus zone.';
        END IF;
        IF TG_OP = 'UPDATE' AND NEW.due_at IS DISTINCT FROM OLD.due_at
           AND NEW.due_local IS NOT DISTINCT FROM OLD.due_local AND NEW.due_tz IS NOT DISTINCT FROM OLD.due_tz THEN
            RAISE EXCEPTION 'pgwork: % has a local-time deadline; due_at is computed from it', what
                USING ERRCODE = 'check_violation', COLUMN = 'due_at',
                      HINT = 'Update due_local (and due_tz), or set due_local and due_tz to NULL together with due_at.';
        END IF;
        IF NOT EXISTS (SELECT 1 FROM pgwork.time_zone z WHERE z.name = NEW.due_tz) THEN
            RAISE EXCEPTION 'pgwork: % has unknown time zone "%"', what, NEW.due_tz
                USING ERRCODE = 'invalid_parameter_value', COLUMN = 'due_tz',
                      HINT = 'Use an IANA zone name as the server knows it (pgwork.time_zone), e.g. Europe/London or UTC.';
        END IF;
        IF NOT (NEW.due_local > '1970-01-02' AND NEW.due_local < '9998-12-31') THEN
            RAISE EXCEPTION 'pgwork: % has due_local % outside 1970-01-02 .. 9998-12-31', what, NEW.due_local
                USING ERRCODE = 'check_violation', COLUMN = 'due_local';
        END IF;
        NEW.due_at := pgwork.local_to_instant(NEW.due_local, NEW.due_tz);
    ELSIF NEW.due_at IS NULL THEN
        RAISE EXCEPTION 'pgwork: % has no deadline', what
            USING ERRCODE = 'not_null_violation', COLUMN = 'due_at', HINT = 'Set due_at, or due_local and due_tz.';
    END IF;

    -- A series is anchored at its first deadline as local time; its companions need it.
    IF NEW.recur IS NOT NULL AND NEW.due_local IS NULL THEN
        PERFORM pgwork.recur_error(format('%s has recur but no due_local and due_tz', what),
            'A series starts at its first deadline, as local time: set due_local and due_tz (''UTC'' for a series in UTC).',
            'due_local');
    END IF;
    IF NEW.recur IS NULL AND (NEW.recur_until IS NOT NULL OR NEW.recur_skip IS NOT NULL OR NEW.paused) THEN
        PERFORM pgwork.recur_error(format('%s sets %s but has no recur', what,
                                          CASE WHEN NEW.recur_until IS NOT NULL THEN 'recur_until'
                                               WHEN NEW.recur_skip IS NOT NULL THEN 'recur_skip' ELSE 'paused' END),
            'recur_until, recur_skip and paused belong to a recurring reminder (recur).', 'recur');
    END IF;
    IF array_position(NEW.recur_skip, NULL) IS NOT NULL THEN
        PERFORM pgwork.recur_error(format('%s lists NULL in recur_skip', what),
            'recur_skip lists the local deadlines not to send; leave NULL out (NULL or ''{}'' skips none).',
            'recur_skip');
    END IF;
    IF NEW.recur_until < NEW.due_local THEN
        PERFORM pgwork.recur_error(format('%s has recur_until %s before due_local %s', what, NEW.recur_until, NEW.due_local),
            'recur_until is the last local deadline the series may have.', 'recur_until');
    END IF;

    -- The payload, measured as the JSON text a receiver gets (the documented limit; the table
    -- constraint only bounds a row written around this trigger, in its binary form).
    size := octet_length(NEW.payload::text);
    IF size > 65536 THEN
        RAISE EXCEPTION 'pgwork: % has a payload of % bytes; at most 65536 (64 KiB) as JSON text', what, size
            USING ERRCODE = 'check_violation', COLUMN = 'payload';
    END IF;
    IF size > 128 AND NOT pgwork.jsonb_nesting_within(NEW.payload, 64) THEN
        RAISE EXCEPTION 'pgwork: % has a payload nested deeper than 64 levels', what
            USING ERRCODE = 'check_violation', COLUMN = 'payload';
    END IF;

    -- (Re)plan: every occurrence of the current schedule is due for materialisation again; ones
    -- already made for this deadline are kept by ON CONFLICT, ones retention retired by their
    -- tombstones. Ranges and counts are CHECK constraints (cheaper than checking here). A new
    -- channel re-plans too: the unsent rows on the old one are closed (below) and made again on
    -- the new one.
    IF TG_OP = 'INSERT' OR NEW.due_at IS DISTINCT FROM OLD.due_at OR NEW.remind_before IS DISTINCT FROM OLD.remind_before
       OR NEW.channel IS DISTINCT FROM OLD.channel
       OR (NEW.recur IS NOT NULL OR OLD.recur IS NOT NULL)
          AND (NEW.recur IS DISTINCT FROM OLD.recur OR NEW.due_local IS DISTINCT FROM OLD.due_local
               OR NEW.due_tz IS DISTINCT FROM OLD.due_tz OR NEW.recur_until IS DISTINCT FROM OLD.recur_until
               OR NEW.recur_skip IS DISTINCT FROM OLD.recur_skip OR NEW.paused IS DISTINCT FROM OLD.paused) THEN
        -- Exactly {0}: '1 mon -30 days' compares equal to 0 as an interval, so '=' is not enough.
        IF NEW.due_local IS NULL AND cardinality(NEW.remind_before) = 1
           AND array_ndims(NEW.remind_before) = 1 AND NEW.remind_before[1] = '0'
           AND extract(year FROM NEW.remind_before[1]) = 0
           AND extract(month FROM NEW.remind_before[1]) = 0
           AND extract(day FROM NEW.remind_before[1]) = 0 THEN
            NEW.next_fire_at := NULL;  -- the common case: one send, at the deadline (due_at)
        ELSE
            IF array_ndims(NEW.remind_before) > 1 THEN
                RAISE EXCEPTION 'pgwork: % has a remind_before that is not a list of intervals', what
                    USING ERRCODE = 'check_violation', COLUMN = 'remind_before',
                          HINT = 'Write e.g. ''{30 days, 7 days, 0}''.';
            END IF;
            SELECT x INTO bad FROM unnest(NEW.remind_before) AS x
             WHERE extract(year FROM x) < 0 OR extract(month FROM x) < 0 OR extract(day FROM x) < 0
                OR extract(hour FROM x) < 0 OR extract(minute FROM x) < 0 OR extract(second FROM x) < 0
             LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'pgwork: % has remind_before entry "%" with a negative part; it could fire after the deadline', what, bad
                    USING ERRCODE = 'check_violation', COLUMN = 'remind_before',
                          HINT = 'Every part of every entry must be zero or positive, e.g. ''1 mon'' or ''30 days''.';
            END IF;
            IF cardinality(NEW.remind_before) > 1 AND (SELECT count(DISTINCT x) FROM unnest(NEW.remind_before) AS x) <> cardinality(NEW.remind_before) THEN
                RAISE EXCEPTION 'pgwork: % lists the same remind_before entry twice', what
                    USING ERRCODE = 'check_violation', COLUMN = 'remind_before';
            END IF;
            IF NEW.recur IS NULL THEN
                SELECT min(pgwork.fire_at(NEW.due_at, NEW.due_local, NEW.due_tz, x)) INTO NEW.next_fire_at
                  FROM unnest(NEW.remind_before) AS x;
            ELSIF TG_OP = 'UPDATE' AND OLD.recur IS NOT NULL AND NEW.recur = OLD.recur
                  AND NEW.due_at IS NOT DISTINCT FROM OLD.due_at AND NEW.remind_before = OLD.remind_before
                  AND NEW.due_local IS NOT DISTINCT FROM OLD.due_local AND NEW.due_tz IS NOT DISTINCT FROM OLD.due_tz
                  AND NEW.recur_until IS NOT DISTINCT FROM OLD.recur_until
                  AND NEW.recur_skip IS NOT DISTINCT FROM OLD.recur_skip AND NEW.paused = OLD.paused THEN
                -- Only the channel: the schedule is the same series, not restarted. Its unsent
                -- sends on the old channel are closed and its progress rewound to the earliest of
                -- them (reminder_after_reschedule), so the page makes them again on the new one.
                NULL;
            ELSE
                -- A series (re)starts now: its deadlines before now are history, never sent. Its
                -- progress starts at the earliest send a deadline from now can have; the
                -- materialiser's page evaluates the rule from there (nothing is evaluated here).
                NEW.recur_rule := pgwork.recur_compile(NEW.recur, NEW.due_local, NEW.due_tz);
                NEW.recur_version := CASE WHEN TG_OP = 'INSERT' THEN 1 ELSE OLD.recur_version + 1 END;
                NEW.series_from := now();
                NEW.next_fire_at := CASE WHEN NEW.paused THEN 'infinity'
                                         ELSE now() - (SELECT max(x) FROM unnest(NEW.remind_before) AS x) - interval '1 day' END;
            END IF;
        END IF;
        IF NEW.recur IS NULL THEN
            NEW.recur_rule := NULL;
            NEW.series_from := NULL;
        END IF;
        IF TG_OP = 'UPDATE' THEN
            NEW.planned_at := now();  -- what catch_up judges against
        END IF;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        NEW.updated_at := now();
    END IF;
    RETURN NEW;
END
$$;

-- The common insert (an instant deadline, one send at it, a small payload) needs no trigger call
-- at all: its next_fire_at stays NULL, which means due_at. Everything else goes through the
-- function; a payload of 128 bytes or less can be neither too large nor too deep.
CREATE OR REPLACE TRIGGER reminder_before_insert
    BEFORE INSERT ON pgwork.reminder FOR EACH ROW
    WHEN (NEW.due_at IS NULL OR NEW.due_local IS NOT NULL OR NEW.due_tz IS NOT NULL
          -- Compared as text: as intervals, '{1 mon -30 days}' equals '{0}'. (Another
          -- IntervalStyle spells 0 differently and only takes the slower, equally right path.)
          OR NEW.remind_before::text <> '{00:00:00}' OR NEW.next_fire_at IS NOT NULL
          OR octet_length(NEW.payload::text) > 128
          OR NEW.recur IS NOT NULL OR NEW.recur_until IS NOT NULL OR NEW.recur_skip IS NOT NULL OR NEW.paused)
    EXECUTE FUNCTION pgwork.reminder_before_write();
CREATE OR REPLACE TRIGGER reminder_before_update
    BEFORE UPDATE OF source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                     recur, recur_until, recur_skip, paused
    ON pgwork.reminder FOR EACH ROW EXECUTE FUNCTION pgwork.reminder_before_write();

-- Unclaimed work for a schedule that no longer holds is closed at once (pgwork.close_unsent):
-- its ready row (which the claim takes with SKIP LOCKED: an app's open transaction holding it
-- delays no claim) goes, then its record is closed. Work already claimed (a lease row, no ready
-- row) is left alone and re-checked by the claim itself, which re-reads the reminder in the same
-- statement.
CREATE OR REPLACE FUNCTION pgwork.close_unsent(work_ids bigint[], status text)
RETURNS SETOF timestamptz
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- Of the work rows named, those still waiting in work_ready (read by primary key: an id
    -- array) leave it and are closed with this status; returns their due times.
    RETURN QUERY
    WITH unready AS (
        DELETE FROM pgwork.work_ready q
         WHERE q.work_id = ANY (close_unsent.work_ids)
        RETURNING q.work_id
    )
    UPDATE pgwork.renewal_work w
       SET status = close_unsent.status, finished_at = now()
      FROM unready u
     WHERE w.id = u.work_id
    RETURNING w.due_at;
END
$$;
COMMENT ON FUNCTION pgwork.close_unsent(bigint[], text) IS
    'Close the work rows named that no worker holds (their work_ready rows go), returning their due times (the reminder triggers'' only).';
REVOKE EXECUTE ON FUNCTION pgwork.close_unsent(bigint[], text) FROM PUBLIC;

-- Both triggers read the reminder's own rows through work_occurrence_unique, whatever the
-- statistics say: the status is tested with IS NOT DISTINCT FROM (status is NOT NULL, so the same
-- test as =), which the planner cannot match to a partial index's predicate. With '=', statistics
-- taken while little work was live made it add a scan of all of the (then) claim index (a
-- BitmapAnd), and every app's move or delete of a reminder read every live work row of every channel.
CREATE OR REPLACE FUNCTION pgwork.reminder_after_reschedule() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork SET jit = off AS $$
DECLARE
    rewind timestamptz;
BEGIN
    -- An app's edit only ever closes or removes work rows: it never makes a row ready (or
    -- changes a ready one), so it takes no lane lock (pgwork.wake_lanes), which the daemon's
    -- pages, claims and outcome flushes of every source would otherwise wait on until the app's
    -- transaction ends.
    IF NEW.recur_rule IS NULL THEN
        PERFORM pgwork.close_unsent(
            ARRAY(SELECT w.id FROM pgwork.renewal_work w
                   WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
                     AND (w.deadline <> NEW.due_at OR NOT w.occurrence = ANY (NEW.remind_before)
                          OR w.deadline_local IS NOT NULL OR w.channel <> NEW.channel)),
            'superseded');
    ELSE
        -- A new zone moves the instants of the series' local deadlines. Its occurrences made and
        -- never tried (ready, or closed unsent) that move are removed: the next page makes each
        -- again at its new instant, with the same key (its local deadline), if the series still
        -- has it then (a deadline the move put before now is history) and no other row holds
        -- that instant (one send per instant). Kept, they would hold their old instant against
        -- another local deadline that the new zone puts there.
        IF NEW.due_tz IS DISTINCT FROM OLD.due_tz THEN
            -- (A live one only when it is not held: its ready row goes with it.)
            WITH unready AS (
                DELETE FROM pgwork.work_ready q
                 WHERE q.work_id = ANY ((SELECT array_agg(w.id) FROM pgwork.renewal_work w
                                          WHERE w.reminder_id = NEW.id
                                            AND w.status IS NOT DISTINCT FROM 'ready' AND w.attempts = 0
                                            AND w.deadline IS DISTINCT FROM
                                                pgwork.local_to_instant(w.deadline_local, NEW.due_tz))::bigint[])
                RETURNING q.work_id
            )
            DELETE FROM pgwork.renewal_work w
             WHERE w.reminder_id = NEW.id
               AND (coalesce(w.status, '') IN ('superseded', 'expired')
                    OR w.id = ANY ((SELECT coalesce(array_agg(u.work_id), '{}') FROM unready u)::bigint[]))
               AND w.attempts = 0
               AND w.deadline IS DISTINCT FROM pgwork.local_to_instant(w.deadline_local, NEW.due_tz);
        END IF;
        -- Unsent occurrences the series no longer has, those it moves that were tried (waiting
        -- for a retry: they keep their instant, as that send), and those of another channel are
        -- superseded.
        SELECT min(c.due_at) INTO rewind
          FROM pgwork.close_unsent(
                   ARRAY(SELECT w.id FROM pgwork.renewal_work w
                          WHERE w.reminder_id = NEW.id AND w.status IS NOT DISTINCT FROM 'ready'
                            AND (w.deadline IS DISTINCT FROM pgwork.local_to_instant(w.deadline_local, NEW.due_tz)
                                 OR w.channel <> NEW.channel
                                 OR pgwork.series_unwanted(NEW.id, NEW.recur_rule, NEW.due_local, NEW.paused,
                                                           NEW.recur_skip, NEW.recur_until, NEW.remind_before,
                                                           NEW.recur_version, w.deadline_local, w.occurrence,
                                                           NULL) IS NOT NULL)),
                   'superseded') AS c(due_at);
        -- Only the channel changed (the series was not restarted: the same version): what was
        -- closed is wanted still, on the new channel; the page makes it again from there (a send
        -- waiting for a retry goes on; one never tried is judged by the new channel's catch_up).
        IF NEW.recur_version = OLD.recur_version AND NEW.channel IS DISTINCT FROM OLD.channel
           AND rewind < coalesce(NEW.next_fire_at, 'infinity') THEN
            UPDATE pgwork.reminder r SET next_fire_at = rewind WHERE r.id = NEW.id;
        END IF;
    END IF;
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER reminder_after_reschedule
    AFTER UPDATE OF due_at, remind_before, due_local, due_tz, recur, recur_until, recur_skip, paused, channel
    ON pgwork.reminder FOR EACH ROW
    WHEN (OLD.due_at IS DISTINCT FROM NEW.due_at OR OLD.remind_before IS DISTINCT FROM NEW.remind_before
          OR OLD.channel IS DISTINCT FROM NEW.channel
          OR OLD.recur_version IS DISTINCT FROM NEW.recur_version
          OR (OLD.recur_rule IS NULL) <> (NEW.recur_rule IS NULL))
    EXECUTE FUNCTION pgwork.reminder_after_reschedule();

CREATE OR REPLACE FUNCTION pgwork.reminder_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pgwork AS $$
BEGIN
    PERFORM pgwork.close_unsent(
        ARRAY(SELECT w.id FROM pgwork.renewal_work w
               WHERE w.reminder_id = OLD.id AND w.status IS NOT DISTINCT FROM 'ready'),
        'cancelled');
    DELETE FROM pgwork.retired WHERE reminder_id = OLD.id;
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER reminder_after_delete
    AFTER DELETE ON pgwork.reminder FOR EACH ROW EXECUTE FUNCTION pgwork.reminder_after_delete();

-- NOTIFY is a hint: only for a written reminder that fires within the next hour (the longest
-- look-ahead a daemon may use), so a bulk insert of far-future deadlines costs no notification
-- (the WHEN clause is evaluated without calling any function). Postgres folds identical
-- notifications of one transaction into one. The materialiser's own updates (next_fire_at only)
-- do not fire it.
CREATE OR REPLACE FUNCTION pgwork.reminder_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pgwork_reminder', '');
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER reminder_notify
    AFTER INSERT OR UPDATE OF due_at, due_local, due_tz, remind_before, recur, recur_until, recur_skip, paused, channel
    ON pgwork.reminder
    FOR EACH ROW WHEN (coalesce(NEW.next_fire_at, NEW.due_at) <= now() + interval '1 hour')
    EXECUTE FUNCTION pgwork.reminder_notify();
-- pgwork/sql/code/channel_control.sql — Channel control for operators: pause and resume, honoured by every daemon.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

CREATE OR REPLACE FUNCTION pgwork.pause_channel(channel_name text, reason text DEFAULT NULL, actor text DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
-- Pause a channel: every daemon stops claiming its work at once (a NOTIFY tells them) and gives
-- back rows it claimed but has not started. Returns false when it was already paused.
BEGIN
    UPDATE pgwork.channel
       SET paused = true, paused_at = now(), paused_by = coalesce(actor, session_user), paused_reason = reason
     WHERE name = channel_name AND NOT paused;
    IF FOUND THEN
        PERFORM pg_notify('pgwork_channel', channel_name);
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pgwork.channel WHERE name = channel_name) THEN
        RAISE EXCEPTION 'pgwork: no channel named "%"', channel_name
            USING ERRCODE = 'no_data_found', HINT = 'SELECT name FROM pgwork.channel lists them.';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pgwork.pause_channel(text, text, text) IS
    'Pause a channel (its work waits; nothing is dropped or counted). Returns false if already paused.';

CREATE OR REPLACE FUNCTION pgwork.resume_channel(channel_name text, actor text DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
-- Resume a paused channel, and lift a throttle: the operator says the receiver is ready.
-- Returns false when it was neither paused nor throttled.
BEGIN
    UPDATE pgwork.channel
       SET paused = false, paused_at = now(), paused_by = coalesce(actor, session_user), paused_reason = NULL,
           not_before = NULL, throttle_limit = NULL, throttle_from = NULL, throttle_reason = NULL
     WHERE name = channel_name AND (paused OR not_before IS NOT NULL OR throttle_limit IS NOT NULL);
    IF FOUND THEN
        PERFORM pg_notify('pgwork_channel', channel_name);
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pgwork.channel WHERE name = channel_name) THEN
        RAISE EXCEPTION 'pgwork: no channel named "%"', channel_name
            USING ERRCODE = 'no_data_found', HINT = 'SELECT name FROM pgwork.channel lists them.';
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pgwork.resume_channel(text, text) IS
    'Resume a paused channel and lift any throttle. Returns false if it was neither.';
-- pgwork/sql/code/tenancy.sql — Many apps, one database: row-level security by source (off until an operator enables it).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- Who row-level security does not restrict: a superuser or BYPASSRLS role, the tables' owner and
-- its members, and members of pgwork_daemon or pgwork_cleanup. It reads only what pg_roles and
-- pg_has_role show any role, runs with the caller's rights, and the policies call it in a scalar
-- subquery: an InitPlan, evaluated once per statement, never per row.
CREATE OR REPLACE FUNCTION pgwork.rls_exempt() RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce((SELECT r.rolsuper OR r.rolbypassrls FROM pg_catalog.pg_roles r WHERE r.rolname = current_user), false)
    OR pg_catalog.pg_has_role(current_user,
                              (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = 'pgwork.reminder'::regclass),
                              'MEMBER')
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
                WHERE r.rolname IN ('pgwork_daemon', 'pgwork_cleanup')
                  AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER'));
COMMENT ON FUNCTION pgwork.rls_exempt() IS
    'Whether the current role sees every source: a superuser or BYPASSRLS role, the tables'' owner, '
    'or a member of pgwork_daemon or pgwork_cleanup.';

-- An app reads its own rows of app_source (the policy below needs them), nobody else's.
DROP POLICY IF EXISTS app_source_own ON pgwork.app_source;
CREATE POLICY app_source_own ON pgwork.app_source
    USING (role = current_user OR (SELECT pgwork.rls_exempt()));

-- Both tests are uncorrelated scalar subqueries: evaluated once per statement (InitPlans), so
-- the daemon pays nothing per row, and an app's list of sources is read once, not per row.
DROP POLICY IF EXISTS reminder_by_source ON pgwork.reminder;
CREATE POLICY reminder_by_source ON pgwork.reminder
    USING ((SELECT pgwork.rls_exempt())
           OR source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]))
    WITH CHECK ((SELECT pgwork.rls_exempt())
                OR source = ANY ((SELECT array_agg(a.source) FROM pgwork.app_source a WHERE a.role = current_user)::text[]));
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
-- pgwork/sql/code/series.sql — The materialiser's series: a page's recurring reminders made into work, within a budget.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- The latest send of a series that fired before planned_at: what catch_up = latest keeps of the
-- sends that fell before the series was written or edited (the page's share of a series may end
-- before planned_at, so the page cannot see it among its own sends). For each remind_before
-- entry, the last deadline (not before series_from, not skipped, not past the end) whose send
-- fired before planned_at, searched backwards from planned_at in windows that double from a day:
-- a dense rule costs a day's deadlines, a sparse one a few windows. NULL: none.
CREATE OR REPLACE FUNCTION pgwork.series_latest_missed(rule jsonb, due_local timestamp, tz text, remind_before interval[],
                                           recur_skip timestamp[], recur_until timestamp,
                                           series_from timestamptz, planned_at timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE PARALLEL SAFE SET jit = off AS $$
DECLARE
    b       interval;
    best    timestamptz;
    got     timestamptz;
    hi      timestamp;
    size    interval;
    floor_l timestamp := (series_from AT TIME ZONE tz) - interval '1 day';
BEGIN
    FOREACH b IN ARRAY remind_before LOOP
        hi := (planned_at AT TIME ZONE tz) + b + interval '1 day';
        size := interval '1 day';
        got := NULL;
        WHILE got IS NULL AND hi >= floor_l LOOP
            SELECT max(f.fire) INTO got
              FROM (SELECT pgwork.fire_at(pgwork.local_to_instant(x.dl, tz), x.dl, tz, b) AS fire
                      FROM pgwork.recur_between(rule, due_local, greatest(hi - size, floor_l), hi) AS x(dl)
                     WHERE x.dl <> ALL (coalesce(recur_skip, '{}'))
                       AND (recur_until IS NULL OR x.dl <= recur_until)
                       AND pgwork.local_to_instant(x.dl, tz) >= series_from) AS f
             WHERE f.fire < planned_at;
            hi := hi - size - interval '1 microsecond';
            size := least(size * 2, interval '4 years');
        END LOOP;
        best := greatest(best, got);
    END LOOP;
    RETURN best;
END
$$;
COMMENT ON FUNCTION pgwork.series_latest_missed(jsonb, timestamp, text, interval[], timestamp[], timestamp, timestamptz, timestamptz) IS
    'The latest send of a recurring reminder that fired before planned_at (what catch_up = latest keeps).';

-- A page's recurring reminders (series), called by the page only when it has one (so the plan of
-- the one-off path stays what it was): for each, the sends that fall between its progress and
-- the cutoff, judged by the channel's catch_up, inserted keyed by their local deadline; returns
-- each reminder's new progress and what was made. Runs inside the page's statement and
-- transaction (the reminders are locked by it); never claims (a series' occurrence due now is
-- claimed by the next claim, one hop later).
--
-- Its work is bounded whatever a rule asks for. Deadlines are evaluated per remind_before entry,
-- in a window as wide as the page's span of fire time (plus a day each side for DST, and a probe
-- for the next deadline), never across the spread of the entries (sends a year ahead of their
-- deadlines cost no more than sends at them). And a series makes at most its share of the page
-- (budget sends, shared by the page's series, at least 16): when it could make more before the
-- cutoff (a dense rule, catch_up = all over a long past), the page goes only as far in fire time
-- as its share reaches, and leaves its progress there (unfinished): the next passes go on from
-- it, while every other reminder is served in each pass as usual.
CREATE OR REPLACE FUNCTION pgwork.materialise_series(ids bigint[], cutoff timestamptz, budget integer)
RETURNS TABLE (id bigint, next_fire_at timestamptz, made bigint, made_due bigint, skipped bigint,
               made_ready bigint, earliest_made timestamptz, unfinished boolean)
-- Every table it reads is read by key (a reminder by id, a tombstone or a work row by its
-- reminder's key): no sequential scan, whatever the statistics say. Taken while renewal_work was
-- empty, they made the probe for other local deadlines on the same instant a scan of the whole
-- table, once per occurrence made (tests/test_series.py::
-- test_a_series_page_probes_by_key_whatever_the_statistics_say).
LANGUAGE plpgsql VOLATILE SET jit = off SET enable_seqscan = off SET enable_nestloop = off AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT r.id, r.source, r.business_key, r.due_local, r.due_tz, r.remind_before, r.channel,
               r.next_fire_at, greatest(coalesce(r.planned_at, r.created_at), r.series_from) AS planned_at,
               r.traceparent, r.tracestate, r.recur_rule, r.recur_skip, r.recur_until, r.series_from,
               r.recur_version, materialise_series.cutoff AS cutoff, ch.catch_up,
               least(coalesce((r.recur_rule->>'until')::timestamp, 'infinity'),
                     coalesce(r.recur_until, 'infinity')) AS last_local,
               (r.recur_rule->>'interval')::integer
                 * CASE r.recur_rule->>'freq' WHEN 'DAILY' THEN interval '2 days' WHEN 'WEEKLY' THEN interval '8 days'
                                              WHEN 'MONTHLY' THEN interval '32 days' ELSE interval '367 days' END AS span,
               greatest(16, materialise_series.budget / cardinality(materialise_series.ids))::float8 AS share,
               -- Its rule's deadlines a day at most, and times of day (inlined: expressions only).
               pgwork.recur_density(r.recur_rule) AS density, pgwork.recur_times(r.recur_rule) AS times
          FROM pgwork.reminder r
          LEFT JOIN pgwork.channel ch ON ch.name = r.channel
         WHERE r.id = ANY (materialise_series.ids) AND r.recur_rule IS NOT NULL
    ), reach AS MATERIALIZED (
        -- How far in fire time this page goes for a series (upto): to the cutoff, or as far as
        -- its share of sends reaches at the rule's density, when that is short of the cutoff.
        -- Only the entries whose sends can fall in the range count (a send is never more than a
        -- day, for DST, before its deadline minus its entry, and no deadline is before the
        -- series' start): long before the start, only the longest entries have sends. The probe
        -- past the cutoff looks for the next deadline: a period of the rule (which has one then
        -- if it has one every period), two days for a rule with many times a day.
        SELECT d.*, s.step, d.next_fire_at + s.step < d.cutoff AS unfinished,
               least(d.cutoff, d.next_fire_at + s.step) AS upto,
               least(d.span, greatest(interval '2 days', make_interval(days => 1440 / d.times))) AS probe,
               CASE WHEN d.catch_up = 'latest' AND d.next_fire_at < d.planned_at
                    THEN pgwork.series_latest_missed(d.recur_rule, d.due_local, d.due_tz, d.remind_before,
                                                     d.recur_skip, d.recur_until, d.series_from, d.planned_at)
               END AS latest_missed
          FROM due d
         CROSS JOIN LATERAL (SELECT make_interval(secs => 86400.0 * d.share / d.density) AS one) AS o
         CROSS JOIN LATERAL (
               SELECT CASE WHEN d.next_fire_at + o.one / cardinality(d.remind_before) >= d.cutoff
                           THEN o.one  -- not short of the cutoff, whichever entries count
                           ELSE o.one / greatest(1, (SELECT count(*) FROM unnest(d.remind_before) AS b(before)
                                                      WHERE d.series_from - b.before - interval '1 day'
                                                            < d.next_fire_at + o.one)) END AS step) AS s
    ), windows AS MATERIALIZED (
        -- The local deadlines whose sends may fall between the series' progress (never before its
        -- start) and upto, and the probe when the page goes to the cutoff: one window for all its
        -- remind_before entries when they lie close together (no further apart than the probe:
        -- rent's {7 days, 0}), so each deadline is evaluated once; one per entry when they are
        -- far apart, so that sends a year ahead of their deadlines cost no more than sends at
        -- them. A local time and the instant it becomes differ from a plain shift by the zone's
        -- offset changes near it (pgwork.offset_shift: none, most of the year), so the window
        -- reaches that much (and a minute) past the sends' span, not a day each side: a series
        -- every minute evaluated 2,880 deadlines a window for a share of 16. Past hi_main, the
        -- probe needs the first deadline only (the one after it sends later), unless an offset
        -- change is near or the probe is long: then the whole probe, as the order of local times
        -- may not hold (a DST gap shifts a time forward past the next).
        SELECT r.id, r.recur_rule, r.due_local, r.due_tz, e.befores, e.longest, r.recur_skip, r.series_from,
               r.last_local,
               greatest((r.next_fire_at AT TIME ZONE r.due_tz) + e.shortest
                          - pgwork.offset_shift(r.due_tz, r.next_fire_at),
                        (r.series_from AT TIME ZONE r.due_tz) - pgwork.offset_shift(r.due_tz, r.series_from))
                 - interval '1 minute' AS lo,
               (r.upto AT TIME ZONE r.due_tz) + e.longest + pgwork.offset_shift(r.due_tz, r.upto)
                 + interval '1 minute' AS hi_main,
               (r.upto AT TIME ZONE r.due_tz) + e.longest + pgwork.offset_shift(r.due_tz, r.upto)
                 + interval '1 minute' + CASE WHEN r.unfinished THEN interval '0' ELSE r.probe END AS hi,
               -- The probe's order holds with no offset change where its sends fall (a dense
               -- rule's probe: two days at most, and its entries as far apart at most).
               NOT r.unfinished AND r.probe <= interval '2 days'
                 AND pgwork.offset_shift(r.due_tz, r.upto) = '0'
                 AND pgwork.offset_shift(r.due_tz, r.upto + interval '48 hours') = '0'
                 AND pgwork.offset_shift(r.due_tz, r.upto + interval '96 hours') = '0' AS probe_first
          FROM reach r
         CROSS JOIN LATERAL (SELECT min(x) AS shortest, max(x) AS longest FROM unnest(r.remind_before) AS x) AS m
         CROSS JOIN LATERAL (
               SELECT r.remind_before AS befores, m.shortest, m.longest
                WHERE m.longest - m.shortest <= r.probe
               UNION ALL
               SELECT ARRAY[x], x, x
                 FROM unnest(r.remind_before) AS x
                WHERE m.longest - m.shortest > r.probe) AS e
    ), keyed AS MATERIALIZED (
        -- What a window's deadlines depend on. With INTERVAL=1 and a window after the first
        -- deadline, the first deadline does not matter (every period is kept; the rule's parts
        -- were completed from it when it was compiled): the key says so with -infinity, and such
        -- series of one rule, one zone, one window and its entries share one evaluation below.
        SELECT w.id, w.recur_rule, w.due_tz, w.befores, w.lo, least(w.hi, w.last_local) AS hi,
               least(w.hi_main, w.last_local) AS hi_main, w.probe_first, w.recur_skip, w.series_from,
               CASE WHEN (w.recur_rule->>'interval')::integer = 1 AND w.lo >= w.due_local
                    THEN '-infinity' ELSE w.due_local END AS anchor
          FROM windows w
    ), evaluated AS MATERIALIZED (
        -- Each distinct window's deadlines, each as an instant (pgwork.local_to_instant), with the
        -- instants of its entries' sends (in the order of befores): on rent day, a million series
        -- of "the 1st at 09:00 Berlin" cost one evaluation per page.
        -- Past hi_main, only the probe's first deadline when its order holds (probe_first).
        SELECT e.recur_rule, e.due_tz, e.lo, e.hi, e.hi_main, e.probe_first, e.anchor, e.befores, x.dl, x.deadline_at,
               ARRAY(SELECT pgwork.fire_at(x.deadline_at, x.dl, e.due_tz, b.before)
                       FROM unnest(e.befores) WITH ORDINALITY AS b(before, i) ORDER BY b.i) AS fire_ats
          FROM (SELECT DISTINCT k.recur_rule, k.due_tz, k.lo, k.hi, k.hi_main, k.probe_first, k.anchor, k.befores
                  FROM keyed k) AS e
         CROSS JOIN LATERAL (
               SELECT r.dl, pgwork.local_to_instant(r.dl, e.due_tz) AS deadline_at
                 FROM (SELECT d.dl
                         FROM pgwork.recur_between(e.recur_rule, CASE WHEN e.anchor = '-infinity' THEN e.lo ELSE e.anchor END,
                                                   e.lo, least(e.hi_main, e.hi)) AS d(dl)
                       UNION ALL
                       (SELECT d.dl
                          FROM pgwork.recur_between(e.recur_rule, CASE WHEN e.anchor = '-infinity' THEN e.lo ELSE e.anchor END,
                                                    e.lo, e.hi) AS d(dl)
                         WHERE d.dl > e.hi_main
                         ORDER BY d.dl
                         LIMIT CASE WHEN e.probe_first THEN 1 END)) AS r) AS x
    ), deadlines AS MATERIALIZED (
        -- Its deadlines in the window, without the skipped ones and the history before the
        -- series' start; two deadlines on one instant (a time shifted by a DST gap onto another
        -- of the series) are one: the one not shifted. (No join with due here: estimated at a
        -- few rows, it was made a nested loop, a page's series times its deadlines.)
        SELECT DISTINCT ON (k.id, k.befores, e.deadline_at) k.id, k.befores, e.dl, e.deadline_at, e.fire_ats
          FROM keyed k
          JOIN evaluated e
            ON e.recur_rule = k.recur_rule AND e.due_tz = k.due_tz AND e.lo = k.lo AND e.hi = k.hi
           AND e.hi_main = k.hi_main AND e.probe_first = k.probe_first
           AND e.anchor = k.anchor AND e.befores = k.befores
         WHERE e.dl <> ALL (coalesce(k.recur_skip, '{}')) AND e.deadline_at >= k.series_from
         ORDER BY k.id, k.befores, e.deadline_at, (e.deadline_at AT TIME ZONE k.due_tz) <> e.dl, e.dl
    ), occ AS MATERIALIZED (
        -- Each deadline x remind_before entry; the channel's catch_up judges the sends that fired
        -- before the series was written or last edited (never a deadline before it: history).
        SELECT r.id, r.source, r.business_key, k.deadline_at AS due_at, r.channel, b.before,
               r.next_fire_at AS progress, b.fire_at, r.planned_at, r.cutoff, r.upto, r.unfinished,
               r.traceparent, r.tracestate, k.dl, r.recur_version, r.catch_up,
               pgwork.skipped_by_catch_up(r.catch_up, b.fire_at, r.planned_at,
                                          CASE WHEN r.catch_up = 'latest' THEN r.latest_missed END) AS skip
          FROM deadlines k
          JOIN reach r ON r.id = k.id
         CROSS JOIN LATERAL unnest(k.befores, k.fire_ats) AS b(before, fire_at)
    ), made AS (
        -- A series' occurrences, identified by their local deadline (work_series_occurrence_unique),
        -- so a zone edit or a time zone data update never makes a second one. A tombstone of the
        -- same local deadline stops it, and so does a row of another local deadline on the same
        -- instant (the same send, made before an edit). An occurrence an edit superseded is made
        -- again (its instant may have moved), on the reminder's channel now; one waiting for a
        -- retry keeps its retry time, and is never closed by catch_up (that send goes on).
        INSERT INTO pgwork.renewal_work AS w
               (reminder_id, source, business_key, deadline, occurrence, due_at, channel, operation_id,
                available_at, status, finished_at, last_error, traceparent, tracestate,
                deadline_local, recur_version)
        SELECT o.id, o.source, o.business_key, o.due_at, o.before, o.fire_at, o.channel,
               pgwork.series_operation_id(o.id, o.source, o.business_key, o.dl, o.before),
               o.fire_at,
               CASE WHEN o.skip THEN 'expired' ELSE 'ready' END,
               CASE WHEN o.skip THEN now() END,
               CASE WHEN o.skip THEN format('skipped by catch_up = %s: due %s, before its series was written or edited (%s)',
                                           o.catch_up, o.fire_at, o.planned_at) END,
               o.traceparent, o.tracestate,
               o.dl, o.recur_version
          FROM occ o
         WHERE o.fire_at >= o.progress
           AND CASE WHEN o.unfinished THEN o.fire_at < o.upto ELSE o.fire_at <= o.cutoff END
           AND (SELECT true FROM pgwork.retired t
                 WHERE t.reminder_id = o.id AND t.deadline_local = o.dl AND t.occurrence = o.before
                 LIMIT 1) IS NULL
           AND (SELECT true FROM pgwork.renewal_work x
                 WHERE x.reminder_id = o.id AND x.deadline = o.due_at AND x.occurrence = o.before
                   AND x.deadline_local IS DISTINCT FROM o.dl
                 LIMIT 1) IS NULL
            ON CONFLICT (reminder_id, deadline_local, occurrence) WHERE deadline_local IS NOT NULL DO UPDATE
           SET status = CASE WHEN w.attempts > 0 THEN 'ready' ELSE excluded.status END,
               available_at = CASE WHEN w.attempts > 0
                                   THEN greatest(w.available_at, excluded.available_at)
                                   ELSE excluded.available_at END,
               finished_at = CASE WHEN w.attempts > 0 THEN NULL ELSE excluded.finished_at END,
               last_error = CASE WHEN w.attempts > 0 THEN w.last_error ELSE excluded.last_error END,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate, channel = excluded.channel,
               deadline = excluded.deadline, due_at = excluded.due_at, recur_version = excluded.recur_version
         WHERE w.status = 'superseded'
        RETURNING w.id, w.reminder_id, w.status, w.due_at, w.channel, w.source, w.available_at
    ), queued AS (
        -- The rows made ready, in the claim's order (pgwork.wake_lanes wakes their lanes).
        INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
        SELECT m.id, m.channel, m.source, m.available_at, m.due_at FROM made m WHERE m.status = 'ready'
    ), nxt AS (
        -- Unfinished: its progress is how far the page went. Else its first send past the
        -- cutoff in the windows, but never later than the earliest send of a deadline past a
        -- window (not looked at yet), less a day for DST; with nothing in the windows, that
        -- bound is a probe. 'infinity' once every window reached the series' end.
        SELECT r.id, r.unfinished,
               CASE WHEN r.unfinished THEN r.upto
                    WHEN b.ended THEN coalesce(f.next_at, 'infinity')
                    ELSE least(f.next_at, b.bound) END AS next_fire_at
          FROM reach r
          JOIN (SELECT w.id, bool_and(w.hi >= w.last_local) AS ended,
                       min(pgwork.local_to_instant(w.hi - w.longest, w.due_tz)) - interval '1 day' AS bound
                  FROM windows w
                 GROUP BY w.id) AS b ON b.id = r.id
          LEFT JOIN (SELECT o.id, min(o.fire_at) FILTER (WHERE o.fire_at > o.cutoff) AS next_at
                       FROM occ o
                      GROUP BY o.id) AS f ON f.id = r.id
    )
    SELECT n.id, n.next_fire_at,
           count(m.reminder_id),
           count(m.reminder_id) FILTER (WHERE m.due_at <= now() AND m.status = 'ready'),
           count(m.reminder_id) FILTER (WHERE m.status = 'expired'),
           count(m.reminder_id) FILTER (WHERE m.status = 'ready'),
           min(m.due_at),
           n.unfinished
      FROM nxt n
      LEFT JOIN made m ON m.reminder_id = n.id
     GROUP BY n.id, n.next_fire_at, n.unfinished;
END
$$;
COMMENT ON FUNCTION pgwork.materialise_series(bigint[], timestamptz, integer) IS
    'The materialiser''s page for its recurring reminders (called by materialise_page only).';
REVOKE EXECUTE ON FUNCTION pgwork.materialise_series FROM PUBLIC;
-- pgwork/sql/code/page.sql — The materialiser's page: one call makes the due work rows and claims what the daemons asked for.
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.

-- One page of the materialiser, as two statements run here, so that the daemon sends one:
--
-- 1. The materialiser's coordination lock: the row lock of pgwork.materialiser_state, which no
--    app role can take (locking a row needs UPDATE on its table), unlike an advisory lock, whose
--    key any session can hold. Taken in a statement of its own, before the page's: this function
--    is VOLATILE, so each statement takes a new snapshot (READ COMMITTED), and the page's is
--    younger than any retention batch that retired work rows (retention takes the same row
--    exclusively): a page can never miss a tombstone and re-insert an occurrence already sent.
--    With coordinate, only one materialiser pages at a time (the others get no row and retry
--    shortly); without (tests racing two passes), materialisers share the lock. Without the
--    lock, the function returns no row.
--
-- 2. One keyset page of reminders with an occurrence firing at or before the cutoff: insert
--    their work rows, advance each reminder's next_fire_at past the cutoff ('infinity' when
--    nothing is left), and NOTIFY the workers of every daemon when it made rows left for a
--    claim (ready: due now, or later, which their claim timers must learn of; the payload names
--    the daemon whose materialiser made them: its own workers know already). Rows the page
--    claimed or closed as expired are no other daemon's business: told of them, every other
--    daemon would run a claim that finds nothing, once per reminder due now. Only occurrences
--    at or after the reminder's progress (next_fire_at) are inserted, and never one that
--    retention retired: an occurrence is materialised once per deadline, whatever retention
--    deleted since. A repeat is a no-op; a superseded row for the same deadline is revived
--    because the deadline came back.
--    Reminders locked by an app's transaction are skipped (their progress is unchanged, so the
--    next pass takes them); the caller sees that in next_fire_at. So are those in aside: the
--    daemon sets aside a reminder a page failed on, for a while, so that the others go on.
--    One hop for work due now: up to room occurrences due now of each of the daemon's channels
--    in take (those with idle workers: [{"channel", "room", "expire_after_s"}, ...]) are
--    inserted already claimed, under a lease for daemon_id, as the claim would (a work_lease
--    row with lease and attempts 1; the record keeps 0, the last settled). Only for a channel whose gate is open and that has nothing to count (no rate
--    limit, global concurrency or throttle limit: their claims go through claim_work) and for
--    an occurrence not past its expire_after; the others are inserted ready.
--    A series makes at most its share of the page (pgwork.materialise_series): unfinished
--    counts those whose progress the page left short of the cutoff, for the next pass.
--    It returns the page's figures on every row, with the rows it inserted claimed, one per
--    row, as claim_work returns them (pgwork.claimed; a page that claimed none returns one row
--    whose claimed is NULL).
--
-- The page commits without waiting for the WAL flush: one lost in a crash is redone by the next
-- pass (the progress is in the same transaction), and work due now reaches a worker one disk
-- flush sooner. It always runs its generic plan: with many reminders the planner judged it worse
-- than a custom one (it cannot see the cutoff) and planned the page again on every pass, 1.4 ms
-- of a 7 ms idle latency with a million far-future reminders; the page reads its index in key
-- order up to a LIMIT either way. And it never scans a table: every row it reads, it reads by
-- key (reminders through their index, by ctid once locked; work rows and tombstones by their
-- keys), whatever the statistics said when its plan was made. A plan made while the tables were
-- empty or small, and kept, advanced the page's reminders by a sequential scan of all of them
-- on every pass (tests/test_hot_path.py::test_a_page_planned_on_empty_tables_reads_by_key).
-- The three settings are transaction-local.
CREATE OR REPLACE FUNCTION pgwork.materialise_page(
    coordinate boolean, cutoff_at timestamptz, lookahead interval, after_at timestamptz,
    after_id bigint, page_limit integer, origin text, take jsonb, claim_lease interval,
    daemon_id text, aside bigint[])
RETURNS TABLE (
    cutoff timestamptz, scanned bigint, made bigint, made_due bigint, skipped bigint,
    notified bigint, earliest_made timestamptz, last_at timestamptz, last_id bigint,
    unfinished bigint, claimed pgwork.claimed)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    got boolean;
    cut timestamptz;
    -- Fair turns (see below): the page's reminders (their row versions), and where its cursor
    -- moves.
    fair tid[];
    fair_at timestamptz;
    fair_id bigint;
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
            set_config('plan_cache_mode', 'force_generic_plan', true),
            set_config('enable_seqscan', 'off', true);
    got := CASE WHEN materialise_page.coordinate
                THEN (SELECT true FROM pgwork.materialiser_state FOR UPDATE SKIP LOCKED) IS NOT NULL
                ELSE (SELECT true FROM pgwork.materialiser_state FOR SHARE) IS NOT NULL END;
    IF NOT got THEN
        RETURN;
    END IF;
    cut := coalesce(materialise_page.cutoff_at, now() + materialise_page.lookahead);
    -- Fair turns. A page takes the due reminders in due order; when more are due after the
    -- cursor than it can take (one app's flood, a catch-up), that order would make every other
    -- source's reminders wait behind them. Such a page serves each source with due reminders
    -- in turn instead: half the page goes to every such source's earliest ones (its share: that
    -- half over their number, at least one), the rest to due order, which moves the cursor
    -- (the rows served out of order leave the due set as they are made). Sources are found by
    -- a skip scan of reminder_due_by_source, a probe or two per source: only for a page that is
    -- full, never for an idle one. A page of one reminder (bisecting a failed page) is in due
    -- order. The page takes the rows chosen by their row versions (a TID scan, whatever the
    -- statistics said when its plan was made: by id, a plan made while the table was empty read
    -- a whole index per page, 6 s with 200,000 reminders on PostgreSQL 15); one an app changed
    -- meanwhile is left for the next page.
    IF materialise_page.page_limit > 1
       AND (SELECT count(*) FROM (
                SELECT FROM pgwork.reminder r
                 WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                   AND coalesce(r.next_fire_at, r.due_at) <= cut
                   AND (coalesce(r.next_fire_at, r.due_at), r.id)
                       > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                   AND NOT r.id = ANY (materialise_page.aside)
                 ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                 LIMIT materialise_page.page_limit + 1) AS c) > materialise_page.page_limit THEN
        WITH RECURSIVE src AS (
            (SELECT r.source FROM pgwork.reminder r
              WHERE r.next_fire_at IS NULL OR r.next_fire_at < 'infinity'
              ORDER BY r.source LIMIT 1)
            UNION ALL
            SELECT (SELECT r.source FROM pgwork.reminder r
                     WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity') AND r.source > s.source
                     ORDER BY r.source LIMIT 1)
              FROM src s
             WHERE s.source IS NOT NULL
        ), due_src AS MATERIALIZED (
            -- A probe per source (a scalar subquery with LIMIT, not EXISTS, which a plan made
            -- on stale statistics turned into a hash of every due reminder, on every page).
            SELECT s.source
              FROM src s
             WHERE s.source IS NOT NULL
               AND (SELECT true FROM pgwork.reminder r
                     WHERE r.source = s.source
                       AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                       AND coalesce(r.next_fire_at, r.due_at) <= cut
                       AND (coalesce(r.next_fire_at, r.due_at), r.id)
                           > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                       AND NOT r.id = ANY (materialise_page.aside)
                     ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                     LIMIT 1) IS NOT NULL
        ), share AS MATERIALIZED (
            SELECT greatest(1, (materialise_page.page_limit / 2) / count(*))::int AS n, count(*) AS sources
              FROM due_src
        ), picks AS MATERIALIZED (
            SELECT p.id, p.row_ctid
              FROM due_src s
             CROSS JOIN share h
             CROSS JOIN LATERAL (
                   SELECT r.id, r.ctid AS row_ctid, coalesce(r.next_fire_at, r.due_at) AS at
                     FROM pgwork.reminder r
                    WHERE r.source = s.source
                      AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                      AND coalesce(r.next_fire_at, r.due_at) <= cut
                      AND (coalesce(r.next_fire_at, r.due_at), r.id)
                          > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                      AND NOT r.id = ANY (materialise_page.aside)
                    ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                    LIMIT h.n) AS p
             WHERE h.sources > 1
             ORDER BY p.at, p.id
             LIMIT materialise_page.page_limit / 2
        ), fill AS MATERIALIZED (
            SELECT r.id, r.ctid AS row_ctid, coalesce(r.next_fire_at, r.due_at) AS at
              FROM pgwork.reminder r
             WHERE (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
               AND coalesce(r.next_fire_at, r.due_at) <= cut
               AND (coalesce(r.next_fire_at, r.due_at), r.id)
                   > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
               AND NOT r.id = ANY (materialise_page.aside)
               AND NOT r.id = ANY ((SELECT coalesce(array_agg(k.id), '{}') FROM picks k)::bigint[])
             ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
             LIMIT materialise_page.page_limit - (SELECT count(*) FROM picks)
        )
        SELECT (SELECT array_agg(k.row_ctid) FROM picks k) || (SELECT array_agg(f.row_ctid) FROM fill f),
               l.at, l.id
          INTO fair, fair_at, fair_id
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (SELECT f.at, f.id FROM fill f ORDER BY f.at DESC, f.id DESC LIMIT 1) AS l ON true
         WHERE (SELECT count(*) FROM picks) > 0;
    END IF;
    RETURN QUERY
    WITH params AS MATERIALIZED (
        -- The first page of a pass fixes the cutoff; later pages pass it back.
        SELECT cut AS cutoff
    ), due AS MATERIALIZED (
        SELECT *
          FROM (SELECT r.ctid AS row_ctid, r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz,
                       r.remind_before, r.channel, coalesce(r.next_fire_at, r.due_at) AS next_fire_at,
                       coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate,
                       r.series_from
                  FROM pgwork.reminder r
                 WHERE fair IS NULL
                   AND (r.next_fire_at IS NULL OR r.next_fire_at < 'infinity')
                   AND coalesce(r.next_fire_at, r.due_at) <= cut
                   AND (coalesce(r.next_fire_at, r.due_at), r.id)
                       > (coalesce(materialise_page.after_at, '-infinity'), materialise_page.after_id)
                   AND NOT r.id = ANY (materialise_page.aside)
                 ORDER BY coalesce(r.next_fire_at, r.due_at), r.id
                 LIMIT materialise_page.page_limit
                   FOR UPDATE OF r SKIP LOCKED) AS in_order
        UNION ALL
        -- Only the row versions in the inner query: a TID scan is then its one plan (with
        -- sequential scans off); whether each is still due is checked on the version it locked.
        SELECT t.row_ctid, t.id, t.source, t.business_key, t.due_at, t.due_local, t.due_tz,
               t.remind_before, t.channel, coalesce(t.next_fire_at, t.due_at), t.planned_at,
               t.traceparent, t.tracestate, t.series_from
          FROM (SELECT r.ctid AS row_ctid, r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz,
                       r.remind_before, r.channel, r.next_fire_at,
                       coalesce(r.planned_at, r.created_at) AS planned_at, r.traceparent, r.tracestate,
                       r.series_from
                  FROM pgwork.reminder r
                 WHERE fair IS NOT NULL AND r.ctid = ANY (fair)
                OFFSET 0  -- a fence: no qual of the outer query is pushed into this one
                   FOR UPDATE OF r SKIP LOCKED) AS t
         WHERE (t.next_fire_at IS NULL OR t.next_fire_at < 'infinity')
           AND coalesce(t.next_fire_at, t.due_at) <= cut
    ), fires AS MATERIALIZED (
        SELECT d.id, d.source, d.business_key, d.due_at, d.channel, b.before, d.next_fire_at AS progress,
               pgwork.fire_at(d.due_at, d.due_local, d.due_tz, b.before) AS fire_at,
               d.planned_at, (SELECT p.cutoff FROM params p) AS cutoff, d.traceparent, d.tracestate
          FROM due d
         CROSS JOIN LATERAL unnest(d.remind_before) AS b(before)
         WHERE d.series_from IS NULL
    ), series AS MATERIALIZED (
        -- Recurring reminders are made by pgwork.materialise_series, called only when the page
        -- has one (the one-off path's plan stays as small as it was).
        SELECT s.*
          FROM (SELECT array_agg(d.id) AS ids FROM due d WHERE d.series_from IS NOT NULL) AS a
         CROSS JOIN LATERAL pgwork.materialise_series(a.ids, (SELECT p.cutoff FROM params p),
                                                      materialise_page.page_limit) AS s
         WHERE a.ids IS NOT NULL
    ), occ AS MATERIALIZED (
        -- The channel's catch_up policy for occurrences that fired before the schedule was
        -- written: all are sent; latest: only the most recent of them; none: none. The others
        -- are closed as expired, with the reason.
        SELECT f.*,
               pgwork.skipped_by_catch_up(ch.catch_up, f.fire_at, f.planned_at,
                                          max(f.fire_at) FILTER (WHERE f.fire_at < f.planned_at)
                                              OVER (PARTITION BY f.id)) AS skip,
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
               o.fire_at,
               CASE WHEN o.skip THEN 'expired' ELSE 'ready' END,
               CASE WHEN o.skip THEN now() END,
               CASE WHEN o.skip THEN format('skipped by catch_up = %s: due %s, before its reminder was written (%s)',
                                           o.catch_up, o.fire_at, o.planned_at) END,
               o.traceparent, o.tracestate,
               0, 0,
               -- Claimed here: its lease row follows (leased), and claimed_at = now() tells them apart.
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
           -- A revived row keeps its lease and attempts: it is made ready, never claimed here, on
           -- the reminder's channel now. One that was tried (waiting for a retry when an edit
           -- closed it) is that send going on: never closed by catch_up, its retry time kept.
           SET status = CASE WHEN w.attempts > 0 THEN 'ready' ELSE excluded.status END,
               available_at = CASE WHEN w.attempts > 0 THEN greatest(w.available_at, excluded.due_at)
                                   ELSE excluded.available_at END,
               finished_at = CASE WHEN w.attempts > 0 THEN NULL ELSE excluded.finished_at END,
               last_error = CASE WHEN w.attempts > 0 THEN w.last_error ELSE excluded.last_error END,
               traceparent = excluded.traceparent, tracestate = excluded.tracestate, channel = excluded.channel
         WHERE w.status = 'superseded'
        -- The whole row only for those claimed here (pgwork.as_claimed below): a row revived by
        -- the upsert keeps the claimed_at of an earlier statement.
        RETURNING w.id, w.reminder_id, w.status, w.due_at, w.channel, w.source, w.available_at,
                  w.status = 'ready' AND w.claimed_at IS NOT DISTINCT FROM now() AS taken,
                  CASE WHEN w.status = 'ready' AND w.claimed_at IS NOT DISTINCT FROM now() THEN w END AS work
    ), queued AS (
        -- The rows made ready (pgwork.wake_lanes wakes their lanes) ...
        INSERT INTO pgwork.work_ready (work_id, channel, source, available_at, due_at)
        SELECT m.id, m.channel, m.source, m.available_at, m.due_at FROM made m WHERE m.status = 'ready' AND NOT m.taken
    ), leased AS (
        -- ... and the leases of those claimed here: the first, one attempt.
        INSERT INTO pgwork.work_lease (work_id, lease, attempts, channel, source, due_at, expires_at, claimed_by, claimed_at)
        SELECT m.id, 1, 1, m.channel, m.source, m.due_at, now() + materialise_page.claim_lease,
               materialise_page.daemon_id, now()
          FROM made m WHERE m.taken
    ), nxt AS (
        SELECT o.id, coalesce(min(o.fire_at) FILTER (WHERE o.fire_at > o.cutoff), 'infinity') AS next_fire_at
          FROM occ o
         GROUP BY o.id
        UNION ALL
        SELECT s.id, s.next_fire_at FROM series s
    ), advanced AS (
        -- By ctid: the rows are locked by this statement, and a join on id would scan the table.
        UPDATE pgwork.reminder r
           SET next_fire_at = n.next_fire_at
          FROM due d
          JOIN nxt n ON n.id = d.id
         WHERE r.ctid = d.row_ctid
    ), figures AS (
        -- One aggregate over each of made, series and due (each scalar subquery over a CTE was
        -- nodes of its own for every page to start and end).
        SELECT p.cutoff, CASE WHEN fair IS NULL THEN c.scanned ELSE cardinality(fair) END AS scanned,
               m.made + s.made AS made, m.made_due + s.made_due AS made_due, m.skipped + s.skipped AS skipped,
               (SELECT count(*) FROM (SELECT pg_notify('pgwork_work', materialise_page.origin)
                                       WHERE m.ready OR s.ready) AS n) AS notified,
               least(m.earliest, s.earliest) AS earliest_made,
               CASE WHEN fair IS NULL THEN l.next_fire_at ELSE coalesce(fair_at, materialise_page.after_at) END AS last_at,
               CASE WHEN fair IS NULL THEN l.id ELSE coalesce(fair_id, materialise_page.after_id) END AS last_id,
               s.unfinished
          FROM params p
         CROSS JOIN (SELECT count(*) AS made,
                            count(*) FILTER (WHERE m.due_at <= now() AND m.status = 'ready') AS made_due,
                            count(*) FILTER (WHERE m.status = 'expired') AS skipped,
                            coalesce(bool_or(m.status = 'ready' AND NOT m.taken), false) AS ready,
                            min(m.due_at) AS earliest
                       FROM made m) AS m
         CROSS JOIN (SELECT coalesce(sum(s.made), 0)::bigint AS made, coalesce(sum(s.made_due), 0)::bigint AS made_due,
                            coalesce(sum(s.skipped), 0)::bigint AS skipped, coalesce(bool_or(s.made_ready > 0), false) AS ready,
                            min(s.earliest_made) AS earliest, count(*) FILTER (WHERE s.unfinished) AS unfinished
                       FROM series s) AS s
         CROSS JOIN (SELECT count(*) AS scanned FROM due) AS c
          LEFT JOIN LATERAL (SELECT d.next_fire_at, d.id FROM due d ORDER BY d.next_fire_at DESC, d.id DESC LIMIT 1) l ON true
    ), claimed AS (
        -- The reminder as this statement's snapshot sees it (advanced changed only its progress).
        SELECT pgwork.as_claimed(m.work, 'claimed', 1, 1, 'ready', r.recipient, r.payload::text, NULL) AS claimed,
               m.due_at, m.id
          FROM made m
          JOIN pgwork.reminder r ON r.id = m.reminder_id
         WHERE m.taken
    )
    SELECT f.cutoff, f.scanned, f.made, f.made_due, f.skipped, f.notified, f.earliest_made,
           f.last_at, f.last_id, f.unfinished, c.claimed
      FROM figures f
      LEFT JOIN claimed c ON true
     ORDER BY c.due_at, c.id;
END
$$;
COMMENT ON FUNCTION pgwork.materialise_page IS
    'The materialiser''s page (lock, page, the rows it claimed), called by the daemon only.';
REVOKE EXECUTE ON FUNCTION pgwork.materialise_page FROM PUBLIC;
-- pgwork/sql/code/roles.sql — The group roles and what each may do (created where migrate may create roles).
-- Code, not tables: `pgwork migrate` applies every file of pgwork/sql/code/ after the pending
-- migrations, in the order of pgwork.queries.CODE, so each definition here is the only one.
--
-- pgwork_app may schedule, move, cancel and read reminders, and nothing else.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        CREATE ROLE pgwork_app NOLOGIN;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'pgwork: could not create role pgwork_app (no CREATEROLE); grants to it are skipped';
END
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_app') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_app;
        GRANT SELECT, DELETE ON pgwork.reminder TO pgwork_app;
        -- UPDATE of source and business_key is granted so that the trigger, not a bare
        -- "permission denied", tells an app they cannot change.
        GRANT INSERT (source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                      traceparent, tracestate, recur, recur_until, recur_skip, paused),
              UPDATE (source, business_key, due_at, due_local, due_tz, remind_before, channel, recipient, payload,
                      traceparent, tracestate, recur, recur_until, recur_skip, paused)
              ON pgwork.reminder TO pgwork_app;
        GRANT SELECT ON pgwork.reminder_status, pgwork.time_zone, pgwork.app_source TO pgwork_app;
        -- Of a channel, what an app needs to pick one: not the receiver's state (throttle_reason
        -- quotes a receiver's reply to another source's delivery), nor the breaker's counts.
        GRANT SELECT (name, kind, registered_at, paused, catch_up) ON pgwork.channel TO pgwork_app;
        GRANT EXECUTE ON FUNCTION pgwork.reminder_notify() TO pgwork_app;
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------------------
-- Roles: pgwork_daemon runs the daemon and the operator commands (status, dlq, channel);
-- pgwork_cleanup runs `pgwork cleanup` (the retention timer). Group roles: GRANT one to the
-- login role that connects. Neither can change the schema or delete a reminder; only the
-- schema's owner runs `pgwork migrate`.
-- ---------------------------------------------------------------------------------------------

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        CREATE ROLE pgwork_daemon NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        CREATE ROLE pgwork_cleanup NOLOGIN;
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'pgwork: could not create roles pgwork_daemon, pgwork_cleanup (no CREATEROLE); grants to them are skipped';
END
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_daemon') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_daemon;
        GRANT SELECT ON pgwork.schema_version, pgwork.time_zone, pgwork.app_source, pgwork.reminder_status
           TO pgwork_daemon;
        -- reminder: the materialiser's progress (next_fire_at); never INSERT or DELETE.
        GRANT SELECT, UPDATE ON pgwork.config, pgwork.reminder, pgwork.materialiser_state,
              pgwork.retention_state TO pgwork_daemon;
        GRANT SELECT, INSERT, UPDATE ON pgwork.channel TO pgwork_daemon;
        GRANT SELECT, INSERT, UPDATE, DELETE ON pgwork.renewal_work, pgwork.work_ready, pgwork.work_lease,
              pgwork.attempt, pgwork.retired, pgwork.daemon, pgwork.lane, pgwork.set_aside TO pgwork_daemon;
        GRANT USAGE ON ALL SEQUENCES IN SCHEMA pgwork TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_page TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.claim_lanes, pgwork.claim_rows, pgwork.lease_end, pgwork.lease_extend
           TO pgwork_daemon;
        GRANT EXECUTE ON FUNCTION pgwork.materialise_series TO pgwork_daemon;
        BEGIN
            -- The xmin-horizon gauge reads other sessions' backend_xmin.
            GRANT pg_read_all_stats TO pgwork_daemon;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'pgwork: could not grant pg_read_all_stats to pgwork_daemon; pgwork_xmin_horizon_age sees only its own sessions';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgwork_cleanup') THEN
        GRANT USAGE ON SCHEMA pgwork TO pgwork_cleanup;
        GRANT SELECT ON pgwork.schema_version, pgwork.reminder, pgwork.channel, pgwork.daemon,
              pgwork.app_source TO pgwork_cleanup;
        -- materialiser_state: a batch locks its row (see retention_delete_batch).
        GRANT SELECT, UPDATE ON pgwork.config, pgwork.retention_state, pgwork.materialiser_state
           TO pgwork_cleanup;
        GRANT SELECT, DELETE ON pgwork.renewal_work, pgwork.attempt TO pgwork_cleanup;
        -- retired: tombstones are written, and a series' pruned once they guard nothing.
        GRANT SELECT, INSERT, DELETE ON pgwork.retired TO pgwork_cleanup;
    END IF;
END
$$;
INSERT INTO pgwork.schema_version (version) VALUES (24);
