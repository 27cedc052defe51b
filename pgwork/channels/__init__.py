"""Delivery channels. The public names a python target uses live here:
``from pgwork.channels import Delivery, Delivered, Retry, Failed``.

A channel gets a :class:`Delivery` and answers :class:`Delivered`, :class:`Retry` or
:class:`Failed`. Raising an exception counts as :class:`Retry` (with backoff). The
``operation_id`` is the same on every attempt of an occurrence: receivers use it to deduplicate.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import ChannelConfig, ConfigError
from . import log, python, webhook
from .log import LogChannel
from .python import PythonChannel
from .types import Channel, Delivered, Delivery, Failed, Outcome, PayloadError, Retry
from .webhook import WebhookChannel, parse_retry_after

__all__ = [
    "KINDS",
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

#: Each kind of channel, by the name a config gives it: how one is made. Each module declares
#: its own (``KIND``, ``make``); the ``kind`` option's choices (pgwork/config.py) must name the
#: same ones (tests/test_config.py::test_the_kinds_config_accepts_are_the_kinds_channels_make).
KINDS: dict[str, Callable[[ChannelConfig], Channel]] = {
    m.KIND: m.make for m in (log, python, webhook)
}


def make_channel(config: ChannelConfig) -> Channel:
    """:raises ConfigError: when a python channel's target cannot be loaded, or the kind is none
    of these."""
    make = KINDS.get(config.kind)
    if make is None:
        raise ConfigError(f"channels.{config.name}.kind: unknown kind {config.kind!r}")
    return make(config)
