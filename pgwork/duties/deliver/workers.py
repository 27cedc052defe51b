"""One channel's delivery workers: ``concurrency`` long-lived tasks that take rows from the
channel's queue, deliver each outside any transaction, decide what its outcome means (the retry
policy) and hand it to the outcome writer; and the reaper that ends an attempt past
``attempt_timeout``."""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from ... import store
from ...channels import KINDS, Delivered, Delivery, Retry
from ...channels.policy import decide
from ...channels.types import Outcome, attempt_timed_out
from ..outcomes import Record
from .gate import GateState
from .state import ChannelState, Lifecycle, Wiring


class _Started(NamedTuple):
    """An attempt under way: what the channel was given, when (monotonic), its trace span."""

    delivery: Delivery
    t0: float
    span: Any


class Workers:
    """A worker hands each outcome to the outcome writer and goes on with the next row; the row
    is settled (see Settling) once the outcome is durable. Workers sleep only when the queue is
    empty, and a claim wakes only as many as it brought rows: a task or a wake-up per row would
    cost more than a no-op delivery."""

    #: Deliveries a worker runs back to back before it yields to the event loop.
    YIELD_EVERY = 64
    #: A held worker looks again this often, seconds.
    HOLD_SLICE = 0.5

    def __init__(self, state: ChannelState, wiring: Wiring) -> None:
        self.state = state
        self.name = state.name
        self.channel = state.channel
        c = state.channel.config
        self.attempt_timeout = c.attempt_timeout
        self.policy = c.retry
        self.writer = wiring.writer
        self.clock = wiring.clock
        self.tracer = wiring.tracer
        kind = KINDS.get(c.kind)
        #: Its deliveries go to another host (a deliver span is a client's).
        self._remote = kind is not None and kind.remote
        # The state's containers, at hand (never replaced, only changed).
        self._queue = state.queue
        self._idle = state.idle
        self._awaiting_outcome = state.awaiting_outcome
        #: Attempts under way and when each must end: the workers add, the reaper reads.
        self._attempts: dict[anyio.CancelScope, float] = {}
        self._m_duration = state.metrics.delivery_duration.labels(self.name)

    def start(self, tg: TaskGroup) -> None:
        for _ in range(self.state.concurrency):
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

    async def _delivering(self) -> None:
        """Runs deliveries one after another inside one cancel scope, which the reaper cancels
        when the attempt under way is overdue (not a scope per attempt: bench/README.md,
        "Per-delivery code"). A cancelled scope is left at once and a new one made, so the
        cancellation ends that one attempt: the next starts in a fresh scope."""
        done = 0
        s = self.state
        closed, paused, gate = Lifecycle.CLOSED, GateState.PAUSED, s.gate
        queue, idle = self._queue, self._idle
        while s.lifecycle is not closed:
            row: store.Claimed | None = None
            started: _Started | None = None
            with anyio.CancelScope() as scope:
                while s.lifecycle is not closed:
                    if not queue or gate.state is paused:
                        ev = anyio.Event()
                        idle.append(ev)
                        await ev.wait()
                        continue
                    if gate.until:
                        # Throttled: queued rows wait (their leases are kept) until the hold
                        # passes, in slices: a resume (or a stop) ends the hold early.
                        hold = gate.hold_left(time.monotonic())
                        if hold > 0:
                            await anyio.sleep(min(hold, self.HOLD_SLICE))
                            continue
                    row = queue.popleft()
                    started = self._start(row)
                    self._attempts[scope] = started.t0 + self.attempt_timeout
                    try:
                        outcome = await self._call(started.delivery)
                    finally:
                        del self._attempts[scope]
                        s.active -= 1
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
        self.state.active += 1
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
        # The row stays at hand until its outcome is durable: the settling counts and logs it.
        self._awaiting_outcome[row.id, row.lease] = (row, elapsed)
        if isinstance(outcome, Retry) and outcome.pause is not None:
            # The receiver is gone (a 410): start nothing more here at once, not once the
            # outcome is durable (a fast receiver got several more requests meanwhile); the
            # settling and the gate's read then hold the channel as the database says.
            self.state.gate.hold(math.inf)
        self.writer.submit(Record.of(row, self.name, outcome, decided, t0, t1))
        if self.state.capacity.delivered(elapsed):
            self.state.waker.wake("slot")
