"""The ``python`` channel: an async function of the operator's, imported at start."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..config import ChannelConfig, ConfigError
from .types import DELIVERED, Delivered, Delivery, Failed, Outcome, PayloadError, Retry


@dataclass
class PythonChannel:
    """Calls ``async def fn(delivery: Delivery) -> Delivered | Retry | Failed | None``
    (None means delivered)."""

    config: ChannelConfig
    fn: Callable[[Delivery], Awaitable[Outcome | None]]

    @classmethod
    def load(cls, config: ChannelConfig) -> PythonChannel:
        where = f"channels.{config.name}.target"
        assert config.target is not None
        module_name, _, attr = config.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(f"{where}: cannot import module {module_name!r}: {e}") from None
        fn = getattr(module, attr, None)
        if fn is None:
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        if not callable(fn) or not inspect.iscoroutinefunction(fn):
            raise ConfigError(f"{where}: {config.target} is not an async function")
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


#: The kind a channel config names to be delivered by this module, and how one is made.
KIND = "python"
make = PythonChannel.load
