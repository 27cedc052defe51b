"""The ``log`` channel: the demo channel of ``make run``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..logs import personal
from ..settings import ChannelConfig
from .types import DELIVERED, Delivery, Kind, Outcome


@dataclass
class LogChannel:
    """The demo channel: logs the delivery and succeeds."""

    config: ChannelConfig
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("pgwork.delivery"))

    async def deliver(self, d: Delivery) -> Outcome:
        self.log.info(
            "REMINDER %s/%s due %s -> %s",
            d.source,
            personal(d.business_key),  # log.redact covers the message text too
            d.due_at.isoformat(),
            personal(d.recipient),
            extra={
                "operation_id": str(d.operation_id),
                "source": d.source,
                "business_key": d.business_key,
                "recipient": d.recipient,
                "channel": d.channel,
                "attempt": d.attempt,
            },
        )
        return DELIVERED

    async def aclose(self) -> None:
        return None


@dataclass(frozen=True)
class LogOptions:
    """A log channel has no options of its own."""


def _read(
    raw: Mapping[str, Any], label: Callable[[str], str], env: Mapping[str, str], secrets: bool
) -> LogOptions:
    return LogOptions()


KIND = Kind(name="log", options=LogOptions, read=_read, make=LogChannel)
