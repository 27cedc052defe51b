"""`pgwork run`: every duty started in one anyio task group, and a two-stage stop.

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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import psycopg
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from . import build, db, eventloop, logs, store
from .channels import Channel, make_channel
from .clock import Clock
from .config import Config
from .duties.deliver import Deliveries, Wiring
from .duties.gauges import Gauges
from .duties.leases import Heartbeat, Leases
from .duties.listener import Listener
from .duties.materialise import Materialiser, warm_pages
from .duties.outcomes import OutcomeWriter, check_shape
from .duties.retention import RetentionDuty
from .duties.trends import Trends
from .metrics import Metrics, serve_metrics
from .secrets import Secrets
from .supervise import Supervisor, connection_lost
from .tracing import Tracer
from .waker import WakerGroup

log = logging.getLogger("pgwork.daemon")

#: The exit status of a daemon that stepped aside for `pgwork migrate` (EX_TEMPFAIL): its
#: supervisor starts it again (systemd's Restart=on-failure, a container's restart policy).
STEPPED_ASIDE = 75

Pool = AsyncConnectionPool[AsyncConnection[Any]]


@dataclass
class Daemon:
    cfg: Config
    dsn: str
    metrics: Metrics = field(default_factory=Metrics)
    identity: store.Identity = field(init=False)
    #: Set once every duty has started (tests and systemd readiness wait on it).
    ready: anyio.Event = field(default_factory=anyio.Event)
    #: Set when run() has returned.
    finished: anyio.Event = field(default_factory=anyio.Event)
    #: The database's clock, as seen from here.
    clock: Clock = field(default_factory=Clock)
    _state: str = "starting"
    #: Set by the first and the second stop request.
    _stopping: anyio.Event = field(default_factory=anyio.Event)
    _hard_stop: anyio.Event = field(default_factory=anyio.Event)
    _gauges: Gauges | None = None
    #: HOST:PORT the metrics are served on, once serving (the port got for 0 or a range).
    metrics_at: str | None = None
    #: The OpenTelemetry tracer provider for tracing.enabled (None: the process's global one).
    tracer_provider: Any = None
    #: HOST:PORT of the web page, once serving (web.enabled).
    web_at: str | None = None
    #: Who asked this daemon to step aside for a migration (it then exits with STEPPED_ASIDE).
    stepped_aside: str | None = None

    def __post_init__(self) -> None:
        self.sup = Supervisor(self.metrics)
        self.secrets = Secrets.from_config(self.cfg, self.dsn)
        logs.add_secrets(self.secrets)
        host, pid = socket.gethostname(), os.getpid()
        self.identity = store.Identity(
            self.cfg.daemon_id or f"{host}:{pid}:{secrets.token_hex(3)}", host, pid
        )

    @property
    def daemon_id(self) -> str:
        return self.identity.daemon_id

    @property
    def pooled(self) -> bool:
        """The DSN points at a transaction-pooling PgBouncer (``database.pooler``)."""
        return self.cfg.pooler == "transaction"

    @property
    def listen_dsn(self) -> str | None:
        """Where LISTEN connects: ``database.listen_dsn``; else the DSN itself, unless it goes
        through a pooler (LISTEN needs a session of its own): then None, no listener."""
        if self.cfg.listen_dsn:
            return self.cfg.listen_dsn
        return None if self.pooled else self.dsn

    @property
    def summary(self) -> str:
        """A one-line summary for `systemctl status` (the gauges duty's, while running)."""
        if self._state == "running" and self._gauges is not None:
            return self._gauges.summary
        if self._state == "running":
            return "running (metrics disabled: lag is in `pgwork status`)"
        return self._state

    def request_stop(self) -> None:
        """First call: graceful stop. Second call: cancel in-flight deliveries."""
        (self._hard_stop if self._stopping.is_set() else self._stopping).set()

    def step_aside(self, asked_by: str) -> None:
        """`pgwork migrate` asks: stop as on SIGTERM (no more claims or pages; deliveries in
        flight finish within the grace, queued rows are given back), then exit with
        ``STEPPED_ASIDE`` for the supervisor to start pgwork again, which waits for the
        migration at its start. Once; a stop already under way goes on as it is."""
        if self.stepped_aside is not None or self._stopping.is_set():
            return
        self.stepped_aside = asked_by
        log.warning(
            "stepping aside for `pgwork migrate` (%s): no more claims, deliveries in flight "
            "finish, then exit %d for the supervisor to start pgwork again",
            asked_by,
            STEPPED_ASIDE,
        )
        self.request_stop()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Wait for the database, start every duty, serve until stopped. The database lost at
        any step of the start (after it first answered, before ready) is waited for again, as
        at the first connection; once running, each duty rides out an outage itself."""
        try:
            while True:
                try:
                    await self._start(task_status)
                    return
                except Exception as e:
                    if self.ready.is_set() or not _database_lost(e):
                        raise
                    self._state = f"waiting for the database ({db.describe(self.dsn)})"
                    log.error(
                        "the database went away while pgwork was starting; waiting for it "
                        "again: %s",
                        db.redact(str(_first_leaf(e))).strip(),
                        extra={"error_class": type(_first_leaf(e)).__name__},
                    )
        finally:
            self.finished.set()

    async def _start(self, task_status: TaskStatus[None]) -> None:
        def waiting() -> None:
            self._state = f"waiting for the database ({db.describe(self.dsn)})"

        def waiting_for_schema(why: str) -> None:
            self._state = why

        if not await db.wait_until_reachable(
            self.dsn,
            timeout=self.cfg.connect_timeout,
            stop=self._stopping,
            on_failure=waiting,
            on_wait=waiting_for_schema,
            pooled=self.pooled,
        ):
            task_status.started()
            return
        channels = {n: make_channel(c) for n, c in self.cfg.channels.items()}
        server = None
        if self.cfg.metrics_enabled:
            server, self.metrics_at = serve_metrics(self.metrics.registry, self.cfg.metrics_listen)
        pool = db.make_pool(
            self.dsn,
            self.cfg.pool_size,
            self.cfg.connect_timeout,
            pooled=self.pooled,
            plan_once=True,
        )
        try:
            await pool.open(wait=True, timeout=self.cfg.connect_timeout * 4)
            async with pool.connection() as conn:
                await check_shape(conn)  # the outcome records against pgwork.outcome
            if not self.pooled:  # behind PgBouncer, a session is not a server connection
                await warm_pages(pool, self.cfg.pool_size)
            await self._run(pool, channels, task_status)
        finally:
            with anyio.CancelScope(shield=True):
                for ch in channels.values():
                    await ch.aclose()
                await pool.close(timeout=5)
                if server is not None:
                    server.shutdown()
                    server.server_close()

    async def _run(
        self, pool: Pool, channels: dict[str, Channel], task_status: TaskStatus[None]
    ) -> None:
        cfg, sup = self.cfg, self.sup
        leases = Leases()
        trends = Trends(pool, sup, self.daemon_id, self.clock)
        writer = OutcomeWriter(
            pool, sup.metrics, self.identity, sup.health, self.secrets, trends=trends
        )
        work_made = WakerGroup()
        deliveries = Deliveries(
            channels,
            Wiring(
                pool,
                writer,
                leases,
                sup,
                cfg,
                self.identity,
                clock=self.clock,
                woken_by=work_made,
                tracer=Tracer(self.tracer_provider) if cfg.tracing_enabled else None,
            ),
        )
        materialiser = Materialiser(
            pool,
            sup,
            work_made,
            tick=cfg.tick,
            lookahead=cfg.lookahead,
            page_size=cfg.page_size,
            claimers=[r.claimer for r in deliveries.runners],
            origin=self.daemon_id,
        )
        listen_dsn = self.listen_dsn
        heartbeat = Heartbeat(
            pool,
            leases,
            sup,
            lease=cfg.lease,
            identity=self.identity,
            clock=self.clock,
            listener_up=lambda: listener.up if listen_dsn else None,
            metrics_at=self.metrics_at,
            channels=sorted(self.cfg.channels),
            migration_asked=self.step_aside,
            session_pid=lambda: listener.session_pid if listen_dsn else None,
        )
        listener = Listener(
            listen_dsn or self.dsn,
            sup,
            materialiser.waker,
            work_made,
            connect_timeout=cfg.connect_timeout,
            gate_changed=deliveries.gate_changed,
            origin=self.daemon_id,
            changed=heartbeat.waker,
            # Any role may NOTIFY: the heartbeat looks at the owner's row, and steps aside
            # only for a request that stands there.
            migration_asked=lambda _: heartbeat.waker.wake("migrate"),
        )
        if listen_dsn is None:
            log.warning(
                "no LISTEN: database.pooler = transaction and no database.listen_dsn; new work "
                "is found by the tick (materialiser.tick = %ss) and the claim timers only",
                cfg.tick,
                extra={"duty": "listener"},
            )
        async with anyio.create_task_group() as duties:
            # Every duty is started (its first connection made, its loop entered) before READY;
            # the heartbeat first, as it reads the database's clock.
            await duties.start(heartbeat.run)
            await duties.start(writer.run)
            await duties.start(trends.run)
            if listen_dsn is not None:
                await duties.start(listener.run)
            await duties.start(materialiser.run)
            if cfg.metrics_enabled:
                self._gauges = Gauges(
                    pool,
                    sup,
                    interval=cfg.metrics_interval,
                    rows_held=lambda: deliveries.held,
                    listener_up=lambda: listener.up if listen_dsn else None,
                    source_series=cfg.metrics_source_lag_series,
                )
                await duties.start(self._gauges.run)
            if cfg.web_enabled:
                from . import web

                self.web_at = await duties.start(web.serve, pool, cfg)
            if cfg.retention_enabled:
                retention = RetentionDuty(
                    cfg.retention_dsn or self.dsn,
                    cfg.retention,
                    sup,
                    interval=cfg.retention_interval,
                    connect_timeout=cfg.connect_timeout,
                    pooled=self.pooled,
                )
                await duties.start(retention.run)
            duties.start_soon(
                sup.revival.probe, partial(db.probe, self.dsn, cfg.connect_timeout, self.pooled)
            )
            sup.who_holds = partial(_who_holds, pool)
            await duties.start(deliveries.run)

            self._state = "running"
            self.ready.set()
            task_status.started()
            log.info(
                "pgwork running",
                extra={
                    "daemon_id": self.daemon_id,
                    "channels": list(channels),
                    "database": db.describe(self.dsn),
                    "version": build.version(),
                    "event_loop": eventloop.name(),
                },
            )
            await self._stopping.wait()
            self._state = f"stopping: {deliveries.held} rows held"
            log.info(
                "stopping: claiming stopped, %d deliveries in flight",
                deliveries.held,
                extra={"grace_s": cfg.shutdown_grace, "outcomes_pending": writer.pending()},
            )
            await deliveries.stop(cfg.shutdown_grace, self._hard_stop)
            await trends.last_write()
            duties.cancel_scope.cancel()
        log.info("pgwork stopped", extra={"daemon_id": self.daemon_id})


def _database_lost(e: BaseException) -> bool:
    """Every error under ``e`` (a task group's, leaf by leaf) is the database not answering,
    and none is an answer that will not change (a database or role that does not exist, …)."""
    if isinstance(e, BaseExceptionGroup):
        return all(_database_lost(x) for x in e.exceptions)
    return connection_lost(e) and not (
        isinstance(e, psycopg.OperationalError) and db.refused_for_good(e)
    )


def _first_leaf(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


async def _who_holds(pool: Any) -> str:
    """The sessions holding the locks pgwork's sessions wait for, on one line."""
    async with pool.connection(timeout=5) as conn:
        holders = await store.lock_holders(conn)
    return store.holders_text(holders) or "(it went meanwhile)"
