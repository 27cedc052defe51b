"""Configuration: a TOML file, environment overrides, and a clear error naming any wrong option."""

from __future__ import annotations

import base64
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from .durations import parse_duration


class ConfigError(Exception):
    """A configuration value is missing or wrong; the message names the option."""


#: A channel's name: the rule of pgwork.channel's channel_name_valid constraint (schema.sql).
CHANNEL_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")


def option(
    name: str,
    kind: str,
    default: Any = MISSING,
    *,
    within: tuple[float, float] | None = None,
    choices: tuple[str, ...] | None = None,
    shown: str | None = None,
    factory: Any = None,
) -> Any:
    """A configuration option, declared once on its field: ``name`` as the TOML file spells it
    (``section.key``; a channel option's key), ``kind`` (how its text is read: str, int,
    duration, bool, path; or a channel's own: rate, headers, secrets), its default, its bounds
    or its choices, and ``shown``: the default as the README's table writes it when it is
    computed (e.g. ``host:pid:random``). Loading, the bound and choice checks, the channel keys
    and the README table's test (tests/test_config.py) all read these."""
    md = {"option": name, "kind": kind, "within": within, "choices": choices, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    if default is MISSING:
        return field(metadata=md)  # required
    return field(default=default, metadata=md)


def declared(cls: type) -> dict[str, Field[Any]]:
    """A configuration class's options by name, in declaration order."""
    return {f.metadata["option"]: f for f in fields(cls) if "option" in f.metadata}


@dataclass(frozen=True)
class RetryPolicy:
    #: Attempts before a failing occurrence goes dead (redrive grants this many again).
    max_attempts: int = option("max_attempts", "int", 100, within=(1, 10_000))
    #: First backoff step, seconds; attempt n waits a random time in [0, min(cap, base * 2**(n-1))].
    base: float = option("backoff_base", "duration", 2.0, within=(0.001, 86400))
    #: Longest backoff, seconds.
    cap: float = option("backoff_cap", "duration", 3600.0, within=(0.001, 7 * 86400))
    #: How long an occurrence is retried, seconds from its due time (or its redrive): the last
    #: try is at the end of this window; a failure after it is a dead letter.
    retry_for: float = option("retry_for", "duration", 86400.0, within=(0.001, 90 * 86400))


@dataclass(frozen=True)
class RetentionPolicy:
    #: Delivered, cancelled and superseded work older than this is deleted, seconds.
    keep: float = option("retention.keep", "duration", 30 * 86400.0, within=(0, 10 * 365 * 86400))
    #: Dead letters older than this are deleted (longer: someone may still redrive them), seconds.
    dead_keep: float = option(
        "retention.dead_keep", "duration", 90 * 86400.0, within=(0, 10 * 365 * 86400)
    )
    #: Largest batch (rows per transaction); a batch that times out halves, then grows back by 10%.
    batch_size: int = option("retention.batch_size", "int", 1000, within=(10, 100_000))
    #: Smallest batch after repeated timeouts.
    min_batch: int = 10
    #: Pause between batches, seconds (leaves room for the hot path).
    pause: float = option("retention.pause", "duration", 0.05, within=(0, 60))
    #: Per-batch statement timeout and lock timeout, seconds.
    statement_timeout: float = option(
        "retention.statement_timeout", "duration", 2.0, within=(0.01, 3600)
    )
    lock_timeout: float = option("retention.lock_timeout", "duration", 0.5, within=(0.001, 3600))


@dataclass(frozen=True)
class ChannelConfig:
    name: str
    #: ``log`` (demo: logs the delivery), ``webhook`` (HTTP POST) or ``python`` (an async callable).
    kind: str = option("kind", "str", choices=("log", "webhook", "python"))
    #: Deliveries of this channel in flight at once, per daemon.
    concurrency: int = option("concurrency", "int", 16, within=(1, 10_000))
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # webhook
    url: str | None = option("url", "str", None)
    headers: Mapping[str, str] = option("headers", "headers", factory=dict, shown="`{}`")
    connect_timeout: float = option("connect_timeout", "duration", 5.0, within=(0.01, 600))
    read_timeout: float = option("read_timeout", "duration", 10.0, within=(0.01, 3600))
    max_response_bytes: int = option(
        "max_response_bytes", "int", 65536, within=(0, 64 * 1024 * 1024)
    )
    verify_tls: bool = option("verify_tls", "bool", True)
    #: PEM file of the certificate authorities a webhook receiver's certificate may be signed
    #: by, trusted besides the system's (a private CA); None: the system's alone.
    ca_file: str | None = option("ca_file", "str", None)
    #: Most one attempt may take in all (connect, send, every byte of the answer; or a python
    #: target's call), seconds; past it the attempt is a retry. Below the lease by default.
    attempt_timeout: float = option("attempt_timeout", "duration", 30.0, within=(0.01, 86400))
    #: How long after its due time an occurrence is still worth sending, seconds; past it the
    #: claim closes it as ``expired`` (never sent). None: always worth sending.
    expire_after: float | None = option("expire_after", "duration", None, within=(1, 400 * 86400))
    #: Occurrences that fired before their reminder was written or moved: ``all`` are sent,
    #: ``latest`` only the most recent one, ``none`` none.
    catch_up: str = option("catch_up", "str", "all", choices=("all", "latest", "none"))
    #: Deliveries per second across all daemons (a token bucket in the channel's row); None: no limit.
    rate_limit: float | None = option("rate_limit", "rate", None)
    #: How many deliveries the rate limit lets through at once after a quiet spell.
    rate_burst: float | None = option(
        "rate_burst", "int", None, within=(1, 1_000_000), shown="a second's worth"
    )
    #: Deliveries in flight (rows claimed) across all daemons at most; None: no cap.
    global_concurrency: int | None = option(
        "global_concurrency", "int", None, within=(1, 1_000_000)
    )
    #: Circuit breaker: failed attempts in a row (any daemon) that hold the channel; None: off.
    breaker_after: int | None = option("breaker_after", "int", None, within=(1, 1_000_000))
    #: How long a tripped breaker holds the channel before one delivery probes it, seconds.
    breaker_probe: float = option("breaker_probe", "duration", 30.0, within=(0.1, 86400))
    #: Standard Webhooks signing secrets as configured (``whsec_…``), newest first; empty:
    #: requests are not signed.
    signing_secrets: tuple[str, ...] = option("signing_secret", "secrets", (), shown="—")
    # python
    target: str | None = option("target", "str", None)

    @property
    def signing_keys(self) -> tuple[bytes, ...]:
        """The HMAC keys of ``signing_secrets`` (validated when the config was read)."""
        return tuple(signing_key(s) for s in self.signing_secrets)


@dataclass(frozen=True)
class Config:
    #: libpq URI or conninfo; None means: libpq environment if set, else the embedded server.
    dsn: str | None = option("database.dsn", "str", None)
    #: Data directory of the embedded server (used only when no database is configured).
    embedded_dir: Path = option("database.embedded_dir", "path", Path(".pgwork/pgdata"))
    pool_size: int = option("database.pool_size", "int", 8, within=(2, 200))
    #: Seconds to wait for a database connection before a pass fails (and is retried).
    connect_timeout: float = option("database.connect_timeout", "duration", 5.0, within=(0.1, 300))
    #: ``transaction``: the DSN points at a transaction-pooling PgBouncer (no session state, no
    #: prepared statements, LISTEN only through ``listen_dsn``); ``none``: a direct connection.
    pooler: str = option("database.pooler", "str", "none", choices=("none", "transaction"))
    #: A direct connection for LISTEN (behind a pooler); default: ``dsn`` without a pooler, none
    #: with one (then the tick is the only wake-up).
    listen_dsn: str | None = option("database.listen_dsn", "str", None)
    #: Claims (and the materialiser's pages that claim) commit after the WAL flush: a database
    #: crash cannot take back a claim whose request went out, so every request that reached a
    #: receiver has its attempt row. Off: they commit without waiting (faster; README says what
    #: a crash may then repeat).
    synchronous_claims: bool = option("database.synchronous_claims", "bool", False)
    daemon_id: str | None = option("daemon.id", "str", None, shown="host:pid:random")
    #: ``auto``: uvloop where it is installed, else asyncio; ``uvloop`` (required); ``asyncio``.
    event_loop: str = option(
        "daemon.event_loop", "str", "auto", choices=("auto", "uvloop", "asyncio")
    )
    #: Seconds in-flight deliveries may take to finish after SIGTERM before they are cancelled.
    shutdown_grace: float = option("daemon.shutdown_grace", "duration", 30.0, within=(0, 3600))
    #: Materialiser: timed wake-up even without NOTIFY (the correctness floor), seconds.
    tick: float = option("materialiser.tick", "duration", 5.0, within=(0.05, 3600))
    #: Materialiser: occurrences firing this far ahead get their work rows early, seconds.
    #: (NOTIFY covers reminders firing within the next hour, schema.sql: no longer look-ahead.)
    lookahead: float = option("materialiser.lookahead", "duration", 300.0, within=(0, 3600))
    #: Materialiser: reminders per page (one short transaction each).
    page_size: int = option("materialiser.page_size", "int", 1000, within=(1, 100_000))
    #: Worker: how long a claim holds a row before another worker may take it, seconds.
    lease: float = option("worker.lease", "duration", 60.0, within=(1, 86400))
    #: Worker: rows claimed per statement at most (never more than the free capacity).
    claim_batch: int = option("worker.claim_batch", "int", 100, within=(1, 10_000))
    log_format: str = option("log.format", "str", "auto", choices=("auto", "json", "text"))
    log_level: str = option(
        "log.level", "str", "info", choices=("debug", "info", "warning", "error")
    )
    #: ``none`` keeps business keys and recipients in logs; ``hash`` or ``drop`` hides them.
    log_redact: str = option("log.redact", "str", "none", choices=("none", "hash", "drop"))
    metrics_enabled: bool = option("metrics.enabled", "bool", True)
    metrics_listen: str = option("metrics.listen", "str", "127.0.0.1:9464")
    #: How often database-derived gauges are refreshed, seconds.
    metrics_interval: float = option("metrics.interval", "duration", 5.0, within=(0.1, 3600))
    #: Run the retention duty inside the daemon (``pgwork cleanup`` runs it on its own).
    retention_enabled: bool = option("retention.enabled", "bool", True)
    #: Optional separate DSN (e.g. a role allowed to DELETE) for retention; default: ``dsn``.
    retention_dsn: str | None = option("retention.dsn", "str", None)
    #: Seconds between retention passes.
    retention_interval: float = option("retention.interval", "duration", 60.0, within=(0.1, 86400))
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    channels: Mapping[str, ChannelConfig] = field(
        default_factory=lambda: {"log": ChannelConfig(name="log", kind="log")}
    )
    #: OpenTelemetry spans for claim -> deliver -> outcome (needs the otel extra).
    tracing_enabled: bool = option("tracing.enabled", "bool", False)
    #: Serve the web page from the daemon too (`pgwork web` serves it on its own).
    web_enabled: bool = option("web.enabled", "bool", False)
    web_listen: str = option("web.listen", "str", "127.0.0.1:9465")
    #: The token that enables the page's actions (None: read-only).
    web_token: str | None = option("web.token", "str", None)
    #: The channels came from the config (file or environment), not the built-in demo default:
    #: `pgwork migrate` registers them.
    channels_configured: bool = False


# The top-level options, derived from the declarations above: option path -> (Config field,
# or "retention.<RetentionPolicy field>", kind), then their choices and bounds.
_TOP = declared(Config)
_POLICY = declared(RetentionPolicy)
_OPTIONS: dict[str, tuple[str, str]] = {
    **{o: (f.name, f.metadata["kind"]) for o, f in _TOP.items()},
    **{o: ("retention." + f.name, f.metadata["kind"]) for o, f in _POLICY.items()},
}
_CHOICES: dict[str, tuple[str, ...]] = {
    o: f.metadata["choices"] for o, f in {**_TOP, **_POLICY}.items() if f.metadata["choices"]
}
_LIMITS: dict[str, tuple[float, float]] = {
    o: f.metadata["within"] for o, f in {**_TOP, **_POLICY}.items() if f.metadata["within"]
}
#: A channel table's keys, and their declarations (on ChannelConfig and RetryPolicy).
_CHANNEL = {**declared(ChannelConfig), **declared(RetryPolicy)}
_CHANNEL_KEYS = set(_CHANNEL)

_RATE_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
}


def parse_rate(option: str, raw: Any) -> float:
    """Deliveries per second from ``50``, ``2.5``, ``'50/s'``, ``'3000/min'`` or ``'100/h'``."""
    value: Any = raw
    per = 1.0
    if isinstance(raw, str):
        count, sep, unit = raw.strip().partition("/")
        if sep and unit.strip() not in _RATE_UNITS:
            raise ConfigError(
                f"{option}: unknown unit {unit.strip()!r}; use /s, /min or /h (got {raw!r})"
            )
        per = _RATE_UNITS[unit.strip()] if sep else 1.0
        try:
            value = float(count)
        except ValueError:
            raise ConfigError(
                f"{option}: expected deliveries per second, e.g. 50 or '3000/min' (got {raw!r})"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{option}: expected deliveries per second, e.g. 50 or '3000/min' (got {raw!r})"
        )
    rate = float(value) / per
    if not 0.001 <= rate <= 1_000_000:
        raise ConfigError(f"{option}: must be between 0.001 and 1000000 per second (got {raw!r})")
    return rate


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


def _signing_secrets(where: str, raw: Any, env: Mapping[str, str]) -> tuple[str, ...]:
    """``signing_secret``: ``env:NAME`` (recommended) or the value; several secrets separated by
    spaces while one is rotated (each request then carries a signature per secret)."""
    if raw is None:
        return ()
    option = f"{where}.signing_secret"
    if not isinstance(raw, str):
        raise ConfigError(f"{option}: expected a string such as 'env:PGWORK_SIGNING_SECRET'")
    if raw.startswith("env:"):
        if raw[4:] not in env:
            raise ConfigError(f"{option}: environment variable {raw[4:]} is not set")
        raw = env[raw[4:]]
    secrets = tuple(raw.split())
    if not secrets:
        raise ConfigError(f"{option}: empty")
    for i, s in enumerate(secrets, 1):
        try:
            signing_key(s)
        except ValueError as e:
            # The value is never shown: it is a secret.
            raise ConfigError(f"{option}: secret {i} of {len(secrets)}: {e}") from None
    return secrets


def _convert(option: str, kind: str, value: Any) -> Any:
    try:
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
        if kind == "path":
            if not isinstance(value, str) or not value:
                raise ValueError("expected a path")
            return Path(value)
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError("expected a whole number")
            if isinstance(value, str):
                value = int(value.strip())
            if not isinstance(value, int):
                raise ValueError("expected a whole number")
            return value
        if kind == "duration":
            if isinstance(value, bool) or not isinstance(value, str):
                raise ValueError("expected a duration string such as '5s' or '10m'")
            return parse_duration(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError("expected true or false")
    except ValueError as e:
        raise ConfigError(f"{option}: {e} (got {value!r})") from None
    raise AssertionError(kind)


def listen_ports(value: str) -> tuple[str, range] | None:
    """``HOST:PORT`` (0: any free port) or ``HOST:FIRST-LAST`` (the first free port of the
    range: several daemons on one host with one config) as (host, ports); None if malformed."""
    host, sep, port = value.rpartition(":")
    first, dash, last = port.partition("-")
    if not sep or any(c.isspace() for c in value) or not first.isdigit():
        return None
    if not dash:
        last = first
    if not last.isdigit():
        return None
    lo, hi = int(first), int(last)
    if not (lo == hi == 0 or 1 <= lo <= hi <= 65535):
        return None
    return host, range(lo, hi + 1)


def _check_listen(option: str, value: str) -> None:
    if listen_ports(value) is None:
        raise ConfigError(
            f"{option}: expected HOST:PORT with a port from 1 to 65535, HOST:0 (any free port) or "
            f"HOST:FIRST-LAST (the first free port of a range) (got {value!r})"
        )


def _check_url(where: str, url: Any) -> None:
    """A webhook URL that can be requested: http(s), a host, a valid port, no spaces."""
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
        raise ConfigError(f"{where}.url: {problem} (got {url!r})")


def _check(option: str, value: Any) -> None:
    if option in ("metrics.listen", "web.listen"):
        _check_listen(option, value)
    if option == "web.token" and (len(value) < 16 or value != value.strip()):
        raise ConfigError(
            "web.token: at least 16 characters with no surrounding spaces (set it with "
            "PGWORK_WEB_TOKEN rather than in the file; e.g. `openssl rand -hex 24`)"
        )
    if option in _CHOICES and value not in _CHOICES[option]:
        raise ConfigError(f"{option}: must be one of {', '.join(_CHOICES[option])} (got {value!r})")
    if option in _LIMITS:
        lo, hi = _LIMITS[option]
        if not lo <= value <= hi:
            raise ConfigError(f"{option}: must be between {lo:g} and {hi:g} (got {value!r})")


def _channel(
    name: str, raw: Any, env: Mapping[str, str], sources: Mapping[str, str] | None = None
) -> ChannelConfig:
    """``sources`` maps an option to the environment variable that set it (for errors)."""
    where = f"channels.{name}"
    sources = sources or {}

    def label(key: str) -> str:
        return f"{where}.{key}" + (f" (from {sources[key]})" if key in sources else "")

    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    unknown = set(raw) - _CHANNEL_KEYS
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown option")
    if not CHANNEL_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: channel names are lower-case letters, digits, _ and - (got {name!r})"
        )

    def choice(key: str, default: Any) -> Any:
        value = raw.get(key, default)
        allowed = _CHANNEL[key].metadata["choices"]
        if value not in allowed:
            raise ConfigError(f"{label(key)}: must be one of {', '.join(allowed)} (got {value!r})")
        return value

    kind = choice("kind", None)

    def num(key: str) -> Any:
        """A channel option read, bounded and defaulted as its field declares it."""
        declared_as = _CHANNEL[key]
        if key not in raw:
            return declared_as.default
        v = _convert(label(key), declared_as.metadata["kind"], raw[key])
        lo, hi = declared_as.metadata["within"]
        if not lo <= v <= hi:
            raise ConfigError(f"{label(key)}: must be between {lo:g} and {hi:g} (got {raw[key]!r})")
        return v

    retry = RetryPolicy(
        max_attempts=num("max_attempts"),
        base=num("backoff_base"),
        cap=num("backoff_cap"),
        retry_for=num("retry_for"),
    )
    catch_up = choice("catch_up", _CHANNEL["catch_up"].default)
    rate = parse_rate(label("rate_limit"), raw["rate_limit"]) if "rate_limit" in raw else None
    burst = num("rate_burst")
    if burst is not None and rate is None:
        raise ConfigError(f"{label('rate_burst')}: only with a rate_limit")
    if retry.cap < retry.base:
        raise ConfigError(f"{where}.backoff_cap: must not be shorter than backoff_base")
    headers: dict[str, str] = {}
    for hk, hv in (raw.get("headers") or {}).items():
        if not isinstance(hv, str):
            raise ConfigError(f"{where}.headers.{hk}: expected a string")
        if hv.startswith("env:"):
            var = hv[4:]
            if var not in env:
                raise ConfigError(f"{where}.headers.{hk}: environment variable {var} is not set")
            hv = env[var]
        if any(c in hv for c in "\r\n\x00") or not hv.isascii() or not hv.isprintable():
            raise ConfigError(
                f"{where}.headers.{hk}: the value has a line break, a control or a non-ASCII "
                "character (the value is not shown: it may be a secret)"
            )
        headers[hk] = hv
    url = raw.get("url")
    target = raw.get("target")
    ca_file = raw.get("ca_file")
    if ca_file is not None:
        _check_ca_file(label("ca_file"), ca_file, kind)
    if kind == "webhook":
        _check_url(where, url)
    elif url is not None:
        raise ConfigError(f"{where}.url: only webhook channels take a url")
    if kind != "webhook" and "signing_secret" in raw:
        raise ConfigError(f"{where}.signing_secret: only webhook channels are signed")
    if kind == "python":
        if not isinstance(target, str) or ":" not in target:
            raise ConfigError(
                f"{where}.target: a python channel needs 'module:function' (got {target!r})"
            )
    elif target is not None:
        raise ConfigError(f"{where}.target: only python channels take a target")
    return ChannelConfig(
        name=name,
        kind=kind,
        concurrency=num("concurrency"),
        retry=retry,
        url=url,
        headers=headers,
        connect_timeout=num("connect_timeout"),
        read_timeout=num("read_timeout"),
        max_response_bytes=num("max_response_bytes"),
        verify_tls=_convert(
            label("verify_tls"), "bool", raw.get("verify_tls", _CHANNEL["verify_tls"].default)
        ),
        ca_file=ca_file,
        attempt_timeout=num("attempt_timeout"),
        signing_secrets=_signing_secrets(where, raw.get("signing_secret"), env),
        target=target,
        expire_after=num("expire_after"),
        catch_up=catch_up,
        rate_limit=rate,
        # A second's worth by default (at least one).
        rate_burst=float(burst) if burst is not None else (max(1.0, rate) if rate else None),
        global_concurrency=num("global_concurrency"),
        breaker_after=num("breaker_after"),
        breaker_probe=num("breaker_probe"),
    )


def _check_ca_file(where: str, path: object, kind: str) -> None:
    """A CA file that is not a readable PEM certificate is refused at start, not at the first
    delivery."""
    if kind != "webhook":
        raise ConfigError(f"{where}: only webhook channels take a ca_file")
    if not isinstance(path, str):
        raise ConfigError(f"{where}: expected a path to a PEM file")
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ConfigError(f"{where}: {path} holds no PEM certificate")


def _check_dsn(option: str, dsn: str, env: Mapping[str, str]) -> None:
    """A DSN that cannot parse is a configuration error, reported without echoing the string
    (libpq's parse errors quote the token they choke on, often the password)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(dsn)
    except ProgrammingError:
        names = ["PGWORK_" + option.replace(".", "_").upper()]
        if option == "database.dsn":
            names.insert(0, "PGWORK_DSN")
        var = next((n for n in names if env.get(n) == dsn), None)
        where = f"{option} (from {var})" if var else option
        raise ConfigError(
            f"{where}: not a valid libpq URI or conninfo string (the value is not shown: it may "
            "hold a password; in a URI, percent-encode special characters)"
        ) from None


def _channel_env_overrides(
    chans: dict[str, Any], env: Mapping[str, str], sources: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """``chans`` with ``PGWORK_CHANNELS_<NAME>_<OPTION>`` applied (NAME upper-cased, - as _; a
    name the file does not have adds a channel); ``sources`` learns which variable set what.
    Headers are set in the file (their values may name an environment variable with ``env:``)."""
    out = {n: dict(t) if isinstance(t, dict) else t for n, t in chans.items()}
    by_env_name = {n.upper().replace("-", "_"): n for n in out}
    keys = sorted(_CHANNEL_KEYS - {"headers"}, key=len, reverse=True)
    prefix = "PGWORK_CHANNELS_"
    for var in sorted(env):
        if not var.startswith(prefix):
            continue
        rest = var[len(prefix) :]
        for key in keys:
            if rest.endswith("_" + key.upper()) and len(rest) > len(key) + 1:
                env_name = rest[: -len(key) - 1]
                break
        else:
            raise ConfigError(
                f"{var}: not a channel option; use PGWORK_CHANNELS_<NAME>_<OPTION> with OPTION one "
                f"of {', '.join(sorted(k.upper() for k in keys))}"
            )
        name = by_env_name.get(env_name, env_name.lower())
        table = out.setdefault(name, {})
        if isinstance(table, dict):
            table[key] = env[var]
            sources.setdefault(name, {})[key] = var
    return out


def load(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Read the TOML file (``path``, else ``$PGWORK_CONFIG``, else none) and apply environment
    overrides: ``PGWORK_DSN`` and ``PGWORK_<SECTION>_<KEY>`` (e.g. ``PGWORK_MATERIALISER_TICK=1s``).

    :raises ConfigError: naming the first wrong option.
    """
    env = os.environ if env is None else env
    path = path or env.get("PGWORK_CONFIG") or None
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None

    values: dict[str, Any] = {}
    known_sections = {o.split(".")[0] for o in _OPTIONS} | {"channels"}
    for section, table in raw.items():
        if section not in known_sections:
            raise ConfigError(
                f"{section}: unknown section (known: {', '.join(sorted(known_sections))})"
            )
        if section == "channels":
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a table")
        for key, value in table.items():
            option = f"{section}.{key}"
            if option not in _OPTIONS:
                raise ConfigError(f"{option}: unknown option")
            _fname, kind = _OPTIONS[option]
            values[option] = _convert(option, kind, value)

    for option, (_fname, kind) in _OPTIONS.items():
        var = "PGWORK_" + option.replace(".", "_").upper()
        if var in env:
            values[option] = _convert(f"{option} (from {var})", kind, env[var])
    if env.get("PGWORK_DSN"):
        values["database.dsn"] = env["PGWORK_DSN"]

    for option, value in values.items():
        _check(option, value)
    for option in ("database.dsn", "retention.dsn", "database.listen_dsn"):
        if values.get(option):
            _check_dsn(option, values[option], env)

    kwargs = {
        _OPTIONS[o][0]: v for o, v in values.items() if not _OPTIONS[o][0].startswith("retention.")
    }
    policy = {
        _OPTIONS[o][0].split(".", 1)[1]: v
        for o, v in values.items()
        if _OPTIONS[o][0].startswith("retention.")
    }
    if policy:
        kwargs["retention"] = RetentionPolicy(**policy)
    chans = raw.get("channels", {})
    if "channels" in raw and (not isinstance(chans, dict) or not chans):
        raise ConfigError("channels: expected at least one [channels.NAME] table")
    sources: dict[str, dict[str, str]] = {}
    chans = _channel_env_overrides(chans, env, sources)
    if chans:
        kwargs["channels"] = {
            name: _channel(name, t, env, sources.get(name)) for name, t in chans.items()
        }
        kwargs["channels_configured"] = True
    cfg = Config(**kwargs)
    if cfg.claim_batch < 1:
        raise ConfigError("worker.claim_batch: must be at least 1")
    return cfg
