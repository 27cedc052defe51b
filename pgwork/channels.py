"""Delivery channels: what a delivery is, what a channel may answer, and the three kinds.

A channel gets a :class:`Delivery` and answers :class:`Delivered`, :class:`Retry` or
:class:`Failed`. Raising an exception counts as :class:`Retry` (with backoff). The
``operation_id`` is the same on every attempt of an occurrence: receivers use it to deduplicate.
"""

from __future__ import annotations

import email.utils
import importlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, Protocol
from uuid import UUID

import httpx

from .config import ChannelConfig, ConfigError
from .logs import personal

log = logging.getLogger("pgwork.channels")


@dataclass(frozen=True)
class Delivery:
    """One attempt to deliver one reminder occurrence."""

    work_id: int
    #: Stable idempotency key of the occurrence (same on every attempt and after redrive).
    operation_id: UUID
    source: str
    business_key: str
    #: The reminder's deadline.
    deadline: datetime
    #: How long before the deadline this send is (``timedelta(0)``: at the deadline).
    occurrence: timedelta
    #: When this occurrence was due (deadline minus occurrence).
    due_at: datetime
    channel: str
    recipient: str
    #: The payload as the database stores it (JSON text): numbers exactly as written, never
    #: round-tripped through floats. Webhooks receive this text as it is.
    payload_json: str
    #: 1 for the first attempt; counts reclaims after an expired lease too.
    attempt: int

    @cached_property
    def payload(self) -> dict[str, Any]:
        """The payload decoded (numbers become ints and floats). :raises PayloadError: when it
        cannot be decoded."""
        try:
            value = json.loads(self.payload_json)
        except (ValueError, RecursionError) as e:
            raise PayloadError(f"payload cannot be decoded: {type(e).__name__}") from None
        if not isinstance(value, dict):
            raise PayloadError("payload is not a JSON object")
        return value

    def document_json(self) -> str:
        """The JSON document a webhook receives, as text; the payload is spliced in as stored."""
        head = json.dumps(
            {
                "operation_id": str(self.operation_id),
                "source": self.source,
                "business_key": self.business_key,
                "deadline": self.deadline.isoformat(),
                "occurrence_seconds": self.occurrence.total_seconds(),
                "due_at": self.due_at.isoformat(),
                "channel": self.channel,
                "recipient": self.recipient,
                "attempt": self.attempt,
            },
            separators=(",", ":"),
        )
        return f'{head[:-1]},"payload":{self.payload_json}}}'

    def document(self) -> dict[str, Any]:
        """The webhook document decoded (for logs and tests)."""
        doc: dict[str, Any] = json.loads(self.document_json())
        return doc


class PayloadError(Exception):
    """A stored payload that cannot be decoded (a python channel's delivery fails for good)."""


@dataclass(frozen=True)
class Delivered:
    """The receiver has it. ``duplicate``: it said it already had it (e.g. HTTP 409)."""

    receipt: Any = None
    duplicate: bool = False
    http_status: int | None = None


@dataclass(frozen=True)
class Retry:
    """Try again later: after ``delay`` seconds if given (e.g. Retry-After), else with backoff."""

    error: str = ""
    delay: float | None = None
    http_status: int | None = None
    error_class: str = "Retry"


@dataclass(frozen=True)
class Failed:
    """Permanent failure: the occurrence goes to the dead-letter state at once."""

    error: str = ""
    http_status: int | None = None
    error_class: str = "Failed"


Outcome = Delivered | Retry | Failed


class Channel(Protocol):
    config: ChannelConfig

    async def deliver(self, d: Delivery) -> Outcome: ...

    async def aclose(self) -> None: ...


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
        return Delivered()

    async def aclose(self) -> None:
        return None


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
            return Delivered()
        if not isinstance(result, Delivered | Retry | Failed):
            return Retry(
                error=f"channel returned {type(result).__name__}, not an outcome",
                error_class="BadOutcome",
            )
        return result

    async def aclose(self) -> None:
        return None


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date); None if absent/garbage."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # "²".isdigit() is true, and float("²") raises
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class WebhookChannel:
    """HTTP POST of :meth:`Delivery.document` with ``Idempotency-Key: <operation id>``.

    2xx delivered; 409 delivered (duplicate suppressed); 429 and 503 retry no earlier than
    Retry-After; other 5xx, connection errors and timeouts retry with backoff; 3xx and other 4xx
    fail permanently (dead letter).
    """

    #: Longest Retry-After honoured, seconds (a receiver asking for more gets this).
    MAX_RETRY_AFTER = 86400.0
    #: Connections per HTTP client. httpx's pool slows down sharply with many concurrent requests
    #: on one client (encode/httpx#3215), so the channel's concurrency is spread over several.
    CONNECTIONS_PER_CLIENT = 4

    def __init__(self, config: ChannelConfig) -> None:
        self.config = config
        assert config.url is not None
        self.url = config.url
        per = min(self.CONNECTIONS_PER_CLIENT, config.concurrency)
        self.clients = [
            httpx.AsyncClient(
                timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
                verify=config.verify_tls,
                follow_redirects=False,
                limits=httpx.Limits(max_connections=per, max_keepalive_connections=per),
                # Receivers are asked not to compress; a body compressed anyway is not inflated.
                headers={"User-Agent": "pgwork", "Accept-Encoding": "identity", **config.headers},
            )
            for _ in range(-(-config.concurrency // per))
        ]
        self._next = 0

    async def deliver(self, d: Delivery) -> Outcome:
        body = d.document_json().encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": str(d.operation_id)}
        self._next = (self._next + 1) % len(self.clients)
        client = self.clients[self._next]
        try:
            async with client.stream("POST", self.url, content=body, headers=headers) as resp:
                data = await self._read_capped(resp)
        except httpx.TimeoutException as e:
            return Retry(error=f"timeout: {type(e).__name__}", error_class=type(e).__name__)
        except httpx.HTTPError as e:
            return Retry(error=f"{type(e).__name__}: {e}"[:500], error_class=type(e).__name__)
        code = resp.status_code
        encoding = resp.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("", "identity") and data:
            data = f"({encoding}-encoded body not decoded; {len(data)} bytes read)".encode()
        if 200 <= code < 300:
            return Delivered(receipt=_receipt(data, code), http_status=code)
        if code == 409:
            return Delivered(receipt=_receipt(data, code), duplicate=True, http_status=code)
        text = data[:300].decode("utf-8", "replace")
        if code in (429, 503):
            delay = parse_retry_after(resp.headers.get("Retry-After"))
            if delay is not None:
                delay = min(delay, self.MAX_RETRY_AFTER)
            return Retry(
                error=f"HTTP {code}: {text}",
                delay=delay,
                http_status=code,
                error_class=f"HTTP{code}",
            )
        if code >= 500:
            return Retry(error=f"HTTP {code}: {text}", http_status=code, error_class=f"HTTP{code}")
        return Failed(error=f"HTTP {code}: {text}", http_status=code, error_class=f"HTTP{code}")

    async def _read_capped(self, resp: httpx.Response) -> bytes:
        """At most ``max_response_bytes`` of the body as sent (Content-Encoding is not undone)."""
        cap = self.config.max_response_bytes
        chunks: list[bytes] = []
        size = 0
        # Raw bytes, never decoded: a gzip bomb's cap counts what arrives, and nothing is
        # inflated in memory (the body is only an excerpt for the ledger anyway).
        async for chunk in resp.aiter_raw():
            room = cap - size
            if room <= 0:
                break
            chunks.append(chunk[:room])
            size += min(len(chunk), room)
        return b"".join(chunks)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()


def _receipt(data: bytes, code: int) -> Any:
    receipt: dict[str, Any] = {"http_status": code}
    if data:
        try:
            parsed = json.loads(data)
        except ValueError:
            receipt["body"] = data[:200].decode("utf-8", "replace")
        else:
            receipt["body"] = parsed if len(data) <= 2000 else "(truncated)"
    return receipt


def make_channel(config: ChannelConfig) -> Channel:
    """:raises ConfigError: when a python channel's target cannot be loaded."""
    if config.kind == "log":
        return LogChannel(config)
    if config.kind == "webhook":
        return WebhookChannel(config)
    if config.kind == "python":
        return PythonChannel.load(config)
    raise ConfigError(f"channels.{config.name}.kind: unknown kind {config.kind!r}")
