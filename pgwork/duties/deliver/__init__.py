"""Claim/deliver duty: per channel, claim due rows with SKIP LOCKED in short transactions,
deliver outside any transaction, and hand the outcome to the outcome writer.

``capacity`` and ``gate`` hold the arithmetic (pure, synchronous); ``state`` what one channel's
roles share; ``claimer``, ``workers`` and ``settling`` its three roles, which ``channel`` puts
together; ``deliveries`` every channel as one duty, and the stop."""

from __future__ import annotations

from .capacity import Capacity
from .channel import ChannelRunner, Lifecycle, Wiring
from .deliveries import Deliveries
from .gate import Gate, GateState

__all__ = ["Capacity", "ChannelRunner", "Deliveries", "Gate", "GateState", "Lifecycle", "Wiring"]
