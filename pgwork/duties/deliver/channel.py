"""One channel's claim loop and delivery workers: claim due rows with SKIP LOCKED in short
transactions, deliver outside any transaction, hand each outcome to the outcome writer, and
settle the row once its outcome is durable. The arithmetic lives in ``Capacity`` and ``Gate``;
this module holds the tasks around them."""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from ... import store
from ...channels import KINDS, Channel, Delivered, Delivery, Retry
from ...channels.policy import decide
from ...channels.types import Outcome, attempt_timed_out
from ...clock import Clock
from ...config import Config
from ...store import Status
from ...supervise import Next, Supervisor
from ...tracing import Tracer
from ...waker import Waker, WakerGroup
from ..leases import Claim, Leases, release_all
from ..outcomes import OutcomeWriter, Record
from .capacity import Capacity
from .gate import Gate, GateState

log = logging.getLogger("pgwork.worker")


class Lifecycle(enum.Enum):
    #: Claims run, workers deliver.
    CLAIMING = "claiming"
    #: No claim starts (one under way finishes; its rows are held); workers deliver the queue.
    DRAINING = "draining"
    #: Queued rows are not started (held, and released without counting an attempt); idle
    #: workers end.
    CLOSED = "closed"


class _Started(NamedTuple):
    """An attempt under way: what the channel was given, when (monotonic), its trace span."""

    delivery: Delivery
    t0: float
    span: Any


@dataclass(frozen=True)
class Wiring:
    """What every channel's runner is built with, made once by the daemon: the pool, the outcome
    writer, the lease registry, the supervisor, the config, this daemon's identity and the
    database's clock as seen from here, the waker rows made and NOTIFYs ring, the tracer."""

    pool: AsyncConnectionPool[AsyncConnection[Any]]
    writer: OutcomeWriter
    leases: Leases
    sup: Supervisor
    cfg: Config
    identity: store.Identity
    clock: Clock = field(default_factory=Clock)
    woken_by: WakerGroup | None = None
    #: OpenTelemetry spans (tracing.enabled); None: off, and nothing on the path below pays.
    tracer: Tracer | None = None


class ChannelRunner:
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
    #: A held worker looks again this often, seconds.
    HOLD_SLICE = 0.5
    #: Beyond one row per worker, a channel holds only the rows its workers start within this
    #: long at their measured pace (see Capacity), seconds.
    PREFETCH_S = 0.25
    #: Batches of delivered rows whose outcomes may wait to be written (see Capacity).
    WRITING_BATCHES = 2

    def __init__(self, channel: Channel, wiring: Wiring) -> None:
        cfg, identity = wiring.cfg, wiring.identity
        self.channel = channel
        kind = KINDS.get(channel.config.kind)
        #: Its deliveries go to another host (a deliver span is a client's).
        self._remote = kind is not None and kind.remote
        self.tracer = wiring.tracer
        self.sup = wiring.sup
        metrics = wiring.sup.metrics
        self.clock = wiring.clock
        self.attempt_timeout = channel.config.attempt_timeout
        self.name = channel.config.name
        self.policy = channel.config.retry
        self.concurrency = channel.config.concurrency
        self.pool = wiring.pool
        self.writer = wiring.writer
        self.leases = wiring.leases
        self.metrics = metrics
        self.identity = identity
        self.daemon_id = identity.daemon_id
        self.lease = timedelta(seconds=cfg.lease)
        self.synchronous_claims = cfg.synchronous_claims
        c = channel.config
        self.expire_after = timedelta(seconds=c.expire_after) if c.expire_after else None
        #: Configured limits that claims count (under the channel's lock, see
        #: pgwork.claim_lanes): the materialiser's page does not claim for such a channel. The
        #: config's half of pgwork.limited (work.sql), which also counts a throttle limit: the
        #: page asks that too.
        self.lock_channel = c.rate_limit is not None or c.global_concurrency is not None
        self.claim_batch = cfg.claim_batch
        self.tick = cfg.tick
        self.waker = Waker()
        if wiring.woken_by is not None:
            wiring.woken_by.add(self.waker)  # rows made (materialiser), NOTIFY (listener)
        wiring.writer.subscribe(self.name, self.settle)
        # The state below, and the task that writes each (the claim loop, the workers, the
        # reaper, the materialiser's page, the outcome writer's settle, the listener, the stop):
        #: Rows held and the room for more: the claim loop and the page (taken, reserve), the
        #: workers (delivered), the outcome writer (settled), the claim loop and the stop
        #: (given_back).
        self.capacity = Capacity(
            self.concurrency,
            self.claim_batch,
            prefetch_s=self.PREFETCH_S,
            writing_batches=self.WRITING_BATCHES,
        )
        #: The channel's gate: the claim loop (read), the outcome writer (hold), the listener
        #: and a failed give-back (changed), a worker lifting a passed hold.
        self.gate = Gate()
        #: Claiming, draining or closed: the stop (stop_claiming, stop_taking).
        self.lifecycle = Lifecycle.CLAIMING
        #: Rows claimed and queued, not started: appended by the claim loop and the page, popped
        #: by the workers, emptied by a give-back and the stop.
        self._queue: deque[store.Claimed] = deque()
        #: Idle workers' events: appended by a worker, set by whoever queues rows or stops.
        self._idle: list[anyio.Event] = []
        #: Deliveries inside the channel right now: the workers.
        self.active = 0
        #: Claim statements under way (this loop's, or a page's for this channel): the claim
        #: loop and the page; a stop waits for them, then gives back their rows.
        self.claiming = 0
        #: Consecutive claims that got nothing while a row was due: the claim loop.
        self._due_unclaimed = 0
        #: Attempts under way and when each must end: the workers add, the reaper reads.
        self._attempts: dict[anyio.CancelScope, float] = {}
        #: Delivered rows whose outcome is not durable yet, and how long each delivery took: a
        #: worker adds, the outcome writer's settle takes (for the metrics and the log line).
        self._awaiting_outcome: dict[store.ClaimKey, tuple[store.Claimed, float]] = {}
        # Labelled metric children, looked up once.
        self._m_attempts = {
            o: metrics.attempts.labels(self.name, o)
            for o in ("delivered", "duplicate", "retry", "failed", "fenced")
        }
        self._m_duration = metrics.delivery_duration.labels(self.name)
        self._m_lateness = metrics.lateness.labels(self.name)
        # Read when scraped: a set() per delivery cost more than the delivery of a no-op.
        metrics.rows_held.labels(self.name).set_function(lambda: self.capacity.held)
        metrics.deliveries_active.labels(self.name).set_function(lambda: self.active)
        self._m_claimed = metrics.claimed.labels(self.name)
        self._m_duplicates = metrics.duplicates.labels(self.name)

    def start_workers(self, tg: TaskGroup) -> None:
        for _ in range(self.concurrency):
            tg.start_soon(self._delivering)
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

    @property
    def held(self) -> int:
        """Rows claimed by this channel and not yet settled."""
        return self.capacity.held

    def stop_claiming(self) -> None:
        """Claim nothing more (a claim under way finishes; its rows are held, not started)."""
        if self.lifecycle is Lifecycle.CLAIMING:
            self.lifecycle = Lifecycle.DRAINING
        self.waker.wake("stop")

    def stop_taking(self) -> None:
        """On shutdown: queued rows are not started (they stay held and are released without
        counting an attempt); idle workers end; nothing is claimed."""
        self.lifecycle = Lifecycle.CLOSED
        left = len(self._queue)
        if self.tracer is not None:
            self.tracer.released((r.id, r.lease) for r in self._queue)
        self._queue.clear()
        self.capacity.given_back(left)
        for ev in self._idle:
            ev.set()
        self._idle.clear()

    def _request(self, limit: int) -> store.ClaimRequest:
        return store.ClaimRequest(
            channel=self.name,
            limit=limit,
            max_attempts=self.policy.max_attempts,
            lease=self.lease,
            daemon_id=self.daemon_id,
            expire_after=self.expire_after,
            synchronous=self.synchronous_claims,
        )

    async def _claim(self, limit: int) -> list[store.Claimed]:
        async with self.pool.connection() as conn:
            return await store.claim_work(conn, self._request(limit))

    def _wake_for_room(self, woken: bool) -> None:
        """A capacity transition freed room worth a claim while the claim loop slept for it."""
        if woken:
            self.waker.wake("slot")

    def page_claim(self) -> store.ClaimRequest | None:
        """What the materialiser's page may insert claimed for this channel (one hop from the
        app's INSERT to a delivery), or None when this channel should not take rows that way:
        it has a rate limit or a global concurrency (claims count those under the channel's
        lock), it is stopping, paused or held, its gate is not read yet, its own claim is under
        way, or it has no room. The room it asks for is reserved until ``page_claimed``."""
        if (
            self.lock_channel
            or self.lifecycle is not Lifecycle.CLAIMING
            or self.claiming
            or not self.gate.allows_page_claim(time.monotonic())
        ):
            return None
        limit = self.capacity.room()
        if not limit:
            return None
        self.claiming += 1
        self.capacity.reserve(limit)
        return self._request(limit)

    def page_claimed(
        self, request: store.ClaimRequest, rows: list[store.Claimed] | None, t_claim: float
    ) -> None:
        """The materialiser's page committed with ``rows`` claimed for this channel (None: it
        failed, nothing was claimed)."""
        self.claiming -= 1
        if rows is not None:
            self._queue_claimed(rows, t_claim)
            if rows and not self.gate.allows_page_claim(time.monotonic()):
                # A pause (or hold) landed while the page ran: give these back too.
                self.gate_changed()
        # The room reserved was perhaps what left none for the claim loop, and no row of its own
        # may ever settle to wake it (the page's rows went to another daemon).
        self._wake_for_room(self.capacity.unreserve(request.limit))

    def gate_changed(self) -> None:
        """The channel was paused, resumed or throttled (a NOTIFY): read its gate again."""
        self.gate.changed()
        self.waker.wake("gate")

    async def _read_gate(self) -> store.GateReading:
        async with self.pool.connection() as conn:
            return await store.next_available(conn, channel=self.name)

    async def _apply_gate(self, gate: store.GateReading) -> None:
        """Take the channel's state from the database. Paused, or held by a throttle or the
        circuit breaker: give back the rows queued here (not started, so not counted), so that
        they are claimed again under the channel's limits once it opens. Asked on every read
        while paused or held, not only when that changes: rows a page claimed just as the pause
        landed, and rows whose give-back failed, are given back by the next read."""
        changed, give_back = self.gate.read(gate, time.monotonic())
        if changed and gate.retired:
            # Its gauges go with the next refresh (they are the channels the database has).
            log.warning(
                "channel %s was retired (`pgwork channel retire`): this daemon claims none of "
                "its work until it is registered again; remove it from this daemon's config, or "
                "a restart registers it again",
                self.name,
                extra={"channel": self.name},
            )
        elif changed:
            self.metrics.channel_paused.labels(self.name).set(1 if gate.paused else 0)
            log.warning(
                "channel %s", "paused" if gate.paused else "resumed", extra={"channel": self.name}
            )
        if give_back and self._queue:
            await self._give_back_queued("paused" if gate.paused else "throttled")
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
        claims = [Claim(r.id, r.lease, self.name) for r in queued]
        try:
            released = await release_all(self.pool, self.leases, self.identity, claims)
        except BaseException:
            self._queue.extendleft(reversed(queued))
            self.gate.changed()
            raise
        if self.tracer is not None:
            self.tracer.released((r.id, r.lease) for r in queued)
        self._wake_for_room(self.capacity.given_back(len(queued)))
        log.info(
            "gave back %d queued rows of a %s channel", released, why, extra={"channel": self.name}
        )

    async def claim_step(self) -> Next:
        """Claim as many rows as there is room for (at most one batch) and queue them."""
        if self.lifecycle is not Lifecycle.CLAIMING:
            return Next(math.inf, "stopped")
        if self.gate.must_read():
            await self._apply_gate(await self._read_gate())
            if self.gate.paused:
                return Next(self.tick, "paused")  # a resume NOTIFY wakes us sooner
        limit = self.capacity.room()
        if not limit:
            # A delivery ending, rows settling or a page giving back its reserved room wakes us.
            self.capacity.wait_for_room()
            return Next(math.inf, "slot")
        self.claiming += 1
        t_claim = time.monotonic()
        try:
            rows = await self._claim(limit)
        finally:
            self.claiming -= 1
        self._queue_claimed(rows, t_claim)
        if self.lifecycle is not Lifecycle.CLAIMING:
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

    def _queue_claimed(self, rows: list[store.Claimed], t_claim: float) -> None:
        """Queue what a claim returned (rows closed at the claim are counted and logged) and wake
        as many idle workers as it brought rows."""
        taken = 0
        for row in rows:
            if row.prev_status == Status.CLAIMED:
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
            if row.status != Status.CLAIMED:
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
            self.leases.add(Claim(row.id, row.lease, self.name))
            if self.lifecycle is Lifecycle.CLOSED:
                continue  # stopping: held, and released without counting an attempt
            self._queue.append(row)
            taken += 1
        if self.tracer is not None and taken:
            self.tracer.claimed(list(self._queue)[-taken:], self.name, t_claim, time.monotonic())
        self.capacity.taken(taken)
        self._m_claimed.inc(taken)
        for _ in range(min(taken, len(self._idle))):
            self._idle.pop().set()

    async def _delivering(self) -> None:
        """Runs deliveries one after another inside one cancel scope, which the reaper cancels
        when the attempt under way is overdue (not a scope per attempt: bench/README.md, "Per-delivery code"). A cancelled scope
        is left at once and a new one made, so the cancellation ends that one attempt: the next
        starts in a fresh scope."""
        done = 0
        closed, paused, gate = Lifecycle.CLOSED, GateState.PAUSED, self.gate
        while self.lifecycle is not closed:
            row: store.Claimed | None = None
            started: _Started | None = None
            with anyio.CancelScope() as scope:
                while self.lifecycle is not closed:
                    if not self._queue or gate.state is paused:
                        ev = anyio.Event()
                        self._idle.append(ev)
                        await ev.wait()
                        continue
                    if gate.until:
                        # Throttled: queued rows wait (their leases are kept) until the hold
                        # passes, in slices: a resume (or a stop) ends the hold early.
                        hold = gate.hold_left(time.monotonic())
                        if hold > 0:
                            await anyio.sleep(min(hold, self.HOLD_SLICE))
                            continue
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
                self._finish(row, started, attempt_timed_out(self.name, self.attempt_timeout))

    def _start(self, row: store.Claimed) -> _Started:
        traceparent, tracestate = row.traceparent, row.tracestate
        span = None
        if self.tracer is not None:
            span, traceparent, tracestate = self.tracer.deliver_start(
                (row.id, row.lease), self.name, self._remote
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
        _, t0, span = started
        t1 = time.monotonic()
        elapsed = t1 - t0
        self._m_duration.observe(elapsed)
        # How long the occurrence has been tried: only a retry needs it (database clock).
        tried_for = (
            0.0
            if isinstance(outcome, Delivered)
            else (self.clock.db_time(t1) - row.retry_since).total_seconds()
        )
        decided = decide(outcome, row.attempts - row.attempts_base, self.policy, tried_for)
        if self.tracer is not None:
            self.tracer.deliver_end(
                (row.id, row.lease), span, decided.ledger, outcome.http_status, decided.error
            )
        # The row stays at hand until its outcome is durable: settle counts and logs it.
        self._awaiting_outcome[row.id, row.lease] = (row, elapsed)
        self.writer.submit(Record.of(row, self.name, outcome, decided, t0, t1))
        if self.capacity.delivered(elapsed):
            self.waker.wake("slot")

    def settle(self, records: list[Record], fenced: set[store.ClaimKey]) -> None:
        """Called by the outcome writer once ``records`` of this channel are durable; ``fenced``
        holds the (work id, lease) of those refused because the lease had passed on."""
        logged = log.getEffectiveLevel()
        counted: dict[str, int] = {}
        for r in records:
            key = r.key
            self.leases.drop(key)
            row, elapsed = self._awaiting_outcome.pop(key)
            accepted = key not in fenced
            outcome = r.outcome if accepted else "fenced"
            counted[outcome] = counted.get(outcome, 0) + 1
            if self.tracer is not None:
                self.tracer.settled(key, r.outcome, accepted)
            if accepted and r.status == Status.DELIVERED:
                # Both instants by the database's clock (see Clock).
                late = self.clock.seconds_since(row.due_at, r.finished)
                self._m_lateness.observe(late if late > 0.0 else 0.0)
                if r.outcome == "duplicate":
                    self._m_duplicates.inc()
            if r.status == Status.READY:
                self.waker.wake("local")  # the retry may be due before the next tick
            if accepted and r.throttle is not None:
                # Hold here at once (the other daemons learn it by NOTIFY); the gate read then
                # gives the queue back.
                self.gate.hold(r.finished + r.throttle)
                self.waker.wake("gate")
            if accepted and r.pause is not None:
                # Start nothing more at once; the gate read then gives the queue back.
                self.gate.hold(math.inf)
                self.waker.wake("gate")
            # A delivered attempt at debug: the ledger and the metrics have it, and a line each
            # cost a third of a webhook delivery's CPU in the daemon (bench/README.md); what
            # went wrong at info, a dead letter at warning.
            if r.status == Status.DEAD:
                level = logging.WARNING
            elif accepted and r.status == Status.DELIVERED:
                level = logging.DEBUG
            else:
                level = logging.INFO
            if level >= logged:
                log.log(
                    level,
                    "dead letter after attempt %s" if r.status == Status.DEAD else "attempt %s",
                    outcome,
                    extra=r.log_fields(row, outcome, elapsed),
                )
        for label, n in counted.items():
            self._m_attempts[label].inc(n)
        self._wake_for_room(self.capacity.settled(len(records)))
