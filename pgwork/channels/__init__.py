"""Delivery channels. The public names a python target uses live here:
``from pgwork.channels import Delivery, Delivered, Retry, Failed``.

A channel gets a :class:`Delivery` and answers :class:`Delivered`, :class:`Retry` or
:class:`Failed`. Raising an exception counts as :class:`Retry` (with backoff). The
``operation_id`` is the same on every attempt of an occurrence: receivers use it to deduplicate.
"""

from __future__ import annotations

from ..config import ChannelConfig, ConfigError
from .log import LogChannel
from .python import PythonChannel
from .types import Channel, Delivered, Delivery, Failed, Outcome, PayloadError, Retry
from .webhook import WebhookChannel, parse_retry_after

__all__ = [
    "Channel",
    "Delivered",
    "Delivery",
    "Failed",
    "LogChannel",
    "Outcome",
    "PayloadError",
    "PythonChannel",
    "Retry",
    "WebhookChannel",
    "make_channel",
    "parse_retry_after",
]


def make_channel(config: ChannelConfig) -> Channel:
    """:raises ConfigError: when a python channel's target cannot be loaded."""
    if config.kind == "log":
        return LogChannel(config)
    if config.kind == "webhook":
        return WebhookChannel(config)
    if config.kind == "python":
        return PythonChannel.load(config)
    raise ConfigError(f"channels.{config.name}.kind: unknown kind {config.kind!r}")
