"""Listener duty: one dedicated LISTEN connection (outside the pool) that turns NOTIFY into
in-process wake-ups. It is only ever a hint: every loop also has its timed tick."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from psycopg import AsyncConnection

from . import db
from .metrics import Metrics
from .queries import Q
from .supervise import Backoff, Revival
from .waker import Waker

log = logging.getLogger("pgwork.listener")

CHANNELS = ("pgwork_reminder", "pgwork_work")


class Listener:
    def __init__(
        self,
        dsn: str,
        metrics: Metrics,
        materialiser: Waker,
        workers: Callable[[], Iterable[Waker]],
        *,
        ping_interval: float = 10.0,
        connect_timeout: float = 5.0,
        revival: Revival | None = None,
    ) -> None:
        self.dsn = dsn
        self.metrics = metrics
        self.materialiser = materialiser
        self.workers = workers
        self.ping_interval = ping_interval
        self.connect_timeout = connect_timeout
        self.revival = revival or Revival()
        #: Cuts a reconnect backoff short when the database answers again.
        self._retry = Waker()
        self._backoff_state = Backoff()
        self.up = False

    def _set_up(self, up: bool) -> None:
        self.up = up
        self.metrics.listener_up.set(1 if up else 0)

    def _wake_all(self, cause: str) -> None:
        self.materialiser.wake(cause)
        for w in self.workers():
            w.wake(cause)

    async def run(self) -> None:
        backoff = self._backoff_state = Backoff()
        self._set_up(False)
        while True:
            try:
                conn = await db.connect(
                    self.dsn,
                    timeout=self.connect_timeout,
                    keepalives=1,
                    keepalives_idle=30,
                    keepalives_interval=10,
                    keepalives_count=3,
                )
            except Exception as e:
                delay = backoff.next()
                log.warning(
                    "listener cannot connect; retrying in %.1fs: %s",
                    delay,
                    db.redact(str(e)),
                    extra={"duty": "listener", "error_class": type(e).__name__},
                )
                await self._backoff(delay)
                continue
            delay = 0.0
            try:
                await self._listen(conn)
            except Exception as e:
                delay = backoff.next()
                log.warning(
                    "listener connection lost; retrying in %.1fs: %s",
                    delay,
                    db.redact(str(e)),
                    extra={"duty": "listener", "error_class": type(e).__name__},
                )
                self.metrics.duty_failures.labels("listener").inc()
            finally:
                self._set_up(False)
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await conn.close()
            await self._backoff(delay)  # the delay just logged
            if backoff.failures:
                self.metrics.duty_restarts.labels("listener").inc()

    async def _backoff(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less if the database answers again meanwhile."""
        self.revival.failed(self._retry)
        try:
            await self._retry.sleep(delay)
        finally:
            self.revival.recovered(self._retry)

    async def _listen(self, conn: AsyncConnection[Any]) -> None:
        if (await db.fetch_one(conn, "is_standby"))["standby"]:
            raise RuntimeError(
                "connected to a standby (pg_is_in_recovery); NOTIFY does not reach it"
            )
        await conn.execute(Q["listen"])
        self._set_up(True)
        self._backoff_state.reset()  # listening again: the next loss starts from a short delay
        log.info("listening", extra={"duty": "listener", "channels": list(CHANNELS)})
        # Notifications sent while we were away are lost: look at everything once.
        self._wake_all("reconnect")
        while True:
            got = False
            async for n in conn.notifies(timeout=self.ping_interval):
                got = True
                if n.channel == "pgwork_reminder":
                    self.materialiser.wake("notify")
                else:
                    for w in self.workers():
                        w.wake("notify")
            if not got:
                # Silence: make sure the connection is still alive.
                with anyio.fail_after(self.connect_timeout):
                    await conn.execute(Q["ping"])
