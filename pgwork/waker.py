"""Wake a sleeping loop early, and say why it woke."""

from __future__ import annotations

import math

import anyio


class Waker:
    """A sleep that ``wake()`` cuts short. Wake-ups while nobody sleeps are remembered once,
    so a notification that arrives during a pass triggers one more pass, never zero."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._cause = ""

    def wake(self, cause: str) -> None:
        if not self._event.is_set():
            self._cause = cause
            self._event.set()

    async def sleep(self, seconds: float) -> str:
        """Sleep up to ``seconds``; return the wake cause, or ``"timer"`` if none came."""
        if not self._event.is_set() and seconds > 0:
            with anyio.move_on_after(seconds if math.isfinite(seconds) else None):
                await self._event.wait()
        if self._event.is_set():
            cause = self._cause
            self._event = anyio.Event()
            return cause
        return "timer"


class WakerGroup:
    """Wakes every member at once: the delivery loops, woken by the materialiser when it made
    rows and by the listener on a notification."""

    def __init__(self) -> None:
        self._members: list[Waker] = []

    def add(self, w: Waker) -> None:
        self._members.append(w)

    def wake(self, cause: str) -> None:
        for w in self._members:
            w.wake(cause)
