"""Outcome writer: attempt outcomes are written in batches, one statement per flush (group
commit). A delivery counts as done only once its outcome is durable."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import psycopg
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import db, store
from ..channels.policy import Decision
from ..channels.types import Delivered, Outcome, Receipt, Retry
from ..metrics import Metrics
from ..secrets import Secrets
from ..store import ClaimKey, Identity
from ..supervise import Backoff, Health
from .trends import Trends

log = logging.getLogger("pgwork.outcomes")


#: Longest error text stored (the ledger's CHECK allows 2000).
MAX_ERROR = 2000
#: Longest error class stored.
MAX_ERROR_CLASS = 200
#: Largest receipt stored, as JSON text; a larger one is replaced by a note saying so.
MAX_RECEIPT = 16384
#: Deepest receipt stored; deeper parts are replaced by their text.
MAX_RECEIPT_DEPTH = 32
#: Longest retry delay stored, seconds (a receiver may ask for more; it is clamped).
MAX_RETRY_DELAY = 7 * 86400.0
#: Longest pause reason stored on the channel row.
MAX_PAUSE_REASON = 500
#: How long a throttling answer without Retry-After holds the channel, seconds.
THROTTLE_HOLD = 1.0
#: Longest a single answer may hold the channel, seconds.
MAX_THROTTLE_HOLD = 3600.0


def clean_text(text: str | None, limit: int) -> str | None:
    """``text`` as Postgres can store it: no NUL characters (text and jsonb refuse them), no
    lone surrogates, at most ``limit`` characters."""
    if text is None:
        return None
    text = text.replace("\x00", "")
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:limit]


def _clean_json(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return clean_text(value, MAX_RECEIPT)
    if depth >= MAX_RECEIPT_DEPTH:
        # Not repr(): that recurses through whatever lies below, and a deep enough value raises.
        return f"({type(value).__name__} nested deeper than {MAX_RECEIPT_DEPTH})"
    if isinstance(value, dict):
        return {clean_text(str(k), 200): _clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_json(v, depth + 1) for v in value]
    return clean_text(str(value), MAX_RECEIPT)


def clean_receipt(receipt: Any) -> Any:
    """A receipt as valid, storable JSON: NaN and infinities become null, NUL characters and
    lone surrogates go, other objects become their text, depth and size are bounded."""
    return clean_receipt_json(receipt)[0]


def clean_receipt_json(receipt: Any) -> tuple[Any, str | None]:
    """``clean_receipt`` of ``receipt`` and its JSON text (None for None)."""
    if receipt is None:
        return None, None
    try:
        cleaned = _clean_json(receipt, 0)
        text = json.dumps(cleaned, separators=(",", ":"), allow_nan=False)
    except (RecursionError, ValueError, TypeError) as e:
        # A receipt never changes an outcome: one that cannot be stored is noted instead.
        cleaned = {"unstorable": True, "error": clean_text(f"{type(e).__name__}: {e}", 200)}
        return cleaned, json.dumps(cleaned, separators=(",", ":"))
    if len(text) > MAX_RECEIPT:
        cleaned = {"truncated": True, "text": text[: MAX_RECEIPT // 2]}
        return cleaned, json.dumps(cleaned, separators=(",", ":"))
    return cleaned, text


class Cleaner:
    """Cleans records for storage with the daemon's secrets (``Record.cleaned``). The receipts a
    channel promises not to change (``Receipt``) are cleaned once each: a receiver that answers
    every request alike costs one cleaning, not one per delivery."""

    #: Receipts remembered; past this many the memo starts afresh.
    MEMO = 256

    def __init__(self, secrets: Secrets | None = None) -> None:
        self.secrets = secrets or Secrets()
        self._memo: dict[int, tuple[Receipt, Any, str | None]] = {}

    def receipt(self, receipt: Any) -> tuple[Any, str | None]:
        """The receipt as Postgres can store it, secrets masked, and its JSON text."""
        if type(receipt) is not Receipt:
            return clean_receipt_json(self.secrets.scrub_json(receipt))
        # Keyed by identity; the entry holds the object, so the id cannot be reused meanwhile.
        hit = self._memo.get(id(receipt))
        if hit is not None and hit[0] is receipt:
            return hit[1], hit[2]
        cleaned, text = clean_receipt_json(self.secrets.scrub_json(receipt))
        if len(self._memo) >= self.MEMO:
            self._memo.clear()
        self._memo[id(receipt)] = (receipt, cleaned, text)
        return cleaned, text


def clean_delay(delay: float | None) -> float | None:
    """A retry delay Postgres can add to now(): finite, not negative, at most a week."""
    if delay is None:
        return None
    if not math.isfinite(delay) or delay < 0:
        return 0.0 if delay != math.inf else MAX_RETRY_DELAY
    return min(delay, MAX_RETRY_DELAY)


@dataclass(slots=True)
class Record:
    """One attempt's outcome, as written to ``renewal_work`` and the attempt ledger. Not frozen,
    as it is made once per attempt (the cost: bench/README.md, "Per-delivery code"); nothing changes a record after it is made:
    ``cleaned`` and ``bare`` return new ones."""

    work_id: int
    lease: int
    attempt: int
    channel: str
    outcome: str  # delivered | duplicate | retry | failed
    status: str  # delivered | ready | dead
    retry_after: float | None
    #: When the attempt started and finished, on this process's monotonic clock: the statement
    #: turns them into database-clock times ("so many seconds ago").
    started: float
    finished: float
    http_status: int | None = None
    error_class: str | None = None
    error: str | None = None
    receipt: Any = None
    #: Seconds to hold the whole channel (a throttling answer), or None.
    throttle: float | None = None
    #: Why to pause the channel (e.g. HTTP 410), or None.
    pause: str | None = None
    #: The receipt's JSON text, once cleaned (``cleaned`` sets it): written as it is.
    receipt_json: str | None = None

    @classmethod
    def of(
        cls,
        row: store.Claimed,
        channel: str,
        outcome: Outcome,
        decided: Decision,
        started: float,
        finished: float,
    ) -> Record:
        """The record of one attempt at ``row``: what the channel returned and what the retry
        policy ``decided`` of it. A throttling answer
        holds the channel for its Retry-After (THROTTLE_HOLD without one, MAX_THROTTLE_HOLD at
        most). Cleaning for storage is ``cleaned``'s, in the writer's task."""
        ledger, status, delay, error = (
            decided.ledger,
            decided.status,
            decided.retry_in,
            decided.error,
        )
        throttle = pause = None
        if isinstance(outcome, Retry):
            if outcome.throttle:
                hold = clean_delay(outcome.delay)
                throttle = min(THROTTLE_HOLD if hold is None else hold, MAX_THROTTLE_HOLD)
            pause = outcome.pause
        if isinstance(outcome, Delivered):
            error_class, receipt = None, outcome.receipt
        else:
            error_class, receipt = outcome.error_class, None
        return cls(
            work_id=row.id,
            lease=row.lease,
            attempt=row.attempts,
            channel=channel,
            outcome=ledger,
            status=status,
            retry_after=delay,
            started=started,
            finished=finished,
            http_status=outcome.http_status,
            error_class=error_class,
            error=error,
            receipt=receipt,
            throttle=throttle,
            pause=pause,
        )

    @property
    def key(self) -> ClaimKey:
        """What a claim is known by: the row and the lease that claimed it."""
        return (self.work_id, self.lease)

    def log_fields(self, row: store.Claimed, outcome: str, took: float) -> dict[str, Any]:
        """What the log line of this attempt carries once settled: the occurrence it was for
        (``row``), the ``outcome`` as counted (``fenced`` for a late one) and how long it took."""
        return {
            "work_id": self.work_id,
            "operation_id": str(row.operation_id),
            "source": row.source,
            "business_key": row.business_key,
            "recipient": row.recipient,
            "channel": self.channel,
            "attempt": self.attempt,
            "outcome": outcome,
            "status": self.status,
            "duration_ms": round(took * 1000, 2),
            "http_status": self.http_status,
            **({"error": self.error} if self.error else {}),
            **({"retry_in_s": round(self.retry_after, 3)} if self.retry_after is not None else {}),
        }

    def cleaned(self, cleaner: Cleaner | None = None) -> Record:
        """This record as Postgres can store it (see the ``clean_*`` functions), with every
        configured secret masked (a receiver may echo the request's headers back), and its
        receipt's JSON text."""
        plain = (
            self.error is None
            and self.error_class is None
            and self.pause is None
            and (self.retry_after is None or 0 <= self.retry_after <= MAX_RETRY_DELAY)
            and (
                self.http_status is None
                or (type(self.http_status) is int and 100 <= self.http_status < 1000)
            )
        )
        if plain and self.receipt is None:
            return self  # nothing to clean: most delivered records (and it is the hot path)
        c = cleaner or Cleaner()
        receipt, receipt_json = c.receipt(self.receipt)
        if plain:
            # A delivered webhook: only the receipt. Not dataclasses.replace (~3 µs a record);
            # by keyword, so that no field can take another's place (~0.5 µs more than by position).
            return Record(
                work_id=self.work_id,
                lease=self.lease,
                attempt=self.attempt,
                channel=self.channel,
                outcome=self.outcome,
                status=self.status,
                retry_after=self.retry_after,
                started=self.started,
                finished=self.finished,
                http_status=self.http_status,
                error_class=None,
                error=None,
                receipt=receipt,
                throttle=self.throttle,
                pause=None,
                receipt_json=receipt_json,
            )
        s = c.secrets
        return replace(
            self,
            pause=clean_text(self.pause, MAX_PAUSE_REASON),
            retry_after=clean_delay(self.retry_after),
            error=clean_text(s.scrub(self.error) if self.error else self.error, MAX_ERROR),
            error_class=clean_text(self.error_class, MAX_ERROR_CLASS),
            receipt=receipt,
            receipt_json=receipt_json,
            # Not `in range(100, 1000)`: for None that scans all 900 values.
            http_status=(
                self.http_status
                if isinstance(self.http_status, int) and 100 <= self.http_status < 1000
                else None
            ),
        )

    def bare(self, why: str) -> Record:
        """The state change alone, for a record whose details could not be stored."""
        return replace(
            self,
            error=f"{self.error or ''} [outcome details could not be stored: {why}]"[-MAX_ERROR:],
            error_class=None,
            receipt=None,
            receipt_json=None,
            http_status=None,
        )

    def json_text(self, now: float) -> str:
        """The record as a JSON object for ``record_outcomes`` (absent keys are NULL); ``now`` is
        monotonic.

        Written with one f-string, not ``json.dumps`` of a dict, as it runs once per attempt
        (bench/README.md, "Per-delivery code"): integers, finite floats (``repr`` is JSON) and the names of channels, outcomes
        and statuses (JSON strings made once each) go in as JSON writes them; the fields most
        records lack are added by ``json.dumps``. Guarded by
        tests/test_hot_path.py::test_an_outcome_record_is_the_json_object_its_fields_make."""
        started, finished = now - self.started, now - self.finished
        text = (
            f'{{"work_id":{self.work_id},"lease":{self.lease},'
            f'"attempt":{self.attempt},"channel":{_json_name(self.channel)},'
            f'"outcome":{_json_name(self.outcome)},"status":{_json_name(self.status)},'
            f'"started_ago":{started if started > 0.0 else 0.0!r},'
            f'"finished_ago":{finished if finished > 0.0 else 0.0!r}'
        )
        if (
            self.retry_after is None
            and self.error_class is None
            and self.error is None
            and self.throttle is None
            and self.pause is None
            and (self.receipt is None or self.receipt_json is not None)
        ):
            # Every delivered record: a webhook's has its status and its receipt's text.
            if self.http_status is not None:
                text = f'{text},"http_status":{self.http_status!r}'
            if self.receipt_json is not None:
                text = f'{text},"receipt":{self.receipt_json}'
            return text + "}"
        rare = {
            "retry_after": self.retry_after,
            "http_status": self.http_status,
            "error_class": self.error_class,
            "error": self.error,
            "receipt": self.receipt,
            "throttle": self.throttle,
            "pause": self.pause,
        }
        tail = json.dumps({k: v for k, v in rare.items() if v is not None}, separators=(",", ":"))
        return f"{text},{tail[1:]}"


def sent_keys() -> frozenset[str]:
    """The keys ``json_text`` writes for a record with every field set: what pgwork.outcome, the
    one declaration of the record as ``record_outcomes`` reads it, must name."""
    full = Record(
        work_id=1,
        lease=1,
        attempt=1,
        channel="c",
        outcome="retry",
        status="ready",
        retry_after=1.0,
        started=0.0,
        finished=0.0,
        http_status=503,
        error_class="E",
        error="e",
        receipt={},
        throttle=1.0,
        pause="p",
    )
    return frozenset(json.loads(full.json_text(0.0)))


async def check_shape(conn: AsyncConnection[Any]) -> None:
    """:raises db.SchemaError: when the records this code writes are not what pgwork.outcome
    declares (a key the statement would drop, or one it waits for in vain). Run at a daemon's
    start."""
    declared = frozenset(await store.type_fields(conn, "pgwork.outcome"))
    sent = sent_keys()
    if declared != sent:
        raise db.SchemaError(
            f"pgwork.outcome declares {', '.join(sorted(declared - sent)) or 'nothing more'} "
            f"and not {', '.join(sorted(sent - declared)) or 'nothing less'} than the outcome "
            "records this pgwork writes: the type was changed by hand, or this code's schema "
            "files disagree with pgwork/duties/outcomes.py"
        )


#: JSON strings of the channel, outcome and status names seen (few distinct values).
_JSON_NAMES: dict[str, str] = {}


def _json_name(name: str) -> str:
    text = _JSON_NAMES.get(name)
    if text is None:
        text = _JSON_NAMES[name] = json.dumps(name)
    return text


@dataclass
class _Batch:
    records: list[Record] = field(default_factory=list)
    #: (work id, lease) of the records refused because the lease had passed on.
    fenced: set[ClaimKey] = field(default_factory=set)


class OutcomeWriter:
    #: Most records written by one statement.
    MAX_BATCH = 1000
    #: Flushes under way at once (Postgres commits concurrent flushes with one WAL flush).
    FLUSHES = 2
    #: While a flush is under way, a second starts only for at least this many records; fewer
    #: wait for the first to end and go with the next (fewer, larger statements: Postgres's CPU
    #: per webhook delivery down a tenth, bench/README.md), while a burst is written at once.
    SECOND_FLUSH_AT = 64
    #: A flush under way for longer than this, seconds, is stalled (waiting on a lock another
    #: session holds, or retrying after a failure): it no longer counts against ``FLUSHES`` or
    #: holds back a small batch, so the outcomes of other work are written meanwhile.
    STALLED_AFTER = 1.0
    #: Flushes under way at once, stalled ones included (each holds a pooled connection).
    MAX_FLUSHES = 4
    #: Records a flush gathers while outcomes stream in (a flush under way, or one ended within
    #: ``GATHER_S``): the statement's fixed cost (~0.3 ms of Postgres) is shared by more of
    #: them. At claim batch 10, 25 records a flush instead of 15, Postgres's CPU per no-op job down a tenth
    #: (bench/README.md, issue 54). A record that finds the writer quiet goes at once.
    GATHER = 32
    #: Longest a record waits to be gathered, seconds.
    GATHER_S = 0.002

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        metrics: Metrics,
        identity: Identity,
        health: Health | None = None,
        secrets: Secrets | None = None,
        trends: Trends | None = None,
    ) -> None:
        self.pool = pool
        #: Counts what each flush made durable, per channel and minute (the web page's trend).
        self.trends = trends
        self.metrics = metrics
        self.cleaner = Cleaner(secrets)
        self.daemon_id, self.host, self.pid = identity
        self.health = health or Health()
        #: Per channel, who settles its records once they are durable (the channel's worker).
        self._settlers: dict[str, Callable[[list[Record], set[ClaimKey]], None]] = {}
        self._current = _Batch()
        self._waiting: list[_Batch] = []
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._flushing = 0
        #: When each flush under way started (monotonic), by the batch's id.
        self._under_way: dict[int, float] = {}
        #: When the last flush ended, and when the current batch goes short of ``GATHER``.
        self._ended = -math.inf
        self._due = -math.inf

    def subscribe(
        self, channel: str, settle: Callable[[list[Record], set[ClaimKey]], None]
    ) -> None:
        """``settle(records, fenced)`` is called with the channel's records once they are
        durable; ``fenced`` holds the (work id, lease) of those refused as late."""
        self._settlers[channel] = settle

    def pending(self) -> int:
        """Outcomes not yet durable: queued, or in a flush under way."""
        return (
            len(self._current.records) + sum(len(b.records) for b in self._waiting) + self._flushing
        )

    def submit(self, rec: Record) -> None:
        """Queue ``rec``; it is written with the next flush, and its channel's settler is called
        with it (and whether it was fenced) once it is durable. The record is cleaned first: nothing a
        receiver or a channel returned can make the statement fail."""
        batch = self._current
        batch.records.append(rec.cleaned(self.cleaner))
        n = len(batch.records)
        first = n == 1
        if first:
            now = time.monotonic()
            quiet = not self._under_way and now - self._ended >= self.GATHER_S
            self._due = now if quiet else now + self.GATHER_S
        if n >= self.MAX_BATCH:
            self._waiting.append(batch)
            self._current = _Batch()
        if self._idle.is_set():
            self._idle = anyio.Event()
        # The flush loop is woken only when this record sets when its batch goes (a batch's
        # first: the loop's timer), completes a gathered batch, or makes a second flush's worth.
        # Otherwise the end of the flush under way, that timer or the stall watch
        # (_watch_stalls) wakes it: woken per record, each pass armed a timer, about a
        # microsecond of the writer's ~7 per record (a writer with the database replaced by a
        # sleep, 2026-12-02).
        if first or self._waiting or n == self.GATHER or n >= self.SECOND_FLUSH_AT:
            self._wake.set()

    def _flowing(self, now: float) -> int:
        """Flushes under way that are not stalled."""
        return sum(1 for t in self._under_way.values() if now - t < self.STALLED_AFTER)

    def _take(self, now: float) -> _Batch | None:
        """The next batch to flush now, if any may start: at most ``FLUSHES`` flowing and
        ``MAX_FLUSHES`` in all; a small batch waits for a flowing flush to end, and then until
        it holds ``GATHER`` records or its first has waited ``GATHER_S``."""
        flowing = self._flowing(now)
        if flowing >= self.FLUSHES or len(self._under_way) >= self.MAX_FLUSHES:
            return None
        if self._waiting:
            return self._waiting.pop(0)
        n = len(self._current.records)
        if n >= self.SECOND_FLUSH_AT or (
            n and not flowing and (n >= self.GATHER or now >= self._due)
        ):
            b, self._current = self._current, _Batch()
            return b
        return None

    def _gathering_for(self, now: float) -> float | None:
        """Seconds until the batch being gathered may go; None when nothing but a wake-up can
        let a batch go (none gathered; its time has come and something else holds it, as a
        flush under way or every flush slot held: a zero timeout would spin the loop)."""
        if self._current.records and not self._flowing(now) and now < self._due:
            return self._due - now
        return None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Flush whatever is pending: at once when the writer is quiet, else once the flush
        under way ends and the batch is gathered (``GATHER``, ``GATHER_S``), ``SECOND_FLUSH_AT``
        records wait, or the flush under way has stalled (``STALLED_AFTER``), with up to
        ``FLUSHES`` flowing flushes (batches grow while they are); a failed flush is retried
        until it succeeds."""
        task_status.started()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_stalls)
            while True:
                now = time.monotonic()
                batch = self._take(now)
                if batch is None:
                    if not self.pending():
                        self._idle.set()
                    with anyio.move_on_after(self._gathering_for(now)):
                        await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
                self._flushing += len(batch.records)
                self._under_way[id(batch)] = now
                tg.start_soon(self._flush, batch)

    async def _watch_stalls(self) -> None:
        """While records wait behind flushes under way, wake the flush loop four times per
        ``STALLED_AFTER``: records waiting behind a stalled flush go within 1.25 ``STALLED_AFTER``
        of its start."""
        while True:
            await anyio.sleep(self.STALLED_AFTER / 4)
            if self._under_way and self.pending() > self._flushing:
                self._wake.set()

    async def _flush(self, batch: _Batch) -> None:
        backoff = Backoff()
        split = False

        async def write() -> None:
            nonlocal split
            self.health.begin(f"outcomes:{id(batch)}")
            try:
                await self._write(batch)
            except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as e:
                # Another session held a row or lane lock past the lock timeout: the batch goes
                # back as two, flushed (and settled) each on its own, so the records that do not
                # need that lock are written now and the one that does is retried alone.
                if len(batch.records) < 2:
                    raise
                log.warning(
                    "writing %d outcomes waited too long for a lock; writing them in halves: %s",
                    len(batch.records),
                    e,
                    extra={"duty": "outcomes", "error_class": type(e).__name__},
                )
                half = len(batch.records) // 2
                self._waiting[:0] = [_Batch(batch.records[:half]), _Batch(batch.records[half:])]
                self.metrics.set_aside.labels("outcomes").inc()
                split = True
            finally:
                self.health.end(f"outcomes:{id(batch)}")

        def failed(e: Exception, delay: float) -> None:
            self.metrics.duty_failures.labels("outcomes").inc()
            log.error(
                "writing %d outcomes failed; retrying in %.1fs: %s",
                len(batch.records),
                delay,
                e,
                extra={"duty": "outcomes", "error_class": type(e).__name__},
            )

        try:
            await backoff.until_done(write, failed)
            if backoff.failures and not split:
                self.metrics.duty_restarts.labels("outcomes").inc()
        finally:
            self._flushing -= len(batch.records)
            del self._under_way[id(batch)]
            self._ended = time.monotonic()
            self._wake.set()  # what waited for this flush to end goes now
        self.metrics.outcomes_pending.set(self.pending())
        if not self.pending():
            self._idle.set()

    async def drain(self) -> None:
        """Wait until everything queued so far is written."""
        while self.pending():
            if self._idle.is_set():
                await anyio.sleep(0.005)
            else:
                await self._idle.wait()

    async def _write(self, batch: _Batch) -> None:
        """Write ``batch``; when the database refuses it for its data (which cleaning should have
        made impossible), write it in halves, so that one bad record cannot hold the others, and
        a single bad record with its details stripped."""
        fenced = await self._write_split(batch.records)
        batch.fenced = fenced
        self.metrics.outcome_flushes.inc()
        for r in batch.records:
            if r.key in fenced:
                self.metrics.fenced.inc()
                log.warning(
                    "late outcome refused: the lease passed to another worker",
                    extra={
                        "work_id": r.work_id,
                        "lease": r.lease,
                        "outcome": r.outcome,
                        "channel": r.channel,
                    },
                )
        if self.trends is not None:
            self.trends.count(batch.records, fenced)
        by_channel: dict[str, list[Record]] = {}
        for r in batch.records:
            by_channel.setdefault(r.channel, []).append(r)
        for channel, records in by_channel.items():
            settle = self._settlers.get(channel)
            if settle is not None:
                settle(records, fenced)

    async def _write_split(self, rs: list[Record]) -> set[ClaimKey]:
        try:
            return await self._statement(rs)
        except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as e:
            if len(rs) > 1:
                log.warning(
                    "outcome batch refused for its data; writing it in halves: %s",
                    e,
                    extra={"duty": "outcomes", "error_class": type(e).__name__, "rows": len(rs)},
                )
                half = len(rs) // 2
                return await self._write_split(rs[:half]) | await self._write_split(rs[half:])
            (r,) = rs
            if r.error_class is None and r.receipt is None and r.http_status is None:
                raise  # nothing left to strip: retried with backoff by the caller
            log.error(
                "outcome details refused by the database; storing the outcome without them: %s",
                e,
                extra={"duty": "outcomes", "work_id": r.work_id, "error_class": type(e).__name__},
            )
            rs[0] = r.bare(type(e).__name__)
            return await self._write_split(rs)

    async def _statement(self, rs: list[Record]) -> set[ClaimKey]:
        now = time.monotonic()
        outcomes = f"[{','.join([r.json_text(now) for r in rs])}]"
        async with self.pool.connection() as conn:
            rows = await store.record_outcomes(
                conn, outcomes=outcomes, daemon_id=self.daemon_id, host=self.host, pid=self.pid
            )
        # Records already applied by a first run of this write (its reply was lost) are not fenced.
        return {(r.fenced_id, r.lease) for r in rows if not r.already}
