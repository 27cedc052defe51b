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
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskStatus
from prometheus_client import start_http_server
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from . import __version__, db, gauges, logs, materialiser
from .channels import Channel, make_channel
from .clock import Clock
from .config import Config, ConfigError
from .listener import Listener
from .metrics import Metrics
from .outcomes import OutcomeWriter, Record
from .queries import Q
from .retention import Retention
from .secrets import Secrets
from .supervise import Backoff, Health, Next, Revival, duty_loop
from .systemd import Notifier
from .waker import Waker
from .worker import ChannelWorker, Leases, heartbeat_step, release_all

log = logging.getLogger("pgwork.daemon")

#: Bound on the final flush and release after the grace period, seconds.
FINAL_STEPS_TIMEOUT = 10.0


@dataclass
class Daemon:
    cfg: Config
    dsn: str
    metrics: Metrics = field(default_factory=Metrics)
    identity: tuple[str, str, int] = field(init=False)
    health: Health = field(default_factory=Health)
    materialiser_waker: Waker = field(default_factory=Waker)
    #: Set once every duty has started (tests and systemd readiness wait on it).
    ready: anyio.Event = field(default_factory=anyio.Event)
    #: Set when run() has returned.
    finished: anyio.Event = field(default_factory=anyio.Event)
    #: A one-line summary for `systemctl status`, refreshed by the metrics duty.
    summary: str = "starting"
    _stop_requested: int = 0
    _stop_changed: anyio.Event = field(default_factory=anyio.Event)
    _workers: dict[str, ChannelWorker] = field(default_factory=dict)
    #: The database's clock, as seen from here.
    clock: Clock = field(default_factory=Clock)
    revival: Revival = field(default_factory=Revival)

    def __post_init__(self) -> None:
        self.secrets = Secrets.from_config(self.cfg, self.dsn)
        logs.add_secrets(self.secrets)
        host = socket.gethostname()
        pid = os.getpid()
        self.identity = (self.cfg.daemon_id or f"{host}:{pid}:{secrets.token_hex(3)}", host, pid)

    @property
    def daemon_id(self) -> str:
        return self.identity[0]

    @property
    def heartbeat_every(self) -> float:
        """Seconds between heartbeats (leases are extended three times per lease)."""
        return self.cfg.lease / 3

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: cancel in-flight deliveries."""
        self._stop_requested += 1
        self._stop_changed.set()

    async def _stop_level(self, level: int) -> None:
        while self._stop_requested < level:
            await self._stop_changed.wait()
            self._stop_changed = anyio.Event()

    # -- startup ---------------------------------------------------------------------------

    async def _wait_for_database(self) -> bool:
        """Wait until the database answers (retrying with backoff, logging each failure) and
        check its schema. Returns False when a stop was requested meanwhile."""
        backoff = Backoff()
        while not self._stop_requested:
            try:
                conn = await db.connect(self.dsn, timeout=self.cfg.connect_timeout)
            except Exception as e:
                delay = backoff.next()
                log.error(
                    "database unreachable (%s); retrying in %.1fs: %s",
                    db.describe(self.dsn),
                    delay,
                    db.redact(str(e)).strip(),
                    extra={"error_class": type(e).__name__},
                )
                self.summary = f"waiting for the database ({db.describe(self.dsn)})"
                with anyio.move_on_after(delay):
                    await self._stop_level(1)
                continue
            try:
                await db.check_schema(conn)
            finally:
                await conn.close()
            return True
        return False

    async def _prepare(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        names = list(self.cfg.channels)
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(
                Q["register_channels"],
                {"names": names, "kinds": [self.cfg.channels[n].kind for n in names]},
            )
            daemon_id, host, pid = self.identity
            await conn.execute(
                Q["daemon_register"],
                {
                    "id": daemon_id,
                    "host": host,
                    "pid": pid,
                    "version": __version__,
                    "heartbeat_every": timedelta(seconds=self.heartbeat_every),
                },
            )
        async with pool.connection() as conn:
            await self.clock.sync(conn)
        self.clock.warn_if_skewed()

    def _start_metrics_server(self) -> Any:
        if not self.cfg.metrics_enabled:
            return None
        host, _, port = self.cfg.metrics_listen.rpartition(":")
        try:
            server, _thread = start_http_server(
                int(port), host or "127.0.0.1", self.metrics.registry
            )
        except (OSError, ValueError, OverflowError) as e:
            raise ConfigError(
                f"metrics.listen: cannot serve on {self.cfg.metrics_listen!r}: {e}"
            ) from None
        log.info("metrics on http://%s/metrics", self.cfg.metrics_listen)
        return server

    # -- run -------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            if not await self._wait_for_database():
                task_status.started()
                return
            channels: dict[str, Channel] = {
                n: make_channel(c) for n, c in self.cfg.channels.items()
            }
            server = self._start_metrics_server()
            pool = db.make_pool(self.dsn, self.cfg.pool_size, self.cfg.connect_timeout)
            await pool.open(wait=True, timeout=self.cfg.connect_timeout * 4)
            try:
                await self._prepare(pool)
                await self._run(pool, channels, task_status)
            finally:
                with anyio.CancelScope(shield=True):
                    for ch in channels.values():
                        await ch.aclose()
                    with anyio.move_on_after(5):
                        async with pool.connection() as conn:
                            await conn.execute(Q["daemon_unregister"], {"id": self.daemon_id})
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
        cfg = self.cfg
        leases = Leases()
        workers = self._workers

        def written(records: list[Record], fenced: set[tuple[int, int]]) -> None:
            by_channel: dict[str, list[Record]] = {}
            for r in records:
                by_channel.setdefault(r.channel, []).append(r)
            for name, rs in by_channel.items():
                workers[name].settle(rs, fenced)

        writer = OutcomeWriter(
            pool,
            self.metrics,
            self.identity,
            on_written=written,
            health=self.health,
            secrets=self.secrets,
        )
        for name, ch in channels.items():
            workers[name] = ChannelWorker(
                ch,
                pool,
                writer,
                leases,
                self.metrics,
                daemon_id=self.daemon_id,
                lease=cfg.lease,
                claim_batch=cfg.claim_batch,
                tick=cfg.tick,
                clock=self.clock,
            )
        listener = Listener(
            self.dsn,
            self.metrics,
            self.materialiser_waker,
            lambda: [w.waker for w in workers.values()],
            connect_timeout=cfg.connect_timeout,
            revival=self.revival,
        )

        def wake_workers() -> None:
            for w in workers.values():
                w.waker.wake("local")

        stalls = materialiser.Stalls()

        async def materialise_step() -> Next:
            async with pool.connection() as conn:
                res = await materialiser.run_once(
                    conn,
                    lookahead=cfg.lookahead,
                    page_size=cfg.page_size,
                    on_made=wake_workers,
                    progress=lambda: self.health.progress("materialiser"),
                )
            locked, busy = stalls.result(res, time.monotonic())
            self.metrics.materialiser_locked.set(locked)
            self.metrics.materialiser_busy.set(busy)
            if res is None:
                return Next(materialiser.BUSY_RETRY, "busy")
            self.metrics.materialised.inc(res.made)
            self.metrics.materialiser_cutoff.set(res.cutoff.timestamp())
            self.metrics.materialiser_pass.observe(res.duration)
            if res.next_after_cutoff is None:
                return Next(cfg.tick, "tick")
            if res.skipped:
                # An app holds a due reminder's row lock: look again soon, without spinning.
                return Next(min(cfg.tick, materialiser.LOCKED_RETRY), "locked")
            # Sleep until the next known occurrence enters the look-ahead window (database clock).
            wait = res.next_after_cutoff
            return Next(min(cfg.tick, wait), "timer" if wait < cfg.tick else "tick")

        async def heartbeat() -> Next:
            lost = await heartbeat_step(pool, leases, cfg.lease)
            for work_id, lease in lost:
                log.warning(
                    "lease lost while delivering (another worker may take the row)",
                    extra={"work_id": work_id, "lease": lease},
                )
            async with pool.connection() as conn:
                await conn.execute(
                    Q["daemon_heartbeat"], {"id": self.daemon_id, "listener_up": listener.up}
                )
                gone = await db.fetch_all(conn, "daemons_forget_gone")
                await self.clock.sync(conn)
            for g in gone:
                log.info(
                    "forgot daemon %s: no heartbeat for long", g["id"], extra={"gone": g["id"]}
                )
            return Next(self.heartbeat_every, "tick")

        retention = Retention(cfg.retention, self.metrics)

        async def retention_step() -> Next:
            conn = await db.connect(cfg.retention_dsn or self.dsn, timeout=cfg.connect_timeout)
            try:
                await retention.configure(conn)
                res = await retention.run_once(
                    conn, progress=lambda: self.health.progress("retention")
                )
            finally:
                await conn.close()
            if not res.paused:
                self.metrics.retention_last_pass.set_to_current_time()
            return Next(cfg.retention_interval, "tick")

        def loop(
            name: str, step: Any, waker: Waker | None = None, first: Next | None = None
        ) -> Any:
            return partial(
                duty_loop,
                name,
                step,
                waker or Waker(),
                self.metrics,
                first=first,
                health=self.health,
                revival=self.revival,
            )

        async with anyio.create_task_group() as duties:
            duties.start_soon(writer.run)
            duties.start_soon(listener.run)
            duties.start_soon(loop("materialiser", materialise_step, self.materialiser_waker))
            duties.start_soon(
                loop("heartbeat", heartbeat, first=Next(self.heartbeat_every, "tick"))
            )
            if cfg.metrics_enabled:
                duties.start_soon(loop("metrics", partial(self._refresh_metrics, pool, listener)))
            duties.start_soon(self.revival.probe, partial(self._probe, cfg.connect_timeout))
            if cfg.retention_enabled:
                duties.start_soon(loop("retention", retention_step, first=Next(1.0, "tick")))

            # Claim loops live with the duties and stop cooperatively (a flag), so a stop never
            # cancels a database call; the work group holds only the delivery workers.
            for w in workers.values():
                duties.start_soon(loop(f"claim:{w.name}", w.claim_step, w.waker))

            async with anyio.create_task_group() as work:
                for w in workers.values():
                    w.start_workers(work)
                if not cfg.metrics_enabled:
                    self.summary = "running (metrics disabled: lag is in `pgwork status`)"
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

                # Claiming stopped. Rows claimed but not started are not started now (they are
                # released below); deliveries in flight get the grace period, or less on a second signal.
                for w in workers.values():
                    w.stop_claiming()
                    w.stop_taking()
                in_flight = sum(w.in_flight for w in workers.values())
                self.summary = f"stopping: {in_flight} deliveries in flight"
                log.info(
                    "stopping: claiming stopped, %d deliveries in flight",
                    in_flight,
                    extra={
                        "grace_s": cfg.shutdown_grace,
                        "outcomes_pending": writer.pending(),
                        "held": len(leases.held),
                    },
                )
                work.cancel_scope.deadline = anyio.current_time() + cfg.shutdown_grace

                async def hard_stop() -> None:
                    await self._stop_level(2)
                    log.warning("second stop request: cancelling in-flight deliveries")
                    work.cancel_scope.cancel()

                async def done_when_idle() -> None:
                    # Shutdown only: a 20 ms poll is simpler than an event per worker.
                    while any(w.in_flight for w in workers.values()):  # noqa: ASYNC110
                        await anyio.sleep(0.02)
                    work.cancel_scope.cancel()

                work.start_soon(hard_stop)
                work.start_soon(done_when_idle)

            for w in workers.values():
                w.close()
            # Final steps, bounded: write what is pending, then give back what we still hold.
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
            duties.cancel_scope.cancel()
        log.info("pgwork stopped", extra={"daemon_id": self.daemon_id})

    async def _probe(self, timeout: float) -> None:
        conn = await db.connect(self.dsn, timeout=timeout)
        await conn.close()

    async def _refresh_metrics(
        self, pool: AsyncConnectionPool[AsyncConnection[Any]], listener: Listener
    ) -> Next:
        """Database-derived gauges, refreshed here so that a scrape never runs a query. Every
        query reads an index bounded by live rows, dead letters or the catalog, never the rows
        retention keeps (bench/ measures this against a 10M-row table)."""
        async with pool.connection() as conn:
            reading = await gauges.read(conn)
        gauges.publish(self.metrics, reading)
        in_flight = sum(w.in_flight for w in self._workers.values())
        self.summary = (
            f"running: {in_flight} rows held, lag {reading.lag['lag_seconds']:.1f}s, "
            f"{reading.dead_letters} dead letters, "
            f"listener {'up' if listener.up else 'DOWN'}"
        )
        return Next(self.cfg.metrics_interval, "tick")


async def watchdog(daemon: Daemon, notifier: Notifier) -> None:
    """Feed the systemd watchdog at half its timeout, only while no pass is stuck; keep the
    STATUS= line current."""
    timeout = notifier.watchdog_timeout
    interval = timeout / 2 if timeout else 5.0
    complained = False
    while True:
        notifier.status(daemon.summary)
        if timeout:
            stuck = daemon.health.stuck(timeout)
            if not stuck:
                notifier.watchdog()
                complained = False
            elif not complained:
                complained = True
                log.error(
                    "not feeding the watchdog: %s",
                    ", ".join(f"{n} stuck for {s:.0f}s" for n, s in stuck),
                    extra={"stuck": [n for n, _ in stuck]},
                )
        await anyio.sleep(interval)


async def serve(daemon: Daemon, *, signals: bool = True, notifier: Notifier | None = None) -> None:
    """Run ``daemon`` until SIGTERM/SIGINT (or ``request_stop``) ends it, speaking sd_notify."""
    notifier = notifier or Notifier()
    try:
        async with anyio.create_task_group() as tg:
            if signals:

                async def on_signals() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                        async for signum in sigs:
                            log.info("received %s", signal.Signals(signum).name)
                            notifier.stopping()
                            daemon.request_stop()

                tg.start_soon(on_signals)
            notifier.status("starting: connecting to the database")
            await tg.start(daemon.run)
            if daemon.ready.is_set():
                notifier.ready(f"running: daemon {daemon.daemon_id}")
                tg.start_soon(watchdog, daemon, notifier)
            await daemon.finished.wait()
            notifier.stopping("stopped")
            tg.cancel_scope.cancel()
    finally:
        notifier.close()
