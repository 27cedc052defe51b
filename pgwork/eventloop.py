"""The event loop the daemon runs on: uvloop where it is installed (``daemon.event_loop =
"auto"``, the default; a dependency on Linux and macOS), else the standard library's asyncio
loop. anyio's asyncio backend takes the choice as an option; nothing else in pgwork depends on
it. bench/HISTORY.md ("Event loop") has the figures that chose this default."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .config import ConfigError

T = TypeVar("T")


def use_uvloop(setting: str) -> bool:
    """Whether ``setting`` (auto, uvloop, asyncio) means uvloop here. ``uvloop`` when it cannot
    be imported is a configuration error, not a silent fallback."""
    if setting == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if setting == "uvloop":
            raise ConfigError(
                'daemon.event_loop = "uvloop", but uvloop is not installed here '
                '(pip install uvloop, or choose "auto" or "asyncio")'
            ) from None
        return False
    return True


def run(main: Callable[[], Awaitable[T]], setting: str) -> T:
    """Run ``main`` on the loop ``setting`` chooses."""
    return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": use_uvloop(setting)})


def name() -> str:
    """The running loop, for the start log line: ``uvloop 0.23.0`` or ``asyncio``."""
    loop = asyncio.get_running_loop()
    if type(loop).__module__.startswith("uvloop"):
        from importlib.metadata import version

        return f"uvloop {version('uvloop')}"
    return "asyncio"
