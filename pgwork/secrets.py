"""Secrets pgwork knows (database passwords, webhook header values): they never appear in a log
line, an error, a stored row or a process list. Whatever could echo one passes through
:meth:`Secrets.scrub` first."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .options import declared
from .settings import ChannelConfig

MASK = "***"


class Configured(Protocol):
    """What of a pgwork.config.Config holds secrets (this module is below the configuration,
    which logs through it)."""

    @property
    def dsn(self) -> str | None: ...
    @property
    def retention_dsn(self) -> str | None: ...
    @property
    def listen_dsn(self) -> str | None: ...
    @property
    def web_token(self) -> str | None: ...
    @property
    def channels(self) -> Mapping[str, ChannelConfig]: ...


class Secrets:
    #: Shorter values are not treated as secrets (masking them would mangle ordinary text).
    MIN_LENGTH = 4

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: list[str] = []
        for v in values:
            self.add(v)

    def add(self, value: str | None) -> None:
        if value and len(value) >= self.MIN_LENGTH and value not in self._values:
            self._values.append(value)
            self._values.sort(key=len, reverse=True)  # a secret containing another goes first

    def merge(self, other: Secrets) -> None:
        for v in other._values:
            self.add(v)

    def __bool__(self) -> bool:
        return bool(self._values)

    def scrub(self, text: str) -> str:
        for v in self._values:
            if v in text:
                text = text.replace(v, MASK)
        return text

    def scrub_json(self, value: Any) -> Any:
        """``value`` (decoded JSON) with every string scrubbed."""
        if not self._values:
            return value
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub(str(k)): self.scrub_json(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.scrub_json(v) for v in value]
        return value

    @classmethod
    def from_config(cls, cfg: Configured, *dsns: str | None) -> Secrets:
        """The passwords of the configured DSNs (and ``dsns``), and every value of a channel
        option its kind declares as secrets or headers (operators put tokens in headers; masking
        a harmless one costs nothing)."""
        s = cls()
        for dsn in (cfg.dsn, cfg.retention_dsn, cfg.listen_dsn, *dsns):
            s.add(dsn_password(dsn))
        s.add(cfg.web_token)
        for ch in cfg.channels.values():
            if ch.options is None:
                continue
            for f in declared(type(ch.options)).values():
                held = getattr(ch.options, f.name)
                if f.metadata["kind"] == "secrets":
                    for secret in held:
                        s.add(secret)
                        s.add(secret.removeprefix("whsec_"))
                elif f.metadata["kind"] == "headers":
                    for value in held.values():
                        s.add(value)
                        # "Bearer <token>": the token alone may be echoed too.
                        s.add(value.partition(" ")[2])
        return s


def dsn_password(dsn: str | None) -> str | None:
    if not dsn:
        return None
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        return None
    return None if password is None else str(password)
