"""The one shape every background loop has: sleep (or be woken), run a pass, log and back off on
failure, never die silently."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import psycopg
from anyio.abc import TaskStatus
from psycopg_pool import PoolTimeout

from .metrics import Metrics
from .waker import Waker

log = logging.getLogger("pgwork.supervise")


class Health:
    """Which passes are running and when each last made progress (a page, a batch, a flush): a
    pass that made no progress for far longer than any step should take means a stuck loop, and
    the systemd watchdog stops being fed. A long pass that keeps making progress is healthy."""

    def __init__(self) -> None:
        self.running: dict[str, float] = {}

    def begin(self, name: str) -> None:
        self.running[name] = time.monotonic()

    def progress(self, name: str) -> None:
        """``name`` finished a step of its pass (only counted while the pass runs)."""
        if name in self.running:
            self.running[name] = time.monotonic()

    def end(self, name: str) -> None:
        self.running.pop(name, None)

    def stuck(self, limit: float) -> list[tuple[str, float]]:
        """Passes without progress for longer than ``limit`` seconds, with how long."""
        now = time.monotonic()
        return [(n, now - t) for n, t in self.running.items() if now - t > limit]


class Revival:
    """Duties that lost the database wait out their backoff, or less: when it answers again (a
    probe connects once a second while any of them waits), every one of them looks again at
    once, so a long outage does not leave a loop asleep for its 30-second backoff afterwards.
    Only failures of the connection count (a statement's error, or a lock it waited for, is not
    cured by the server answering), and "answers again" is said only after a probe that got no
    answer."""

    PROBE_INTERVAL = 1.0

    def __init__(self) -> None:
        self.failing: set[Waker] = set()
        #: A probe got no answer since the last revival.
        self.down = False

    def failed(self, waker: Waker) -> None:
        self.failing.add(waker)

    def recovered(self, waker: Waker) -> None:
        self.failing.discard(waker)

    def revive(self) -> None:
        for w in list(self.failing):
            w.wake("revived")

    async def probe(self, connect: Callable[[], Awaitable[None]]) -> None:
        """While any duty waits for the database, try ``connect`` once a second; once it
        answers, revive them."""
        while True:
            await anyio.sleep(self.PROBE_INTERVAL)
            if not self.failing:
                continue
            try:
                await connect()
            except Exception:
                self.down = True
                continue
            if self.down:
                log.info("the database answers again; failed duties look again now")
                self.down = False
            self.revive()


#: How soon a duty that waited for a lock past its lock timeout tries again, seconds (each try
#: waits for the lock up to the timeout again: the lock's holder is an app, not an outage).
LOCK_RETRY = 0.5


def lock_wait(e: BaseException) -> bool:
    """A statement gave up waiting for a lock (its lock_timeout): another session holds what
    it needs. (psycopg files it under OperationalError, beside a lost connection.)"""
    return isinstance(e, psycopg.errors.LockNotAvailable)


def connection_lost(e: BaseException) -> bool:
    """The database did not answer (a lost or refused connection), as opposed to an error of
    a statement's or a lock it waited for."""
    return isinstance(
        e, psycopg.OperationalError | psycopg.InterfaceError | PoolTimeout
    ) and not lock_wait(e)


@dataclass(frozen=True)
class Next:
    """When a loop wants its next pass: after ``seconds`` (``reason`` labels the wake-up)."""

    seconds: float
    reason: str = "tick"


class Backoff:
    """Exponential backoff with full jitter; class constants are the tunables."""

    INITIAL = 0.5
    FACTOR = 2.0
    CAP = 30.0

    def __init__(self) -> None:
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        ceiling = min(self.CAP, self.INITIAL * self.FACTOR ** (self.failures - 1))
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.failures = 0

    async def until_done(
        self,
        attempt: Callable[[], Awaitable[None]],
        on_error: Callable[[Exception, float], None],
        stop: anyio.Event | None = None,
    ) -> bool:
        """The one retry shape for work that must finish (a startup wait, an outcome flush):
        run ``attempt`` until it returns, calling ``on_error(exc, delay)`` (log, count) and
        waiting ``delay`` after each failure. False when ``stop`` is set before it succeeds."""
        while stop is None or not stop.is_set():
            try:
                await attempt()
            except Exception as e:
                delay = self.next()
                on_error(e, delay)
                if stop is None:
                    await anyio.sleep(delay)
                else:
                    with anyio.move_on_after(delay):
                        await stop.wait()
                continue
            return True
        return False


@dataclass
class Supervisor:
    """What every duty's loop shares: metrics, the health record behind the systemd watchdog,
    the revival that cuts backoffs short when the database answers again, and who holds a lock
    a duty waits for (``who_holds``, set once the daemon has a pool: named once per wait)."""

    metrics: Metrics
    health: Health = field(default_factory=Health)
    revival: Revival = field(default_factory=Revival)
    who_holds: Callable[[], Awaitable[str]] | None = None

    async def loop(
        self,
        name: str,
        step: Callable[[], Awaitable[Next]],
        waker: Waker | None = None,
        *,
        first: Next | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run ``step`` forever, the one loop shape of every duty: sleep until the step's
        ``Next`` (or a wake-up), run a pass, and on an exception log, count and back off (cut
        short by a revival). Cancellation passes straight through (it is how a duty stops).
        ``task_status`` is started before the first sleep."""
        waker = waker or Waker()
        backoff = Backoff()
        nxt = first or Next(0, "start")
        waiting_since: float | None = None  # waiting for a lock another session holds
        task_status.started()
        while True:
            cause = await waker.sleep(nxt.seconds)
            self.metrics.wakeups.labels(name, nxt.reason if cause == "timer" else cause).inc()
            self.health.begin(name)
            try:
                nxt = await step()
            except Exception as e:
                self.metrics.duty_failures.labels(name).inc()
                if lock_wait(e):
                    # Not an outage, and no backoff to grow: another session holds a lock this
                    # pass needs. Said once, naming the holder (`pgwork status` does too).
                    if waiting_since is None:
                        waiting_since = time.monotonic()
                        log.warning(
                            "%s waits for a lock another session holds; it tries again until "
                            "the lock goes: %s",
                            name,
                            await self._holders(),
                            extra={"duty": name, "error_class": type(e).__name__},
                        )
                    nxt = Next(LOCK_RETRY, "locked")
                    continue
                delay = backoff.next()
                log.error(
                    "%s pass failed; retrying in %.1fs: %s",
                    name,
                    delay,
                    e,
                    extra={
                        "duty": name,
                        "error_class": type(e).__name__,
                        "failures": backoff.failures,
                    },
                    exc_info=backoff.failures == 1,
                )
                nxt = Next(delay, "retry")
                if connection_lost(e):
                    self.revival.failed(waker)
            else:
                self.revival.recovered(waker)
                if waiting_since is not None:
                    log.info(
                        "%s goes on: the lock it waited for went after %.0fs",
                        name,
                        time.monotonic() - waiting_since,
                        extra={"duty": name},
                    )
                    waiting_since = None
                if backoff.failures:
                    self.metrics.duty_restarts.labels(name).inc()
                    log.info(
                        "%s recovered after %d failed passes",
                        name,
                        backoff.failures,
                        extra={"duty": name},
                    )
                    backoff.reset()
                self.metrics.duty_last_success.labels(name).set_to_current_time()
            finally:
                self.health.end(name)

    async def _holders(self) -> str:
        """Who holds the locks pgwork's sessions wait for, as `pgwork status` names them."""
        if self.who_holds is None:
            return "(unknown: `pgwork status` names it)"
        try:
            return await self.who_holds()
        except Exception as e:  # a report only: the wait is said either way
            return f"(could not read who: {e})"
