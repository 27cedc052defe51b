"""The ``log`` channel: the demo channel of ``make run``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..config import ChannelConfig
from ..logs import personal
from .types import DELIVERED, Delivery, Outcome


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


#: The kind a channel config names to be delivered by this module, and how one is made.
KIND = "log"
make = LogChannel
