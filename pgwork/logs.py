"""Structured logs: one event per line, correlation fields as fields (JSON, or text on a TTY)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
from datetime import UTC, datetime
from typing import Any

import psycopg

from .db import redact as _redact_dsn
from .secrets import Secrets

#: Secrets to mask in every line (added by the daemon and the CLI once the config is known):
#: one merged set, however many daemons a process runs.
_SECRETS = Secrets()
#: The ``log.redact`` mode in force (the log channel's own message text honours it too).
_MODE = ["none"]
#: The line format ``setup`` chose: "text" on a terminal, else "json".
_FORMAT = ["text"]


def add_secrets(secrets: Secrets) -> None:
    _SECRETS.merge(secrets)


def redact(text: str) -> str:
    """``text`` without DSN passwords or any configured secret."""
    return _SECRETS.scrub(_redact_dsn(text))


def personal(value: str) -> str:
    """A business key or recipient as ``log.redact`` allows it in message text."""
    return personal_as(value, _MODE[0])


def personal_as(value: str, mode: str) -> str:
    """A business key or recipient as redaction ``mode`` (none, hash, drop) allows it."""
    if mode == "hash":
        return "h:" + hashlib.sha256(value.encode()).hexdigest()[:16]
    if mode == "drop":
        return "(redacted)"
    return value


def brief(e: psycopg.Error) -> str:
    """A database error as a log line tells it: the server's message, its detail and where it
    was raised (the innermost line of its CONTEXT). Not the whole CONTEXT, which quotes every
    enclosing statement: a page's error carried the page's SQL, about 12 kB a line."""
    d = e.diag
    text = d.message_primary or (str(e).splitlines() or [type(e).__name__])[0]
    if d.message_detail:
        text += f" ({d.message_detail})"
    where = (d.context or "").strip().splitlines()
    return text + (f" [in {where[0]}]" if where else "")


def _message(record: logging.LogRecord) -> str:
    """The record's message, with each database error in it told briefly."""
    args = record.args
    if isinstance(args, tuple) and any(isinstance(a, psycopg.Error) for a in args):
        record.args = tuple(brief(a) if isinstance(a, psycopg.Error) else a for a in args)
    return record.getMessage()


def _traceback(formatter: logging.Formatter, ei: Any) -> str:
    """A traceback whose last line tells a database error briefly, as the message does."""
    text = formatter.formatException(ei)
    e = ei[1]
    if isinstance(e, psycopg.Error):
        text = text.replace(str(e), brief(e))
    return text


#: Fields that may carry personal data; hashed or dropped when ``log.redact`` says so.
PERSONAL = ("business_key", "recipient")

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _fields(record: logging.LogRecord, redact_mode: str) -> dict[str, Any]:
    # A comprehension over the record's attributes: a line per attempt is the daemon's most
    # frequent work after the delivery itself (see bench/HISTORY.md, "The log line per attempt").
    out = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and k[:1] != "_"}
    if redact_mode != "none":
        for k in PERSONAL:
            v = out.get(k)
            if v is None:
                continue
            if redact_mode == "drop":
                del out[k]
            else:
                out[k] = "h:" + hashlib.sha256(str(v).encode()).hexdigest()[:16]
    if _SECRETS:
        for k, v in out.items():
            if isinstance(v, str):
                out[k] = redact(v)
    return out


class _UtcMillis:
    """``datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")``, with the part up to
    the second made once per second."""

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, t: float) -> str:
        # Rounded to the microsecond as datetime.fromtimestamp rounds, then cut to milliseconds.
        frac, whole = math.modf(t)
        micros = round(frac * 1e6)
        second = int(whole)
        if micros >= 1_000_000:
            second, micros = second + 1, micros - 1_000_000
        elif micros < 0:
            second, micros = second - 1, micros + 1_000_000
        if second != self._second:
            self._second = second
            self._prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._prefix}.{micros // 1000:03d}+00:00"


class JsonFormatter(logging.Formatter):
    def __init__(self, redact_mode: str = "none") -> None:
        super().__init__()
        self.redact_mode = redact_mode
        self._ts = _UtcMillis()
        # One encoder: json.dumps with any argument builds a new one for every line.
        self._encode = json.JSONEncoder(default=str, ensure_ascii=False).encode

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": self._ts(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": redact(_message(record)),
        }
        doc.update(_fields(record, self.redact_mode))
        if record.exc_info:
            doc["error"] = redact(_traceback(self, record.exc_info))
        return self._encode(doc)


class TextFormatter(logging.Formatter):
    def __init__(self, redact_mode: str = "none") -> None:
        super().__init__()
        self.redact_mode = redact_mode

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        fields = " ".join(f"{k}={v}" for k, v in _fields(record, self.redact_mode).items())
        line = f"{ts} {record.levelname:<7} {record.name}: {redact(_message(record))}"
        if fields:
            line += f"  {fields}"
        if record.exc_info:
            line += "\n" + redact(_traceback(self, record.exc_info))
        return line


def say(text: str, file: Any = None, level: int = logging.INFO, **fields: Any) -> None:
    """A command's own line (a summary, a welcome): as written on a terminal; when the logs are
    JSON lines (off a terminal: a journal, a pipe), a JSON line of the logs' shape, so that what
    the command writes is one format."""
    if _FORMAT[0] == "json":
        record = logging.LogRecord("pgwork.cli", level, "", 0, text, None, None)
        record.__dict__.update(fields)
        text = JsonFormatter(_MODE[0]).format(record)
    print(text, file=file if file is not None else sys.stdout)


def setup(fmt: str = "auto", level: str = "info", redact_mode: str = "none") -> None:
    _MODE[0] = redact_mode
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    _FORMAT[0] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(redact_mode) if fmt == "json" else TextFormatter(redact_mode)
    )
    # No line shows the caller's file, thread or process: leave them out of every record
    # (the logging HOWTO's "Optimization"; finding the caller alone walks the stack per line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
