"""`pgwork run`: every duty in one anyio task group, and a two-stage stop.

Stop: the first SIGTERM/SIGINT stops claiming at once and gives in-flight deliveries
``shutdown_grace`` seconds; a second signal (or the grace deadline) cancels them. Then pending
outcomes are flushed, rows still held are released without counting an attempt, and the daemon
exits 0. SIGKILL at any point loses nothing: held rows come back when their lease expires.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from . import __version__, db, logs, store
from .channels import Channel, make_channel
from .clock import Clock
from .config import Config
from .duties.deliver import ChannelWorker
from .duties.gauges import Gauges
from .duties.leases import Heartbeat, Leases, release_all
from .duties.listener import Listener
from .duties.materialise import Materialiser
from .duties.outcomes import OutcomeWriter
from .duties.retention import RetentionDuty
from .metrics import Metrics, serve_metrics
from .secrets import Secrets
from .supervise import Supervisor
from .waker import WakerGroup

log = logging.getLogger("pgwork.daemon")

#: Bound on the final flush and release after the grace period, seconds.
FINAL_STEPS_TIMEOUT = 10.0


@dataclass
class Daemon:
    cfg: Config
    dsn: str
    metrics: Metrics = field(default_factory=Metrics)
    identity: tuple[str, str, int] = field(init=False)
    #: Set once every duty has started (tests and systemd readiness wait on it).
    ready: anyio.Event = field(default_factory=anyio.Event)
    #: Set when run() has returned.
    finished: anyio.Event = field(default_factory=anyio.Event)
    #: The database's clock, as seen from here.
    clock: Clock = field(default_factory=Clock)
    _state: str = "starting"
    _stop_requested: int = 0
    _stop_changed: anyio.Event = field(default_factory=anyio.Event)
    _gauges: Gauges | None = None

    def __post_init__(self) -> None:
        self.sup = Supervisor(self.metrics)
        self._held: Callable[[], int] = lambda: 0
        self.secrets = Secrets.from_config(self.cfg, self.dsn)
        logs.add_secrets(self.secrets)
        host = socket.gethostname()
        pid = os.getpid()
        self.identity = (self.cfg.daemon_id or f"{host}:{pid}:{secrets.token_hex(3)}", host, pid)

    @property
    def daemon_id(self) -> str:
        return self.identity[0]

    @property
    def summary(self) -> str:
        """A one-line summary for `systemctl status` (the gauges duty's, while running)."""
        if self._state == "running":
            if self._gauges is not None:
                return self._gauges.summary
            return "running (metrics disabled: lag is in `pgwork status`)"
        return self._state

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: cancel in-flight deliveries."""
        self._stop_requested += 1
        self._stop_changed.set()

    async def _stop_level(self, level: int) -> None:
        while self._stop_requested < level:
            await self._stop_changed.wait()
            self._stop_changed = anyio.Event()

    # -- startup ---------------------------------------------------------------------------

    async def _prepare(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        """Make the configured channels known (reminders naming them are accepted) and read the
        database's clock."""
        names = list(self.cfg.channels)
        async with pool.connection() as conn, conn.transaction():
            await store.register_channels(
                conn, names=names, kinds=[self.cfg.channels[n].kind for n in names]
            )
        async with pool.connection() as conn:
            await self.clock.sync(conn)
        self.clock.warn_if_skewed()

    # -- run -------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            stop = anyio.Event()

            def waiting() -> None:
                self._state = f"waiting for the database ({db.describe(self.dsn)})"

            async with anyio.create_task_group() as tg:

                async def stop_on_request() -> None:
                    await self._stop_level(1)
                    stop.set()

                tg.start_soon(stop_on_request)
                reachable = await db.wait_until_reachable(
                    self.dsn, timeout=self.cfg.connect_timeout, stop=stop, on_failure=waiting
                )
                tg.cancel_scope.cancel()
            if not reachable:
                task_status.started()
                return
            channels: dict[str, Channel] = {
                n: make_channel(c) for n, c in self.cfg.channels.items()
            }
            server = (
                serve_metrics(self.metrics.registry, self.cfg.metrics_listen)
                if self.cfg.metrics_enabled
                else None
            )
            pool = db.make_pool(self.dsn, self.cfg.pool_size, self.cfg.connect_timeout)
            await pool.open(wait=True, timeout=self.cfg.connect_timeout * 4)
            try:
                await self._prepare(pool)
                await self._run(pool, channels, task_status)
            finally:
                with anyio.CancelScope(shield=True):
                    for ch in channels.values():
                        await ch.aclose()
                    await pool.close(timeout=5)
                    if server is not None:
                        server.shutdown()
                        server.server_close()
        finally:
            self.finished.set()

    async def _run(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        channels: dict[str, Channel],
        task_status: TaskStatus[None],
    ) -> None:
        cfg, sup = self.cfg, self.sup
        leases = Leases()
        writer = OutcomeWriter(
            pool, sup.metrics, self.identity, health=sup.health, secrets=self.secrets
        )
        work_made = WakerGroup()
        workers = [
            ChannelWorker(
                ch,
                pool,
                writer,
                leases,
                sup,
                daemon_id=self.daemon_id,
                lease=cfg.lease,
                claim_batch=cfg.claim_batch,
                tick=cfg.tick,
                clock=self.clock,
                woken_by=work_made,
            )
            for ch in channels.values()
        ]
        materialiser = Materialiser(
            pool, sup, work_made, tick=cfg.tick, lookahead=cfg.lookahead, page_size=cfg.page_size
        )
        listener = Listener(
            self.dsn, sup, materialiser.waker, work_made, connect_timeout=cfg.connect_timeout
        )
        heartbeat = Heartbeat(
            pool,
            leases,
            sup,
            lease=cfg.lease,
            identity=self.identity,
            clock=self.clock,
            listener_up=lambda: listener.up,
        )
        self._held = lambda: sum(w.held for w in workers)

        async with anyio.create_task_group() as duties:
            # Every duty is started (its first connection made, its loop entered) before READY.
            await duties.start(writer.run)
            await duties.start(listener.run)
            await duties.start(materialiser.run)
            await duties.start(heartbeat.run)
            if cfg.metrics_enabled:
                self._gauges = Gauges(
                    pool,
                    sup,
                    interval=cfg.metrics_interval,
                    rows_held=self._held,
                    listener_up=lambda: listener.up,
                )
                await duties.start(self._gauges.run)
            if cfg.retention_enabled:
                retention = RetentionDuty(
                    cfg.retention_dsn or self.dsn,
                    cfg.retention,
                    sup,
                    interval=cfg.retention_interval,
                    connect_timeout=cfg.connect_timeout,
                )
                await duties.start(retention.run)
            duties.start_soon(sup.revival.probe, partial(self._probe, cfg.connect_timeout))
            # Claim loops stop cooperatively (a flag), so a stop never cancels a database call;
            # the work group holds only the delivery workers.
            for w in workers:
                await duties.start(w.run)

            async with anyio.create_task_group() as work:
                for w in workers:
                    w.start_workers(work)
                self._state = "running"
                self.ready.set()
                task_status.started()
                log.info(
                    "pgwork running",
                    extra={
                        "daemon_id": self.daemon_id,
                        "channels": list(channels),
                        "database": db.describe(self.dsn),
                        "version": __version__,
                    },
                )
                await self._stop_level(1)
                await self._graceful(work, workers, writer, leases)

            for w in workers:
                w.close()
            await self._final_steps(pool, writer, leases)
            duties.cancel_scope.cancel()
        log.info("pgwork stopped", extra={"daemon_id": self.daemon_id})

    async def _graceful(
        self,
        work: TaskGroup,
        workers: list[ChannelWorker],
        writer: OutcomeWriter,
        leases: Leases,
    ) -> None:
        """Claiming stops; rows claimed but not started are not started now (they are released
        at the end); deliveries in flight get the grace period, or less on a second signal."""
        for w in workers:
            w.stop_claiming()
            w.stop_taking()
        held = self._held()
        self._state = f"stopping: {held} rows held"
        log.info(
            "stopping: claiming stopped, %d deliveries in flight",
            held,
            extra={
                "grace_s": self.cfg.shutdown_grace,
                "outcomes_pending": writer.pending(),
                "held": len(leases.held),
            },
        )
        work.cancel_scope.deadline = anyio.current_time() + self.cfg.shutdown_grace

        async def hard_stop() -> None:
            await self._stop_level(2)
            log.warning("second stop request: cancelling in-flight deliveries")
            work.cancel_scope.cancel()

        async def done_when_idle() -> None:
            # Shutdown only: a 20 ms poll is simpler than an event per worker.
            while self._held():  # noqa: ASYNC110
                await anyio.sleep(0.02)
            work.cancel_scope.cancel()

        work.start_soon(hard_stop)
        work.start_soon(done_when_idle)

    async def _final_steps(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        writer: OutcomeWriter,
        leases: Leases,
    ) -> None:
        """Bounded: write what is pending, then give back what we still hold."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(FINAL_STEPS_TIMEOUT) as scope:
            await writer.drain()
            released = await release_all(pool, leases, self.identity)
            if released:
                log.info("released %d rows without counting an attempt", released)
        if scope.cancelled_caught:
            log.error(
                "final flush/release did not finish in %ss; held rows return when their "
                "lease expires",
                FINAL_STEPS_TIMEOUT,
            )

    async def _probe(self, timeout: float) -> None:
        conn = await db.connect(self.dsn, timeout=timeout)
        await conn.close()
