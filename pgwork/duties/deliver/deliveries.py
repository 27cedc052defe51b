"""Every channel's claim loop and delivery workers as one duty, and the delivery side of the
two-stage stop."""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ... import store
from ...channels import Channel
from ..leases import release_all
from .channel import ChannelRunner, Wiring

log = logging.getLogger("pgwork.worker")


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

    def __init__(self, channels: dict[str, Channel], wiring: Wiring) -> None:
        self.pool = wiring.pool
        self.writer = wiring.writer
        self.leases = wiring.leases
        self.identity = wiring.identity
        self.runners = [ChannelRunner(ch, wiring) for ch in channels.values()]
        self._work: TaskGroup | None = None
        self._stopped = anyio.Event()

    def gate_changed(self, channel: str | None) -> None:
        """A channel's gate changed (NOTIFY ``pgwork_channel``); None: any may have (the
        listener reconnected, notifications may have been lost)."""
        for w in self.runners:
            if channel is None or w.name == channel:
                w.gate_changed()

    @property
    def held(self) -> int:
        """Rows claimed by this daemon and not yet settled."""
        return sum(w.held for w in self.runners)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Claim loops stop cooperatively (a flag), so a stop never cancels a claim statement;
        the work group holds only the delivery workers."""
        async with self.pool.connection() as conn, conn.transaction():
            changed = await store.register_channels(conn, [w.channel.config for w in self.runners])
        for name in changed:
            log.warning(
                "channel %s: this daemon's config changed its shared settings (catch_up, "
                "global_concurrency, rate_limit, breaker); daemons sharing a database should "
                "share them",
                name,
                extra={"channel": name},
            )
        async with anyio.create_task_group() as claims:
            for w in self.runners:
                await claims.start(w.run)
            async with anyio.create_task_group() as work:
                for w in self.runners:
                    w.start_workers(work)
                self._work = work
                task_status.started()
            for w in self.runners:
                w.stop_taking()
            self._stopped.set()

    async def stop(self, grace: float, hard: anyio.Event) -> None:
        """Stop claiming; return once every delivery in flight has ended (settled, or cancelled
        by the grace deadline or by ``hard``)."""
        assert self._work is not None, "stop() before run() started"
        work = self._work
        for w in self.runners:
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
            while any(w.claiming for w in self.runners):  # noqa: ASYNC110
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
