"""Sign-in and CSRF for the web page's actions: who may act, and whether a form is this page's.

An action needs the configured ``web.token``: signing in with it starts a session (a random id,
at most eight hours, in an HttpOnly, SameSite=Strict cookie) that this process keeps and sign-out
ends; nothing derived from the token alone is ever sent. Every form carries a CSRF token, this
process's MAC of the browser's CSRF cookie (a cookie planted from another port of the host has no
token that matches), and a POST from another origin is refused."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from urllib.parse import urlsplit

from aiohttp import web

CSRF_COOKIE = "pgwork_csrf"
#: A CSRF token made for this request (the browser had none): the response sets it as a cookie.
NEW_CSRF = web.RequestKey("pgwork_new_csrf", str)
AUTH_COOKIE = "pgwork_auth"
#: How long a sign-in lasts (seconds); sign-out, or a restart of the page, ends it sooner.
SESSION_TTL = 8 * 3600
#: Sign-ins kept at most (the oldest go first).
MAX_SESSIONS = 1000


class Forbidden(web.HTTPForbidden):
    """An action refused: the page says why, in its own markup (``app`` renders it)."""

    def __init__(self, why: str) -> None:
        super().__init__(text=f"pgwork: {why}")
        self.why = why


class Auth:
    def __init__(self, token: str | None) -> None:
        self.token = token
        # Sign-ins: a random id per browser (what the auth cookie holds) -> when it expires
        # (monotonic). Kept here, so each can end alone: sign-out revokes it, and a restart of
        # the page ends them all. Never the token, nor anything derived from it alone.
        self._sessions: dict[str, float] = {}
        self._csrf_key = secrets.token_bytes(32)

    @property
    def actions_on(self) -> bool:
        return self.token is not None

    def form_token(self, cookie: str) -> str:
        return hmac.new(self._csrf_key, cookie.encode(), hashlib.sha256).hexdigest()

    def csrf(self, request: web.Request) -> str:
        """The form token for this browser: a MAC of its CSRF cookie (a new cookie is set on the
        response when it has none)."""
        cookie = request.cookies.get(CSRF_COOKIE)
        if not cookie:
            cookie = request.get(NEW_CSRF) or secrets.token_urlsafe(32)
            request[NEW_CSRF] = cookie
        return self.form_token(cookie)

    @staticmethod
    def set_cookie(request: web.Request, resp: web.StreamResponse) -> None:
        """The CSRF cookie, on every response to a browser that has none."""
        if CSRF_COOKIE not in request.cookies:
            resp.set_cookie(
                CSRF_COOKIE,
                request.get(NEW_CSRF) or secrets.token_urlsafe(32),
                httponly=True,
                samesite="Strict",
                path="/",
            )

    def signed_in(self, request: web.Request) -> bool:
        if self.token is None:
            return False
        expires = self._sessions.get(request.cookies.get(AUTH_COOKIE, ""))
        return expires is not None and expires > time.monotonic()

    def right_token(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def new_session(self) -> str:
        now = time.monotonic()
        for sid in [k for k, t in self._sessions.items() if t <= now]:
            del self._sessions[sid]
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]  # the oldest
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = now + SESSION_TTL
        return sid

    def end_session(self, request: web.Request) -> None:
        self._sessions.pop(request.cookies.get(AUTH_COOKIE, ""), None)

    async def checked_post(self, request: web.Request) -> dict[str, str]:
        """The form of a POST, refused unless its CSRF token matches this browser's cookie and
        the request comes from this page (Origin, when the browser sends it)."""
        form = await request.post()
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = str(form.get("csrf", ""))
        if not cookie or not hmac.compare_digest(self.form_token(cookie), sent):
            raise Forbidden("the form's CSRF token does not match (reload the page)")
        # A browser sends Origin with every POST; "null" (an opaque origin: a sandboxed frame,
        # a data: URL) is another origin too. A client without one (curl) still needs the token.
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            raise Forbidden("a form from another origin")
        return {k: str(v) for k, v in form.items()}

    async def action(self, request: web.Request) -> dict[str, str]:
        """The form of an action: a checked POST by a signed-in operator."""
        form = await self.checked_post(request)
        if self.token is None:
            raise Forbidden("actions are off (no web.token is configured)")
        if not self.signed_in(request):
            raise Forbidden("sign in with web.token first")
        return form


def back(request: web.Request, given: str | None = None) -> str:
    """Where sign-in returns to: the page it came from on this host (the form's ``next``, else
    the Referer), never another site (both are the browser's word, and can name any)."""
    if given:
        ref = urlsplit(given)
        if not ref.scheme and not ref.netloc:
            return _local(ref.path, ref.query)
    ref = urlsplit(request.headers.get("Referer", ""))
    if ref.scheme not in ("http", "https") or ref.netloc != request.host:
        return "/"
    return _local(ref.path, ref.query)


def _local(path: str, query: str) -> str:
    path = path or "/"
    if not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path + (f"?{query}" if query else "")
