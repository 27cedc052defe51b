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
    migration_requester    integer,
    code_checksum text,
    code_replaced text[] NOT NULL DEFAULT '{}'
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
COMMENT ON COLUMN pgwork.schema_version.code_checksum IS
    'The checksum of the SQL code (pgwork/sql/code/) `pgwork migrate` applied last: a build whose '
    'code differs at the same version migrates by applying its code again.';
COMMENT ON COLUMN pgwork.schema_version.code_replaced IS
    'The checksums of the code applied before, oldest first: a build whose code is among them is '
    'older than the database, and refuses to run or migrate here.';

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
    -- Which channel module delivers (pgwork/channels/): the daemon's config checks it, so a
    -- new kind needs no migration.
    kind          text NOT NULL,
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

CREATE TABLE pgwork.work_moved (
    work_id  bigint PRIMARY KEY,
    channel  text NOT NULL,
    moved_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE pgwork.work_moved IS
    'Sends in flight whose reminder an app moved to another channel: where each goes when its '
    'lease ends without an outcome (written by the reminder''s trigger, which never touches the '
    'lease a daemon holds; read and deleted by the claim of that channel, and by the outcome).';
COMMENT ON COLUMN pgwork.work_moved.channel IS 'The channel the reminder names now.';
-- Where a channel's claim finds the sends moved to it (the table holds a row per send moved
-- while in flight, gone with its lease).
CREATE INDEX work_moved_channel ON pgwork.work_moved (channel);

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

-- Per channel and minute, what each daemon's sends came to: the web page's trend. Each daemon
-- counts the outcomes it made durable (the same rows as the ledger's) and writes its minutes
-- every few seconds, each value whole, so a write repeated after a lost reply counts nothing
-- twice; a daemon killed loses at most its last unwritten seconds of trend (the ledger keeps the
-- record). Read a channel's last hours by key; daemons prune minutes older than two days.
CREATE TABLE pgwork.channel_minute (
    channel    text NOT NULL,
    minute     timestamptz NOT NULL,
    written_by text NOT NULL,
    delivered  bigint NOT NULL DEFAULT 0,
    failed     bigint NOT NULL DEFAULT 0,
    dead       bigint NOT NULL DEFAULT 0,
    fenced     bigint NOT NULL DEFAULT 0,
    took_sum   double precision NOT NULL DEFAULT 0,
    took_max   double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (channel, minute, written_by)
);
COMMENT ON TABLE pgwork.channel_minute IS
    'Per channel, minute (by the database''s clock) and daemon: the attempts it recorded that minute. '
    'A trend for the web page, written by each daemon every few seconds; the ledger is the record.';
COMMENT ON COLUMN pgwork.channel_minute.written_by IS 'The daemon''s id and a token of its process (a restarted daemon writes minutes of its own).';
COMMENT ON COLUMN pgwork.channel_minute.delivered IS 'Attempts delivered (a duplicate answer included).';
COMMENT ON COLUMN pgwork.channel_minute.failed IS 'Attempts that did not deliver (to be retried, or dead).';
COMMENT ON COLUMN pgwork.channel_minute.dead IS 'Of the failed, those that made the row dead.';
COMMENT ON COLUMN pgwork.channel_minute.fenced IS 'Late outcomes refused: the lease had passed to another worker.';
COMMENT ON COLUMN pgwork.channel_minute.took_sum IS 'Seconds the attempts took, summed (the mean is took_sum / (delivered + failed)).';

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
    channels     text[],
    session_pid  bigint
);
COMMENT ON TABLE pgwork.daemon IS
    'Running (or recently running) daemons. One is alive while its heartbeat is recent or its '
    'session lock is held (pgwork.daemon_alive); one not alive is shown as gone, and once its '
    'heartbeat is ten intervals old it is deleted by the others.';
COMMENT ON COLUMN pgwork.daemon.listener_up IS
    'Whether its LISTEN connection is up; NULL: it runs without one by configuration (behind a '
    'transaction pooler with no listen_dsn: the tick alone finds new work).';
COMMENT ON COLUMN pgwork.daemon.metrics_at IS
    'HOST:PORT its Prometheus metrics are served on (the port it got, when metrics.listen names '
    'port 0 or a range); NULL: metrics off.';
COMMENT ON COLUMN pgwork.daemon.channels IS
    'The channels it serves (its config''s): `pgwork channel retire` names the daemons serving one. '
    'NULL: a daemon older than schema 24.';
COMMENT ON COLUMN pgwork.daemon.session_pid IS
    'The backend pid of its LISTEN session, which holds its session lock: while that lock is held '
    'the daemon is alive without writing (pgwork.daemon_alive). NULL: no such session.';
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
