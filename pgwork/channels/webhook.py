"""The ``webhook`` channel: an HTTP POST per attempt, signed as Standard Webhooks define, with the
receiver's answer mapped to an outcome by the documented status-code table."""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

from pyreqwest.client import Client, ClientBuilder
from pyreqwest.exceptions import ConnectError, RequestError
from pyreqwest.response import Response

from .. import options
from ..options import ConfigError, option
from ..settings import ChannelConfig
from .types import Delivered, Delivery, Failed, Kind, Outcome, Receipt, Retry, attempt_timed_out

T = TypeVar("T")


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


#: Shortest signing key, bytes (Standard Webhooks: 24 to 64).
SIGNING_KEY_MIN = 24


def signing_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret. :raises ValueError: saying what is wrong."""
    if not secret.startswith("whsec_"):
        raise ValueError("a signing secret starts with whsec_")
    try:
        key = base64.b64decode(secret[6:], validate=True)
    except ValueError:
        raise ValueError("the part after whsec_ is not base64") from None
    if len(key) < SIGNING_KEY_MIN:
        raise ValueError(f"the key is {len(key)} bytes; at least {SIGNING_KEY_MIN} are needed")
    return key


@dataclass(frozen=True)
class WebhookOptions:
    """A webhook channel's own options (its channel table's keys besides the common ones)."""

    url: str = option("url", "str", doc="`http(s)://` endpoint")
    headers: Mapping[str, str] = option(
        "headers",
        "headers",
        factory=dict,
        shown="`{}`",
        doc='extra headers; `"env:NAME"` reads the environment',
    )
    connect_timeout: float = option(
        "connect_timeout",
        "duration",
        5.0,
        within=(0.01, 600),
        doc="most the connection (TCP and TLS) may take",
    )
    read_timeout: float = option(
        "read_timeout",
        "duration",
        10.0,
        within=(0.01, 3600),
        doc="most any silence of the receiver may last, per read (`attempt_timeout` bounds the whole)",
    )
    max_response_bytes: int = option(
        "max_response_bytes",
        "int",
        65536,
        within=(0, 64 * 1024 * 1024),
        doc="response bytes read at most",
    )
    verify_tls: bool = option("verify_tls", "bool", True, doc="verify certificates")
    ca_file: str | None = option(
        "ca_file",
        "str",
        None,
        doc="a PEM file of private certificate authorities trusted besides the system's",
    )
    signing_secrets: tuple[str, ...] = option(
        "signing_secret",
        "secrets",
        (),
        shown="—",
        doc=(
            "`whsec_…` secret(s) that sign every request (Standard Webhooks); "
            '`"env:NAME"` reads the environment; two, space-separated, while rotating'
        ),
    )

    @property
    def signing_keys(self) -> tuple[bytes, ...]:
        """The HMAC keys of ``signing_secrets`` (validated when the config was read)."""
        return tuple(signing_key(s) for s in self.signing_secrets)


def _read(
    raw: Mapping[str, Any], label: Callable[[str], str], env: Mapping[str, str], secrets: bool
) -> WebhookOptions:
    _check_url(label("url"), raw.get("url"))
    if "ca_file" in raw:
        _check_ca_file(label("ca_file"), raw["ca_file"])
    return options.read(
        WebhookOptions,
        raw,
        label,
        headers=_headers(label("headers"), raw.get("headers", {}), env, secrets),
        signing_secrets=_signing_secrets(
            label("signing_secret"), raw.get("signing_secret"), env, secrets
        ),
    )


def _check_url(where: str, url: Any) -> None:
    """A URL that can be requested: http(s), a host, a valid port, no spaces."""
    from urllib.parse import urlsplit

    problem = None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        problem = "a webhook channel needs an http:// or https:// URL"
    elif any(c.isspace() or ord(c) < 32 for c in url):
        problem = "the URL has a space or a control character"
    else:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError as e:
            problem = f"not a valid URL ({e})"
        else:
            if not parts.hostname:
                problem = "the URL has no host"
    if problem:
        raise ConfigError(f"{where}: {problem} (got {url!r})")


def _check_ca_file(where: str, path: object) -> None:
    """A CA file that is not a readable PEM certificate is refused at start, not at the first
    delivery."""
    if not isinstance(path, str):
        raise ConfigError(f"{where}: expected a path to a PEM file")
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ConfigError(f"{where}: {path} holds no PEM certificate")


def _headers(where: str, raw: Any, env: Mapping[str, str], secrets: bool) -> dict[str, str]:
    """``headers``: names to values; ``"env:NAME"`` reads the environment (``secrets=False``: an
    unset variable leaves the header out)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table of header names to values")
    headers: dict[str, str] = {}
    for hk, hv in raw.items():
        if not isinstance(hv, str):
            raise ConfigError(f"{where}.{hk}: expected a string")
        if hv.startswith("env:"):
            var = hv[4:]
            if var not in env:
                if not secrets:
                    continue  # a command that sends nothing needs no header
                raise ConfigError(f"{where}.{hk}: environment variable {var} is not set")
            hv = env[var]
        if any(c in hv for c in "\r\n\x00") or not hv.isascii() or not hv.isprintable():
            raise ConfigError(
                f"{where}.{hk}: the value has a line break, a control or a non-ASCII "
                "character (the value is not shown: it may be a secret)"
            )
        headers[hk] = hv
    return headers


def _signing_secrets(
    where: str, raw: Any, env: Mapping[str, str], required: bool = True
) -> tuple[str, ...]:
    """``signing_secret``: ``env:NAME`` (recommended) or the value; several secrets separated by
    spaces while one is rotated (each request then carries a signature per secret).
    ``required=False`` (a command that sends nothing): an unset variable gives no secret."""
    if raw is None:
        return ()
    if not isinstance(raw, str):
        raise ConfigError(f"{where}: expected a string such as 'env:PGWORK_SIGNING_SECRET'")
    if raw.startswith("env:"):
        if raw[4:] not in env:
            if not required:
                return ()
            raise ConfigError(f"{where}: environment variable {raw[4:]} is not set")
        raw = env[raw[4:]]
    secrets = tuple(raw.split())
    if not secrets:
        raise ConfigError(f"{where}: empty")
    for i, s in enumerate(secrets, 1):
        try:
            signing_key(s)
        except ValueError as e:
            # The value is never shown: it is a secret.
            raise ConfigError(f"{where}: secret {i} of {len(secrets)}: {e}") from None
    return secrets


class WebhookChannel:
    """HTTP POST of :meth:`Delivery.document_json` with ``Idempotency-Key`` and ``webhook-id``
    (both the operation id), ``webhook-timestamp`` and, with a signing secret, ``webhook-signature``.

    2xx delivered; 409 delivered (duplicate suppressed); 429, 502, 503 and 504 retry no earlier
    than Retry-After and throttle the whole channel; 410 pauses the channel (the row waits);
    other 5xx, connection errors and timeouts retry with backoff; 3xx and other 4xx fail
    permanently (dead letter).

    One HTTP client per channel (pyreqwest: Rust's reqwest and hyper, HTTP/1.1, header names
    sent lower-cased), at most the channel's concurrency of connections, each kept alive for
    the next request: a request waits for a connection only when every connection is busy,
    never behind one slow request, and requests are never pipelined on one connection.
    """

    #: Answers that say the receiver is overloaded: they throttle the channel, not just the row.
    THROTTLING = frozenset({429, 502, 503, 504})
    #: Longest Retry-After honoured, seconds (a receiver asking for more gets this).
    MAX_RETRY_AFTER = 86400.0
    #: How long an idle connection is kept for the next request, seconds.
    IDLE_CONNECTION = 60
    #: Distinct 2xx/409 answers remembered (see _delivered); past this many, it starts afresh.
    ANSWERS = 64

    def __init__(self, config: ChannelConfig) -> None:
        self.config = config
        assert isinstance(config.options, WebhookOptions)
        self.options = config.options
        self.url = config.options.url
        self._keys = config.options.signing_keys
        self._client: Client | None = None
        self._attempt = timedelta(seconds=config.attempt_timeout)
        self._answers: dict[tuple[int, bytes], Delivered] = {}

    def _open(self) -> Client:
        # Made on first use: a client belongs to the event loop that runs the deliveries.
        c = self.options
        b = (
            ClientBuilder()
            # No max_connections: pyreqwest's limit keeps the slot of a request cancelled
            # mid-answer for good (tests/test_http_client.py::
            # test_a_cancelled_attempt_leaves_no_slot_behind); the channel worker already holds
            # at most `concurrency` deliveries in flight, and so connections in use.
            .pool_max_idle_per_host(self.config.concurrency)
            .follow_redirects(False)
            # Receivers are asked not to compress; a body compressed anyway is not inflated.
            .gzip(False)
            .deflate(False)
            .brotli(False)
            .zstd(False)
            # The connect and every read silence are bounded here; the whole attempt's limit
            # (attempt_timeout) by the channel worker, and by each request's own deadline
            # (see _exchange).
            .connect_timeout(timedelta(seconds=c.connect_timeout))
            .read_timeout(timedelta(seconds=c.read_timeout))
            .pool_idle_timeout(timedelta(seconds=self.IDLE_CONNECTION))
            .default_cookie_store(False)
            .user_agent("pgwork")
            .default_headers({"Accept-Encoding": "identity", **c.headers})
            .http1_only()
        )
        if not c.verify_tls:
            b = b.danger_accept_invalid_certs(True)
        elif c.ca_file:
            with open(c.ca_file, "rb") as f:
                b = b.add_root_certificate_pem(f.read())
        self._client = b.build()
        return self._client

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
        got = await _GivenCancellation(self._exchange(self.headers(d, body), body))
        if isinstance(got, Retry):
            return got
        code, data, encoding, retry_after = got
        if encoding not in ("", "identity") and data:
            data = f"({encoding}-encoded body not decoded; {len(data)} bytes read)".encode()
        if 200 <= code < 300 or code == 409:
            return self._delivered(code, data)
        text = data[:300].decode("utf-8", "replace")
        said = f"HTTP {code}: {text}" if text.strip() else f"HTTP {code}"
        if code in self.THROTTLING:
            delay = parse_retry_after(retry_after)
            if delay is not None:
                delay = min(delay, self.MAX_RETRY_AFTER)
            return Retry(
                error=said,
                delay=delay,
                http_status=code,
                error_class=f"HTTP{code}",
                throttle=True,
            )
        if code >= 500:
            return Retry(error=said, http_status=code, error_class=f"HTTP{code}")
        if code == 410:
            return Retry(
                error=said,
                http_status=code,
                error_class="HTTP410",
                pause=f"the receiver answered 410 Gone at {self.url}",
            )
        return Failed(error=said, http_status=code, error_class=f"HTTP{code}")

    def _delivered(self, code: int, data: bytes) -> Delivered:
        """The answer to a 2xx (delivered) or a 409 (delivered, a duplicate the receiver
        suppressed). A receiver answers most requests alike ("{}", an "ok"): the outcome of each
        distinct small answer is made once and shared (it is frozen, its receipt a ``Receipt``
        nothing changes), so its receipt is parsed and cleaned once, not per delivery."""
        key = (code, data)
        got = self._answers.get(key)
        if got is None:
            got = Delivered(receipt=_receipt(data, code), duplicate=code == 409, http_status=code)
            if len(data) <= MAX_PARSED_RECEIPT:
                if len(self._answers) >= self.ANSWERS:
                    self._answers.clear()
                self._answers[key] = got
        return got

    async def _exchange(
        self, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, str, str | None] | Retry:
        """The request and the answer: (status, at most max_response_bytes of the body as sent,
        Content-Encoding, Retry-After), or the Retry a transport failure means."""
        client = self._client or self._open()
        t0 = time.monotonic()
        request = (
            client.post(self.url)
            .headers(headers)
            .body_bytes(body)
            # The attempt's bound, the client's own as well as the worker's: a request the
            # worker cancels is not ended by pyreqwest (its connection reads on in the client's
            # runtime), this deadline ends it, and a request that reaches it first is a Timeout.
            .timeout(self._attempt)
            .build_streamed()
        )
        try:
            async with request as resp:
                data = await self._read_capped(resp)
                encoding = (_header(resp, "Content-Encoding") or "identity").lower()
                return resp.status, data, encoding, _header(resp, "Retry-After")
        except TimeoutError as e:
            if time.monotonic() - t0 >= self.config.attempt_timeout:
                return attempt_timed_out(self.config.name, self.config.attempt_timeout)
            return Retry(error=f"timeout: {type(e).__name__}", error_class="Timeout")
        except RequestError as e:
            return Retry(error=_describe(e)[:500], error_class=_error_class(e))

    async def _read_capped(self, resp: Response) -> bytes:
        """At most ``max_response_bytes`` of the body as sent (Content-Encoding is not undone:
        a gzip bomb's cap counts what arrives, and nothing is inflated in memory)."""
        cap = self.options.max_response_bytes
        reader = resp.body_reader
        chunks: list[bytes] = []
        size = 0
        while size < cap:
            chunk = await reader.read(cap - size)
            if not chunk:
                break
            chunks.append(bytes(chunk))
            size += len(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


def _request(o: WebhookOptions, operation_id: str) -> list[str]:
    """What each attempt of an occurrence sends, but its body: the URL, the headers with the
    occurrence's values, configured headers by name only (their values may be secrets)."""
    lines = [
        f"POST {o.url}",
        "Content-Type: application/json",
        f"Idempotency-Key: {operation_id}",
        f"webhook-id: {operation_id}",
        "webhook-timestamp: (each attempt's start, Unix seconds)",
    ]
    if o.signing_secrets:
        lines.append("webhook-signature: v1,… (HMAC-SHA256 of id.timestamp.body)")
    return lines + [f"{name}: (configured)" for name in o.headers]


KIND = Kind(
    name="webhook",
    options=WebhookOptions,
    read=_read,
    make=WebhookChannel,
    remote=True,
    request=_request,
)


class _GivenCancellation(Generic[T]):
    """Awaits a coroutine, and if the task is cancelled while it runs, raises the cancellation
    the task was given rather than the one the coroutine raised instead.

    pyreqwest answers a cancellation with a CancelledError of its own ("Request was cancelled"),
    without the message the canceller gave; anyio's cancel scopes know their own cancellation by
    that message. Unmended, the attempt's scope (attempt_timeout, shutdown) would not catch it
    and the cancellation would end the whole worker task (tests/test_http_client.py::
    test_a_dripping_body_is_cancelled_by_the_attempt_s_scope). This is ``yield from`` written
    out, to see what is thrown in; it costs no task (a shielded task per delivery did: 12% of
    the channel's time)."""

    __slots__ = ("coro",)

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self.coro = coro

    def __await__(self) -> Generator[Any, Any, T]:
        step = self.coro.__await__()
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                waiting = step.send(sent) if thrown is None else step.throw(thrown)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            except asyncio.CancelledError as raised:
                if isinstance(thrown, asyncio.CancelledError) and raised is not thrown:
                    raise thrown from raised
                raise
            try:
                sent, thrown = (yield waiting), None
            except BaseException as e:  # passed on to the coroutine, as yield from does
                sent, thrown = None, e


def _header(resp: Response, name: str) -> str | None:
    """A response header's value; None when absent or not text (a byte outside visible ASCII,
    which the client will not decode: such a value is garbage, treated as no value)."""
    try:
        return resp.get_header(name)
    except ValueError:
        return None


def _causes(e: RequestError) -> list[str]:
    """The messages of what caused ``e``, outermost first (pyreqwest's ``details``)."""
    causes = (e.details or {}).get("causes") or []
    return [str(c.get("message", "")) for c in causes if isinstance(c, dict)]


def _describe(e: RequestError) -> str:
    """The error and its causes, innermost last ("ConnectError: … <- Connection refused")."""
    return " <- ".join(dict.fromkeys([f"{type(e).__name__}: {e.message}", *_causes(e)]))


def _error_class(e: RequestError) -> str:
    """A stable name for a transport failure (the ledger's ``error_class``; alerts may match it):
    TLSError, ConnectError (no connection made), or ProtocolError (the answer was lost or was
    not HTTP). The client has one exception for every failure to connect: the TLS ones are told
    by their causes (rustls's words; the URL, which could hold any word, is left out)."""
    if isinstance(e, ConnectError):
        words = re.sub(r"\(https?://[^)]*\)", "", " ".join(_causes(e)).lower())
        tls = ("certificate", "tls", "handshake", "alert")
        return "TLSError" if any(w in words for w in tls) else "ConnectError"
    return "ProtocolError"


#: Largest 2xx body parsed as JSON for the receipt; a larger one is kept as the start of its text.
MAX_PARSED_RECEIPT = 2000


def _receipt(data: bytes, code: int) -> Receipt:
    """What a 2xx (or 409) answer said, for the ledger: its JSON when small, else its text. No
    body can fail the delivery: a document nested past the parser's recursion limit is kept as
    text like any other body that is not JSON (issue 25: it once made every 2xx a retry)."""
    receipt = Receipt(http_status=code)
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
