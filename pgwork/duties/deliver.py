"""Claim/deliver duty: per channel, claim due rows with SKIP LOCKED in short transactions,
deliver outside any transaction, and hand the outcome to the outcome writer. ``Deliveries`` runs
every channel and owns the delivery side of the two-stage stop."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from datetime import timedelta
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import store
from ..channels import Channel, Delivered, Delivery, Retry
from ..channels.policy import decide
from ..channels.types import Outcome
from ..clock import Clock
from ..config import Config
from ..supervise import Next, Supervisor
from ..tracing import Tracer
from ..waker import Waker, WakerGroup
from .leases import Held, Leases, release_all
from .outcomes import OutcomeWriter, Record, clean_delay, clean_text

log = logging.getLogger("pgwork.worker")


class _Started(NamedTuple):
    """An attempt under way: what the channel was given, when (monotonic), its trace span."""

    delivery: Delivery
    t0: float
    span: Any


class ChannelWorker:
    """One channel: a claim loop that keeps a queue topped up, and ``concurrency`` long-lived
    delivery workers that take rows from it.

    A worker hands each outcome to the outcome writer and goes on with the next row; the row is
    *settled* (its lease dropped, its capacity freed, the attempt logged and counted) only once the
    outcome is durable. Workers sleep only when the queue is empty, and a claim wakes only as many
    as it brought rows: a task or a wake-up per row would cost more than a no-op delivery.
    """

    #: Deliveries a worker runs back to back before it yields to the event loop.
    YIELD_EVERY = 64
    #: Least wait after a claim that got nothing while a row was due (locked by someone), seconds.
    EMPTY_PASS_FLOOR = 0.05
    #: How often a channel at its global concurrency (or throttle limit) looks for a free slot
    #: that another daemon's outcome made, seconds.
    FULL_POLL = 0.05
    #: How long a throttling answer without Retry-After holds the channel, seconds.
    THROTTLE_HOLD = 1.0
    #: Longest a single answer may hold the channel, seconds.
    MAX_THROTTLE_HOLD = 3600.0
    #: A held worker looks again this often, seconds.
    HOLD_SLICE = 0.5
    #: Beyond one row per worker, a channel holds only the rows its workers start within this
    #: long at their measured pace: a burst is not taken by the first daemon to wake while
    #: others sit idle (a fast channel still holds two whole batches), seconds.
    PREFETCH_S = 0.25
    #: Batches of delivered rows whose outcomes may wait to be written (see max_writing).
    WRITING_BATCHES = 2

    def __init__(
        self,
        channel: Channel,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        writer: OutcomeWriter,
        leases: Leases,
        sup: Supervisor,
        cfg: Config,
        *,
        identity: tuple[str, str, int],
        clock: Clock | None = None,
        woken_by: WakerGroup | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.channel = channel
        #: OpenTelemetry spans (tracing.enabled); None: off, and nothing on the path below pays.
        self.tracer = tracer
        self.sup = sup
        metrics = sup.metrics
        self.clock = clock or Clock()
        self.attempt_timeout = channel.config.attempt_timeout
        self.name = channel.config.name
        self.policy = channel.config.retry
        self.concurrency = channel.config.concurrency
        self.pool = pool
        self.writer = writer
        self.leases = leases
        self.metrics = metrics
        self.identity = identity
        self.daemon_id = identity[0]
        self.lease = timedelta(seconds=cfg.lease)
        c = channel.config
        self.expire_after = timedelta(seconds=c.expire_after) if c.expire_after else None
        #: Configured limits that claims count (under the channel's lock, see claim_lock): the
        #: materialiser's page does not claim for such a channel.
        self.lock_channel = c.rate_limit is not None or c.global_concurrency is not None
        self.claim_batch = cfg.claim_batch
        self.tick = cfg.tick
        self.waker = Waker()
        if woken_by is not None:
            woken_by.add(self.waker)  # rows made (materialiser), NOTIFY (listener)
        writer.subscribe(self.name, self.settle)
        #: Most rows held not yet delivered (queued, or in a delivery): one per worker plus what
        #: the workers start within PREFETCH_S, at most two batches. Until a delivery has been
        #: timed: one more per worker.
        self.max_held = 2 * self.concurrency
        #: Most rows held delivered, waiting for their outcome to be written, beyond max_held:
        #: no other daemon could take them, so they leave the prefetch room to the claims (one
        #: batch's outcomes are written while the next batch is delivered), but a writer that
        #: falls behind stops the claims.
        self.max_writing = self.WRITING_BATCHES * self.claim_batch
        #: Seconds a delivery takes, a moving average (None: none timed yet).
        self._delivery_s: float | None = None
        #: Rows claimed and not yet settled: queued, being delivered, or waiting for their outcome
        #: to be written.
        self.held = 0
        #: Rows delivered whose outcome is not durable yet (part of ``held``).
        self.writing = 0
        #: The claim loop sleeps until a slot frees (see _woken_for_room).
        self._slot_wait = False
        #: Deliveries inside the channel right now.
        self.active = 0
        self._queue: deque[store.Claimed] = deque()
        self._idle: list[anyio.Event] = []
        self._closed = False
        self._stopping = False
        #: Consecutive claims that got nothing while a row was due (see claim_step).
        self._due_unclaimed = 0
        #: Claim statements under way (this loop's, or the materialiser's for this channel): a
        #: stop waits for them, then gives back their rows.
        self.claiming = 0
        #: Room promised to the materialiser's page under way (see page_claim).
        self._reserved = 0
        #: Attempts under way and when each must end (see _reap).
        self._attempts: dict[anyio.CancelScope, float] = {}
        #: The channel's gate as last seen (see _apply_gate): paused; no delivery starts before
        #: this monotonic instant (a throttle); the gate must be read again (a NOTIFY).
        self.paused = False
        self._hold_until = 0.0
        self._gate_stale = True
        # Labelled metric children, looked up once.
        self._m_attempts = {
            o: metrics.attempts.labels(self.name, o)
            for o in ("delivered", "duplicate", "retry", "failed", "fenced")
        }
        self._m_duration = metrics.delivery_duration.labels(self.name)
        self._m_lateness = metrics.lateness.labels(self.name)
        # Read when scraped: a set() per delivery cost more than the delivery of a no-op.
        metrics.rows_held.labels(self.name).set_function(lambda: self.held)
        metrics.deliveries_active.labels(self.name).set_function(lambda: self.active)
        self._m_claimed = metrics.claimed.labels(self.name)
        self._m_duplicates = metrics.duplicates.labels(self.name)

    def start_workers(self, tg: TaskGroup) -> None:
        for _ in range(self.concurrency):
            tg.start_soon(self._worker)
        tg.start_soon(self._reap)

    async def _reap(self) -> None:
        """Cancel attempts past ``attempt_timeout``, checking four times per timeout (at most
        once a second): an attempt ends within a quarter of its limit after it."""
        every = min(1.0, self.attempt_timeout / 4)
        while True:
            await anyio.sleep(every)
            now = time.monotonic()
            for scope, deadline in list(self._attempts.items()):
                if now >= deadline:
                    scope.cancel()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The claim loop. It stops cooperatively (``stop_claiming``), so a stop never cancels a
        claim statement; the delivery workers run in the daemon's work group."""
        await self.sup.loop(
            f"claim:{self.name}", self.claim_step, self.waker, task_status=task_status
        )

    def stop_claiming(self) -> None:
        """Claim nothing more (a claim under way finishes; its rows are held, not started)."""
        self._stopping = True
        self.waker.wake("stop")

    def stop_taking(self) -> None:
        """On shutdown: queued rows are not started (they stay held and are released without
        counting an attempt); idle workers end."""
        self._closed = True
        left = len(self._queue)
        if self.tracer is not None:
            self.tracer.released((r.id, r.lease) for r in self._queue)
        self._queue.clear()
        self.held -= left
        for ev in self._idle:
            ev.set()
        self._idle.clear()

    def close(self) -> None:
        self.stop_taking()

    def _request(self, limit: int) -> store.ClaimRequest:
        return store.ClaimRequest(
            channel=self.name,
            limit=limit,
            max_attempts=self.policy.max_attempts,
            lease=self.lease,
            daemon_id=self.daemon_id,
            expire_after=self.expire_after,
        )

    async def _claim(self, limit: int) -> list[store.Claimed]:
        async with self.pool.connection() as conn:
            return await store.claim_work(conn, self._request(limit))

    def _free(self) -> int:
        """Rows a claim could take now: room among the undelivered rows (max_held), and among
        all held rows (max_held plus max_writing)."""
        undelivered = self.held - self.writing
        return (
            min(self.max_held - undelivered, self.max_held + self.max_writing - self.held)
            - self._reserved
        )

    def _room(self) -> int:
        """How many rows a claim may take now (at most one batch); 0: too few to be worth a
        claim (a delivery ending or rows settling wakes the loop)."""
        if self._delivery_s is not None:
            ahead = self.concurrency * self.PREFETCH_S / max(self._delivery_s, 1e-6)
            self.max_held = self.concurrency + max(1, min(math.ceil(ahead), 2 * self.claim_batch))
        free = self._free()
        if free < self._worth_a_claim():
            return 0
        return min(free, self.claim_batch)

    def _worth_a_claim(self) -> int:
        return max(1, min(self.claim_batch, self.max_held) // 2)

    def _woken_for_room(self) -> None:
        """Wake the claim loop sleeping for a slot once a claim is worth it again."""
        if self._slot_wait and self._free() >= self._worth_a_claim():
            self._slot_wait = False
            self.waker.wake("slot")

    def page_claim(self) -> store.ClaimRequest | None:
        """What the materialiser's page may insert claimed for this channel (one hop from the
        app's INSERT to a delivery), or None when this channel should not take rows that way:
        it has a rate limit or a global concurrency (claims count those under the channel's
        lock), it is stopping, paused or held, its gate is not read yet, its own claim is under
        way, or it has no room. The room it asks for is reserved until ``page_claimed``."""
        if (
            self.lock_channel
            or self._stopping
            or self._closed
            or self.paused
            or self._gate_stale
            or self.claiming
            or self._hold_until > time.monotonic()
        ):
            return None
        limit = self._room()
        if not limit:
            return None
        self.claiming += 1
        self._reserved += limit
        return self._request(limit)

    def page_claimed(
        self, request: store.ClaimRequest, rows: list[store.Claimed] | None, t_claim: float
    ) -> None:
        """The materialiser's page committed with ``rows`` claimed for this channel (None: it
        failed, nothing was claimed)."""
        self.claiming -= 1
        self._reserved -= request.limit
        if rows is not None:
            self._take(rows, t_claim)
            if rows and (self.paused or self._hold_until > time.monotonic()):
                # The pause (or hold) landed while the page ran: give these back too.
                self.gate_changed()
        # The room reserved was perhaps what left none for the claim loop, and no row of its own
        # may ever settle to wake it (the page's rows went to another daemon).
        self._woken_for_room()

    def gate_changed(self) -> None:
        """The channel was paused, resumed or throttled (a NOTIFY): read its gate again."""
        self._gate_stale = True
        self.waker.wake("gate")

    async def _read_gate(self) -> store.Gate:
        async with self.pool.connection() as conn:
            return await store.next_available(conn, channel=self.name)

    async def _apply_gate(self, gate: store.Gate) -> None:
        """Take the channel's state from the database. Paused, or held by a throttle or the
        circuit breaker: give back the rows queued here (not started, so not counted), so that
        they are claimed again under the channel's limits once it opens. Asked on every read
        while paused or held, not only when that changes: rows a page claimed just as the pause
        landed, and rows whose give-back failed, are given back by the next read."""
        self._hold_until = time.monotonic() + gate.hold_s if gate.hold_s else 0.0
        changed = gate.paused != self.paused
        if changed:
            self.paused = gate.paused
            self.metrics.channel_paused.labels(self.name).set(1 if gate.paused else 0)
            log.warning(
                "channel %s", "paused" if gate.paused else "resumed", extra={"channel": self.name}
            )
        if (gate.paused or gate.hold_s) and self._queue:
            await self._give_back_queued("paused" if gate.paused else "held")
        elif changed and not gate.paused:
            for _ in range(min(len(self._queue), len(self._idle))):
                self._idle.pop().set()

    async def _give_back_queued(self, why: str) -> None:
        """Release the queued rows. Should the release fail (a dropped connection, a failover),
        they stay queued and owned (the heartbeat keeps their leases) and the gate is read
        again, which tries once more: never forgotten in the lease registry."""
        queued = list(self._queue)
        self._queue.clear()
        if not queued:
            return
        held = [Held(r.id, r.lease, self.name) for r in queued]
        try:
            released = await release_all(self.pool, self.leases, self.identity, held)
        except BaseException:
            self._queue.extendleft(reversed(queued))
            self._gate_stale = True
            raise
        if self.tracer is not None:
            self.tracer.released((r.id, r.lease) for r in queued)
        self.held -= len(queued)
        log.info(
            "gave back %d queued rows of a %s channel", released, why, extra={"channel": self.name}
        )

    async def claim_step(self) -> Next:
        """Claim as many rows as there is room for (at most one batch) and queue them."""
        if self._stopping:
            return Next(math.inf, "stopped")
        if self._gate_stale or self.paused:
            self._gate_stale = False
            await self._apply_gate(await self._read_gate())
            if self.paused:
                return Next(self.tick, "paused")  # a resume NOTIFY wakes us sooner
        limit = self._room()
        if not limit:
            # A delivery ending, rows settling or a page giving back its reserved room wakes us.
            self._slot_wait = True
            return Next(math.inf, "slot")
        self.claiming += 1
        t_claim = time.monotonic()
        try:
            rows = await self._claim(limit)
        finally:
            self.claiming -= 1
        self._take(rows, t_claim)
        if self._stopping:
            return Next(math.inf, "stopped")
        if len(rows) == limit:
            return Next(0, "more")
        # Only now, with the rows handed to the workers: when is the next row claimable? Asked
        # of the database's clock, so a host clock that is off cannot make the loop spin.
        gate = await self._read_gate()
        await self._apply_gate(gate)
        wait = gate.wait_s
        if gate.paused:
            return Next(self.tick, "paused")
        if wait is None:
            return Next(self.tick, "tick")
        # The gate may keep a claimable row waiting: a throttle, the rate limit's tokens, a
        # global concurrency reached (another daemon's outcome frees a slot: look again soon).
        wait = max(
            wait,
            gate.hold_s or 0.0,
            gate.tokens_s or 0.0,
            self.FULL_POLL if gate.full else 0.0,
        )
        if not rows and wait <= 0:
            # Nothing claimed, yet something is due now. Once, that is a row that became due
            # between the claim and this question: claim again at once. Twice in a row, it is a
            # row locked by another transaction: look again soon, not at once.
            self._due_unclaimed += 1
            if self._due_unclaimed > 1:
                wait = self.EMPTY_PASS_FLOOR
        else:
            self._due_unclaimed = 0
        return Next(max(0.0, min(self.tick, wait)), "timer" if wait < self.tick else "tick")

    def _take(self, rows: list[store.Claimed], t_claim: float) -> None:
        """Queue what a claim returned (rows closed at the claim are counted and logged) and wake
        as many idle workers as it brought rows."""
        taken = 0
        for row in rows:
            if row.prev_status == "claimed":
                self.metrics.lease_reclaims.labels(self.name).inc()
                log.warning(
                    "reclaimed a row whose lease expired",
                    extra={
                        "work_id": row.id,
                        "channel": self.name,
                        "attempt": row.attempts,
                        "operation_id": str(row.operation_id),
                    },
                )
            if row.status != "claimed":
                self.metrics.closed_at_claim.labels(self.name, row.status).inc()
                log.info(
                    "closed at claim instead of sending: %s",
                    row.status,
                    extra={
                        "work_id": row.id,
                        "channel": self.name,
                        "outcome": row.status,
                        "operation_id": str(row.operation_id),
                    },
                )
                continue
            self.leases.add(Held(row.id, row.lease, self.name))
            if self._closed:
                continue  # stopping: held, and released without counting an attempt
            self._queue.append(row)
            taken += 1
        if self.tracer is not None and taken:
            self.tracer.claimed(list(self._queue)[-taken:], self.name, t_claim, time.monotonic())
        self.held += taken
        self._m_claimed.inc(taken)
        for _ in range(min(taken, len(self._idle))):
            self._idle.pop().set()

    async def _worker(self) -> None:
        """Runs deliveries one after another inside one cancel scope, which the reaper cancels
        when the attempt under way is overdue (a scope per attempt cost ~15 µs of a no-op
        delivery's ~100). A cancelled scope is left at once and a new one made, so the
        cancellation ends that one attempt: the next starts in a fresh scope."""
        done = 0
        while not self._closed:
            row: store.Claimed | None = None
            started: _Started | None = None
            with anyio.CancelScope() as scope:
                while not self._closed:
                    if not self._queue or self.paused:
                        ev = anyio.Event()
                        self._idle.append(ev)
                        await ev.wait()
                        continue
                    if self._hold_until:
                        # Throttled: queued rows wait (their leases are kept) until the hold
                        # passes.
                        hold = self._hold_until - time.monotonic()
                        if hold > 0:
                            # In slices: a resume (or a stop) ends the hold early.
                            await anyio.sleep(min(hold, self.HOLD_SLICE))
                            continue
                        self._hold_until = 0.0
                    row = self._queue.popleft()
                    started = self._start(row)
                    self._attempts[scope] = started.t0 + self.attempt_timeout
                    try:
                        outcome = await self._call(started.delivery)
                    finally:
                        del self._attempts[scope]
                        self.active -= 1
                    self._finish(row, started, outcome)
                    row = None
                    if scope.cancel_called:
                        break  # the target kept its answer from a timed-out attempt
                    done += 1
                    if done % self.YIELD_EVERY == 0:
                        await anyio.lowlevel.checkpoint()
            if row is not None and started is not None:
                # Left by the reaper's cancellation: this attempt timed out.
                self._finish(
                    row,
                    started,
                    Retry(
                        error=f"attempt timed out after {self.attempt_timeout:g}s "
                        f"(channels.{self.name}.attempt_timeout)",
                        error_class="AttemptTimeout",
                    ),
                )

    def _start(self, row: store.Claimed) -> _Started:
        traceparent, tracestate = row.traceparent, row.tracestate
        span = None
        if self.tracer is not None:
            span, traceparent, tracestate = self.tracer.deliver_start(
                (row.id, row.lease), self.name, self.channel.config.kind
            )
        self.active += 1
        return _Started(Delivery.from_claim(row, traceparent, tracestate), time.monotonic(), span)

    async def _call(self, d: Delivery) -> Outcome:
        # The whole attempt is bounded: a receiver dripping bytes or a hung target is a retry
        # (the reaper cancels the worker's scope once the attempt is overdue).
        try:
            return await self.channel.deliver(d)
        except Exception as e:  # a channel bug or a receiver problem: retry with backoff
            return Retry(error=f"{type(e).__name__}: {e}"[:500], error_class=type(e).__name__)

    def _finish(self, row: store.Claimed, started: _Started, outcome: Outcome) -> None:
        d, t0, span = started
        t1 = time.monotonic()
        elapsed = t1 - t0
        self._m_duration.observe(elapsed)
        avg = self._delivery_s
        self._delivery_s = elapsed if avg is None else avg + 0.1 * (elapsed - avg)
        # How long the occurrence has been tried: only a retry needs it (database clock).
        tried_for = (
            0.0
            if isinstance(outcome, Delivered)
            else (self.clock.db_time(t1) - row.retry_since).total_seconds()
        )
        ledger, status, delay, error = decide(
            outcome, row.attempts - row.attempts_base, self.policy, tried_for
        )
        if self.tracer is not None:
            self.tracer.deliver_end((row.id, row.lease), span, ledger, outcome.http_status, error)
        throttle = pause = None
        if isinstance(outcome, Retry):
            if outcome.throttle:
                hold = clean_delay(outcome.delay)
                throttle = min(self.THROTTLE_HOLD if hold is None else hold, self.MAX_THROTTLE_HOLD)
            pause = clean_text(outcome.pause, 500)
        self.writer.submit(
            Record(
                work_id=d.work_id,
                lease=row.lease,
                attempt=row.attempts,
                channel=self.name,
                outcome=ledger,
                status=status,
                retry_after=delay,
                started=t0,
                finished=t1,
                http_status=outcome.http_status,
                error_class=None if isinstance(outcome, Delivered) else outcome.error_class,
                error=error,
                receipt=outcome.receipt if isinstance(outcome, Delivered) else None,
                throttle=throttle,
                pause=pause,
                due_at=d.due_at,
                operation_id=d.operation_id,
                source=d.source,
                business_key=d.business_key,
                recipient=d.recipient,
                duration=elapsed,
            )
        )
        self.writing += 1
        self._woken_for_room()

    def settle(self, records: list[Record], fenced: set[tuple[int, int]]) -> None:
        """Called by the outcome writer once ``records`` of this channel are durable; ``fenced``
        holds the (work id, lease) of those refused because the lease had passed on."""
        log_info = log.isEnabledFor(logging.INFO)
        counted: dict[str, int] = {}
        for r in records:
            self.leases.drop(r.key)
            accepted = r.key not in fenced
            outcome = r.outcome if accepted else "fenced"
            counted[outcome] = counted.get(outcome, 0) + 1
            if self.tracer is not None:
                self.tracer.settled(r.key, r.outcome, accepted)
            if accepted and r.status == "delivered" and r.due_at is not None:
                # Both instants by the database's clock (see Clock).
                late = self.clock.seconds_since(r.due_at, r.finished)
                self._m_lateness.observe(late if late > 0.0 else 0.0)
                if r.outcome == "duplicate":
                    self._m_duplicates.inc()
            if r.status == "ready":
                self.waker.wake("local")  # the retry may be due before the next tick
            if accepted and r.throttle is not None:
                # Hold here at once (the other daemons learn it by NOTIFY); the gate read then
                # gives the queue back.
                self._hold_until = max(self._hold_until, r.finished + r.throttle)
                self.gate_changed()
            if accepted and r.pause is not None:
                # Start nothing more at once; the gate read then gives the queue back.
                self._hold_until = math.inf
                self.gate_changed()
            level = logging.WARNING if r.status == "dead" else logging.INFO
            if level == logging.WARNING or log_info:
                log.log(
                    level,
                    "attempt %s",
                    outcome,
                    extra={
                        "work_id": r.work_id,
                        "operation_id": str(r.operation_id),
                        "source": r.source,
                        "business_key": r.business_key,
                        "recipient": r.recipient,
                        "channel": self.name,
                        "attempt": r.attempt,
                        "outcome": outcome,
                        "status": r.status,
                        "duration_ms": round(r.duration * 1000, 2),
                        "http_status": r.http_status,
                        **({"error": r.error} if r.error else {}),
                        **(
                            {"retry_in_s": round(r.retry_after, 3)}
                            if r.retry_after is not None
                            else {}
                        ),
                    },
                )
        for label, n in counted.items():
            self._m_attempts[label].inc(n)
        self.held -= len(records)
        self.writing -= len(records)
        self._woken_for_room()


class Deliveries:
    """Every configured channel's claim loop and workers, as one duty.

    Started, it makes the channels known to the database (reminders naming them are accepted),
    starts each claim loop and its workers. ``stop`` is the delivery side of the two-stage stop:
    claiming stops at once, queued rows are not started, deliveries in flight get ``grace``
    seconds (or less on a hard stop), then pending outcomes are written and the rows still held
    are released without counting an attempt.
    """

    #: How often the stop looks whether every held row has settled, seconds.
    IDLE_POLL = 0.02
    #: Bound on the final flush and release after the grace period, seconds.
    FINAL_STEPS_TIMEOUT = 10.0

    def __init__(
        self,
        channels: dict[str, Channel],
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        writer: OutcomeWriter,
        leases: Leases,
        sup: Supervisor,
        cfg: Config,
        *,
        identity: tuple[str, str, int],
        clock: Clock,
        woken_by: WakerGroup,
        tracer: Tracer | None = None,
    ) -> None:
        self.pool = pool
        self.writer = writer
        self.leases = leases
        self.identity = identity
        self.workers = [
            ChannelWorker(
                ch,
                pool,
                writer,
                leases,
                sup,
                cfg,
                identity=identity,
                clock=clock,
                woken_by=woken_by,
                tracer=tracer,
            )
            for ch in channels.values()
        ]
        self._work: TaskGroup | None = None
        self._stopped = anyio.Event()

    def gate_changed(self, channel: str | None) -> None:
        """A channel's gate changed (NOTIFY ``pgwork_channel``); None: any may have (the
        listener reconnected, notifications may have been lost)."""
        for w in self.workers:
            if channel is None or w.name == channel:
                w.gate_changed()

    @property
    def held(self) -> int:
        """Rows claimed by this daemon and not yet settled."""
        return sum(w.held for w in self.workers)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Claim loops stop cooperatively (a flag), so a stop never cancels a claim statement;
        the work group holds only the delivery workers."""
        async with self.pool.connection() as conn, conn.transaction():
            changed = await store.register_channels(conn, [w.channel.config for w in self.workers])
        for name in changed:
            log.warning(
                "channel %s: this daemon's config changed its shared settings (catch_up, "
                "global_concurrency, rate_limit, breaker); daemons sharing a database should "
                "share them",
                name,
                extra={"channel": name},
            )
        async with anyio.create_task_group() as claims:
            for w in self.workers:
                await claims.start(w.run)
            async with anyio.create_task_group() as work:
                for w in self.workers:
                    w.start_workers(work)
                self._work = work
                task_status.started()
            for w in self.workers:
                w.close()
            self._stopped.set()

    async def stop(self, grace: float, hard: anyio.Event) -> None:
        """Stop claiming; return once every delivery in flight has ended (settled, or cancelled
        by the grace deadline or by ``hard``)."""
        assert self._work is not None, "stop() before run() started"
        work = self._work
        for w in self.workers:
            w.stop_claiming()
            w.stop_taking()
        work.cancel_scope.deadline = anyio.current_time() + grace

        async def hard_stop() -> None:
            await hard.wait()
            log.warning("second stop request: cancelling in-flight deliveries")
            work.cancel_scope.cancel()

        async def done_when_idle() -> None:
            # Shutdown only: a short poll is simpler than an event per worker.
            while self.held:  # noqa: ASYNC110
                await anyio.sleep(self.IDLE_POLL)
            work.cancel_scope.cancel()

        work.start_soon(hard_stop)
        work.start_soon(done_when_idle)
        await self._stopped.wait()
        await self._final_steps()

    async def _final_steps(self) -> None:
        """Bounded: write what is pending, then give back what we still hold."""
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(self.FINAL_STEPS_TIMEOUT) as scope,
        ):
            # A claim under way may have committed already: wait for its rows (held, never
            # started), so that they are given back below, not left claimed until their lease
            # expires. No claim starts after stop_claiming.
            while any(w.claiming for w in self.workers):  # noqa: ASYNC110
                await anyio.sleep(self.IDLE_POLL)
            await self.writer.drain()
            released = await release_all(self.pool, self.leases, self.identity)
            if released:
                log.info("released %d rows without counting an attempt", released)
        if scope.cancelled_caught:
            log.error(
                "final flush/release did not finish in %ss; held rows return when their "
                "lease expires",
                self.FINAL_STEPS_TIMEOUT,
            )
