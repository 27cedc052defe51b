"""No-op Python channel for benchmarks; optionally records when each reminder reached it."""

from __future__ import annotations

import time

import anyio

from pgwork.channels import Delivery

#: business_key -> time.time() of the call, while RECORD is on.
CALLED: dict[str, float] = {}
RECORD = False
_waiting: dict[str, anyio.Event] = {}


async def deliver(d: Delivery) -> None:
    if RECORD:
        CALLED[d.business_key] = time.time()
        ev = _waiting.pop(d.business_key, None)
        if ev is not None:
            ev.set()


def expect(key: str) -> None:
    _waiting[key] = anyio.Event()


async def wait(key: str) -> float:
    """When ``key`` (announced with ``expect``) reached the channel."""
    ev = _waiting.get(key)
    if ev is not None:
        await ev.wait()
    return CALLED[key]
