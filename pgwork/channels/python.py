"""The ``python`` channel: an async function of the operator's, imported at start."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import options
from ..options import ConfigError, option
from ..settings import ChannelConfig
from .types import DELIVERED, Delivered, Delivery, Failed, Kind, Outcome, PayloadError, Retry


@dataclass(frozen=True)
class PythonOptions:
    target: str = option("target", "str", doc="`module:function`")


def _read(
    raw: Mapping[str, Any], label: Callable[[str], str], env: Mapping[str, str], secrets: bool
) -> PythonOptions:
    target = raw.get("target")
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(
            f"{label('target')}: a python channel needs 'module:function' (got {target!r})"
        )
    return options.read(PythonOptions, raw, label)


@dataclass
class PythonChannel:
    """Calls ``async def fn(delivery: Delivery) -> Delivered | Retry | Failed | None``
    (None means delivered)."""

    config: ChannelConfig
    fn: Callable[[Delivery], Awaitable[Outcome | None]]

    @classmethod
    def load(cls, config: ChannelConfig) -> PythonChannel:
        where = f"channels.{config.name}.target"
        assert isinstance(config.options, PythonOptions)
        target = config.options.target
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(f"{where}: cannot import module {module_name!r}: {e}") from None
        fn = getattr(module, attr, None)
        if fn is None:
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        if not callable(fn) or not inspect.iscoroutinefunction(fn):
            raise ConfigError(f"{where}: {target} is not an async function")
        return cls(config, fn)

    async def deliver(self, d: Delivery) -> Outcome:
        try:
            d.payload  # noqa: B018 (decoded once, here: a payload that cannot be is a permanent failure)
        except PayloadError as e:
            return Failed(error=str(e), error_class="PayloadError")
        result = await self.fn(d)
        if result is None:
            return DELIVERED
        if not isinstance(result, Delivered | Retry | Failed):
            return Retry(
                error=f"channel returned {type(result).__name__}, not an outcome",
                error_class="BadOutcome",
            )
        return result

    async def aclose(self) -> None:
        return None


KIND = Kind(name="python", options=PythonOptions, read=_read, make=PythonChannel.load)
