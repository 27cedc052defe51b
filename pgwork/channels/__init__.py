"""Delivery channels. The public names a python target uses live here:
``from pgwork.channels import Delivery, Delivered, Retry, Failed``.

A channel gets a :class:`Delivery` and answers :class:`Delivered`, :class:`Retry` or
:class:`Failed`. Raising an exception counts as :class:`Retry` (with backoff). The
``operation_id`` is the same on every attempt of an occurrence: receivers use it to deduplicate.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ..options import ConfigError
from ..settings import ChannelConfig
from .log import LogChannel
from .python import PythonChannel
from .types import Channel, Delivered, Delivery, Failed, Kind, Outcome, PayloadError, Retry
from .webhook import WebhookChannel, parse_retry_after

__all__ = [
    "KINDS",
    "Channel",
    "Delivered",
    "Delivery",
    "Failed",
    "Kind",
    "LogChannel",
    "Outcome",
    "PayloadError",
    "PythonChannel",
    "Retry",
    "WebhookChannel",
    "make_channel",
    "parse_retry_after",
]


def _kinds() -> dict[str, Kind[Any]]:
    """Every module of this package that declares a ``KIND``, by the kind's name: a new kind of
    channel is a new module here, and nothing else (the configuration reads its options from it,
    the reference documents them, the database does not check kinds)."""
    found: dict[str, Kind[Any]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        kind = getattr(importlib.import_module(f"{__name__}.{info.name}"), "KIND", None)
        if isinstance(kind, Kind):
            if kind.name in found:
                raise AssertionError(f"two channel modules declare the kind {kind.name!r}")
            found[kind.name] = kind
    return found


#: Each kind of channel, by the name a config gives it.
KINDS: dict[str, Kind[Any]] = _kinds()


def make_channel(config: ChannelConfig) -> Channel:
    """:raises ConfigError: when a python channel's target cannot be loaded, or the kind is none
    of these."""
    kind = KINDS.get(config.kind)
    if kind is None:
        raise ConfigError(f"channels.{config.name}.kind: unknown kind {config.kind!r}")
    return kind.make(config)
