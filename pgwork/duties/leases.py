"""Leases: the claims this daemon holds, by (work id, lease); the heartbeat duty that extends
them (and keeps this daemon's row, and its view of the database's clock, current); and their
release on shutdown."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta
from typing import Any

import anyio
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import build, store
from ..clock import Clock
from ..store import ClaimKey, Identity
from ..supervise import Next, Supervisor
from ..waker import Waker

log = logging.getLogger("pgwork.leases")


@dataclass
class Claim:
    """A claim this daemon holds: a row claimed, its outcome not yet durable."""

    work_id: int
    lease: int
    channel: str


class Leases:
    """The claims this daemon holds, by (work id, lease), for heartbeats and for release on
    shutdown. One row can be held under two leases at once (a lease expired while its delivery
    was still running, and this daemon claimed the row again): they are two claims."""

    def __init__(self) -> None:
        self.claims: dict[ClaimKey, Claim] = {}

    def add(self, h: Claim) -> None:
        self.claims[(h.work_id, h.lease)] = h

    def drop(self, key: ClaimKey) -> None:
        self.claims.pop(key, None)


async def heartbeat_step(
    pool: AsyncConnectionPool[AsyncConnection[Any]], leases: Leases, lease: float
) -> set[ClaimKey]:
    """Extend the lease of every claim still held; returns the (work id, lease) no longer ours."""
    claims = list(leases.claims.values())
    if not claims:
        return set()
    async with pool.connection() as conn:
        rows = await store.extend_leases(
            conn,
            work_id=[h.work_id for h in claims],
            lease_no=[h.lease for h in claims],
            lease=timedelta(seconds=lease),
        )
    kept = {(r.id, r.lease) for r in rows}
    lost = {(h.work_id, h.lease) for h in claims} - kept
    # A claim whose outcome became durable meanwhile was dropped from `leases`; only the rest are lost.
    return {k for k in lost if k in leases.claims}


async def release_all(
    pool: AsyncConnectionPool[AsyncConnection[Any]],
    leases: Leases,
    identity: Identity,
    only: list[Claim] | None = None,
) -> int:
    """Give back every row still held (or ``only`` these), without counting the attempt.
    Returns how many."""
    claims = list(leases.claims.values()) if only is None else only
    if not claims:
        return 0
    daemon_id, host, pid = identity
    async with pool.connection() as conn:
        rows = await store.release_leases(
            conn,
            work_id=[h.work_id for h in claims],
            lease_no=[h.lease for h in claims],
            daemon_id=daemon_id,
            host=host,
            pid=pid,
        )
    for h in claims:
        leases.drop((h.work_id, h.lease))
    return len(rows)


@dataclass(eq=False)
class Heartbeat:
    """The heartbeat duty, every lease/3: extend every held lease (a lease lost meanwhile is
    logged; its late outcome will be fenced), refresh this daemon's row with its listener state
    (written only when it changed while the listener's session holds the daemon's session lock:
    then that lock says the daemon is alive; without it, every interval), forget daemons gone for
    long, and re-read the database's clock."""

    pool: AsyncConnectionPool[AsyncConnection[Any]]
    leases: Leases
    sup: Supervisor
    _: KW_ONLY
    lease: float
    identity: Identity
    clock: Clock
    #: Whether the LISTEN connection is up; None: no listener by configuration.
    listener_up: Callable[[], bool | None]
    #: HOST:PORT its metrics are served on (None: off), shown by `pgwork status`.
    metrics_at: str | None = None
    #: The channels it serves, shown to `pgwork channel retire`.
    channels: Sequence[str] = ()
    #: Wakes a heartbeat before its time (the listener came up or went down).
    waker: Waker = field(default_factory=Waker)
    #: Called with who asks when a heartbeat finds `pgwork migrate` asking the daemons to step
    #: aside (the floor under the listener's NOTIFY).
    migration_asked: Callable[[str], None] = lambda _: None
    #: The pid of the session holding this daemon's session lock (the listener's; None: none).
    session_pid: Callable[[], int | None] = lambda: None
    #: What the row says now (listener up, session pid); None: not written since registering.
    _written: tuple[bool | None, int | None] | None = field(default=None, init=False)

    @property
    def daemon_id(self) -> str:
        return self.identity.daemon_id

    @property
    def every(self) -> float:
        """Seconds between heartbeats: three per lease."""
        return self.lease / 3

    async def step(self) -> Next:
        for work_id, lease in await heartbeat_step(self.pool, self.leases, self.lease):
            log.warning(
                "lease lost while delivering (another worker may take the row)",
                extra={"work_id": work_id, "lease": lease},
            )
        state = (self.listener_up(), self.session_pid())
        async with self.pool.connection() as conn:
            if state[1] is None or state != self._written:
                # Seen alive by the heartbeat's time: written every interval.
                found, asked_by = await store.daemon_heartbeat(
                    conn, id=self.daemon_id, listener_up=state[0], session_pid=state[1]
                )
                if not found:  # forgotten by another daemon (judged gone meanwhile): again
                    await self._register(conn)
                    self._written = None
                else:
                    self._written = state
            else:
                # Seen alive by its session's lock, and the row says so: nothing to write.
                asked_by = await store.migration_pending(conn)
            gone = await store.daemons_forget_gone(conn)
            await self.clock.sync(conn)
        if asked_by is not None:
            self.migration_asked(asked_by)
        for g in gone:
            log.info("forgot daemon %s: no heartbeat for long", g, extra={"gone": g})
        return Next(self.every, "tick")

    async def _register(self, conn: AsyncConnection[Any]) -> None:
        daemon_id, host, pid = self.identity
        await store.daemon_register(
            conn,
            id=daemon_id,
            host=host,
            pid=pid,
            version=build.version(),
            heartbeat_every=timedelta(seconds=self.every),
            listener_up=self.listener_up(),
            metrics_at=self.metrics_at,
            channels=self.channels,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Registers this daemon's row, heartbeats until cancelled, then removes the row."""
        async with self.pool.connection() as conn:
            await self._register(conn)
            await self.clock.sync(conn)
        self.clock.warn_if_skewed()
        try:
            await self.sup.loop(
                "heartbeat",
                self.step,
                self.waker,
                first=Next(self.every, "tick"),
                task_status=task_status,
            )
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                async with self.pool.connection() as conn:
                    await store.daemon_unregister(conn, id=self.daemon_id)
