"""Listener duty: one dedicated LISTEN connection (outside the pool) that turns NOTIFY into
in-process wake-ups. It is only ever a hint: every loop also has its timed tick."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus
from psycopg import AsyncConnection

from .. import db, store
from ..supervise import Next, Supervisor
from ..waker import Waker, WakerGroup

log = logging.getLogger("pgwork.listener")

#: The NOTIFY channels: reminders written (materialiser), work rows made (delivery loops), a
#: delivery channel paused, resumed or throttled (its claim loop; the payload names it).
REMINDER_CHANNEL = "pgwork_reminder"
WORK_CHANNEL = "pgwork_work"
GATE_CHANNEL = "pgwork_channel"
#: `pgwork migrate` asks the daemons to step aside (the payload: who asks).
MIGRATE_CHANNEL = "pgwork_migrate"
CHANNELS = (REMINDER_CHANNEL, WORK_CHANNEL, GATE_CHANNEL, MIGRATE_CHANNEL)


@dataclass(eq=False)
class Listener:
    """One pass = one connection's life: connect, refuse a standby, LISTEN, wake everyone once
    (notifications sent while away are lost), then turn notifications into wake-ups, pinging
    through silences. A connection lost after it listened ends the pass normally (reconnect at
    once); one that cannot be made or refuses fails it (backoff, cut short by a revival)."""

    #: Seconds of silence before the connection is pinged.
    PING_INTERVAL = 10.0

    dsn: str
    sup: Supervisor
    materialiser: Waker
    claimers: WakerGroup
    _: KW_ONLY
    connect_timeout: float = 5.0
    #: Called with a delivery channel's name when its gate changed; None: any may have.
    gate_changed: Callable[[str | None], None] = lambda _: None
    #: This daemon's id: rows its own materialiser made (the NOTIFY's payload) woke its
    #: workers already.
    origin: str = ""
    #: Woken when the connection comes up or goes down (the heartbeat writes it to this
    #: daemon's row at once, for `pgwork status`).
    changed: Waker | None = None
    #: Called with the payload of a NOTIFY pgwork_migrate (any role may send one: it is a
    #: reason to look at the request, never the request itself).
    migration_asked: Callable[[str], None] = lambda _: None
    up: bool = field(default=False, init=False)
    #: The pid of the listening session while it holds this daemon's session lock (keyed by
    #: ``origin``): the daemon is seen alive by it without writing (pgwork.daemon_alive).
    session_pid: int | None = field(default=None, init=False)
    _first: anyio.Event = field(default_factory=anyio.Event, init=False)

    def _set_up(self, up: bool, session_pid: int | None = None) -> None:
        if (up, session_pid) != (self.up, self.session_pid) and self.changed is not None:
            self.changed.wake("listener")
        self.up, self.session_pid = up, session_pid
        self.sup.metrics.listener_up.set(1 if up else 0)

    async def step(self) -> Next:
        try:
            return await self._connection()
        finally:
            self._first.set()  # the first attempt is over, whichever way

    async def _connection(self) -> Next:
        conn = await db.connect(
            self.dsn,
            timeout=self.connect_timeout,
            keepalives=1,
            keepalives_idle=30,
            keepalives_interval=10,
            keepalives_count=3,
        )
        try:
            if await store.is_standby(conn):
                raise RuntimeError(
                    "connected to a standby (pg_is_in_recovery); NOTIFY does not reach it"
                )
            await store.listen(conn)
            pid = await store.daemon_session_lock(conn, id=self.origin) if self.origin else None
            self._set_up(True, pid)
            self._first.set()
            log.info("listening", extra={"duty": "listener", "channels": list(CHANNELS)})
            self.materialiser.wake("reconnect")
            self.claimers.wake("reconnect")
            self.gate_changed(None)
            try:
                await self._listen(conn)
            except Exception as e:  # lost after listening: reconnect at once
                log.warning(
                    "listener connection lost; reconnecting: %s",
                    db.redact(str(e)),
                    extra={"duty": "listener", "error_class": type(e).__name__},
                )
            return Next(0, "reconnect")
        finally:
            self._set_up(False)
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await conn.close()

    async def _listen(self, conn: AsyncConnection[Any]) -> None:
        # Waiting for notifications is not a pass in progress: the watchdog must not count it
        # (a hung ping is bounded by fail_after below).
        self.sup.health.end("listener")
        while True:
            got = False
            async for n in conn.notifies(timeout=self.PING_INTERVAL):
                got = True
                if n.channel == REMINDER_CHANNEL:
                    self.materialiser.wake("notify")
                elif n.channel == GATE_CHANNEL:
                    self.gate_changed(n.payload)
                elif n.channel == MIGRATE_CHANNEL:
                    self.migration_asked(n.payload)
                elif not (self.origin and n.payload == self.origin):
                    self.claimers.wake("notify")
            if not got:
                # Silence: make sure the connection is still alive.
                with anyio.fail_after(self.connect_timeout):
                    await store.ping(conn)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Started once the first connection attempt is over (listening, or failed and backing
        off): readiness waits for it, but never hangs on a listener that cannot connect."""
        self._set_up(False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sup.loop, "listener", self.step)
            await self._first.wait()
            task_status.started()
