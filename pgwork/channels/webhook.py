"""The ``webhook`` channel: an HTTP POST per attempt, signed as Standard Webhooks define, with the
receiver's answer mapped to an outcome by the documented status-code table."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
import ssl
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp

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


def sign(keys: tuple[bytes, ...], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` for each
    key, space-separated (several keys while a secret is being rotated)."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(k, signed, hashlib.sha256).digest()).decode()
        for k in keys
    )


class WebhookChannel:
    """HTTP POST of :meth:`Delivery.document_json` with ``Idempotency-Key`` and ``webhook-id``
    (both the operation id), ``webhook-timestamp`` and, with a signing secret, ``webhook-signature``.

    2xx delivered; 409 delivered (duplicate suppressed); 429, 502, 503 and 504 retry no earlier
    than Retry-After and throttle the whole channel; 410 pauses the channel (the row waits);
    other 5xx, connection errors and timeouts retry with backoff; 3xx and other 4xx fail
    permanently (dead letter).

    One aiohttp session per channel, its connector sized to the channel's concurrency: a request
    waits for a connection only when every connection is busy, never behind one slow request.
    """

    #: Answers that say the receiver is overloaded: they throttle the channel, not just the row.
    THROTTLING = frozenset({429, 502, 503, 504})
    #: Longest Retry-After honoured, seconds (a receiver asking for more gets this).
    MAX_RETRY_AFTER = 86400.0
    #: How long resolved host names are kept, seconds.
    DNS_CACHE = 60

    def __init__(self, config: ChannelConfig) -> None:
        self.config = config
        assert config.url is not None
        self.url = config.url
        self._keys = config.signing_keys
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the event loop that runs the deliveries.
        c = self.config
        connector = aiohttp.TCPConnector(
            limit=c.concurrency,
            limit_per_host=0,
            ttl_dns_cache=self.DNS_CACHE,
            ssl=_ssl_context(c) if c.verify_tls else False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # The whole attempt's limit (attempt_timeout) is enforced for every channel kind by the
            # channel worker; here only the connect and the read silences are bounded.
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=c.connect_timeout, sock_read=c.read_timeout
            ),
            # Receivers are asked not to compress; a body compressed anyway is not inflated.
            headers={"User-Agent": "pgwork", "Accept-Encoding": "identity", **c.headers},
            auto_decompress=False,
            raise_for_status=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        return self._session

    def headers(self, d: Delivery, body: bytes, now: float | None = None) -> dict[str, str]:
        op = str(d.operation_id)
        ts = int(now if now is not None else time.time())
        h = {
            "Content-Type": "application/json",
            "Idempotency-Key": op,
            "webhook-id": op,
            "webhook-timestamp": str(ts),
        }
        if self._keys:
            h["webhook-signature"] = sign(self._keys, op, ts, body)
        if d.traceparent:
            h["traceparent"] = d.traceparent
            if d.tracestate:
                h["tracestate"] = d.tracestate
        return h

    async def deliver(self, d: Delivery) -> Outcome:
        body = d.document_json().encode()
        session = self._session or self._open()
        try:
            async with session.post(
                self.url, data=body, headers=self.headers(d, body), allow_redirects=False
            ) as resp:
                data = await self._read_capped(resp)
                code = resp.status
                encoding = resp.headers.get("Content-Encoding", "identity").lower()
                retry_after = resp.headers.get("Retry-After")
        except TimeoutError as e:
            return Retry(error=f"timeout: {type(e).__name__}", error_class="Timeout")
        except (aiohttp.ClientError, ValueError) as e:
            return Retry(error=f"{type(e).__name__}: {e}"[:500], error_class=_error_class(e))
        if encoding not in ("", "identity") and data:
            data = f"({encoding}-encoded body not decoded; {len(data)} bytes read)".encode()
        if 200 <= code < 300:
            return Delivered(receipt=_receipt(data, code), http_status=code)
        if code == 409:
            return Delivered(receipt=_receipt(data, code), duplicate=True, http_status=code)
        text = data[:300].decode("utf-8", "replace")
        if code in self.THROTTLING:
            delay = parse_retry_after(retry_after)
            if delay is not None:
                delay = min(delay, self.MAX_RETRY_AFTER)
            return Retry(
                error=f"HTTP {code}: {text}",
                delay=delay,
                http_status=code,
                error_class=f"HTTP{code}",
                throttle=True,
            )
        if code >= 500:
            return Retry(error=f"HTTP {code}: {text}", http_status=code, error_class=f"HTTP{code}")
        if code == 410:
            return Retry(
                error=f"HTTP {code}: {text}",
                http_status=code,
                error_class="HTTP410",
                pause=f"the receiver answered 410 Gone at {self.url}",
            )
        return Failed(error=f"HTTP {code}: {text}", http_status=code, error_class=f"HTTP{code}")

    async def _read_capped(self, resp: aiohttp.ClientResponse) -> bytes:
        """At most ``max_response_bytes`` of the body as sent (Content-Encoding is not undone:
        a gzip bomb's cap counts what arrives, and nothing is inflated in memory)."""
        cap = self.config.max_response_bytes
        chunks: list[bytes] = []
        size = 0
        while size < cap:
            chunk = await resp.content.read(cap - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _ssl_context(c: ChannelConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if c.ca_file:
        ctx.load_verify_locations(c.ca_file)
    return ctx


def _error_class(e: Exception) -> str:
    """A stable name for a transport failure (the ledger's ``error_class``; alerts may match it):
    TLSError, ConnectError (no connection made), or ProtocolError (the answer was lost or was
    not HTTP)."""
    if isinstance(e, aiohttp.ClientSSLError):
        return "TLSError"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "ConnectError"
    return "ProtocolError"


#: Largest 2xx body parsed as JSON for the receipt; a larger one is kept as the start of its text.
MAX_PARSED_RECEIPT = 2000


def _receipt(data: bytes, code: int) -> Any:
    """What a 2xx (or 409) answer said, for the ledger: its JSON when small, else its text. No
    body can fail the delivery: a document nested past the parser's recursion limit is kept as
    text like any other body that is not JSON (issue 25: it once made every 2xx a retry)."""
    receipt: dict[str, Any] = {"http_status": code}
    if not data:
        return receipt
    if len(data) > MAX_PARSED_RECEIPT:
        receipt["body"] = "(truncated)"
        receipt["text"] = data[:200].decode("utf-8", "replace")
        return receipt
    try:
        receipt["body"] = json.loads(data)
    except (ValueError, RecursionError):
        receipt["body"] = data[:200].decode("utf-8", "replace")
    return receipt
