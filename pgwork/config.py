"""Configuration: a TOML file, environment overrides, and a clear error naming any wrong option."""

from __future__ import annotations

import base64
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .durations import parse_duration


class ConfigError(Exception):
    """A configuration value is missing or wrong; the message names the option."""


@dataclass(frozen=True)
class RetryPolicy:
    #: Attempts before a failing occurrence goes dead (redrive grants this many again).
    max_attempts: int = 100
    #: First backoff step, seconds; attempt n waits a random time in [0, min(cap, base * 2**(n-1))].
    base: float = 2.0
    #: Longest backoff, seconds.
    cap: float = 3600.0
    #: How long an occurrence is retried, seconds from its due time (or its redrive): the last
    #: try is at the end of this window; a failure after it is a dead letter.
    retry_for: float = 86400.0


@dataclass(frozen=True)
class RetentionPolicy:
    #: Delivered, cancelled and superseded work older than this is deleted, seconds.
    keep: float = 30 * 86400.0
    #: Dead letters older than this are deleted (longer: someone may still redrive them), seconds.
    dead_keep: float = 90 * 86400.0
    #: Largest batch (rows per transaction); a batch that times out halves, then grows back by 10%.
    batch_size: int = 1000
    #: Smallest batch after repeated timeouts.
    min_batch: int = 10
    #: Pause between batches, seconds (leaves room for the hot path).
    pause: float = 0.05
    #: Per-batch statement timeout and lock timeout, seconds.
    statement_timeout: float = 2.0
    lock_timeout: float = 0.5


@dataclass(frozen=True)
class ChannelConfig:
    name: str
    #: ``log`` (demo: logs the delivery), ``webhook`` (HTTP POST) or ``python`` (an async callable).
    kind: str
    #: Deliveries of this channel in flight at once, per daemon.
    concurrency: int = 16
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # webhook
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    max_response_bytes: int = 65536
    verify_tls: bool = True
    #: Most one attempt may take in all (connect, send, every byte of the answer; or a python
    #: target's call), seconds; past it the attempt is a retry. Below the lease by default.
    attempt_timeout: float = 30.0
    #: How long after its due time an occurrence is still worth sending, seconds; past it the
    #: claim closes it as ``expired`` (never sent). None: always worth sending.
    expire_after: float | None = None
    #: Occurrences that fired before their reminder was written or moved: ``all`` are sent,
    #: ``latest`` only the most recent one, ``none`` none.
    catch_up: str = "all"
    #: Deliveries per second across all daemons (a token bucket in the channel's row); None: no limit.
    rate_limit: float | None = None
    #: How many deliveries the rate limit lets through at once after a quiet spell.
    rate_burst: float | None = None
    #: Deliveries in flight (rows claimed) across all daemons at most; None: no cap.
    global_concurrency: int | None = None
    #: Circuit breaker: failed attempts in a row (any daemon) that hold the channel; None: off.
    breaker_after: int | None = None
    #: How long a tripped breaker holds the channel before one delivery probes it, seconds.
    breaker_probe: float = 30.0
    #: Standard Webhooks signing secrets as configured (``whsec_…``), newest first; empty:
    #: requests are not signed.
    signing_secrets: tuple[str, ...] = ()
    # python
    target: str | None = None

    @property
    def signing_keys(self) -> tuple[bytes, ...]:
        """The HMAC keys of ``signing_secrets`` (validated when the config was read)."""
        return tuple(signing_key(s) for s in self.signing_secrets)


@dataclass(frozen=True)
class Config:
    #: libpq URI or conninfo; None means: libpq environment if set, else the embedded server.
    dsn: str | None = None
    #: Data directory of the embedded server (used only when no database is configured).
    embedded_dir: Path = Path(".pgwork/pgdata")
    pool_size: int = 8
    #: Seconds to wait for a database connection before a pass fails (and is retried).
    connect_timeout: float = 5.0
    #: ``transaction``: the DSN points at a transaction-pooling PgBouncer (no session state, no
    #: prepared statements, LISTEN only through ``listen_dsn``); ``none``: a direct connection.
    pooler: str = "none"
    #: A direct connection for LISTEN (behind a pooler); default: ``dsn`` without a pooler, none
    #: with one (then the tick is the only wake-up).
    listen_dsn: str | None = None
    daemon_id: str | None = None
    #: ``auto``: uvloop where it is installed, else asyncio; ``uvloop`` (required); ``asyncio``.
    event_loop: str = "auto"
    #: Seconds in-flight deliveries may take to finish after SIGTERM before they are cancelled.
    shutdown_grace: float = 30.0
    #: Materialiser: timed wake-up even without NOTIFY (the correctness floor), seconds.
    tick: float = 5.0
    #: Materialiser: occurrences firing this far ahead get their work rows early, seconds.
    lookahead: float = 300.0
    #: Materialiser: reminders per page (one short transaction each).
    page_size: int = 1000
    #: Worker: how long a claim holds a row before another worker may take it, seconds.
    lease: float = 60.0
    #: Worker: rows claimed per statement at most (never more than the free capacity).
    claim_batch: int = 100
    log_format: str = "auto"
    log_level: str = "info"
    #: ``none`` keeps business keys and recipients in logs; ``hash`` or ``drop`` hides them.
    log_redact: str = "none"
    metrics_enabled: bool = True
    metrics_listen: str = "127.0.0.1:9464"
    #: How often database-derived gauges are refreshed, seconds.
    metrics_interval: float = 5.0
    #: Run the retention duty inside the daemon (``pgwork cleanup`` runs it on its own).
    retention_enabled: bool = True
    #: Optional separate DSN (e.g. a role allowed to DELETE) for retention; default: ``dsn``.
    retention_dsn: str | None = None
    #: Seconds between retention passes.
    retention_interval: float = 60.0
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    channels: Mapping[str, ChannelConfig] = field(
        default_factory=lambda: {"log": ChannelConfig(name="log", kind="log")}
    )
    #: OpenTelemetry spans for claim -> deliver -> outcome (needs the otel extra).
    tracing_enabled: bool = False
    #: Serve the web page from the daemon too (`pgwork web` serves it on its own).
    web_enabled: bool = False
    web_listen: str = "127.0.0.1:9465"
    #: The token that enables the page's actions (None: read-only).
    web_token: str | None = None
    #: The channels came from the config (file or environment), not the built-in demo default:
    #: `pgwork migrate` registers them.
    channels_configured: bool = False


# option path -> (Config field, kind). Kinds: str, int, float (duration), bool, path.
_OPTIONS: dict[str, tuple[str, str]] = {
    "database.dsn": ("dsn", "str"),
    "database.embedded_dir": ("embedded_dir", "path"),
    "database.pool_size": ("pool_size", "int"),
    "database.connect_timeout": ("connect_timeout", "duration"),
    "database.pooler": ("pooler", "str"),
    "database.listen_dsn": ("listen_dsn", "str"),
    "daemon.id": ("daemon_id", "str"),
    "daemon.event_loop": ("event_loop", "str"),
    "daemon.shutdown_grace": ("shutdown_grace", "duration"),
    "materialiser.tick": ("tick", "duration"),
    "materialiser.lookahead": ("lookahead", "duration"),
    "materialiser.page_size": ("page_size", "int"),
    "worker.lease": ("lease", "duration"),
    "worker.claim_batch": ("claim_batch", "int"),
    "log.format": ("log_format", "str"),
    "log.level": ("log_level", "str"),
    "log.redact": ("log_redact", "str"),
    "metrics.enabled": ("metrics_enabled", "bool"),
    "metrics.listen": ("metrics_listen", "str"),
    "tracing.enabled": ("tracing_enabled", "bool"),
    "web.enabled": ("web_enabled", "bool"),
    "web.listen": ("web_listen", "str"),
    "web.token": ("web_token", "str"),
    "metrics.interval": ("metrics_interval", "duration"),
    "retention.enabled": ("retention_enabled", "bool"),
    "retention.dsn": ("retention_dsn", "str"),
    "retention.interval": ("retention_interval", "duration"),
    "retention.keep": ("retention.keep", "duration"),
    "retention.dead_keep": ("retention.dead_keep", "duration"),
    "retention.batch_size": ("retention.batch_size", "int"),
    "retention.pause": ("retention.pause", "duration"),
    "retention.statement_timeout": ("retention.statement_timeout", "duration"),
    "retention.lock_timeout": ("retention.lock_timeout", "duration"),
}

_CHOICES = {
    "database.pooler": ("none", "transaction"),
    "daemon.event_loop": ("auto", "uvloop", "asyncio"),
    "log.format": ("auto", "json", "text"),
    "log.level": ("debug", "info", "warning", "error"),
    "log.redact": ("none", "hash", "drop"),
}

_LIMITS: dict[str, tuple[float, float]] = {
    "database.pool_size": (2, 200),
    "database.connect_timeout": (0.1, 300),
    "daemon.shutdown_grace": (0, 3600),
    "materialiser.tick": (0.05, 3600),
    # NOTIFY covers reminders firing within the next hour (schema.sql): no longer look-ahead.
    "materialiser.lookahead": (0, 3600),
    "materialiser.page_size": (1, 100_000),
    "worker.lease": (1, 86400),
    "worker.claim_batch": (1, 10_000),
    "metrics.interval": (0.1, 3600),
    "retention.interval": (0.1, 86400),
    "retention.keep": (0, 10 * 365 * 86400),
    "retention.dead_keep": (0, 10 * 365 * 86400),
    "retention.batch_size": (10, 100_000),
    "retention.pause": (0, 60),
    "retention.statement_timeout": (0.01, 3600),
    "retention.lock_timeout": (0.001, 3600),
}

_CHANNEL_KEYS = {
    "kind",
    "concurrency",
    "max_attempts",
    "backoff_base",
    "backoff_cap",
    "url",
    "headers",
    "connect_timeout",
    "read_timeout",
    "max_response_bytes",
    "verify_tls",
    "target",
    "attempt_timeout",
    "signing_secret",
    "retry_for",
    "expire_after",
    "catch_up",
    "rate_limit",
    "rate_burst",
    "global_concurrency",
    "breaker_after",
    "breaker_probe",
}

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
    import re

    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", name):
        raise ConfigError(
            f"{where}: channel names are lower-case letters, digits, _ and - (got {name!r})"
        )
    kind = raw.get("kind")
    if kind not in ("log", "webhook", "python"):
        raise ConfigError(f"{where}.kind: must be one of log, webhook, python (got {kind!r})")

    def num(key: str, kind_: str, default: Any, lo: float, hi: float) -> Any:
        if key not in raw:
            return default
        v = _convert(label(key), kind_, raw[key])
        if not lo <= v <= hi:
            raise ConfigError(f"{label(key)}: must be between {lo:g} and {hi:g} (got {raw[key]!r})")
        return v

    retry = RetryPolicy(
        max_attempts=num("max_attempts", "int", 100, 1, 10_000),
        base=num("backoff_base", "duration", 2.0, 0.001, 86400),
        cap=num("backoff_cap", "duration", 3600.0, 0.001, 7 * 86400),
        retry_for=num("retry_for", "duration", 86400.0, 0.001, 90 * 86400),
    )
    catch_up = raw.get("catch_up", "all")
    if catch_up not in ("all", "latest", "none"):
        raise ConfigError(
            f"{label('catch_up')}: must be one of all, latest, none (got {catch_up!r})"
        )
    rate = parse_rate(label("rate_limit"), raw["rate_limit"]) if "rate_limit" in raw else None
    burst = num("rate_burst", "int", None, 1, 1_000_000)
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
        concurrency=num("concurrency", "int", 16, 1, 10_000),
        retry=retry,
        url=url,
        headers=headers,
        connect_timeout=num("connect_timeout", "duration", 5.0, 0.01, 600),
        read_timeout=num("read_timeout", "duration", 10.0, 0.01, 3600),
        max_response_bytes=num("max_response_bytes", "int", 65536, 0, 64 * 1024 * 1024),
        verify_tls=_convert(f"{where}.verify_tls", "bool", raw.get("verify_tls", True)),
        attempt_timeout=num("attempt_timeout", "duration", 30.0, 0.01, 86400),
        signing_secrets=_signing_secrets(where, raw.get("signing_secret"), env),
        target=target,
        expire_after=num("expire_after", "duration", None, 1, 400 * 86400),
        catch_up=catch_up,
        rate_limit=rate,
        # A second's worth by default (at least one).
        rate_burst=float(burst) if burst is not None else (max(1.0, rate) if rate else None),
        global_concurrency=num("global_concurrency", "int", None, 1, 1_000_000),
        breaker_after=num("breaker_after", "int", None, 1, 1_000_000),
        breaker_probe=num("breaker_probe", "duration", 30.0, 0.1, 86400),
    )


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
