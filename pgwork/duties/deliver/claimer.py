"""One channel's claimer: the claim loop that keeps its queue topped up (claim due rows with
SKIP LOCKED in short transactions, as many as there is room for), the channel's gate read from
the database (paused, throttled, the rate limit's tokens, a global concurrency), the rows given
back when it closes, and the rows the materialiser's page claims for it."""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

import anyio
from anyio.abc import TaskStatus

from ... import store
from ...store import Status
from ...supervise import Next
from ..leases import Claim, release_all
from .state import ChannelState, Lifecycle, Wiring

log = logging.getLogger("pgwork.worker")


class Claimer:
    #: Least wait after a claim that got nothing while a row was due (locked by someone), seconds.
    EMPTY_PASS_FLOOR = 0.05
    #: How often a channel at its global concurrency (or throttle limit) looks for a free slot
    #: that another daemon's outcome made, seconds.
    FULL_POLL = 0.05

    def __init__(self, state: ChannelState, wiring: Wiring) -> None:
        self.state = state
        self.name = state.name
        self.pool = wiring.pool
        self.sup = wiring.sup
        self.leases = wiring.leases
        self.identity = wiring.identity
        self.metrics = state.metrics
        cfg, c = wiring.cfg, state.channel.config
        self.tick = cfg.tick
        self.lease = timedelta(seconds=cfg.lease)
        self.max_attempts = c.retry.max_attempts
        self.daemon_id = wiring.identity.daemon_id
        self.expire_after = timedelta(seconds=c.expire_after) if c.expire_after else None
        self.synchronous_claims = cfg.synchronous_claims
        #: Configured limits that claims count (under the channel's lock, see
        #: pgwork.claim_lanes): the materialiser's page does not claim for such a channel. The
        #: config's half of pgwork.limited (work.sql), which also counts a throttle limit: the
        #: page asks that too.
        self.lock_channel = c.rate_limit is not None or c.global_concurrency is not None
        #: Consecutive claims that got nothing while a row was due.
        self._due_unclaimed = 0
        self._m_claimed = state.metrics.claimed.labels(self.name)

    def _request(self, limit: int) -> store.ClaimRequest:
        return store.ClaimRequest(
            channel=self.name,
            limit=limit,
            max_attempts=self.max_attempts,
            lease=self.lease,
            daemon_id=self.daemon_id,
            expire_after=self.expire_after,
            synchronous=self.synchronous_claims,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The claim loop, supervised. It stops cooperatively (``stop_claiming``), so a stop
        never cancels a claim statement."""
        await self.sup.loop(
            f"claim:{self.name}", self.claim_step, self.state.waker, task_status=task_status
        )

    async def claim_step(self) -> Next:
        """Claim as many rows as there is room for (at most one batch) and queue them."""
        s = self.state
        if s.lifecycle is not Lifecycle.CLAIMING:
            return Next(math.inf, "stopped")
        if s.gate.must_read():
            await self._apply_gate(await self._read_gate())
            if s.gate.paused:
                return Next(self.tick, "paused")  # a resume NOTIFY wakes us sooner
        limit = s.capacity.room()
        if not limit:
            # A delivery ending, rows settling or a page giving back its reserved room wakes us.
            s.capacity.wait_for_room()
            return Next(math.inf, "slot")
        s.claiming += 1
        t_claim = time.monotonic()
        try:
            async with self.pool.connection() as conn:
                rows = await store.claim_work(conn, self._request(limit))
        finally:
            s.claiming -= 1
        self.queue_claimed(rows, t_claim)
        if s.lifecycle is not Lifecycle.CLAIMING:
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

    def page_claim(self) -> store.ClaimRequest | None:
        """What the materialiser's page may insert claimed for this channel (one hop from the
        app's INSERT to a delivery), or None when this channel should not take rows that way:
        it has a rate limit or a global concurrency (claims count those under the channel's
        lock), it is stopping, paused or held, its gate is not read yet, its own claim is under
        way, or it has no room. The room it asks for is reserved until ``page_claimed``."""
        s = self.state
        if (
            self.lock_channel
            or s.lifecycle is not Lifecycle.CLAIMING
            or s.claiming
            or not s.gate.allows_page_claim(time.monotonic())
        ):
            return None
        limit = s.capacity.room()
        if not limit:
            return None
        s.claiming += 1
        s.capacity.reserve(limit)
        return self._request(limit)

    def page_claimed(
        self, request: store.ClaimRequest, rows: list[store.Claimed] | None, t_claim: float
    ) -> None:
        """The materialiser's page committed with ``rows`` claimed for this channel (None: it
        failed, nothing was claimed)."""
        s = self.state
        s.claiming -= 1
        if rows is not None:
            self.queue_claimed(rows, t_claim)
            if rows and not s.gate.allows_page_claim(time.monotonic()):
                # A pause (or hold) landed while the page ran: give these back too.
                self.gate_changed()
        # The room reserved was perhaps what left none for the claim loop, and no row of its own
        # may ever settle to wake it (the page's rows went to another daemon).
        s.wake_for_room(s.capacity.unreserve(request.limit))

    def gate_changed(self) -> None:
        """The channel was paused, resumed or throttled (a NOTIFY): read its gate again."""
        self.state.gate.changed()
        self.state.waker.wake("gate")

    async def _read_gate(self) -> store.GateReading:
        async with self.pool.connection() as conn:
            return await store.next_available(conn, channel=self.name)

    async def _apply_gate(self, gate: store.GateReading) -> None:
        """Take the channel's state from the database. Paused, or held by a throttle or the
        circuit breaker: give back the rows queued here (not started, so not counted), so that
        they are claimed again under the channel's limits once it opens. Asked on every read
        while paused or held, not only when that changes: rows a page claimed just as the pause
        landed, and rows whose give-back failed, are given back by the next read."""
        s = self.state
        changed, give_back = s.gate.read(gate, time.monotonic())
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
        if give_back and s.queue:
            await self._give_back_queued("paused" if gate.paused else "throttled")
        elif changed and not gate.paused:
            s.wake_idle(len(s.queue))

    async def _give_back_queued(self, why: str) -> None:
        """Release the queued rows. Should the release fail (a dropped connection, a failover),
        they stay queued and owned (the heartbeat keeps their leases) and the gate is read
        again, which tries once more: never forgotten in the lease registry."""
        s = self.state
        queued = list(s.queue)
        s.queue.clear()
        if not queued:
            return
        claims = [Claim(r.id, r.lease, self.name) for r in queued]
        try:
            released = await release_all(self.pool, self.leases, self.identity, claims)
        except BaseException:
            s.queue.extendleft(reversed(queued))
            s.gate.changed()
            raise
        if s.tracer is not None:
            s.tracer.released((r.id, r.lease) for r in queued)
        s.wake_for_room(s.capacity.given_back(len(queued)))
        log.info(
            "gave back %d queued rows of a %s channel", released, why, extra={"channel": self.name}
        )

    def queue_claimed(self, rows: list[store.Claimed], t_claim: float) -> None:
        """Queue what a claim returned (rows closed at the claim are counted and logged) and wake
        as many idle workers as it brought rows."""
        s = self.state
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
            if s.lifecycle is Lifecycle.CLOSED:
                continue  # stopping: held, and released without counting an attempt
            s.queue.append(row)
            taken += 1
        if s.tracer is not None and taken:
            s.tracer.claimed(list(s.queue)[-taken:], self.name, t_claim, time.monotonic())
        s.capacity.taken(taken)
        self._m_claimed.inc(taken)
        s.wake_idle(taken)
