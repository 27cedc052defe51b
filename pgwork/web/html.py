"""The web page's markup: pure functions from a view (``views.py``) and the request's context
(``Ctx``) to HTML. Every value is escaped here (business keys, recipients and payloads are written
by other apps); business keys and recipients follow ``log.redact``; no script, nothing fetched
from elsewhere (the page's Content-Security-Policy forbids both)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape
from typing import Any
from urllib.parse import urlencode

from .. import build, store
from ..durations import interval_text
from ..history import History, attempts_text, channel_state, state, took_ms
from ..logs import personal_as
from . import chart
from .views import (
    PAGE,
    TREND_HOURS,
    ChannelPage,
    DeadFilter,
    DeadPage,
    Overview,
    RemindersPage,
    RetryingPage,
    WorkPage,
)

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{background:#24292f;color:#fff;padding:.6em 1.2em}header a{color:#fff;margin-right:1.2em}
main{padding:1em 1.2em}table{border-collapse:collapse;background:#fff;margin:.5em 0 1.5em;
display:block;max-width:100%;overflow-x:auto}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f0f3f6}.bad{color:#b42318;font-weight:600}.ok{color:#1a7f37}
.note{color:#57606a}form.inline{display:inline}code{font-size:13px}
.done{background:#dafbe1;padding:.4em .8em;border-left:4px solid #1a7f37}
"""
#: Longest excerpt of an answer shown in a ledger, characters.
ANSWER_EXCERPT = 300


@dataclass(frozen=True)
class Ctx:
    """What a page's markup needs of its request."""

    #: The form token for this browser (every form carries it).
    csrf: str
    #: Whether a web.token is configured (actions are on), and this browser signed in with it.
    actions_on: bool
    signed_in: bool
    #: log.redact: how business keys, recipients and payloads are shown.
    redact: str = "none"
    #: This page's path and query (sign-in comes back here).
    here: str = "/"
    #: The URL said refresh=0: no automatic reload.
    no_refresh: bool = False

    def personal(self, value: str | None) -> str:
        return e(personal_as(value, self.redact) if value is not None else None)


def e(value: Any) -> str:
    """Any value as escaped HTML text ('' for None)."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        value = value.isoformat(sep=" ", timespec="seconds")
    elif isinstance(value, timedelta):
        value = interval_text(value)
    return escape(str(value), quote=True)


def link(path: str, text: Any, **query: Any) -> str:
    q = {k: v for k, v in query.items() if v not in (None, "")}
    href = path + ("?" + urlencode(q) if q else "")
    return f'<a href="{escape(href, quote=True)}">{e(text)}</a>'


def table(headings: Iterable[str], rows: Iterable[Iterable[str]], empty: str = "") -> str:
    """Cells are HTML already (escaped by the caller); ``empty``: what to say when there is no
    row (a table of headings alone says nothing)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    if not body and empty:
        return f'<p class="note">{e(empty)}</p>'
    head = "".join(f"<th>{e(h)}</th>" for h in headings)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def fields(pairs: Iterable[tuple[str, str]]) -> str:
    """A two-column table of headings and cells (HTML already); empty cells are left out."""
    return (
        "<table>"
        + "".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in pairs if v)
        + "</table>"
    )


def ago(t: datetime | None, now: datetime) -> str:
    """How long ago (or how soon) ``t`` is, for an operator scanning a page, with the instant
    itself on hover and for machines: ``<time datetime=… title="2026-12-05 17:04:04+00:00">3
    min ago</time>``."""
    if t is None:
        return ""
    secs = (now - t).total_seconds()
    n, unit = abs(secs), "s"
    for size, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if n >= size:
            n, unit = n / size, name
            break
    amount = f"{n:.0f} {unit}"
    said = f"{amount} ago" if secs >= 0 else f"in {amount}"
    return f'<time datetime="{e(t.isoformat())}" title="{e(t)}">{said}</time>'


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def answer(a: dict[str, Any]) -> str | None:
    """What the receiver answered an attempt: its receipt (a delivery's body, kept in the
    ledger) or the error; at most ``ANSWER_EXCERPT`` characters."""
    r = a.get("receipt") or {}
    said = r.get("text") if "text" in r else r.get("body")
    text: str | None = (
        a.get("error")
        if said is None
        else said
        if isinstance(said, str)
        else json.dumps(said, ensure_ascii=False)
    )
    if text is None:
        return None
    return text if len(text) <= ANSWER_EXCERPT else text[: ANSWER_EXCERPT - 1] + "…"


def channel_word(c: store.ChannelState) -> str:
    word, why = channel_state(c)
    return f'<span class="{"ok" if word == "running" else "bad"}">{word}</span> {e(why)}'


# -- the frame ---------------------------------------------------------------------------------


def page(ctx: Ctx, title: str, body: str, refresh: int | None = None) -> str:
    """The page around ``body``; ``refresh``: reload every that many seconds (an overview
    left open on a screen), unless the URL says ``refresh=0``."""
    if not ctx.actions_on:
        who = '<span class="note">actions off (no web.token)</span>'
    elif ctx.signed_in:
        who = (
            f'<form class="inline" method="post" action="/logout">'
            f'<input type="hidden" name="csrf" value="{e(ctx.csrf)}">'
            f"<button>sign out</button></form>"
        )
    else:
        who = sign_in_form(ctx)
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        + (
            f'<meta http-equiv="refresh" content="{refresh}">'
            if refresh and not ctx.no_refresh
            else ""
        )
        + f"<title>{e(title)} · pgwork</title><style>{STYLE}</style></head><body>"
        '<header><a href="/">pgwork</a><a href="/reminders">reminders</a>'
        '<a href="/retrying">retrying</a><a href="/dead">dead letters</a>'
        '<a href="/reminder">a reminder</a>'
        f'<span style="float:right">{who}</span></header>'
        f"<main><h1>{e(title)}</h1>{body}</main>"
        f'<footer class="note" style="padding:0 1.2em">pgwork {e(build.version())}</footer>'
        "</body></html>"
    )


def sign_in_form(ctx: Ctx) -> str:
    """Sign-in, coming back to this page."""
    return (
        f'<form class="inline" method="post" action="/login">'
        f'<input type="hidden" name="csrf" value="{e(ctx.csrf)}">'
        f'<input type="hidden" name="next" value="{e(ctx.here)}">'
        f'<input type="password" name="token" placeholder="web.token" aria-label="web.token" '
        "required> "
        f"<button>sign in for actions</button></form>"
    )


def refused(ctx: Ctx, why: str) -> str:
    """An action refused (a wrong token, a stale form): said on a page, with a way on."""
    return page(
        ctx,
        "Not done",
        f'<p class="bad">{e(why)}</p>'
        + (f"<p>{sign_in_form(ctx)}</p>" if ctx.actions_on and not ctx.signed_in else "")
        + f"<p>{link('/', '← the overview')}</p>",
    )


def action_form(
    ctx: Ctx,
    path: str,
    label: str,
    reason: bool = False,
    hidden: dict[str, Any] | None = None,
) -> str:
    """A signed-in operator's button for ``path`` (nothing otherwise)."""
    if not ctx.signed_in:
        return ""
    extra = (
        '<input name="reason" placeholder="reason" aria-label="reason" maxlength="200"> '
        if reason
        else ""
    )
    more = "".join(
        f'<input type="hidden" name="{e(k)}" value="{e(v)}">'
        for k, v in (hidden or {}).items()
        if v is not None
    )
    return (
        f'<form class="inline" method="post" action="{e(path)}">'
        f'<input type="hidden" name="csrf" value="{e(ctx.csrf)}">{more}'
        f"{extra}<button>{e(label)}</button></form>"
    )


def channel_action(ctx: Ctx, c: store.ChannelState) -> str:
    """Resume a paused or throttled channel (it lifts a throttle's limit too), else pause."""
    if c.paused or c.throttled or c.throttle_limit is not None:
        return action_form(ctx, f"/channel/{c.name}/resume", "resume")
    return action_form(ctx, f"/channel/{c.name}/pause", "pause", reason=True)


# -- pages -------------------------------------------------------------------------------------


def overview(v: Overview, ctx: Ctx) -> str:
    rows = []
    for c in v.channels:
        n = v.counts.get(c.name, {})
        rows.append(
            [
                link(f"/channel/{c.name}", c.name),
                e(c.kind),
                channel_word(c),
                link(f"/channel/{c.name}", n.get("ready", 0), status="ready"),
                link(f"/channel/{c.name}", n.get("waiting", 0), status="waiting"),
                link(f"/channel/{c.name}", n.get("claimed", 0), status="claimed"),
                link("/dead", n.get("dead", 0), channel=c.name),
                ago(c.next_retry_at, v.now),
                channel_action(ctx, c),
            ]
        )
    lag, ret = v.lag, v.retention
    return (
        f"<p>lag <b>{lag.lag_seconds:.1f} s</b> · oldest ready {lag.oldest_ready_seconds:.1f} s"
        f" · not yet materialised {lag.unmaterialised_seconds:.1f} s"
        f" · materialiser cutoff {e(v.materialiser.last_cutoff)}</p>"
        + _late_sources(v.sources)
        + _set_aside_table(v.aside)
        + "<h2>Channels</h2>"
        + table(
            ["channel", "kind", "state", "ready", "waiting", "claimed", "dead", "next retry", ""],
            rows,
            empty="No channel is registered: a daemon registers the channels of its config.",
        )
        + "<h2>Daemons</h2>"
        + table(
            ["id", "state", "version", "started", "heartbeat age s", "listener", "metrics"],
            [
                [
                    e(d.id),
                    '<span class="bad">GONE</span>' if d.gone else "running",
                    e(d.version),
                    ago(d.started_at, v.now),
                    e(round(d.heartbeat_age_seconds, 1)),
                    "-" if d.gone else _listener(d.listener_up),
                    e(d.metrics_at),
                ]
                for d in v.daemons
            ],
            empty="No daemon is running.",
        )
        + "<h2>Retention</h2>"
        + f"<p>{'<b>PAUSED</b> · ' if ret.paused else ''}last pass "
        f"{ago(ret.last_pass_at, v.now) or 'never'} · deleted {ret.total_deleted} in total"
        f" · oldest kept {e(_round(ret.oldest_terminal_age_seconds))} s</p>"
    )


def _listener(up: bool | None) -> str:
    return "off" if up is None else ("up" if up else "DOWN")


def _late_sources(sources: list[store.SourceLag]) -> str:
    """The late sources, latest first: one app's backlog shown as its own."""
    late = [s for s in sources if s.lag_seconds > 0]
    if not late:
        return ""
    return "<h2>Late sources</h2>" + table(
        ["source", "lag s", "oldest due occurrence"],
        [
            [
                e(s.source),
                e(round(s.lag_seconds, 1)),
                "not materialised yet" if s.unmaterialised else "a work row",
            ]
            for s in late
        ],
    )


def _set_aside_table(aside: list[store.SetAside]) -> str:
    """The reminders the materialiser cannot make, each linked to its page."""
    if not aside:
        return ""
    return (
        "<h2>Set aside</h2><p>The materialiser cannot make these reminders; fix or delete "
        "each (its page says why).</p>"
        + table(
            ["reminder", "due", "error", "since", "tries", "next try", "by"],
            [
                [
                    link(
                        "/reminder",
                        f"{a.source} {a.business_key}",
                        source=a.source,
                        key=a.business_key,
                    ),
                    e(a.fire_at),
                    e(a.error),
                    e(a.since),
                    e(a.tries),
                    e(a.next_try_at),
                    e(a.daemon_id),
                ]
                for a in aside
            ],
        )
    )


#: The channel page's row filters: (status, label).
TABS = (("", "live"), ("ready", "ready now"), ("waiting", "waiting for their time"),
        ("claimed", "claimed"))  # fmt: skip


def channel(v: ChannelPage, ctx: Ctx) -> str:
    c, now, name = v.channel, v.now, v.channel.name
    since = c.paused_at if c.paused else c.throttled_at if c.throttle_limit or c.throttled else None
    limits = ", ".join(
        f"{k} {x}"
        for k, x in (
            ("global concurrency", c.global_concurrency),
            ("rate limit /s", c.rate_limit),
            ("throttle limit", c.throttle_limit),
        )
        if x is not None
    )
    head = fields(
        [
            ("kind", e(c.kind)),
            ("state", channel_word(c) + " " + channel_action(ctx, c)),
            ("state changed", f"since {ago(since, now)}" if since else ""),
            ("claimed now", e(c.claimed)),
            ("limits", e(limits or "none")),
            ("catch-up", e(c.catch_up)),
            ("next retry", ago(c.next_retry_at, now)),
        ]
    )
    rows = table(
        ["id", "status", "source", "business key", "due", "available", "attempts", "last error"],
        [
            [
                link(f"/work/{r['id']}", r["id"]),
                e(_live_state(r, c, now)),
                e(r["source"]),
                ctx.personal(r["business_key"]),
                e(r["due_at"]),
                e(r["available_at"]),
                e(attempts_text(r["attempts"], r["attempts_base"])),
                e(r["last_error"]),
            ]
            for r in v.rows
        ],
        empty=f"No {dict(TABS)[v.status] if v.status else 'live'} rows on {name}.",
    )
    more = ""
    if v.next_after is not None:
        src, at, wid = v.next_after
        more = link(
            f"/channel/{name}",
            "next page →",
            status=v.status,
            after_source=src,
            after_at=at.isoformat(),
            after_id=wid,
        )
    tabs = " · ".join(
        f"<b>{e(label)}</b>" if s == v.status else link(f"/channel/{name}", label, status=s)
        for s, label in TABS
    )
    tabs += " · " + link("/retrying", "retrying", channel=name)
    tabs += " · " + link("/dead", "dead", channel=name)
    windows = " · ".join(
        f"<b>{h} h</b>" if h == v.hours else link(f"/channel/{name}", f"{h} h", hours=h)
        for h in sorted(TREND_HOURS)
    )
    return (
        f"{head}<h2>Trend</h2><p>{windows}</p>{chart.trend(v.trend, now, v.hours * 60)}"
        f"<h2>Rows</h2><p>{tabs}</p>{rows}<p>{more}</p>"
    )


def _live_state(r: dict[str, Any], c: store.ChannelState, now: datetime) -> str:
    """A live row's state in the CLI's words (``ready, not yet due``, ``retry waiting``), and
    what holds it: its channel paused or throttled."""
    if r["status"] == "claimed":
        return "claimed"
    row = {
        "status": store.Status.READY,
        "available_at": r["available_at"],
        "attempts": r["attempts"] - r["attempts_base"],
        "due_at": r["due_at"],
        "redriven_at": None,
    }
    return state(row, now, c)


def work(v: WorkPage, ctx: Ctx, request_lines: Sequence[str] | None) -> str:
    w, wid = v.work, v.work["id"]
    pairs = [
        ("status", e(w["status"])),
        ("channel", link(f"/channel/{w['channel']}", w["channel"])),
        ("source", e(w["source"])),
        (
            "business key",
            ctx.personal(w["business_key"])
            + " · "
            + link("/reminder", "all of this reminder", source=w["source"], key=w["business_key"]),
        ),
        ("recipient", ctx.personal(w["recipient"])),
        ("deadline", e(w["deadline"])),
        ("occurrence", e(w["occurrence"])),
        ("due", e(w["due_at"])),
        ("operation id", f"<code>{e(w['operation_id'])}</code>"),
        ("attempts", e(attempts_text(w["attempts"], w["attempts_base"]))),
        ("dead reason", e(w["dead_reason"])),
        ("last error", e(w["last_error"])),
        (
            "redriven",
            e(w["redriven_at"]) + (f" by {e(w['redriven_by'])}" if w["redriven_by"] else ""),
        ),
        ("payload", _payload(ctx, w["payload"])),
    ]
    action = (
        action_form(ctx, f"/work/{wid}/redrive", "redrive")
        if w["status"] == store.Status.DEAD
        else ""
    )
    ledger = table(
        ["lease", "attempt", "outcome", "daemon", "started", "finished", "HTTP", "answer"],
        [
            [
                e(a["lease"]),
                e(a["attempt"]),
                e(a["outcome"]),
                e(a["daemon_id"]),
                e(a["started_at"]),
                e(a["finished_at"]),
                e(a["http_status"]),
                e(answer(a)),
            ]
            for a in v.attempts
        ],
        empty="No attempt yet.",
    )
    request = (
        "<h2>Request (as this config's channel sends it)</h2><pre>"
        + e("\n".join(request_lines))
        + "</pre>"
        if request_lines
        else ""
    )
    return fields(pairs) + f"<p>{action}</p><h2>Attempts</h2>{ledger}{request}"


def _payload(ctx: Ctx, payload: str | None) -> str:
    if payload is None:
        return ""
    return f"<code>{e(payload)}</code>" if ctx.redact == "none" else "(redacted)"


def reminder_form(source: str | None, key: str | None) -> str:
    return (
        '<form method="get" action="/reminder">'
        f'<label>source <input name="source" value="{e(source)}" required></label> '
        f'<label>business key <input name="key" value="{e(key)}" required></label> '
        "<button>show</button></form>"
    )


def reminder(h: History, ctx: Ctx) -> str:
    r = h.reminder
    if r is None:
        head = "<p><b>deleted</b>: its work rows remain until retention removes them.</p>"
    else:
        head = (
            fields(
                [
                    ("id", e(r["id"])),
                    ("channel", link(f"/channel/{r['channel']}", r["channel"])),
                    ("recipient", ctx.personal(r["recipient"])),
                    (
                        "due",
                        e(r["due_at"])
                        if r["due_local"] is None
                        else f"{e(r['due_local'])} {e(r['due_tz'])}",
                    ),
                    ("remind before", e(", ".join(interval_text(b) for b in r["remind_before"]))),
                    ("recur", e(r["recur"])),
                    ("paused", "yes" if r["paused"] else "no"),
                    ("payload", _payload(ctx, r["payload"])),
                ]
            )
            + "<h2>"
            + ("Next deadline of the series" if r["recur"] else "Its deadline")
            + "</h2>"
            + (
                f"<p><b>Its next sends cannot be worked out</b> ({e(h.upcoming_error)}): "
                "the materialiser sets it aside and names it in its log; fix or delete the "
                "row.</p>"
                if h.upcoming_error is not None
                else ""
            )
            + (f"<p><b>Set aside</b>: {e(h.set_aside_text())}</p>" if h.set_aside else "")
            + (f"<p><b>Held</b>: {e(h.locked_text())}</p>" if h.locked_by else "")
            + table(
                ["send at", "deadline", "before", "status"],
                [
                    [e(u["send_at"]), e(u["deadline"]), e(u["remind_before"]), e(u["state"])]
                    for u in h.upcoming
                ],
            )
        )
    parts = [head]
    if h.occurrences:
        parts.append("<h2>Work rows, the latest send first</h2>")
    for w in h.occurrences:
        extra = [
            f"dead: {e(w['dead_reason'])}" if w["dead_reason"] else "",
            f"next try {e(w['available_at'])}" if w["state"] == "retry waiting" else "",
            f"redriven {e(w['redriven_at'])} by {e(w['redriven_by'])}" if w["redriven_at"] else "",
        ]
        wid = w["id"]
        parts.append(
            f"<p>{link(f'/work/{wid}', f'work {wid}')} <b>{e(w['state'])}</b>"
            f" · send {e(w['due_at'])} ({e(w['occurrence'])} before deadline"
            f" {e(w['deadline'])}) · {e(plural(w['attempts'], 'attempt'))}"
            + "".join(f" · {x}" for x in extra if x)
            + "</p>"
            + table(
                ["attempt", "outcome", "started", "took", "HTTP", "next try", "answer"],
                [
                    [
                        e(a["attempt"]),
                        e(a["outcome"]),
                        e(a["started_at"]),
                        e(took_ms(a["took"])),
                        e(a["http_status"]),
                        e(a["retry_at"]),
                        e(answer(a)),
                    ]
                    for a in w["attempts_ledger"]
                ],
            )
        )
    if h.retired:
        parts.append("<h2>Removed by retention (outcome kept, never sent again)</h2>")
        parts.append(
            table(
                ["deadline", "before", "status", "finished"],
                [
                    [e(t["deadline"]), e(t["occurrence"]), e(t["status"]), e(t["finished_at"])]
                    for t in h.retired
                ],
            )
        )
    return "".join(parts)


def dead_filter_form(f: DeadFilter) -> str:
    return (
        '<form method="get" action="/dead">'
        f'<label>channel <input name="channel" value="{e(f.channel)}"></label> '
        f'<label>source <input name="source" value="{e(f.source)}"></label> '
        f'<label>reason contains <input name="reason" value="{e(f.reason)}"></label> '
        f'<label>dead within <input name="since" placeholder="2h" value="{e(f.since)}"></label> '
        "<button>filter</button></form>"
    )


def dead(v: DeadPage, ctx: Ctx) -> str:
    done = ""
    if v.done is not None:
        n, left = v.done
        done = (
            f'<p class="done">{plural(n, "dead letter")} redriven'
            + (f"; {left} left dead (their reminder was cancelled or moved since)" if left else "")
            + ".</p>"
        )
    form = dead_filter_form(v.filter)
    if v.rows and v.filter.any:
        form += bulk_form(ctx, v.filter, "redrive all that match…")
    rows = table(
        ["id", "channel", "source", "business key", "due", "dead since", "attempts", "reason", ""],
        [
            [
                link(f"/work/{r['id']}", r["id"]),
                link(f"/channel/{r['channel']}", r["channel"]),
                e(r["source"]),
                ctx.personal(r["business_key"]),
                e(r["due_at"]),
                e(r["finished_at"]),
                e(attempts_text(r["attempts"], r["attempts_base"])),
                e(r["dead_reason"]),
                action_form(ctx, f"/work/{r['id']}/redrive", "redrive"),
            ]
            for r in v.rows
        ],
        empty="No dead letters match." if v.filter.any else "No dead letters.",
    )
    more = ""
    if v.next_before is not None:
        at, wid = v.next_before
        more = link(
            "/dead", "next page →", **v.filter.items(), before_at=at.isoformat(), before_id=wid
        )
    return f"{done}{form}{rows}<p>{more}</p>"


def bulk_form(
    ctx: Ctx,
    f: DeadFilter,
    label: str,
    confirm: tuple[int, str] | None = None,
) -> str:
    """A signed-in operator's form that redrives what the dead-letter filter selects; with
    ``confirm``, the count and the digest of the set the operator agrees to."""
    hidden: dict[str, Any] = {k: v or "" for k, v in f.items().items()}
    if confirm is not None:
        hidden["confirm"], hidden["digest"] = confirm
    return action_form(ctx, "/dead/redrive", label, hidden=hidden)


def redrive_ask(ctx: Ctx, f: DeadFilter, n: int, left: int, digest: str, changed: bool) -> str:
    """The bulk redrive's question: what matches, and a button for exactly that set."""
    matches = "matches" if n == 1 else "match"
    return (
        (
            "<p><b>The dead letters that match changed since you were asked.</b></p>"
            if changed
            else ""
        )
        + f"<p>{plural(n, 'dead letter')} {matches} ({e(f.said())}). Each gets a fresh attempt "
        "budget and keeps its operation id.</p>"
        + (
            f"<p>{left} more {'matches' if left == 1 else 'match'} but stay dead: their "
            "reminder was cancelled or moved since.</p>"
            if left
            else ""
        )
        + (bulk_form(ctx, f, f"redrive these {n}", confirm=(n, digest)) if n else "")
        + "<p>"
        + link("/dead", "← back to the dead letters", **f.items())
        + "</p>"
    )


def reminders_form(source: str | None, prefix: str) -> str:
    return (
        '<form method="get" action="/reminders">'
        f'<label>source <input name="source" value="{e(source)}" required></label> '
        f'<label>key starts with <input name="prefix" value="{e(prefix)}"></label> '
        "<button>find</button></form>"
    )


def reminders(v: RemindersPage, ctx: Ctx) -> str:
    rows = table(
        ["business key", "channel", "due", "recur", "paused", "latest send", "its status"],
        [
            [
                link(
                    "/reminder",
                    personal_as(r["business_key"], ctx.redact),
                    source=v.source,
                    key=r["business_key"],
                ),
                link(f"/channel/{r['channel']}", r["channel"]),
                e(r["due_at"])
                if r["due_local"] is None
                else f"{e(r['due_local'])} {e(r['due_tz'])}",
                e(r["recur"]),
                "PAUSED" if r["paused"] else "",
                e(r["last_send_at"]),
                e(r["last_status"]),
            ]
            for r in v.rows
        ],
        empty="No reminders match.",
    )
    more = (
        link("/reminders", "next page →", source=v.source, prefix=v.prefix, after=v.next_after)
        if v.next_after is not None
        else ""
    )
    return f"{reminders_form(v.source, v.prefix)}{rows}<p>{more}</p>"


def retrying(v: RetryingPage, ctx: Ctx) -> str:
    assert v.now is not None
    now = v.now
    rows = table(
        ["id", "channel", "source", "business key", "attempts", "next try", "last error"],
        [
            [
                link(f"/work/{r['id']}", r["id"]),
                link(f"/channel/{r['channel']}", r["channel"]),
                e(r["source"]),
                link(
                    "/reminder",
                    personal_as(r["business_key"], ctx.redact),
                    source=r["source"],
                    key=r["business_key"],
                ),
                e(r["attempts"]),
                _next_try(r["retry_at"], v.channels.get(r["channel"]), now),
                e(r["last_error"]),
            ]
            for r in v.rows
        ],
        empty="Nothing waits for a retry"
        + (f" on {v.channel}." if v.channel else ".")
        + " A failed attempt lands here while it waits for its next try.",
    )
    note = f"<p>The {PAGE} soonest.</p>" if len(v.rows) == PAGE else ""
    return rows + note


def _next_try(at: datetime, c: store.ChannelState | None, now: datetime) -> str:
    """When a retry goes: its time, or what holds it past its time (its channel paused or
    throttled), or "due now"."""
    if c is not None and c.paused:
        return f'{e(at)} <span class="bad">held: channel {e(c.name)} PAUSED</span> ({e(c.paused_reason or "no reason given")})'
    if c is not None and c.throttled:
        return f'{e(at)} <span class="bad">held: channel {e(c.name)} THROTTLED</span>'
    if at <= now:
        return f"{e(at)} (due now: the next claim takes it)"
    return ago(at, now)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
