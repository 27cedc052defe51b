"""A channel's trend drawn as inline SVG for the web page: attempts per minute (delivered and
failed, stacked) and how long an attempt took (mean, with the slowest above it). Pure: minutes
in, escaped HTML out; no script, nothing fetched (the page's Content-Security-Policy holds)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html import escape

from ..store import TrendMinute

#: Bars drawn at most: a longer window sums several minutes into a bar.
BARS = 180
BAR_W = 4
HEIGHT = 60
OK, BAD, MEAN, SLOWEST = "#1a7f37", "#b42318", "#0969da", "#9ecbff"


@dataclass
class Bar:
    start: datetime
    delivered: int = 0
    failed: int = 0
    dead: int = 0
    fenced: int = 0
    took_sum: float = 0.0
    took_max: float | None = None

    @property
    def attempts(self) -> int:
        return self.delivered + self.failed

    @property
    def took_mean(self) -> float | None:
        return self.took_sum / self.attempts if self.attempts else None


def bars(minutes: Sequence[TrendMinute], end: datetime, window: int) -> tuple[list[Bar], int]:
    """The ``window`` minutes up to ``end`` (a minute's start, included) as at most ``BARS``
    bars, oldest first; returns them with the minutes each bar sums."""
    per = max(1, math.ceil(window / BARS))
    count = math.ceil(window / per)
    first = end - timedelta(minutes=per * count - 1)
    out = [Bar(first + timedelta(minutes=per * i)) for i in range(count)]
    for m in minutes:
        i = int((m.minute - first).total_seconds() // 60) // per
        if not 0 <= i < count:
            continue
        b = out[i]
        b.delivered += m.delivered
        b.failed += m.failed
        b.dead += m.dead
        b.fenced += m.fenced
        if m.took_mean is not None:
            b.took_sum += m.took_mean * (m.delivered + m.failed)
        if m.took_max is not None:
            b.took_max = max(b.took_max or 0.0, m.took_max)
    return out, per


def _ms(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds * 1000:.0f} ms"


def _span(minutes: int) -> str:
    """A window as an operator says it: ``60 minutes``, ``3 hours``."""
    if minutes > 60 and minutes % 60 == 0:
        return f"{minutes // 60} hours"
    return f"{minutes} minutes"


def _label(b: Bar, per: int) -> str:
    at = b.start.strftime("%H:%M")
    return at if per == 1 else f"{at}+{per}min"


def _svg(title: str, rects: list[str], width: int) -> str:
    return (
        f'<svg role="img" aria-label="{escape(title)}" width="{width}" height="{HEIGHT}" '
        f'viewBox="0 0 {width} {HEIGHT}" style="background:#fff;border:1px solid #d0d7de">'
        + "".join(rects)
        + "</svg>"
    )


def _rect(x: int, h: float, colour: str) -> str:
    return (
        f'<rect x="{x}" y="{HEIGHT - h:.1f}" width="{BAR_W - 1}" height="{h:.1f}" fill="{colour}"/>'
    )


def _bar(tip: str, rects: list[str]) -> str:
    """One bar's rectangles, drawn over each other (the first tallest), with its tooltip."""
    return f"<g><title>{escape(tip)}</title>{''.join(rects)}</g>"


def trend(minutes: Sequence[TrendMinute], end: datetime, window: int) -> str:
    """The trend section: a summary line and two charts (each bar's numbers in its tooltip), of
    the ``window`` minutes up to the one ``end`` falls in."""
    bs, per = bars(minutes, end.astimezone(UTC).replace(second=0, microsecond=0), window)
    delivered = sum(b.delivered for b in bs)
    failed = sum(b.failed for b in bs)
    if not delivered + failed + sum(b.fenced for b in bs):
        return f'<p class="note">No attempts recorded in the last {_span(window)}.</p>'
    took = sum(b.took_sum for b in bs) / (delivered + failed) if delivered + failed else None
    slowest = max((b.took_max for b in bs if b.took_max is not None), default=None)
    summary = (
        f"<p>Last {_span(window)}: <b>{delivered}</b> delivered, "
        f'<span class="{"bad" if failed else "ok"}">{failed} failed</span> '
        f"({sum(b.dead for b in bs)} dead), {sum(b.fenced for b in bs)} fenced; "
        f"an attempt took {_ms(took)} on average, {_ms(slowest)} at most"
        + ("" if per == 1 else f"; a bar is {per} minutes")
        + ".</p>"
    )
    width = len(bs) * BAR_W
    top = max((b.attempts for b in bs), default=0) or 1
    counts: list[str] = []
    for i, b in enumerate(bs):
        if b.attempts:
            counts.append(
                _bar(
                    f"{_label(b, per)}: {b.delivered} delivered, {b.failed} failed ({b.dead} dead)",
                    # The failed stacked on the delivered: drawn as the whole, then the delivered.
                    [
                        _rect(i * BAR_W, HEIGHT * b.attempts / top, BAD),
                        _rect(i * BAR_W, HEIGHT * b.delivered / top, OK),
                    ],
                )
            )
    longest = slowest or 1.0
    times: list[str] = []
    for i, b in enumerate(bs):
        mean = b.took_mean
        if mean is not None and b.took_max is not None:
            times.append(
                _bar(
                    f"{_label(b, per)}: {_ms(mean)} on average, {_ms(b.took_max)} at most",
                    [
                        _rect(i * BAR_W, HEIGHT * b.took_max / longest, SLOWEST),
                        _rect(i * BAR_W, HEIGHT * mean / longest, MEAN),
                    ],
                )
            )
    span = (
        f'<div class="note">{bs[0].start:%Y-%m-%d %H:%M} to '
        f"{bs[-1].start + timedelta(minutes=per - 1):%H:%M} UTC</div>"
    )
    return (
        summary
        + f"<p>Attempts a {'minute' if per == 1 else 'bar'} (top {top}: "
        + f'<span style="color:{OK}">delivered</span>, <span style="color:{BAD}">failed</span>)</p>'
        + _svg("attempts per minute", counts, width)
        + span
        + f"<p>Time an attempt took (top {_ms(longest)}: "
        + f'<span style="color:{MEAN}">mean</span>, <span style="color:{SLOWEST}">slowest</span>)</p>'
        + _svg("time an attempt took", times, width)
        + span
    )
