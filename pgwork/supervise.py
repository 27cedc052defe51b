"""The one shape every background loop has: sleep (or be woken), run a pass, log and back off on
failure, never die silently."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus

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
    """Duties that failed wait out their backoff, or less: when the database answers again (a
    probe connects once a second while any duty is failing), every one of them looks again at
    once, so a long outage does not leave a loop asleep for its 30-second backoff afterwards."""

    PROBE_INTERVAL = 1.0

    def __init__(self) -> None:
        self.failing: set[Waker] = set()

    def failed(self, waker: Waker) -> None:
        self.failing.add(waker)

    def recovered(self, waker: Waker) -> None:
        self.failing.discard(waker)

    def revive(self) -> None:
        for w in list(self.failing):
            w.wake("revived")

    async def probe(self, connect: Callable[[], Awaitable[None]]) -> None:
        """While any duty is failing, try ``connect`` once a second; on success revive them."""
        while True:
            await anyio.sleep(self.PROBE_INTERVAL)
            if not self.failing:
                continue
            try:
                await connect()
            except Exception:
                continue
            log.info("the database answers again; failed duties look again now")
            self.revive()


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
    and the revival that cuts backoffs short when the database answers again."""

    metrics: Metrics
    health: Health = field(default_factory=Health)
    revival: Revival = field(default_factory=Revival)

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
        task_status.started()
        while True:
            cause = await waker.sleep(nxt.seconds)
            self.metrics.wakeups.labels(name, nxt.reason if cause == "timer" else cause).inc()
            self.health.begin(name)
            try:
                nxt = await step()
            except Exception as e:
                self.metrics.duty_failures.labels(name).inc()
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
                self.revival.failed(waker)
            else:
                self.revival.recovered(waker)
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
