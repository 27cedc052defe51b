"""The ``webhook`` channel: an HTTP POST per attempt, with the receiver's answer mapped to an
outcome by the documented status-code table."""

from __future__ import annotations

import email.utils
import json
from datetime import UTC, datetime
from typing import Any

import httpx

from ..config import ChannelConfig
from .types import Delivered, Delivery, Failed, Outcome, Retry


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
