"""Configuration: a TOML file, environment overrides, and a clear error naming any wrong option."""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import options
from .channels import KINDS
from .durations import say_duration
from .options import TABLES, ConfigError, convert, declared, listen_ports, option
from .settings import ChannelConfig, RetryPolicy

#: Re-exported: declared with the options (pgwork/options.py) and a channel's settings
#: (pgwork/settings.py).
__all__ = [
    "ChannelConfig",
    "ConfigError",
    "RetryPolicy",
    "declared",
    "listen_ports",
    "option",
]


#: A channel's name: the rule of pgwork.channel's channel_name_valid constraint (schema.sql).
CHANNEL_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")


@dataclass(frozen=True)
class RetentionPolicy:
    keep: float = option(
        "retention.keep",
        "duration",
        30 * 86400.0,
        within=(0, 10 * 365 * 86400),
        doc="delivered, cancelled and superseded work is deleted after this",
    )
    dead_keep: float = option(
        "retention.dead_keep",
        "duration",
        90 * 86400.0,
        within=(0, 10 * 365 * 86400),
        doc="dead letters are deleted after this",
    )
    batch_size: int = option(
        "retention.batch_size",
        "int",
        1000,
        within=(10, 100_000),
        doc="largest batch (one short transaction each)",
    )
    #: Smallest batch after repeated timeouts.
    min_batch: int = 10
    pause: float = option(
        "retention.pause", "duration", 0.05, within=(0, 60), doc="pause between batches"
    )
    statement_timeout: float = option(
        "retention.statement_timeout",
        "duration",
        2.0,
        within=(0.01, 3600),
        doc="statement timeout of one retention batch; a batch that hits it halves",
    )
    lock_timeout: float = option(
        "retention.lock_timeout",
        "duration",
        0.5,
        within=(0.001, 3600),
        doc="lock timeout of one retention batch; a batch that hits it halves",
    )


@dataclass(frozen=True)
class Config:
    dsn: str | None = option(
        "database.dsn", "str", None, doc="libpq URI/conninfo (`PGWORK_DSN` overrides)"
    )
    embedded_dir: Path = option(
        "database.embedded_dir",
        "path",
        Path(".pgwork/pgdata"),
        doc="data directory of the embedded server",
    )
    pool_size: int = option(
        "database.pool_size",
        "int",
        8,
        within=(2, 200),
        doc="connections in the daemon's pool (plus one for LISTEN)",
    )
    connect_timeout: float = option(
        "database.connect_timeout",
        "duration",
        5.0,
        within=(0.1, 300),
        doc="wait for a connection before a pass fails and is retried",
    )
    pooler: str = option(
        "database.pooler",
        "str",
        "none",
        choices=("none", "transaction"),
        doc=(
            "`transaction`: `database.dsn` points at a transaction-pooling "
            "PgBouncer (see [PgBouncer](operations.md#pgbouncer))"
        ),
    )
    listen_dsn: str | None = option(
        "database.listen_dsn",
        "str",
        None,
        doc=("a direct connection for LISTEN; default: `database.dsn`, or none behind a pooler"),
    )
    synchronous_claims: bool = option(
        "database.synchronous_claims",
        "bool",
        False,
        doc=(
            "claims commit after the WAL flush: the attempt ledger is complete "
            "across a database crash (see [Durability](how-it-works.md))"
        ),
    )
    daemon_id: str | None = option(
        "daemon.id",
        "str",
        None,
        shown="host:pid:random",
        doc="identity in the ledger and `pgwork status`",
    )
    event_loop: str = option(
        "daemon.event_loop",
        "str",
        "auto",
        choices=("auto", "uvloop", "asyncio"),
        doc=(
            "`auto`: uvloop where it is installed (a dependency on CPython off "
            "Windows), else asyncio; `uvloop` (refused at start if it cannot be "
            "imported); `asyncio`. The `pgwork running` log line says which runs"
        ),
    )
    shutdown_grace: float = option(
        "daemon.shutdown_grace",
        "duration",
        30.0,
        within=(0, 3600),
        doc="time in-flight deliveries get after SIGTERM",
    )
    tick: float = option(
        "materialiser.tick",
        "duration",
        5.0,
        within=(0.05, 3600),
        doc=("timed wake-up of the materialiser and the claimers (the correctness floor)"),
    )
    lookahead: float = option(
        "materialiser.lookahead",
        "duration",
        300.0,
        within=(0, 3600),
        doc=(
            "occurrences firing this far ahead get their work rows early (claimable"
            " only when due); at most `1h`"
        ),
    )
    page_size: int = option(
        "materialiser.page_size",
        "int",
        1000,
        within=(1, 100_000),
        doc="reminders per materialiser transaction",
    )
    lease: float = option(
        "worker.lease",
        "duration",
        60.0,
        within=(1, 86400),
        doc="how long a claim holds a row before another worker may take it",
    )
    claim_batch: int = option(
        "worker.claim_batch",
        "int",
        100,
        within=(1, 10_000),
        doc="rows claimed per statement at most",
    )
    log_format: str = option(
        "log.format",
        "str",
        "auto",
        choices=("auto", "json", "text"),
        doc="`json`, `text`, or `auto` (text on a TTY, JSON otherwise)",
    )
    log_level: str = option(
        "log.level",
        "str",
        "info",
        choices=("debug", "info", "warning", "error"),
        doc="`debug`, `info`, `warning`, `error`",
    )
    log_redact: str = option(
        "log.redact",
        "str",
        "none",
        choices=("none", "hash", "drop"),
        doc="`hash` or `drop` business keys and recipients in logs",
    )
    metrics_enabled: bool = option("metrics.enabled", "bool", True, doc="serve Prometheus metrics")
    metrics_listen: str = option(
        "metrics.listen",
        "str",
        "127.0.0.1:9464",
        doc=(
            "address of `/metrics`: `HOST:PORT`; `HOST:0` (any free port); "
            "`HOST:FIRST-LAST` (the first free port of the range). `pgwork status` "
            "shows where each daemon serves"
        ),
    )
    metrics_interval: float = option(
        "metrics.interval",
        "duration",
        5.0,
        within=(0.1, 3600),
        doc="refresh of database-derived gauges",
    )
    metrics_source_lag_series: int = option(
        "metrics.source_lag_series",
        "int",
        20,
        within=(0, 10_000),
        doc=(
            "`pgwork_source_lag_seconds` series at most: the most overdue sources, so that "
            "the family's size does not grow with the number of sources"
        ),
    )
    retention_enabled: bool = option(
        "retention.enabled",
        "bool",
        True,
        doc=("run the retention duty in the daemon (`false` when a timer runs `pgwork cleanup`)"),
    )
    retention_dsn: str | None = option(
        "retention.dsn",
        "str",
        None,
        doc="separate credentials for retention (`PGWORK_RETENTION_DSN`)",
    )
    retention_interval: float = option(
        "retention.interval",
        "duration",
        60.0,
        within=(0.1, 86400),
        doc="time between retention passes",
    )
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    channels: Mapping[str, ChannelConfig] = field(
        # The demo channel, read as the table [channels.log] kind = "log" would be.
        default_factory=lambda: {"log": _channel("log", {"kind": "log"}, {})}
    )
    tracing_enabled: bool = option(
        "tracing.enabled",
        "bool",
        False,
        doc=(
            "OpenTelemetry spans for claim → deliver → outcome (needs `pip install "
            "'pgwork[otel]'`; exported over OTLP/HTTP as the `OTEL_EXPORTER_OTLP_*`"
            " variables say)"
        ),
    )
    web_enabled: bool = option(
        "web.enabled",
        "bool",
        False,
        doc=(
            "serve the [web page](observability.md#web-page) from the daemon too (`pgwork web` serves it alone)"
        ),
    )
    web_listen: str = option(
        "web.listen",
        "str",
        "127.0.0.1:9463",
        doc="the web page's address (`HOST:0` and `HOST:FIRST-LAST` as for metrics)",
    )
    web_token: str | None = option(
        "web.token",
        "str",
        None,
        doc=(
            "enables the page's actions (redrive, pause, resume); at least 16 "
            "characters; set it as `PGWORK_WEB_TOKEN` rather than in the file. "
            "Without it the page is read-only"
        ),
    )
    #: The channels came from the config (file or environment), not the built-in demo default:
    #: `pgwork migrate` registers them.
    channels_configured: bool = False

    def expire_after(self) -> dict[str, float | None]:
        """Each configured channel's ``expire_after``, seconds (None: never): what explains a
        row that its next claim will close unsent (``pgwork reminder``, the web page)."""
        return {name: c.expire_after for name, c in self.channels.items()}


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
#: The options every channel takes, declared on ChannelConfig and RetryPolicy; then a channel
#: table's keys: those and every kind's own (pgwork.channels.KINDS; a kind's reader checks its own).
_COMMON = {**declared(ChannelConfig), **declared(RetryPolicy)}
_CHANNEL = {**_COMMON, **{o: f for k in KINDS.values() for o, f in declared(k.options).items()}}
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


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean worker.lease?)`` for a name one slip away from a known one, else ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


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


def check_listen(option: str, value: str) -> None:
    if listen_ports(value) is None:
        raise ConfigError(
            f"{option}: expected HOST:PORT with a port from 1 to 65535, HOST:0 (any free port) or "
            f"HOST:FIRST-LAST (the first free port of a range) (got {value!r})"
        )


def _check(option: str, value: Any) -> None:
    if option in ("metrics.listen", "web.listen"):
        check_listen(option, value)
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
            if _OPTIONS[option][1] == "duration":
                raise ConfigError(
                    f"{option}: must be between {say_duration(lo)} and {say_duration(hi)} "
                    f"(got {say_duration(value)!r})"
                )
            raise ConfigError(f"{option}: must be between {lo:g} and {hi:g} (got {value!r})")


def _channel(
    name: str,
    raw: Any,
    env: Mapping[str, str],
    sources: Mapping[str, str] | None = None,
    secrets: bool = True,
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
        key = sorted(unknown)[0]
        raise ConfigError(f"{where}.{key}: unknown option{_did_you_mean(key, _CHANNEL_KEYS)}")
    if not CHANNEL_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: channel names are lower-case letters, digits, _ and - (got {name!r})"
        )
    named = raw.get("kind")
    if not isinstance(named, str) or named not in KINDS:
        raise ConfigError(f"{label('kind')}: must be one of {', '.join(KINDS)} (got {named!r})")
    kind = KINDS[named]
    others = sorted(set(raw) - set(_COMMON) - set(declared(kind.options)))
    if others:  # options of other kinds (an unknown one was refused above)
        key = others[0]
        takers = " and ".join(k.name for k in KINDS.values() if key in declared(k.options))
        raise ConfigError(f"{label(key)}: only {takers} channels take {key} (this is {kind.name})")

    retry = options.read(RetryPolicy, raw, label)
    rate = parse_rate(label("rate_limit"), raw["rate_limit"]) if "rate_limit" in raw else None
    burst = (
        options.value(label("rate_burst"), _COMMON["rate_burst"], raw["rate_burst"])
        if "rate_burst" in raw
        else None
    )
    if burst is not None and rate is None:
        raise ConfigError(f"{label('rate_burst')}: only with a rate_limit")
    if retry.cap < retry.base:
        raise ConfigError(f"{where}.backoff_cap: must not be shorter than backoff_base")
    own = {k: v for k, v in raw.items() if k not in _COMMON}
    # Every common option is read as its field declares it; only these are read by hand.
    return options.read(
        ChannelConfig,
        raw,
        label,
        name=name,
        kind=kind.name,
        retry=retry,
        rate_limit=rate,
        # A second's worth by default (at least one).
        rate_burst=float(burst) if burst is not None else (max(1.0, rate) if rate else None),
        options=kind.read(own, label, env, secrets),
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
    A table of headers is set in the file (its values may name an environment variable with
    ``env:``)."""
    out = {n: dict(t) if isinstance(t, dict) else t for n, t in chans.items()}
    by_env_name = {n.upper().replace("-", "_"): n for n in out}
    keys = sorted(
        (k for k, f in _CHANNEL.items() if f.metadata["kind"] not in TABLES), key=len, reverse=True
    )
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
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    secrets: bool = True,
) -> Config:
    """Read the TOML file (``path``, else ``$PGWORK_CONFIG``, else none) and apply environment
    overrides: ``PGWORK_DSN`` and ``PGWORK_<SECTION>_<KEY>`` (e.g. ``PGWORK_MATERIALISER_TICK=1s``).
    ``secrets=False``: for a command that sends nothing, a channel's secret whose environment
    variable is not set is left unresolved instead of refused (only sending needs them).

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
                raise ConfigError(f"{option}: unknown option{_did_you_mean(option, _OPTIONS)}")
            _fname, kind = _OPTIONS[option]
            values[option] = convert(option, kind, value)

    for option, (_fname, kind) in _OPTIONS.items():
        var = "PGWORK_" + option.replace(".", "_").upper()
        if var in env:
            values[option] = convert(f"{option} (from {var})", kind, env[var])
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
            name: _channel(name, t, env, sources.get(name), secrets) for name, t in chans.items()
        }
        kwargs["channels_configured"] = True
    cfg = Config(**kwargs)
    if cfg.claim_batch < 1:
        raise ConfigError("worker.claim_batch: must be at least 1")
    return cfg
