"""`pgwork web`: a small read-mostly page for operators — overview, a channel's rows, one row with
its attempt ledger, the dead letters — and three actions (redrive, pause, resume).

Safe by default: it binds to 127.0.0.1; every value is HTML-escaped (business keys and payloads
are written by other apps) and a Content-Security-Policy forbids scripts outright; business keys
and recipients follow ``log.redact``; actions need the configured ``web.token`` (signed in for at
most eight hours, in an HttpOnly, SameSite=Strict cookie that names a sign-in this process keeps
and sign-out ends), are POST-only and carry a CSRF token that must be this process's MAC of its
cookie; each is recorded with who and when, like the CLI's. Every page runs a few
short autocommit statements that read indexes of live or dead rows only; none holds a
transaction open. Server-rendered HTML, no JavaScript, nothing fetched from elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from html import escape
from typing import Any
from urllib.parse import urlencode, urlsplit

import anyio
import psycopg
from aiohttp import web
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from . import build, chart, jsontext, store
from .channels import KINDS
from .config import CHANNEL_NAME, Config, ConfigError, listen_ports
from .durations import interval_text, parse_duration
from .duties import gauges
from .history import History, channel_state, reminder_history, took_ms
from .logs import personal_as

log = logging.getLogger("pgwork.web")

Pool = AsyncConnectionPool[AsyncConnection[Any]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Rows per page.
PAGE = 50
#: The trend windows a channel's page offers, hours (the first is the default); the daemons keep
#: two days of minutes (pgwork/duties/trends.py).
TREND_HOURS = (3, 1, 12, 48)
#: The reminders set aside the overview lists (status lists up to 100).
OVERVIEW_SET_ASIDE = 20
#: Seconds between reloads of the overview (``?refresh=0``: none).
OVERVIEW_REFRESH = 15
CSRF_COOKIE = "pgwork_csrf"
#: A CSRF token made for this request (the browser had none): the response sets it as a cookie.
NEW_CSRF = web.RequestKey("pgwork_new_csrf", str)
AUTH_COOKIE = "pgwork_auth"
#: How long a sign-in lasts (seconds); sign-out, or a restart of the page, ends it sooner.
SESSION_TTL = 8 * 3600
#: Sign-ins kept at most (the oldest go first).
MAX_SESSIONS = 1000
#: Longest query parameter accepted (a filter, a cursor).
MAX_PARAM = 500
BIGINT_MAX = 2**63 - 1
HEADERS = {
    # No script may run, whatever a page contains; styles only from the page itself.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
header{background:#24292f;color:#fff;padding:.6em 1.2em}header a{color:#fff;margin-right:1.2em}
main{padding:1em 1.2em}table{border-collapse:collapse;background:#fff;margin:.5em 0 1.5em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f0f3f6}.bad{color:#b42318;font-weight:600}.ok{color:#1a7f37}
.note{color:#57606a}form.inline{display:inline}code{font-size:13px}
"""


def _e(value: Any) -> str:
    """Any value as escaped HTML text ('' for None)."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        value = value.isoformat(sep=" ", timespec="seconds")
    elif isinstance(value, timedelta):
        value = interval_text(value)
    return escape(str(value), quote=True)


def _json_value(value: Any) -> str:
    """What json.dumps cannot write itself: an interval as PostgreSQL writes it, else text."""
    return interval_text(value) if isinstance(value, timedelta) else str(value)


def _late_sources(sources: list[store.SourceLag]) -> str:
    """The late sources, latest first: one app's backlog shown as its own."""
    late = [s for s in sources if s.lag_seconds > 0]
    if not late:
        return ""
    return "<h2>Late sources</h2>" + _table(
        ["source", "lag s", "oldest due occurrence"],
        [
            [
                _e(s.source),
                _e(round(s.lag_seconds, 1)),
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
        + _table(
            ["reminder", "due", "error", "since", "tries", "tried again at", "by"],
            [
                [
                    _link(
                        "/reminder",
                        f"{a.source} {a.business_key}",
                        source=a.source,
                        key=a.business_key,
                    ),
                    _e(a.fire_at),
                    _e(a.error),
                    _e(a.since),
                    _e(a.tries),
                    _e(a.next_try_at),
                    _e(a.daemon_id),
                ]
                for a in aside
            ],
        )
    )


def _ago(t: datetime | None, now: datetime) -> str:
    """``t`` as escaped text with how long ago (or how soon) it is, for an operator scanning a
    page: ``2026-12-05 17:04:04+00:00 (3 min ago)``."""
    if t is None:
        return ""
    secs = (now - t).total_seconds()
    n, unit = abs(secs), "s"
    for size, name in ((86400, "d"), (3600, "h"), (60, "min")):
        if n >= size:
            n, unit = n / size, name
            break
    amount = f"{n:.0f} {unit}"
    return f"{_e(t)} ({amount} ago)" if secs >= 0 else f"{_e(t)} (in {amount})"


#: Longest excerpt of an answer shown in a ledger, characters.
ANSWER_EXCERPT = 300


def _answer(a: dict[str, Any]) -> str | None:
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


def _channel_state(c: store.ChannelState) -> str:
    word, why = channel_state(c)
    return f'<span class="{"ok" if word == "running" else "bad"}">{word}</span> {_e(why)}'


def _table(headings: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """Cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headings)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _link(path: str, text: Any, **query: Any) -> str:
    q = {k: v for k, v in query.items() if v not in (None, "")}
    href = path + ("?" + urlencode(q) if q else "")
    return f'<a href="{escape(href, quote=True)}">{_e(text)}</a>'


class WebApp:
    """The page's handlers over a connection pool."""

    def __init__(self, pool: Pool, cfg: Config) -> None:
        self.pool = pool
        self.cfg = cfg
        self.token = cfg.web_token
        self.redact = cfg.log_redact
        # Sign-ins: a random id per browser (what the auth cookie holds) -> when it expires
        # (monotonic). Kept here, so each can end alone: sign-out revokes it, and a restart of
        # the page ends them all. Never the token, nor anything derived from it alone.
        self._sessions: dict[str, float] = {}
        # Form tokens are a MAC of the browser's CSRF cookie under this key: a cookie planted from
        # another port of the host (cookies are not port-scoped) has no token that matches.
        self._csrf_key = secrets.token_bytes(32)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._headers], client_max_size=64 * 1024)
        app.add_routes(
            [
                web.get("/", self.overview),
                web.get("/channel/{name}", self.channel),
                web.get("/work/{id:[0-9]{1,18}}", self.work),
                web.get("/dead", self.dead),
                web.get("/reminder", self.reminder),
                web.get("/reminders", self.reminders),
                web.get("/retrying", self.retrying),
                web.post("/login", self.login),
                web.post("/logout", self.logout),
                web.post("/work/{id:[0-9]{1,18}}/redrive", self.redrive),
                web.post("/dead/redrive", self.redrive_filtered),
                web.post("/channel/{name}/pause", self.pause),
                web.post("/channel/{name}/resume", self.resume),
            ]
        )
        return app

    # -- plumbing ---------------------------------------------------------------------------

    @web.middleware
    async def _headers(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except web.HTTPException as e:  # errors and redirects: raised, with the same headers
            self._finish(request, e)
            raise
        except Exception:  # a defect or a database error: a 500, with the same headers
            log.exception("web: %s %s failed", request.method, request.path)
            resp = web.Response(status=500, text="pgwork: internal error (see the log)")
        self._finish(request, resp)
        return resp

    @staticmethod
    def _finish(request: web.Request, resp: web.StreamResponse) -> None:
        resp.headers.update(HEADERS)
        if CSRF_COOKIE not in request.cookies:
            resp.set_cookie(
                CSRF_COOKIE,
                request.get(NEW_CSRF) or secrets.token_urlsafe(32),
                httponly=True,
                samesite="Strict",
                path="/",
            )

    def _form_token(self, cookie: str) -> str:
        return hmac.new(self._csrf_key, cookie.encode(), hashlib.sha256).hexdigest()

    def _csrf(self, request: web.Request) -> str:
        """The form token for this browser: a MAC of its CSRF cookie (a new cookie is set on the
        response when it has none)."""
        cookie = request.cookies.get(CSRF_COOKIE)
        if not cookie:
            cookie = request.get(NEW_CSRF) or secrets.token_urlsafe(32)
            request[NEW_CSRF] = cookie
        return self._form_token(cookie)

    def _signed_in(self, request: web.Request) -> bool:
        if self.token is None:
            return False
        expires = self._sessions.get(request.cookies.get(AUTH_COOKIE, ""))
        return expires is not None and expires > time.monotonic()

    def _new_session(self) -> str:
        now = time.monotonic()
        for sid in [k for k, t in self._sessions.items() if t <= now]:
            del self._sessions[sid]
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]  # the oldest
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = now + SESSION_TTL
        return sid

    @staticmethod
    def _param(request: web.Request, name: str) -> str | None:
        """A query parameter as text (None when absent or empty); a 400 that names it when it
        holds a NUL or is longer than any real value."""
        value = request.query.get(name) or None
        if value is not None and ("\x00" in value or len(value) > MAX_PARAM):
            raise web.HTTPBadRequest(
                text=f"pgwork: query parameter {name!r} holds a NUL byte or is too long"
            )
        return value

    @classmethod
    def _id_param(cls, request: web.Request, name: str) -> int:
        value = cls._param(request, name) or ""
        if not (value.isascii() and value.isdigit()) or int(value) > BIGINT_MAX:
            raise web.HTTPBadRequest(
                text=f"pgwork: query parameter {name!r} must be a row id (0 .. {BIGINT_MAX})"
            )
        return int(value)

    @classmethod
    def _time_param(cls, request: web.Request, name: str) -> datetime:
        try:
            return datetime.fromisoformat(cls._param(request, name) or "")
        except ValueError:
            raise web.HTTPBadRequest(
                text=f"pgwork: query parameter {name!r} must be an ISO 8601 time"
            ) from None

    @staticmethod
    def _channel_name(request: web.Request) -> str:
        name = request.match_info["name"]
        if not CHANNEL_NAME.fullmatch(name):
            raise web.HTTPBadRequest(text="pgwork: path parameter 'name' is not a channel name")
        return name

    @staticmethod
    def _back(request: web.Request) -> str:
        """Where sign-in returns to: the page it came from on this host, never another site
        (the Referer is the browser's word, and can name any)."""
        ref = urlsplit(request.headers.get("Referer", ""))
        if ref.scheme not in ("http", "https") or ref.netloc != request.host:
            return "/"
        path = ref.path or "/"
        if not path.startswith("/") or path.startswith("//") or "\\" in path:
            return "/"
        return path + (f"?{ref.query}" if ref.query else "")

    def _personal(self, value: str | None) -> str:
        return _e(personal_as(value, self.redact) if value is not None else None)

    def _page(
        self,
        request: web.Request,
        title: str,
        body: str,
        status: int = 200,
        refresh: int | None = None,
    ) -> web.Response:
        """The page around ``body``; ``refresh``: reload every that many seconds (an overview
        left open on a screen), unless the URL says ``refresh=0``."""
        csrf = self._csrf(request)
        if self.token is None:
            who = '<span class="note">actions off (no web.token)</span>'
        elif self._signed_in(request):
            who = (
                f'<form class="inline" method="post" action="/logout">'
                f'<input type="hidden" name="csrf" value="{_e(csrf)}">'
                f"<button>sign out</button></form>"
            )
        else:
            who = (
                f'<form class="inline" method="post" action="/login">'
                f'<input type="hidden" name="csrf" value="{_e(csrf)}">'
                f'<input type="password" name="token" placeholder="web.token" required> '
                f"<button>sign in for actions</button></form>"
            )
        html = (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            + (
                f'<meta http-equiv="refresh" content="{refresh}">'
                if refresh and request.query.get("refresh") != "0"
                else ""
            )
            + f"<title>{_e(title)} · pgwork</title><style>{STYLE}</style></head><body>"
            '<header><a href="/">pgwork</a><a href="/reminders">reminders</a>'
            '<a href="/retrying">retrying</a><a href="/dead">dead letters</a>'
            '<a href="/reminder">a reminder</a>'
            f'<span style="float:right">{who}</span></header>'
            f"<main><h1>{_e(title)}</h1>{body}</main>"
            f'<footer class="note" style="padding:0 1.2em">pgwork {_e(build.version())}</footer>'
            "</body></html>"
        )
        return web.Response(text=html, content_type="text/html", status=status)

    def _action_form(
        self, request: web.Request, path: str, label: str, reason: bool = False
    ) -> str:
        if not self._signed_in(request):
            return ""
        extra = '<input name="reason" placeholder="reason" maxlength="200"> ' if reason else ""
        return (
            f'<form class="inline" method="post" action="{_e(path)}">'
            f'<input type="hidden" name="csrf" value="{_e(self._csrf(request))}">'
            f"{extra}<button>{_e(label)}</button></form>"
        )

    async def _checked_post(self, request: web.Request) -> dict[str, str]:
        """The form of an action, refused unless its CSRF token matches this browser's cookie
        and the request comes from this page (Origin, when the browser sends it)."""
        form = await request.post()
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = str(form.get("csrf", ""))
        if not cookie or not hmac.compare_digest(self._form_token(cookie), sent):
            raise web.HTTPForbidden(text="pgwork: the form's CSRF token does not match")
        # A browser sends Origin with every POST; "null" (an opaque origin: a sandboxed frame,
        # a data: URL) is another origin too. A client without one (curl) still needs the token.
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            raise web.HTTPForbidden(text="pgwork: a form from another origin")
        return {k: str(v) for k, v in form.items()}

    async def _action(self, request: web.Request) -> dict[str, str]:
        form = await self._checked_post(request)
        if self.token is None:
            raise web.HTTPForbidden(text="pgwork: actions are off (no web.token is configured)")
        if not self._signed_in(request):
            raise web.HTTPForbidden(text="pgwork: sign in with web.token first")
        return form

    @staticmethod
    def _actor(request: web.Request) -> str:
        return f"web@{request.remote or 'unknown'}"

    # -- pages ------------------------------------------------------------------------------

    async def overview(self, request: web.Request) -> web.Response:
        async with self.pool.connection() as conn:
            # What the gauges read (each query bounded by live rows or dead letters), and more.
            reading = await gauges.read(conn)
            aside = await store.set_aside_list(conn, limit=OVERVIEW_SET_ASIDE)
            daemons = await store.daemons(conn)
            mat = await store.materialiser_state(conn)
            now = await store.db_now(conn)
        lag, channels, retention = reading.lag, reading.channels, reading.retention
        counts: dict[str, dict[str, int]] = {}
        for s in reading.states:
            counts.setdefault(s.channel, {})[s.status] = s.n
        rows = []
        for c in channels:
            state = _channel_state(c)
            n = counts.get(c.name, {})
            action = self._channel_action(request, c)
            rows.append(
                [
                    _link(f"/channel/{c.name}", c.name),
                    _e(c.kind),
                    state,
                    _link(f"/channel/{c.name}", n.get("ready", 0), status="ready"),
                    _link(f"/channel/{c.name}", n.get("waiting", 0), status="ready"),
                    _link(f"/channel/{c.name}", n.get("claimed", 0), status="claimed"),
                    _link("/dead", n.get("dead", 0), channel=c.name),
                    _ago(c.next_retry_at, now),
                    action,
                ]
            )
        body = (
            f"<p>lag <b>{lag.lag_seconds:.1f} s</b> · oldest ready {lag.oldest_ready_seconds:.1f} s"
            f" · not yet materialised {lag.unmaterialised_seconds:.1f} s"
            f" · materialiser cutoff {_e(mat.last_cutoff)}</p>"
            + _late_sources(reading.sources)
            + _set_aside_table(aside)
            + "<h2>Channels</h2>"
            + _table(
                [
                    "channel",
                    "kind",
                    "state",
                    "ready",
                    "waiting",
                    "claimed",
                    "dead",
                    "next retry",
                    "",
                ],
                rows,
            )
            + "<h2>Daemons</h2>"
            + _table(
                ["id", "state", "version", "started", "heartbeat age s", "listener", "metrics"],
                [
                    [
                        _e(d.id),
                        '<span class="bad">GONE</span>' if d.gone else "running",
                        _e(d.version),
                        _ago(d.started_at, now),
                        _e(round(d.heartbeat_age_seconds, 1)),
                        "off" if d.listener_up is None else ("up" if d.listener_up else "DOWN"),
                        _e(d.metrics_at),
                    ]
                    for d in daemons
                ],
            )
            + "<h2>Retention</h2>"
            + f"<p>{'<b>PAUSED</b> · ' if retention.paused else ''}last pass "
            f"{_ago(retention.last_pass_at, now) or 'never'} · deleted {retention.total_deleted} in total"
            f" · oldest kept {_e(_round(retention.oldest_terminal_age_seconds))} s</p>"
        )
        return self._page(request, "Overview", body, refresh=OVERVIEW_REFRESH)

    def _channel_action(self, request: web.Request, c: store.ChannelState) -> str:
        """Resume a paused or throttled channel (it lifts a throttle's limit too), else pause."""
        if c.paused or c.throttled or c.throttle_limit is not None:
            return self._action_form(request, f"/channel/{c.name}/resume", "resume")
        return self._action_form(request, f"/channel/{c.name}/pause", "pause", reason=True)

    async def channel(self, request: web.Request) -> web.Response:
        name = self._channel_name(request)
        status = self._param(request, "status") or ""
        asked = self._param(request, "hours")
        hours = int(asked) if asked in {str(h) for h in TREND_HOURS} else TREND_HOURS[0]
        statuses = [status] if status in ("ready", "claimed") else ["ready", "claimed"]
        after = None
        if request.query.get("after_id"):
            after = (
                self._param(request, "after_source") or "",
                self._time_param(request, "after_at"),
                self._id_param(request, "after_id"),
            )
        async with self.pool.connection() as conn:
            known = [c for c in await store.channel_states(conn) if c.name == name]
            if not known:
                raise web.HTTPNotFound(text=f"pgwork: no channel {name!r}")
            got = await store.live_page(
                conn, channel=name, statuses=statuses, after=after, limit=PAGE
            )
            now = await store.db_now(conn)
            trend = await store.channel_trend(conn, channel=name, minutes=hours * 60)
        c = known[0]
        since = (
            c.paused_at if c.paused else c.throttled_at if c.throttle_limit or c.throttled else None
        )
        head = (
            "<table>"
            + "".join(
                f"<tr><th>{k}</th><td>{v}</td></tr>"
                for k, v in [
                    ("kind", _e(c.kind)),
                    ("state", _channel_state(c) + " " + self._channel_action(request, c)),
                    ("state changed", f"since {_ago(since, now)}" if since else ""),
                    ("claimed now", _e(c.claimed)),
                    (
                        "limits",
                        _e(
                            ", ".join(
                                f"{k} {v}"
                                for k, v in (
                                    ("global concurrency", c.global_concurrency),
                                    ("rate limit /s", c.rate_limit),
                                    ("throttle limit", c.throttle_limit),
                                )
                                if v is not None
                            )
                            or "none"
                        ),
                    ),
                    ("catch-up", _e(c.catch_up)),
                    ("next retry", _ago(c.next_retry_at, now)),
                ]
                if v  # a time that is not set is left out
            )
            + "</table>"
        )
        table = _table(
            [
                "id",
                "status",
                "source",
                "business key",
                "due",
                "available",
                "attempts",
                "last error",
            ],
            [
                [
                    _link(f"/work/{r['id']}", r["id"]),
                    _e(r["status"]),
                    _e(r["source"]),
                    self._personal(r["business_key"]),
                    _e(r["due_at"]),
                    _e(r["available_at"]),
                    _e(r["attempts"] - r["attempts_base"]),
                    _e(r["last_error"]),
                ]
                for r in got
            ],
        )
        more = ""
        if len(got) == PAGE:
            last = got[-1]
            more = _link(
                f"/channel/{name}",
                "next page →",
                status=status,
                after_source=last["source"],
                after_at=last["available_at"].isoformat(),
                after_id=last["id"],
            )
        tabs = (
            " · ".join(
                _link(f"/channel/{name}", label, status=s)
                for s, label in (("", "live"), ("ready", "ready"), ("claimed", "claimed"))
            )
            + " · "
            + _link("/retrying", "retrying", channel=name)
            + " · "
            + _link("/dead", "dead", channel=name)
        )
        windows = " · ".join(
            f"<b>{h} h</b>" if h == hours else _link(f"/channel/{name}", f"{h} h", hours=h)
            for h in sorted(TREND_HOURS)
        )
        trend_html = f"<h2>Trend</h2><p>{windows}</p>" + chart.trend(trend, now, hours * 60)
        return self._page(
            request,
            f"Channel {name}",
            f"{head}{trend_html}<h2>Live rows</h2><p>{tabs}</p>{table}<p>{more}</p>",
        )

    async def work(self, request: web.Request) -> web.Response:
        work_id = int(request.match_info["id"])
        async with self.pool.connection() as conn:
            got = await store.work_get(conn, id=work_id)
            attempts = await store.work_attempts(conn, id=work_id) if got else []
        if not got:
            return self._page(request, f"Work {work_id}", "<p>No such work row.</p>", status=404)
        w = got[0]
        fields = [
            ("status", _e(w["status"])),
            ("channel", _link(f"/channel/{w['channel']}", w["channel"])),
            ("source", _e(w["source"])),
            (
                "business key",
                self._personal(w["business_key"])
                + " · "
                + _link(
                    "/reminder", "all of this reminder", source=w["source"], key=w["business_key"]
                ),
            ),
            ("recipient", self._personal(w["recipient"])),
            ("deadline", _e(w["deadline"])),
            ("occurrence", _e(w["occurrence"])),
            ("due", _e(w["due_at"])),
            ("operation id", f"<code>{_e(w['operation_id'])}</code>"),
            ("attempts", _e(w["attempts"] - w["attempts_base"])),
            ("dead reason", _e(w["dead_reason"])),
            ("last error", _e(w["last_error"])),
            (
                "redriven",
                _e(w["redriven_at"]) + (f" by {_e(w['redriven_by'])}" if w["redriven_by"] else ""),
            ),
            (
                "payload",
                f"<code>{_e(w['payload'])}</code>" if self.redact == "none" else "(redacted)",
            ),
        ]
        action = (
            self._action_form(request, f"/work/{work_id}/redrive", "redrive")
            if w["status"] == store.Status.DEAD
            else ""
        )
        ledger = _table(
            ["lease", "attempt", "outcome", "daemon", "started", "finished", "HTTP", "answer"],
            [
                [
                    _e(a["lease"]),
                    _e(a["attempt"]),
                    _e(a["outcome"]),
                    _e(a["daemon_id"]),
                    _e(a["started_at"]),
                    _e(a["finished_at"]),
                    _e(a["http_status"]),
                    _e(_answer(a)),
                ]
                for a in attempts
            ],
        )
        body = (
            "<table>"
            + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in fields)
            + "</table>"
            + f"<p>{action}</p><h2>Attempts</h2>{ledger}"
            + self._request(w)
        )
        return self._page(request, f"Work {work_id}", body)

    def _request(self, w: dict[str, Any]) -> str:
        """What each attempt of the row sends, as this config's channel makes it, when its kind
        can say (a webhook: its URL and headers with the row's values, configured headers by
        name only)."""
        c = self.cfg.channels.get(w["channel"])
        kind = KINDS.get(c.kind) if c is not None else None
        if c is None or kind is None or kind.request is None:
            return ""
        return (
            "<h2>Request (as this config's channel sends it)</h2><pre>"
            + _e("\n".join(kind.request(c.options, str(w["operation_id"]))))
            + "</pre>"
        )

    async def reminder(self, request: web.Request) -> web.Response:
        """What happened to one reminder (``pgwork reminder``); ``format=json`` for JSON."""
        source = self._param(request, "source")
        key = self._param(request, "key")
        form = (
            '<form method="get" action="/reminder">'
            f'<input name="source" placeholder="source" value="{_e(source)}" required> '
            f'<input name="key" placeholder="business key" value="{_e(key)}" required> '
            "<button>show</button></form>"
        )
        if source is None or key is None:
            return self._page(request, "Reminder", form)
        async with self.pool.connection() as conn:
            h = await reminder_history(
                conn, source=source, business_key=key, expire_after=self.cfg.expire_after()
            )
        if self._param(request, "format") == "json":
            return web.Response(
                text=jsontext.dumps(self._redacted(h), default=_json_value),
                content_type="application/json",
                status=200 if h.known else 404,
            )
        if not h.known:
            return self._page(
                request,
                "Reminder",
                form + "<p>No such reminder, and no work rows for one.</p>",
                404,
            )
        return self._page(request, f"Reminder {source} / {key}", form + self._history(h))

    def _redacted(self, h: History) -> dict[str, Any]:
        doc = h.as_json()
        if self.redact == "none":
            return doc
        doc["business_key"] = personal_as(doc["business_key"], self.redact)
        r = doc["reminder"]
        if r is not None:
            r["business_key"] = personal_as(r["business_key"], self.redact)
            r["recipient"] = personal_as(r["recipient"], self.redact)
            r["payload"] = "(redacted)"
        return doc

    def _history(self, h: History) -> str:
        r = h.reminder
        if r is None:
            head = "<p><b>deleted</b>: its work rows remain until retention removes them.</p>"
        else:
            head = (
                "<table>"
                + "".join(
                    f"<tr><th>{_e(k)}</th><td>{v}</td></tr>"
                    for k, v in [
                        ("id", _e(r["id"])),
                        ("channel", _link(f"/channel/{r['channel']}", r["channel"])),
                        ("recipient", self._personal(r["recipient"])),
                        (
                            "due",
                            _e(r["due_at"])
                            if r["due_local"] is None
                            else f"{_e(r['due_local'])} {_e(r['due_tz'])}",
                        ),
                        (
                            "remind before",
                            _e(", ".join(interval_text(b) for b in r["remind_before"])),
                        ),
                        ("recur", _e(r["recur"])),
                        ("paused", "yes" if r["paused"] else "no"),
                        (
                            "payload",
                            f"<code>{_e(r['payload'])}</code>"
                            if self.redact == "none"
                            else "(redacted)",
                        ),
                    ]
                )
                + "</table><h2>"
                + ("Next deadline of the series" if r["recur"] else "Its deadline")
                + "</h2>"
                + (
                    f"<p><b>Its next sends cannot be worked out</b> ({_e(h.upcoming_error)}): "
                    "the materialiser sets it aside and names it in its log; fix or delete the "
                    "row.</p>"
                    if h.upcoming_error is not None
                    else ""
                )
                + (
                    f"<p><b>Set aside</b>: {_e(h.set_aside_text())}</p>"
                    if h.set_aside is not None
                    else ""
                )
                + (f"<p><b>Held</b>: {_e(h.locked_text())}</p>" if h.locked_by else "")
                + _table(
                    ["send at", "deadline", "before", "status"],
                    [
                        [
                            _e(u["send_at"]),
                            _e(u["deadline"]),
                            _e(u["remind_before"]),
                            _e(u["state"]),
                        ]
                        for u in h.upcoming
                    ],
                )
            )
        parts = [head]
        if h.occurrences:
            parts.append("<h2>Work rows, the latest send first</h2>")
        for w in h.occurrences:
            extra = [
                f"dead: {_e(w['dead_reason'])}" if w["dead_reason"] else "",
                f"next try {_e(w['available_at'])}" if w["state"] == "retry waiting" else "",
                f"redriven {_e(w['redriven_at'])} by {_e(w['redriven_by'])}"
                if w["redriven_at"]
                else "",
            ]
            wid = w["id"]
            parts.append(
                f"<p>{_link(f'/work/{wid}', f'work {wid}')} <b>{_e(w['state'])}</b>"
                f" · send {_e(w['due_at'])} ({_e(w['occurrence'])} before deadline"
                f" {_e(w['deadline'])}) · {_e(w['attempts'])} attempt(s)"
                + "".join(f" · {x}" for x in extra if x)
                + "</p>"
                + _table(
                    ["attempt", "outcome", "started", "took", "HTTP", "next try", "answer"],
                    [
                        [
                            _e(a["attempt"]),
                            _e(a["outcome"]),
                            _e(a["started_at"]),
                            _e(took_ms(a["took"])),
                            _e(a["http_status"]),
                            _e(a["retry_at"]),
                            _e(_answer(a)),
                        ]
                        for a in w["attempts_ledger"]
                    ],
                )
            )
        if h.retired:
            parts.append("<h2>Removed by retention (outcome kept, never sent again)</h2>")
            parts.append(
                _table(
                    ["deadline", "before", "status", "finished"],
                    [
                        [
                            _e(t["deadline"]),
                            _e(t["occurrence"]),
                            _e(t["status"]),
                            _e(t["finished_at"]),
                        ]
                        for t in h.retired
                    ],
                )
            )
        return "".join(parts)

    @staticmethod
    def _since(value: str | None) -> timedelta | None:
        if value is None:
            return None
        try:
            return timedelta(seconds=parse_duration(value))
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"pgwork: since: {e}") from None

    async def dead(self, request: web.Request) -> web.Response:
        channel = self._param(request, "channel")
        source = self._param(request, "source")
        reason = self._param(request, "reason")
        since_text = self._param(request, "since")
        since = self._since(since_text)
        before = None
        if request.query.get("before_id"):
            before = (self._time_param(request, "before_at"), self._id_param(request, "before_id"))
        async with self.pool.connection() as conn:
            got = await store.dead_page(
                conn,
                channel=channel,
                source=source,
                reason_like=f"%{reason}%" if reason else None,
                before=before,
                limit=PAGE,
                since=since,
            )
        filters = (
            '<form method="get" action="/dead">'
            f'<input name="channel" placeholder="channel" value="{_e(channel)}"> '
            f'<input name="source" placeholder="source" value="{_e(source)}"> '
            f'<input name="reason" placeholder="reason contains" value="{_e(reason)}"> '
            f'<input name="since" placeholder="dead within (2h)" value="{_e(since_text)}"> '
            "<button>filter</button></form>"
        )
        filtered = {"channel": channel, "source": source, "reason": reason, "since": since_text}
        if got and any(filtered.values()):
            filters += self._bulk_form(request, filtered, "redrive all that match…")
        table = _table(
            [
                "id",
                "channel",
                "source",
                "business key",
                "due",
                "dead since",
                "attempts",
                "reason",
                "",
            ],
            [
                [
                    _link(f"/work/{r['id']}", r["id"]),
                    _link(f"/channel/{r['channel']}", r["channel"]),
                    _e(r["source"]),
                    self._personal(r["business_key"]),
                    _e(r["due_at"]),
                    _e(r["finished_at"]),
                    _e(r["attempts"] - r["attempts_base"]),
                    _e(r["dead_reason"]),
                    self._action_form(request, f"/work/{r['id']}/redrive", "redrive"),
                ]
                for r in got
            ],
        )
        more = ""
        if len(got) == PAGE:
            last = got[-1]
            more = _link(
                "/dead",
                "next page →",
                channel=channel,
                source=source,
                reason=reason,
                since=since_text,
                before_at=last["finished_at"].isoformat(),
                before_id=last["id"],
            )
        return self._page(request, "Dead letters", f"{filters}{table}<p>{more}</p>")

    # -- sign-in and actions ----------------------------------------------------------------

    async def login(self, request: web.Request) -> web.Response:
        form = await self._checked_post(request)
        if self.token is None:
            raise web.HTTPForbidden(text="pgwork: actions are off (no web.token is configured)")
        if not hmac.compare_digest(form.get("token", "").encode(), self.token.encode()):
            log.warning("web: a sign-in with a wrong token", extra={"remote": request.remote})
            raise web.HTTPForbidden(text="pgwork: wrong token")
        resp = web.HTTPSeeOther(self._back(request))
        resp.set_cookie(
            AUTH_COOKIE,
            self._new_session(),
            max_age=SESSION_TTL,
            httponly=True,
            samesite="Strict",
            path="/",
        )
        raise resp

    async def logout(self, request: web.Request) -> web.Response:
        await self._checked_post(request)
        self._sessions.pop(request.cookies.get(AUTH_COOKIE, ""), None)
        resp = web.HTTPSeeOther("/")
        resp.del_cookie(AUTH_COOKIE, path="/")
        raise resp

    async def redrive(self, request: web.Request) -> web.Response:
        await self._action(request)
        work_id = int(request.match_info["id"])
        actor = self._actor(request)
        async with self.pool.connection() as conn:
            got = await store.dlq_redrive(
                conn, all=False, ids=[work_id], channel=None, operator=actor
            )
        verdict = got[0].verdict if got else "not a dead letter"
        log.info(
            "web: redrive of work %s: %s",
            work_id,
            verdict,
            extra={"work_id": work_id, "actor": actor},
        )
        if verdict != "ok":
            raise web.HTTPConflict(text=f"pgwork: not redriven: work {work_id} is {verdict}")
        raise web.HTTPSeeOther(f"/work/{work_id}")

    def _bulk_form(
        self,
        request: web.Request,
        filtered: dict[str, str | None],
        label: str,
        confirm: int | None = None,
    ) -> str:
        """A signed-in operator's form that redrives what the dead-letter filter selects; with
        ``confirm``, the count the operator agrees to."""
        if not self._signed_in(request):
            return ""
        fields = "".join(
            f'<input type="hidden" name="{k}" value="{_e(v or "")}">' for k, v in filtered.items()
        )
        if confirm is not None:
            fields += f'<input type="hidden" name="confirm" value="{confirm}">'
        return (
            '<form method="post" action="/dead/redrive">'
            f'<input type="hidden" name="csrf" value="{_e(self._csrf(request))}">'
            f"{fields}<button>{_e(label)}</button></form>"
        )

    async def redrive_filtered(self, request: web.Request) -> web.Response:
        """Redrive what a dead-letter filter selects. The redrive runs in a transaction: it is
        rolled back unless the operator confirmed the count it makes, so the first answer is a
        page that states that count and asks, and a count that changed meanwhile asks again."""
        form = await self._action(request)
        filtered: dict[str, str | None] = {
            k: form.get(k, "").strip()[:MAX_PARAM] or None
            for k in ("channel", "source", "reason", "since")
        }
        since = self._since(filtered["since"])
        said = " · ".join(f"{k} {v}" for k, v in filtered.items() if v) or "every dead letter"
        actor = self._actor(request)
        done = -1
        async with self.pool.connection() as conn:
            async with conn.transaction() as tx:
                got = await store.dlq_redrive(
                    conn,
                    all=True,
                    ids=[],
                    channel=filtered["channel"],
                    source=filtered["source"],
                    since=since,
                    reason_like=f"%{filtered['reason']}%" if filtered["reason"] else None,
                    operator=actor,
                )
                n = sum(1 for g in got if g.verdict == "ok")
                if form.get("confirm") != str(n):
                    raise psycopg.Rollback(tx)
                done = n
        left = len(got) - n
        if done < 0:
            changed = "confirm" in form
            body = (
                ("<p><b>The count changed since you were asked.</b></p>" if changed else "")
                + f"<p>{n} dead letter{'' if n == 1 else 's'} match ({_e(said)}). Each gets a "
                "fresh attempt budget and keeps its operation id.</p>"
                + (
                    f"<p>{left} more match but stay dead: their reminder was cancelled or moved "
                    "since.</p>"
                    if left
                    else ""
                )
                + (self._bulk_form(request, filtered, f"redrive these {n}", confirm=n) if n else "")
                + "<p>"
                + _link("/dead", "← back to the dead letters", **filtered)
                + "</p>"
            )
            return self._page(request, "Redrive dead letters", body, 409 if changed else 200)
        log.info(
            "web: bulk redrive (%s) by %s: %d redriven, %d left dead (reminder cancelled or moved)",
            said,
            actor,
            done,
            left,
            extra={"actor": actor, "filter": said, "redriven": done, "left": left},
        )
        raise web.HTTPSeeOther("/dead?" + urlencode({k: v for k, v in filtered.items() if v}))

    async def reminders(self, request: web.Request) -> web.Response:
        """A source's reminders, by a key prefix if given, one keyset page at a time."""
        source = self._param(request, "source")
        prefix = self._param(request, "prefix") or ""
        after = self._param(request, "after") or ""
        form = (
            '<form method="get" action="/reminders">'
            f'<input name="source" placeholder="source" value="{_e(source)}" required> '
            f'<input name="prefix" placeholder="key starts with" value="{_e(prefix)}"> '
            "<button>find</button></form>"
        )
        if source is None:
            return self._page(request, "Reminders", form)
        async with self.pool.connection() as conn:
            got = await store.reminders_page(
                conn, source=source, prefix=prefix, after=after, limit=PAGE
            )
        if not got:
            return self._page(request, "Reminders", form + "<p>No reminders match.</p>")
        table = _table(
            ["business key", "channel", "due", "recur", "paused", "latest send", "its status"],
            [
                [
                    _link(
                        "/reminder",
                        personal_as(r["business_key"], self.redact),
                        source=source,
                        key=r["business_key"],
                    ),
                    _link(f"/channel/{r['channel']}", r["channel"]),
                    _e(r["due_at"])
                    if r["due_local"] is None
                    else f"{_e(r['due_local'])} {_e(r['due_tz'])}",
                    _e(r["recur"]),
                    "PAUSED" if r["paused"] else "",
                    _e(r["last_send_at"]),
                    _e(r["last_status"]),
                ]
                for r in got
            ],
        )
        more = ""
        if len(got) == PAGE:
            more = _link(
                "/reminders",
                "next page →",
                source=source,
                prefix=prefix,
                after=got[-1]["business_key"],
            )
        return self._page(request, f"Reminders of {source}", f"{form}{table}<p>{more}</p>")

    async def retrying(self, request: web.Request) -> web.Response:
        """Rows that failed and wait for their next try, the soonest first."""
        channel = self._param(request, "channel")
        async with self.pool.connection() as conn:
            got = await store.retrying(conn, channel=channel, limit=PAGE)
            now = await store.db_now(conn)
        table = _table(
            ["id", "channel", "source", "business key", "attempts", "next try", "last error"],
            [
                [
                    _link(f"/work/{r['id']}", r["id"]),
                    _link(f"/channel/{r['channel']}", r["channel"]),
                    _e(r["source"]),
                    _link(
                        "/reminder",
                        personal_as(r["business_key"], self.redact),
                        source=r["source"],
                        key=r["business_key"],
                    ),
                    _e(r["attempts"]),
                    _ago(r["retry_at"], now),
                    _e(r["last_error"]),
                ]
                for r in got
            ],
        )
        note = f"<p>The {PAGE} soonest.</p>" if len(got) == PAGE else ""
        title = "Waiting for a retry" + (f" on {channel}" if channel else "")
        return self._page(request, title, table + note)

    async def pause(self, request: web.Request) -> web.Response:
        form = await self._action(request)
        name = self._channel_name(request)
        actor = self._actor(request)
        reason = form.get("reason", "").strip()[:200] or None
        async with self.pool.connection() as conn:
            await self._channel_known(conn, name)
            await store.channel_pause(conn, channel=name, reason=reason, actor=actor)
        log.info("web: paused channel %s", name, extra={"channel": name, "actor": actor})
        raise web.HTTPSeeOther("/")

    async def resume(self, request: web.Request) -> web.Response:
        await self._action(request)
        name = self._channel_name(request)
        actor = self._actor(request)
        async with self.pool.connection() as conn:
            await self._channel_known(conn, name)
            await store.channel_resume(conn, channel=name, actor=actor)
        log.info("web: resumed channel %s", name, extra={"channel": name, "actor": actor})
        raise web.HTTPSeeOther("/")

    @staticmethod
    async def _channel_known(conn: AsyncConnection[Any], name: str) -> None:
        if name not in {c.name for c in await store.channel_states(conn)}:
            raise web.HTTPNotFound(text=f"pgwork: no channel named {name!r}")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def serve(
    pool: Pool, cfg: Config, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Serve the page on ``web.listen`` until cancelled; ``task_status`` gets HOST:PORT."""
    parsed = listen_ports(cfg.web_listen)
    if parsed is None:
        raise ConfigError(f"web.listen: not HOST:PORT (got {cfg.web_listen!r})")
    host, ports = parsed
    runner = web.AppRunner(WebApp(pool, cfg).app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        error: Exception | None = None
        for port in ports:
            site = web.TCPSite(runner, host or "127.0.0.1", port)
            try:
                await site.start()
            except OSError as e:
                error = e
                continue
            at = f"{host or '127.0.0.1'}:{runner.addresses[-1][1]}"
            log.info("web page on http://%s/", at, extra={"web_at": at})
            task_status.started(at)
            await anyio.sleep_forever()
        raise ConfigError(f"web.listen: cannot serve on {cfg.web_listen!r}: {error}")
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
