"""Structured logs: one event per line, correlation fields as fields (JSON, or text on a TTY)."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from .db import redact as _redact_dsn
from .secrets import Secrets

#: Secrets to mask in every line (added by the daemon and the CLI once the config is known):
#: one merged set, however many daemons a process runs.
_SECRETS = Secrets()
#: The ``log.redact`` mode in force (the log channel's own message text honours it too).
_MODE = ["none"]


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


#: Fields that may carry personal data; hashed or dropped when ``log.redact`` says so.
PERSONAL = ("business_key", "recipient")

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _fields(record: logging.LogRecord, redact_mode: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.__dict__.items():
        if k in _STANDARD or k.startswith("_"):
            continue
        if k in PERSONAL and v is not None:
            if redact_mode == "drop":
                continue
            if redact_mode == "hash":
                v = "h:" + hashlib.sha256(str(v).encode()).hexdigest()[:16]
        if isinstance(v, str) and _SECRETS:
            v = redact(v)
        out[k] = v
    return out


class JsonFormatter(logging.Formatter):
    def __init__(self, redact_mode: str = "none") -> None:
        super().__init__()
        self.redact_mode = redact_mode

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": redact(record.getMessage()),
        }
        doc.update(_fields(record, self.redact_mode))
        if record.exc_info:
            doc["error"] = redact(self.formatException(record.exc_info))
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self, redact_mode: str = "none") -> None:
        super().__init__()
        self.redact_mode = redact_mode

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        fields = " ".join(f"{k}={v}" for k, v in _fields(record, self.redact_mode).items())
        line = f"{ts} {record.levelname:<7} {record.name}: {redact(record.getMessage())}"
        if fields:
            line += f"  {fields}"
        if record.exc_info:
            line += "\n" + redact(self.formatException(record.exc_info))
        return line


def setup(fmt: str = "auto", level: str = "info", redact_mode: str = "none") -> None:
    _MODE[0] = redact_mode
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(redact_mode) if fmt == "json" else TextFormatter(redact_mode)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
