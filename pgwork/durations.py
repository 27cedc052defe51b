"""Durations written the way operators write them: ``"250ms"``, ``"5s"``, ``"10m"``, ``"1h"``."""

from __future__ import annotations

import re
from datetime import timedelta

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> float:
    """Seconds in ``text``; parts may be combined (``"1m30s"``); a bare ``0`` needs no unit.
    Raises ``ValueError``."""
    s = text.strip().replace(" ", "")
    if not s:
        raise ValueError("empty duration")
    if re.fullmatch(r"0+(\.0*)?", s):
        return 0.0
    pos = 0
    total = 0.0
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s):
        raise ValueError(f"not a duration: {text!r} (write e.g. '250ms', '5s', '10m', '1h', '2d')")
    return total


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:g}s"
    if seconds < 7200:
        return f"{seconds / 60:g}m"
    return f"{seconds / 3600:g}h"


def say_duration(seconds: float) -> str:
    """``seconds`` in the largest unit that says it exactly (``3600`` -> ``1h``, ``0.05`` ->
    ``50ms``): how a bound is told to an operator who writes durations."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and round(seconds / size, 9) == round(seconds / size):
            return f"{round(seconds / size)}{unit}"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"


def interval_text(td: timedelta) -> str:
    """``td`` as PostgreSQL writes an interval (IntervalStyle postgres): ``7 days``,
    ``1 day 02:00:00``, ``00:00:00.005007``, ``-1 days +20:55:00``; how a database value is shown
    to an operator (Python's own ``7 days, 0:00:00`` reads as two values in a list)."""
    days, secs, us = td.days, td.seconds, td.microseconds
    parts = [f"{days} day{'' if days == 1 else 's'}"] if days else []
    if secs or us or not days:
        h, rest = divmod(secs, 3600)
        m, sec = divmod(rest, 60)
        clock = f"{h:02d}:{m:02d}:{sec:02d}" + (f".{us:06d}".rstrip("0") if us else "")
        parts.append(("+" if days < 0 else "") + clock)
    return " ".join(parts)
