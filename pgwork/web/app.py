"""The web page's routes: each handler reads its request, builds its view (``views.py``) and
draws it (``html.py``); the actions (sign-in, redrive, pause, resume) check the sign-in and the
form (``auth.py``), act through ``store`` and say what they did, in the log with who and when,
as the CLI's do. Every page runs a few short autocommit statements that read indexes of live or
dead rows only; none holds a transaction open."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import anyio
import psycopg
from aiohttp import web
from anyio.abc import TaskStatus
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .. import jsontext, store
from ..channels import KINDS
from ..config import CHANNEL_NAME, Config, ConfigError, listen_ports
from ..durations import interval_text, parse_duration
from ..history import History
from ..logs import personal_as
from . import html, views
from .auth import AUTH_COOKIE, SESSION_TTL, Auth, Forbidden, back

log = logging.getLogger("pgwork.web")

Pool = AsyncConnectionPool[AsyncConnection[Any]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Seconds between reloads of the overview (``?refresh=0``: none).
OVERVIEW_REFRESH = 15
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


class WebApp:
    """The page's handlers over a connection pool."""

    def __init__(self, pool: Pool, cfg: Config) -> None:
        self.pool = pool
        self.cfg = cfg
        self.auth = Auth(cfg.web_token)

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
        except Forbidden as e:  # an action refused: said on a page, with a way on
            resp = web.Response(
                text=html.refused(self._ctx(request), e.why), content_type="text/html", status=403
            )
        except web.HTTPException as e:  # errors and redirects: raised, with the same headers
            self._finish(request, e)
            raise
        except Exception:  # a defect or a database error: a 500, with the same headers
            log.exception("web: %s %s failed", request.method, request.path)
            resp = web.Response(status=500, text="pgwork: internal error (see the log)")
        self._finish(request, resp)
        return resp

    def _finish(self, request: web.Request, resp: web.StreamResponse) -> None:
        resp.headers.update(HEADERS)
        self.auth.set_cookie(request, resp)

    def _ctx(self, request: web.Request) -> html.Ctx:
        return html.Ctx(
            csrf=self.auth.csrf(request),
            actions_on=self.auth.actions_on,
            signed_in=self.auth.signed_in(request),
            redact=self.cfg.log_redact,
            here=request.path_qs,
            no_refresh=request.query.get("refresh") == "0",
        )

    def _page(
        self, request: web.Request, title: str, body: str, status: int = 200, refresh: int = 0
    ) -> web.Response:
        text = html.page(self._ctx(request), title, body, refresh or None)
        return web.Response(text=text, content_type="text/html", status=status)

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
    def _since(value: str | None) -> timedelta | None:
        if value is None:
            return None
        try:
            return timedelta(seconds=parse_duration(value))
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"pgwork: since: {e}") from None

    @staticmethod
    def _actor(request: web.Request) -> str:
        return f"web@{request.remote or 'unknown'}"

    # -- pages ------------------------------------------------------------------------------

    async def overview(self, request: web.Request) -> web.Response:
        async with self.pool.connection() as conn:
            v = await views.overview(conn)
        body = html.overview(v, self._ctx(request))
        return self._page(request, "Overview", body, refresh=OVERVIEW_REFRESH)

    async def channel(self, request: web.Request) -> web.Response:
        name = self._channel_name(request)
        asked = self._param(request, "hours")
        hours = int(asked) if asked in {str(h) for h in views.TREND_HOURS} else views.TREND_HOURS[0]
        after = None
        if request.query.get("after_id"):
            after = (
                self._param(request, "after_source") or "",
                self._time_param(request, "after_at"),
                self._id_param(request, "after_id"),
            )
        async with self.pool.connection() as conn:
            v = await views.channel(
                conn, name, status=self._param(request, "status") or "", after=after, hours=hours
            )
        if v is None:
            raise web.HTTPNotFound(text=f"pgwork: no channel {name!r}")
        return self._page(request, f"Channel {name}", html.channel(v, self._ctx(request)))

    async def work(self, request: web.Request) -> web.Response:
        work_id = int(request.match_info["id"])
        async with self.pool.connection() as conn:
            v = await views.work(conn, work_id)
        if v is None:
            return self._page(request, f"Work {work_id}", "<p>No such work row.</p>", status=404)
        body = html.work(v, self._ctx(request), self._request_lines(v.work))
        return self._page(request, f"Work {work_id}", body)

    def _request_lines(self, w: dict[str, Any]) -> list[str] | None:
        """What each attempt of the row sends, as this config's channel makes it, when its kind
        can say (a webhook: its URL and headers with the row's values, configured headers by
        name only)."""
        c = self.cfg.channels.get(w["channel"])
        kind = KINDS.get(c.kind) if c is not None else None
        if c is None or kind is None or kind.request is None:
            return None
        return list(kind.request(c.options, str(w["operation_id"])))

    async def reminder(self, request: web.Request) -> web.Response:
        """What happened to one reminder (``pgwork reminder``); ``format=json`` for JSON."""
        source = self._param(request, "source")
        key = self._param(request, "key")
        form = html.reminder_form(source, key)
        if source is None or key is None:
            return self._page(request, "Reminder", form)
        async with self.pool.connection() as conn:
            h = await views.reminder(conn, source, key, self.cfg.expire_after())
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
        body = form + html.reminder(h, self._ctx(request))
        return self._page(request, f"Reminder {source} / {key}", body)

    def _redacted(self, h: History) -> dict[str, Any]:
        doc = h.as_json()
        redact = self.cfg.log_redact
        if redact == "none":
            return doc
        doc["business_key"] = personal_as(doc["business_key"], redact)
        r = doc["reminder"]
        if r is not None:
            r["business_key"] = personal_as(r["business_key"], redact)
            r["recipient"] = personal_as(r["recipient"], redact)
            r["payload"] = "(redacted)"
        return doc

    def _dead_filter(self, get: Callable[[str], str | None]) -> views.DeadFilter:
        return views.DeadFilter(
            channel=get("channel"), source=get("source"), reason=get("reason"), since=get("since")
        )

    async def dead(self, request: web.Request) -> web.Response:
        f = self._dead_filter(lambda k: self._param(request, k))
        before = None
        if request.query.get("before_id"):
            before = (self._time_param(request, "before_at"), self._id_param(request, "before_id"))
        done = None
        if request.query.get("redriven"):
            done = (self._id_param(request, "redriven"), self._id_param(request, "left"))
        async with self.pool.connection() as conn:
            v = await views.dead(conn, f, since=self._since(f.since), before=before, done=done)
        return self._page(request, "Dead letters", html.dead(v, self._ctx(request)))

    async def reminders(self, request: web.Request) -> web.Response:
        """A source's reminders, by a key prefix if given, one keyset page at a time."""
        source = self._param(request, "source")
        prefix = self._param(request, "prefix") or ""
        if source is None:
            return self._page(request, "Reminders", html.reminders_form(None, prefix))
        async with self.pool.connection() as conn:
            v = await views.reminders(conn, source, prefix, self._param(request, "after") or "")
        return self._page(request, f"Reminders of {source}", html.reminders(v, self._ctx(request)))

    async def retrying(self, request: web.Request) -> web.Response:
        """Rows that failed and wait for their next try, the soonest first."""
        channel = self._param(request, "channel")
        async with self.pool.connection() as conn:
            v = await views.retrying(conn, channel)
        title = "Waiting for a retry" + (f" on {channel}" if channel else "")
        return self._page(request, title, html.retrying(v, self._ctx(request)))

    # -- sign-in and actions ----------------------------------------------------------------

    async def login(self, request: web.Request) -> web.Response:
        form = await self.auth.checked_post(request)
        if not self.auth.actions_on:
            raise Forbidden("actions are off (no web.token is configured)")
        if not self.auth.right_token(form.get("token", "")):
            log.warning("web: a sign-in with a wrong token", extra={"remote": request.remote})
            raise Forbidden("wrong token: not signed in (it is web.token in the config)")
        resp = web.HTTPSeeOther(back(request, form.get("next")))
        resp.set_cookie(
            AUTH_COOKIE,
            self.auth.new_session(),
            max_age=SESSION_TTL,
            httponly=True,
            samesite="Strict",
            path="/",
        )
        raise resp

    async def logout(self, request: web.Request) -> web.Response:
        await self.auth.checked_post(request)
        self.auth.end_session(request)
        resp = web.HTTPSeeOther("/")
        resp.del_cookie(AUTH_COOKIE, path="/")
        raise resp

    async def redrive(self, request: web.Request) -> web.Response:
        await self.auth.action(request)
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

    async def redrive_filtered(self, request: web.Request) -> web.Response:
        """Redrive what a dead-letter filter selects. The redrive runs in a transaction: it is
        rolled back unless the operator confirmed exactly the set it makes (its count, and a
        digest of its rows), so the first answer is a page that states that count and asks, and
        a set that changed meanwhile (even keeping its size), or a confirmed form sent again
        after its redrive, asks again."""
        form = await self.auth.action(request)
        f = self._dead_filter(lambda k: form.get(k, "").strip()[:MAX_PARAM] or None)
        since = self._since(f.since)
        actor = self._actor(request)
        done = False
        async with self.pool.connection() as conn:
            async with conn.transaction() as tx:
                got = await store.dlq_redrive(
                    conn,
                    all=True,
                    ids=[],
                    channel=f.channel,
                    source=f.source,
                    since=since,
                    reason_like=f"%{f.reason}%" if f.reason else None,
                    operator=actor,
                )
                ok = sorted(g.id for g in got if g.verdict == "ok")
                digest = hashlib.sha256(",".join(map(str, ok)).encode()).hexdigest()[:32]
                if form.get("confirm") != str(len(ok)) or form.get("digest") != digest:
                    raise psycopg.Rollback(tx)
                done = True
        n, left = len(ok), len(got) - len(ok)
        if not done:
            changed = "confirm" in form
            body = html.redrive_ask(self._ctx(request), f, n, left, digest, changed)
            return self._page(request, "Redrive dead letters", body, 409 if changed else 200)
        log.info(
            "web: bulk redrive (%s) by %s: %d redriven, %d left dead (reminder cancelled or moved)",
            f.said(),
            actor,
            n,
            left,
            extra={"actor": actor, "filter": f.said(), "redriven": n, "left": left},
        )
        query = {k: v for k, v in f.items().items() if v} | {"redriven": n, "left": left}
        raise web.HTTPSeeOther("/dead?" + urlencode(query))

    async def pause(self, request: web.Request) -> web.Response:
        form = await self.auth.action(request)
        name = self._channel_name(request)
        actor = self._actor(request)
        reason = form.get("reason", "").strip()[:200] or None
        async with self.pool.connection() as conn:
            await self._channel_known(conn, name)
            await store.channel_pause(conn, channel=name, reason=reason, actor=actor)
        log.info("web: paused channel %s", name, extra={"channel": name, "actor": actor})
        raise web.HTTPSeeOther("/")

    async def resume(self, request: web.Request) -> web.Response:
        await self.auth.action(request)
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


def _json_value(value: Any) -> str:
    """What json.dumps cannot write itself: an interval as PostgreSQL writes it, else text."""
    return interval_text(value) if isinstance(value, timedelta) else str(value)


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
