"""What a delivery is and what a channel may answer: the types every channel and the claim loop
share. A channel gets a :class:`Delivery` and answers :class:`Delivered`, :class:`Retry` or
:class:`Failed`; the ``operation_id`` is the same on every attempt of an occurrence."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, Self, TypeVar, overload

from ..settings import ChannelConfig
from ..store import Claimed, Occurrence

T = TypeVar("T")
Opts = TypeVar("Opts")

#: The C scanner behind json.loads, without its Python wrapper's two regular-expression matches
#: for surrounding whitespace, most of its cost for a small payload (bench/README.md,
#: "Per-delivery code"; test_hot_path.py::test_a_payload_is_decoded_as_json_loads_decodes_it).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
#: A string as json.dumps writes it (ensure_ascii): its C encoder, without the dumps around it.
_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii


class _once(Generic[T]):
    """``functools.cached_property`` without its lock: on Python 3.11 that takes an RLock on
    every first access, once per delivery. Computed on the first access and kept in the
    instance's ``__dict__``, which later reads find first; a race can only compute it twice."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T | Self:
        if obj is None:
            return self
        value: T = self.fn(obj)
        obj.__dict__[self.name] = value
        return value


def decode_payload(text: str) -> dict[str, Any]:
    """A stored payload decoded, as ``json.loads`` does it. :raises PayloadError: when it cannot
    be decoded or is not an object.

    Postgres writes ``jsonb`` as text without surrounding whitespace, so the scanner alone reads
    it; anything it does not read to the end (whitespace, extra data, an error) goes through
    ``json.loads``, which says what is wrong."""
    try:
        try:
            value, end = _scan(text, 0)
        except StopIteration:
            end = -1
        if end != len(text):
            value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise PayloadError(f"payload cannot be decoded: {type(e).__name__}") from None
    if not isinstance(value, dict):
        raise PayloadError("payload is not a JSON object")
    return value


@dataclass(frozen=True)
class Delivery(Occurrence):
    """One attempt to deliver one reminder occurrence."""

    work_id: int
    recipient: str
    #: The payload as the database stores it (JSON text): numbers exactly as written, never
    #: round-tripped through floats. Webhooks receive this text as it is.
    payload_json: str
    #: 1 for the first attempt; counts reclaims after an expired lease too.
    attempt: int
    #: W3C trace context to send on (the reminder's own, or with tracing on, this delivery's
    #: span, a child of it); None: none.
    traceparent: str | None = None
    tracestate: str | None = None
    #: An occurrence of a recurring reminder: which deadline of the series this is, as local
    #: wall-clock time in ``time_zone`` (None for a one-off reminder).
    deadline_local: datetime | None = None
    time_zone: str | None = None

    @classmethod
    def from_claim(
        cls, row: Claimed, traceparent: str | None = None, tracestate: str | None = None
    ) -> Delivery:
        """The delivery of a claimed row (the claim loop's constructor, once per attempt).

        Every field is set in one step on the instance's ``__dict__``: a frozen dataclass's
        ``__init__`` calls ``object.__setattr__`` once per field (bench/README.md, "Per-delivery
        code"). The instance is the same as ``Delivery(...)`` builds (test_hot_path.py::
        test_a_delivery_from_a_claimed_row_is_the_dataclass_its_fields_make)."""
        # A claimed row's reminder exists (the claim closes the others): both are there.
        assert row.recipient is not None and row.payload is not None
        d = object.__new__(cls)
        d.__dict__.update(
            operation_id=row.operation_id,
            source=row.source,
            business_key=row.business_key,
            deadline=row.deadline,
            occurrence=row.occurrence,
            due_at=row.due_at,
            channel=row.channel,
            work_id=row.id,
            recipient=row.recipient,
            payload_json=row.payload,
            attempt=row.attempts,
            traceparent=traceparent,
            tracestate=tracestate,
            deadline_local=row.deadline_local,
            time_zone=row.time_zone,
        )
        return d

    @_once
    def payload(self) -> dict[str, Any]:
        """The payload decoded (numbers become ints and floats). :raises PayloadError: when it
        cannot be decoded."""
        return decode_payload(self.payload_json)

    def document_json(self) -> str:
        """The JSON document a webhook receives, as text; the payload is spliced in as stored.

        Written with one f-string and json's C string encoder, not ``json.dumps`` of a dict, as
        it runs once per attempt (bench/README.md, "Per-delivery code"): byte for byte what
        ``json.dumps(..., separators=(",", ":"))`` writes (tests/test_hot_path.py::
        test_a_webhook_document_is_what_json_dumps_makes_of_its_fields). A UUID's and an
        ISO 8601 time's text need no escaping; integers and finite floats are their repr."""
        series = (
            ""
            if self.deadline_local is None
            # An occurrence of a series: which deadline of it this is ("April's rent").
            else f',"deadline_local":"{self.deadline_local.isoformat()}",'
            f'"time_zone":{"null" if self.time_zone is None else _json_str(self.time_zone)}'
        )
        return (
            f'{{"operation_id":"{self.operation_id}","source":{_json_str(self.source)},'
            f'"business_key":{_json_str(self.business_key)},'
            f'"deadline":"{self.deadline.isoformat()}",'
            f'"occurrence_seconds":{_whole(self.occurrence.total_seconds())!r},'
            f'"due_at":"{self.due_at.isoformat()}","channel":{_json_str(self.channel)},'
            f'"recipient":{_json_str(self.recipient)},"attempt":{self.attempt!r}{series},'
            f'"payload":{self.payload_json}}}'
        )

    def document(self) -> dict[str, Any]:
        """The webhook document decoded (for logs and tests)."""
        doc: dict[str, Any] = json.loads(self.document_json())
        return doc


def _whole(seconds: float) -> int | float:
    """A whole number of seconds as an integer (``0``, not ``0.0``: what the docs show, and what a
    receiver with an integer field takes)."""
    return int(seconds) if seconds.is_integer() else seconds


class PayloadError(Exception):
    """A stored payload that cannot be decoded (a python channel's delivery fails for good)."""


class Receipt(dict[str, Any]):
    """A receipt its channel never changes once returned (the webhook channel's, one per
    distinct answer): the outcome writer cleans each such object once and reuses the result for
    every record that carries it. A plain dict is cleaned anew each time."""

    __slots__ = ()


@dataclass(frozen=True)
class Delivered:
    """The receiver has it. ``duplicate``: it said it already had it (e.g. HTTP 409)."""

    receipt: Any = None
    duplicate: bool = False
    http_status: int | None = None


#: The plain answer, made once (frozen, so it can be shared): most deliveries of a python
#: channel answer this, and building a frozen dataclass per delivery is not free.
DELIVERED = Delivered()


@dataclass(frozen=True)
class Retry:
    """Try again later: after ``delay`` seconds if given (e.g. Retry-After), else with backoff.

    ``throttle``: the receiver is overloaded (HTTP 429, 502, 503, 504): the whole channel is held
    for ``delay`` seconds (one second without one) and its concurrency halved, in every daemon.
    ``pause``: the receiver is gone for good (HTTP 410): the channel is paused with this reason
    until an operator resumes it; the row waits instead of being dead-lettered."""

    error: str = ""
    delay: float | None = None
    http_status: int | None = None
    error_class: str = "Retry"
    throttle: bool = False
    pause: str | None = None


@dataclass(frozen=True)
class Failed:
    """Permanent failure: the occurrence goes to the dead-letter state at once."""

    error: str = ""
    http_status: int | None = None
    error_class: str = "Failed"


Outcome = Delivered | Retry | Failed


def attempt_timed_out(channel: str, seconds: float) -> Retry:
    """The outcome of an attempt ended by ``attempt_timeout`` (by the channel worker, or by the
    webhook client's own copy of the deadline: the ledger reads the same either way)."""
    return Retry(
        error=f"attempt timed out after {seconds:g}s (channels.{channel}.attempt_timeout)",
        error_class="AttemptTimeout",
    )


class Channel(Protocol):
    config: ChannelConfig

    async def deliver(self, d: Delivery) -> Outcome: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Kind(Generic[Opts]):
    """A kind of channel, declared whole in its own module as ``KIND`` (pgwork.channels finds
    every module of the package that has one): the name a config's ``kind`` gives it, its own
    options (a dataclass declared with pgwork.options.option, held as
    ``ChannelConfig.options``), how they are read from a channel's table, and how a channel is
    made. Nothing else names a kind or its options
    (tests/test_config.py::test_a_channel_kind_is_declared_in_one_file)."""

    name: str
    options: type[Opts]
    #: The options from a channel's table: ``read(raw, label, env, secrets)``; ``label(key)``
    #: names an option in an error; ``secrets=False``: a command that sends nothing (an unset
    #: secret's variable is left unresolved). :raises pgwork.options.ConfigError:
    read: Callable[[Mapping[str, Any], Callable[[str], str], Mapping[str, str], bool], Opts]
    #: A channel from its config. It opens nothing before its first delivery (a command that
    #: only checks a config makes one and drops it). :raises pgwork.options.ConfigError:
    make: Callable[[ChannelConfig], Channel]
    #: It sends to another host: a deliver span is a client's.
    remote: bool = False
    #: What each attempt sends, as lines to show an operator: ``request(options, operation_id)``.
    request: Callable[[Opts, str], list[str]] | None = None
