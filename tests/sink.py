"""A Python channel for tests: records every delivery and answers as the test scripts it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pgwork.channels import Delivery, Outcome

DELIVERED: list[Delivery] = []
#: business_key -> behaviour; a behaviour may return an outcome (None: delivered) or raise.
BEHAVIOUR: dict[str, Callable[[Delivery], Awaitable[Outcome | None]]] = {}
#: behaviour for keys not in BEHAVIOUR
DEFAULT: list[Callable[[Delivery], Awaitable[Outcome | None]]] = []


async def deliver(d: Delivery) -> Outcome | None:
    DELIVERED.append(d)
    b = BEHAVIOUR.get(d.business_key) or (DEFAULT[0] if DEFAULT else None)
    return await b(d) if b is not None else None


def reset() -> None:
    DELIVERED.clear()
    BEHAVIOUR.clear()
    DEFAULT.clear()


def not_async(d: Delivery) -> None:
    """Not a coroutine function: loading it as a channel target must fail."""
