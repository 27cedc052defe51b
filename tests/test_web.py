"""`pgwork web`: the operator's page against a real database with rows in every state, loaded in
a real headless Chromium (DOM assertions, screenshots) and driven over real HTTP for the action
checks (token, CSRF)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import anyio
import psycopg
import pytest

from pgwork import db, web
from pgwork.clock import Clock
from pgwork.config import ChannelConfig
from pgwork.duties import materialise as materialiser
from pgwork.duties.trends import Trends
from pgwork.metrics import Metrics
from pgwork.supervise import Supervisor

from .browser import CHROMIUM, Browser
from .helpers import (
    add,
    add_in_an_unknown_zone,
    claim,
    config,
    count,
    materialise,
    rows,
    running,
    sync_queue,
    until,
    webhook_channel,
)
from .receiver import Answer, Receiver

pytestmark = [pytest.mark.anyio]

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium (Debian's `chromium`, installed by .ci/run as root)"
)

TOKEN = "a-test-token-0123456789"
XSS_KEY = "<script>window.__pwned=1</script>"
XSS_RECIPIENT = "<img src=x onerror=window.__pwned=2>"
XSS_PAYLOAD = '{"note": "</code><script>window.__pwned=3</script>"}'
#: Screenshots go here when set (docs/web for the committed ones); else to the test's tmp dir.
SHOTS = os.environ.get("PGWORK_WEB_SHOTS")


async def _seed(dsn: str, conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """Rows in every state: ready, claimed, delivered, dead (one with hostile text everywhere
    another app could write it), a paused channel and a throttled one."""
    ins = (
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, payload) "
        "VALUES (%s, %s, now() - interval '1 minute', %s, %s, %s::jsonb)"
    )
    for i in range(3):
        await conn.execute(ins, ("leases", f"lease:{i}", "hook", "ops@example.com", "{}"))
    for i in range(2):
        await conn.execute(ins, ("billing", f"invoice:{i}", "test", "bill@example.com", "{}"))
    await conn.execute(ins, ("leases", XSS_KEY, "hook", XSS_RECIPIENT, XSS_PAYLOAD))
    await conn.execute(ins, ("leases", "lease:sent", "hook", "ops@example.com", "{}"))
    await materialise(dsn)
    await claim(dsn, limit=1)  # one `test` row claimed
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), attempts = 5, "
        "lease = 5, dead_reason = 'permanent failure: HTTP 400 ' || business_key "
        "WHERE business_key IN (%s, 'lease:2')",
        (XSS_KEY,),
    )
    await sync_queue(conn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'delivered', finished_at = now(), attempts = 1, "
        "lease = 1 WHERE business_key = 'lease:sent'"
    )
    await sync_queue(conn)
    await conn.execute(
        "SELECT pgwork.pause_channel('test', '<b>maintenance</b> window', 'ops@example.com')"
    )
    await conn.execute(
        "UPDATE pgwork.channel SET not_before = now() + interval '1 hour', "
        "throttle_reason = 'HTTP 429 from the receiver' WHERE name = 'log'"
    )
    await conn.execute(
        "INSERT INTO pgwork.attempt (work_id, lease, attempt, daemon_id, host, pid, started_at, "
        "finished_at, outcome, http_status, error_class, error) "
        "SELECT id, 5, 5, 'host1:4242:ab12cd', 'host1', 4242, now() - interval '2 s', now(), "
        "'failed', 400, 'HTTP', 'HTTP 400: ' || business_key "
        "FROM pgwork.renewal_work WHERE status = 'dead'"
    )
    await conn.execute(
        "INSERT INTO pgwork.daemon (id, host, pid, version, listener_up, metrics_at) "
        "VALUES ('host1:4242:ab12cd', 'host1', 4242, '0.1.0', true, '127.0.0.1:9464')"
    )
    # Three hours of a daemon's trend on `hook`: a few failures, slower every thirteen minutes.
    await conn.execute(
        "INSERT INTO pgwork.channel_minute (channel, minute, written_by, delivered, failed, dead, "
        "took_sum, took_max) "
        "SELECT 'hook', date_trunc('minute', now()) - make_interval(mins => m), "
        "'host1:4242:ab12cd/1a2b3c', 20 + m % 7 * 3, (m % 11 = 0)::int * 4, (m % 33 = 0)::int, "
        "(20 + m % 7 * 3 + (m % 11 = 0)::int * 4) * (0.08 + m % 13 * 0.01), 0.3 + m % 17 * 0.05 "
        "FROM generate_series(0, 179) AS m"
    )
    got = await rows(conn, "SELECT business_key, id FROM pgwork.renewal_work")
    return {r["business_key"]: r["id"] for r in got}


@asynccontextmanager
async def _serving(dsn: str, *channels: ChannelConfig, **cfg: Any) -> AsyncIterator[str]:
    """The page on a free port, served by the code `pgwork web` runs; stopped on exit."""
    c = config(*channels, web_listen="127.0.0.1:0", **cfg)
    pool = db.make_pool(dsn, 2, 5.0)
    async with pool, anyio.create_task_group() as tg:
        at = await tg.start(web.serve, pool, c)
        try:
            yield f"http://{at}"
        finally:
            tg.cancel_scope.cancel()


@asynccontextmanager
async def _browser() -> AsyncIterator[Browser]:
    b = Browser()
    try:
        await b.open()
        yield b
    finally:
        await b.aclose()


def _shot(tmp_path: Path, name: str) -> Path:
    return (Path(SHOTS) if SHOTS else tmp_path) / f"{name}.png"


async def _no_script_ran(b: Browser) -> None:
    assert await b.eval("document.scripts.length") == 0
    assert await b.eval("document.images.length") == 0
    assert await b.eval("typeof window.__pwned") == "undefined"


@needs_chromium
async def test_every_page_shows_each_state_and_runs_no_injected_script(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    ids = await _seed(dsn, conn)
    async with _serving(dsn, web_token=TOKEN) as url, _browser() as b:
        await b.goto(url + "/")
        text = await b.text()
        assert "PAUSED" in text and "<b>maintenance</b> window" in text  # as text, not markup
        assert "THROTTLED" in text and "HTTP 429 from the receiver" in text
        assert re.search(r"hook\s+webhook\s+running\s+2\s+0\s+0\s+2", text), (
            text
        )  # ready, waiting, claimed, dead
        assert re.search(r"test\s+python\s+PAUSED.*\s+1\s+0\s+1\s+0", text), text
        # Every seeded row was due a minute ago: its source is late, with a work row.
        assert re.search(
            r"Late sources\s+source\s+lag s.*\s+leases\s+\d+\.\d\s+a work row", text
        ), text
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "overview"))

        await b.goto(url + "/channel/hook")
        text = await b.text()
        assert "lease:0" in text and "lease:1" in text and "lease:sent" not in text
        assert "Last 3 hours:" in text and "failed (6 dead)" in text, text
        assert await b.eval("document.querySelectorAll('svg g').length") == 2 * 180
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "channel"))
        await b.goto(url + "/channel/test?status=claimed")
        assert "claimed" in await b.text()

        await b.goto(url + "/dead")
        text = await b.text()
        assert XSS_KEY in text and "lease:2" in text  # the hostile key shown as text
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "dead-letters"))

        await b.goto(url + f"/work/{ids[XSS_KEY]}")
        text = await b.text()
        assert XSS_KEY in text and XSS_RECIPIENT in text and "window.__pwned=3" in text
        assert "permanent failure: HTTP 400" in text
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "work"))

        await b.goto(url + "/reminder?" + urlencode({"source": "leases", "key": XSS_KEY}))
        text = await b.text()
        assert XSS_RECIPIENT in text and "permanent failure: HTTP 400" in text, text
        assert "HTTP 400: " + XSS_KEY in text  # the attempt ledger, its error as text
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "reminder"))

        await b.goto(url + "/reminders?source=leases")
        text = await b.text()
        assert XSS_KEY in text and "lease:0" in text and "dead" in text, text
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "reminders"))

        await b.goto(url + "/channel/log")
        text = await b.text()
        assert "THROTTLED" in text and "HTTP 429 from the receiver" in text, text
        await _no_script_ran(b)
        await b.screenshot(_shot(tmp_path, "channel-state"))


@needs_chromium
async def test_a_redrive_through_the_page_needs_the_token(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    ids = await _seed(dsn, conn)
    dead = ids["lease:2"]
    redrive = f'form[action="/work/{dead}/redrive"]'
    async with _serving(dsn, web_token=TOKEN) as url, _browser() as b:
        await b.goto(url + f"/work/{dead}")
        assert await b.eval(f"document.querySelector('{redrive}') === null")  # signed out

        await b.eval(f"document.querySelector('input[name=token]').value = '{'x' * 23}'")
        await b.submit('form[action="/login"]')
        assert "wrong token" in await b.text()
        await b.goto(url + f"/work/{dead}")
        assert await b.eval(f"document.querySelector('{redrive}') === null")

        await b.eval(f"document.querySelector('input[name=token]').value = '{TOKEN}'")
        await b.submit('form[action="/login"]')
        await b.goto(url + f"/work/{dead}")
        await b.screenshot(_shot(tmp_path, "work-signed-in"))
        await b.submit(redrive)
        text = await b.text()
        assert re.search(r"status\s+ready", text), text
        assert "by web@127.0.0.1" in text
    got = await rows(
        conn, "SELECT status, redriven_by FROM pgwork.renewal_work WHERE id = %s", (dead,)
    )
    assert got == [{"status": "ready", "redriven_by": "web@127.0.0.1"}]


def _client() -> aiohttp.ClientSession:
    """A browser-like client: it keeps cookies, also for 127.0.0.1."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def _get(s: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with s.get(url) as r:
        return r.status, await r.text()


def _digest(html: str) -> str:
    m = re.search(r'name="digest" value="([0-9a-f]+)"', html)
    assert m, html
    return m.group(1)


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, html
    return m.group(1)


async def test_actions_are_refused_without_the_token_or_the_csrf_token(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    ids = await _seed(dsn, conn)
    dead = ids["lease:2"]
    async with _serving(dsn, web_token=TOKEN) as url:
        # A bare POST, as a forged form from another site would be (no cookies).
        async with aiohttp.ClientSession() as s, s.post(f"{url}/work/{dead}/redrive") as r:
            assert r.status == 403 and "CSRF" in await r.text()
        async with _client() as s:
            _, html = await _get(s, url + "/")
            csrf = _csrf(html)
            # A valid CSRF token, not signed in.
            async with s.post(f"{url}/work/{dead}/redrive", data={"csrf": csrf}) as r:
                assert r.status == 403 and "sign in" in await r.text()
            async with s.post(f"{url}/login", data={"csrf": csrf, "token": TOKEN}) as r:
                assert r.status == 200  # redirected to the overview
            # Signed in, but the form's CSRF token is not this browser's.
            async with s.post(f"{url}/work/{dead}/redrive", data={"csrf": "forged"}) as r:
                assert r.status == 403
            # Another origin's form, with the right tokens.
            async with s.post(
                f"{url}/work/{dead}/redrive",
                data={"csrf": csrf},
                headers={"Origin": "http://evil.example"},
            ) as r:
                assert r.status == 403 and "origin" in await r.text()
            async with s.get(f"{url}/work/{dead}/redrive") as r:
                assert r.status == 405  # POST only
            assert (
                await rows(conn, "SELECT status FROM pgwork.renewal_work WHERE id = %s", (dead,))
            )[0]["status"] == "dead"

            # Pause and resume, recorded like the CLI's: who and when.
            async with s.post(
                f"{url}/channel/hook/pause", data={"csrf": csrf, "reason": "receiver migration"}
            ) as r:
                assert r.status == 200
            got = await rows(
                conn,
                "SELECT paused, paused_by, paused_reason, paused_at > now() - interval '1 minute' "
                "AS recent FROM pgwork.channel WHERE name = 'hook'",
            )
            assert got == [
                {
                    "paused": True,
                    "paused_by": "web@127.0.0.1",
                    "paused_reason": "receiver migration",
                    "recent": True,
                }
            ]
            async with s.post(f"{url}/channel/hook/resume", data={"csrf": csrf}) as r:
                assert r.status == 200
            async with s.post(f"{url}/channel/nope/pause", data={"csrf": csrf}) as r:
                assert r.status == 404
    assert (await rows(conn, "SELECT paused FROM pgwork.channel WHERE name = 'hook'"))[0] == {
        "paused": False
    }


async def test_without_a_token_the_page_is_read_only(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    ids = await _seed(dsn, conn)
    async with _serving(dsn) as url, _client() as s:
        status, html = await _get(s, f"{url}/work/{ids['lease:2']}")
        assert status == 200 and "actions off" in html and 'action="/login"' not in html
        csrf = _csrf(html) if 'name="csrf"' in html else ""
        async with s.post(f"{url}/login", data={"csrf": csrf, "token": TOKEN}) as r:
            assert r.status == 403


async def test_pages_are_keyset_paged_and_follow_log_redact(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT 's' || (g % 3), 'key:' || g, now() - interval '1 minute', 'hook', 'r' "
        "FROM generate_series(1, 120) g"
    )
    await materialise(dsn)
    seen: list[str] = []
    async with _serving(dsn, log_redact="hash") as url, _client() as s:
        next_url: str | None = f"{url}/channel/hook"
        pages = 0
        while next_url:
            status, html = await _get(s, next_url)
            assert status == 200
            pages += 1
            seen += re.findall(r"h:[0-9a-f]{16}", html)
            assert "key:" not in html  # business keys hashed, as log.redact = hash says
            m = re.search(r'<a href="([^"]+)">next page', html)
            next_url = url + m.group(1).replace("&amp;", "&") if m else None
        status, html = await _get(s, f"{url}/channel/hook?after_id=1&after_at=yesterday")
        assert status == 400
    assert pages == 3 and len(seen) == 120 and len(set(seen)) == 120


async def test_the_reminder_page_answers_json_redacted_and_404_for_an_unknown_one(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """What happened to one reminder, as JSON for scripts: redacted as log.redact says."""
    ids = await _seed(dsn, conn)
    async with _serving(dsn, log_redact="drop") as url, _client() as s:
        q = urlencode({"source": "leases", "key": "lease:2", "format": "json"})
        async with s.get(f"{url}/reminder?{q}") as r:
            assert r.status == 200 and r.content_type == "application/json"
            doc = await r.json()
        (occ,) = doc["occurrences"]
        assert occ["id"] == ids["lease:2"] and occ["state"] == "dead"
        assert occ["attempts_ledger"][0]["http_status"] == 400
        assert doc["reminder"]["recipient"] == "(redacted)" and doc["business_key"] == "(redacted)"
        q = urlencode({"source": "leases", "key": "nosuch", "format": "json"})
        async with s.get(f"{url}/reminder?{q}") as r:
            assert r.status == 404
        status, html = await _get(s, f"{url}/reminder?source=leases&key=nosuch")
        assert status == 404 and "No such reminder" in html
        status, html = await _get(s, f"{url}/reminder")
        assert status == 200 and 'name="key"' in html  # the search form


async def test_the_daemon_serves_the_page_when_web_enabled(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await _seed(dsn, conn)
    cfg = config(web_enabled=True, web_listen="127.0.0.1:0")
    async with running(cfg, dsn) as d, _client() as s:
        assert d.web_at is not None
        status, html = await _get(s, f"http://{d.web_at}/")
        assert status == 200 and 'href="/channel/hook"' in html
        assert d.daemon_id in html  # the daemon itself, listed as running


def test_pgwork_web_serves_until_sigterm(dsn: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PGWORK_"))}
    p = subprocess.Popen(
        [sys.executable, "-m", "pgwork", "web", "--listen", f"127.0.0.1:{port}"],
        env={**env, "PGWORK_DSN": dsn, "PGWORK_WEB_TOKEN": TOKEN},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        while line and "pgwork web on" not in line:
            line = p.stderr.readline()
        assert f"pgwork web on http://127.0.0.1:{port}/ (actions need web.token)" in line, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.status == 200 and b"Overview" in r.read()
            assert "script-src" not in r.headers["Content-Security-Policy"]
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(15) == 0
        if p.stderr is not None:
            p.stderr.close()


# -- issue 25, item 10: odd input, sign-in, CSRF ---------------------------------------------


async def test_odd_input_gets_a_400_naming_the_parameter_with_the_security_headers(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """NUL bytes in names, filters and cursors, and ids beyond bigint, once got a 500 without
    the security headers."""
    big = "99999999999999999999"
    at = "2026-01-01T00:00:00%2B00:00"
    probes = {
        "/channel/a%00b": "name",
        "/dead?channel=a%00b": "channel",
        "/dead?source=%00": "source",
        "/dead?reason=x%00": "reason",
        f"/dead?before_at={at}&before_id={big}": "before_id",
        f"/dead?before_at={at}&before_id=%C2%B2": "before_id",  # a digit to isdigit(), not to int()
        f"/channel/hook?after_source=x&after_at={at}&after_id={big}": "after_id",
        f"/channel/hook?after_source=%00&after_at={at}&after_id=1": "after_source",
        "/channel/hook?status=%00": "status",
    }
    async with _serving(dsn, web_token=TOKEN) as url, aiohttp.ClientSession() as s:
        for path, param in probes.items():
            async with s.get(url + path) as r:
                body = await r.text()
                assert r.status == 400, (path, r.status, body)
                assert param in body, (path, body)
                assert "Content-Security-Policy" in r.headers, path
                assert r.headers["X-Content-Type-Options"] == "nosniff", path
        async with s.get(url + "/no/such/page") as r:
            assert r.status == 404 and "Content-Security-Policy" in r.headers
        # A channel nobody registered: a 404 that says so (it was a 200 with an empty table).
        async with s.get(url + "/channel/nosuch") as r:
            body = await r.text()
            assert r.status == 404 and "no channel 'nosuch'" in body, (r.status, body)
            assert "Content-Security-Policy" in r.headers


async def _signed_in(s: aiohttp.ClientSession, url: str, **headers: str) -> tuple[str, Any]:
    _, html = await _get(s, url + "/")
    csrf = _csrf(html)
    async with s.post(
        f"{url}/login", data={"csrf": csrf, "token": TOKEN}, headers=headers, allow_redirects=False
    ) as r:
        assert r.status == 303, await r.text()
        return csrf, r


async def test_sign_in_never_redirects_to_another_site(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        _, r = await _signed_in(s, url, Referer="http://evil.example/phish")
        assert r.headers["Location"] == "/"
        _, r = await _signed_in(s, url, Referer="//evil.example/phish")
        assert r.headers["Location"] == "/"
        _, r = await _signed_in(s, url, Referer=f"{url}/dead?channel=hook")
        assert r.headers["Location"] == "/dead?channel=hook"


async def test_sign_in_comes_back_to_its_page_and_a_wrong_token_gets_a_page(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 11: signing in from a page came back to the overview (a browser that sent
    no Referer), and a wrong token was a bare text 403. The sign-in form says where it was (its
    own ``next``, this host's only), and a refusal is a page that says why, with the form."""
    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        _, page = await _get(s, f"{url}/dead?channel=hook")
        assert 'name="next" value="/dead?channel=hook"' in page, page
        form = {"csrf": _csrf(page), "token": TOKEN}
        for nxt, back in (
            ("/dead?channel=hook", "/dead?channel=hook"),
            ("http://evil.example/phish", "/"),
            ("//evil.example/phish", "/"),
        ):
            async with s.post(
                f"{url}/login", data={**form, "next": nxt}, allow_redirects=False
            ) as r:
                assert r.status == 303 and r.headers["Location"] == back, (nxt, r.headers)
    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        _, page = await _get(s, f"{url}/")
        async with s.post(
            f"{url}/login", data={"csrf": _csrf(page), "token": "wrong", "next": "/"}
        ) as r:
            said = await r.text()
            assert r.status == 403 and r.content_type == "text/html", said
        assert "wrong token: not signed in" in said and 'action="/login"' in said, said


async def test_a_sign_in_expires_and_sign_out_revokes_it(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    ids = await _seed(dsn, conn)
    dead = ids["lease:2"]
    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        csrf, r = await _signed_in(s, url)
        cookie = r.cookies[web.auth.AUTH_COOKIE]
        assert 0 < int(cookie["max-age"]) <= 24 * 3600  # it expires
        stolen = cookie.value
        async with s.post(f"{url}/logout", data={"csrf": csrf}) as r:
            assert r.status == 200
        # The old cookie (copied before the sign-out) no longer signs anyone in.
        s.cookie_jar.update_cookies({web.auth.AUTH_COOKIE: stolen})
        async with s.post(f"{url}/work/{dead}/redrive", data={"csrf": csrf}) as r:
            assert r.status == 403 and "sign in" in await r.text()
        # Nor does another browser's sign-in: each is its own.
        async with _client() as other:
            await _signed_in(other, url)
        async with s.post(f"{url}/work/{dead}/redrive", data={"csrf": csrf}) as r:
            assert r.status == 403


async def test_a_csrf_cookie_planted_from_another_port_or_a_null_origin_is_refused(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Cookies are not port-scoped: another service on the same host can set pgwork_csrf. A form
    token equal to a cookie the attacker chose must not pass; nor may a form from an opaque
    origin (Origin: null)."""
    ids = await _seed(dsn, conn)
    dead = ids["lease:2"]
    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        csrf, _ = await _signed_in(s, url)
        async with s.post(
            f"{url}/work/{dead}/redrive", data={"csrf": csrf}, headers={"Origin": "null"}
        ) as r:
            assert r.status == 403
        s.cookie_jar.update_cookies({web.auth.CSRF_COOKIE: "planted-by-another-port"})
        async with s.post(
            f"{url}/work/{dead}/redrive", data={"csrf": "planted-by-another-port"}
        ) as r:
            assert r.status == 403
    got = await rows(conn, "SELECT status FROM pgwork.renewal_work WHERE id = %s", (dead,))
    assert got == [{"status": "dead"}]


async def test_a_reminder_set_aside_for_an_unknown_zone_has_a_page_that_says_why(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Written around the triggers in a zone the server does not know, the reminder the
    materialiser sets aside answered 500 with a traceback in the log; its page now shows it as
    stored and why its next sends cannot be worked out."""
    await add_in_an_unknown_zone(conn)
    async with _serving(dsn) as url, _client() as s:
        status, html = await _get(s, f"{url}/reminder?source=mars&key=base:1")
        assert status == 200, html
        assert "cannot be worked out" in html and "Mars/Olympus" in html
        assert "Set aside" not in html  # no daemon has tried it yet
        # A daemon's pass fails on it and sets it aside: the overview lists it, its page says so.
        async with await db.connect(dsn) as c:
            res = await materialiser.run_once(
                c, lookahead=0, page_size=10, aside=materialiser.SetAside(), origin="d-web"
            )
            assert res is not None and res.set_aside == 1
        status, html = await _get(s, f"{url}/")
        assert status == 200 and "Set aside" in html and "base:1" in html, html
        assert "Mars/Olympus" in html
        status, html = await _get(s, f"{url}/reminder?source=mars&key=base:1")
        assert "set aside by d-web" in html, html
        async with s.get(f"{url}/reminder?source=mars&key=base:1&format=json") as r:
            assert r.status == 200
            doc = await r.json()
    assert 'time zone "Mars/Olympus"' in doc["upcoming_error"]
    assert doc["set_aside"]["daemon_id"] == "d-web" and doc["set_aside"]["tries"] == 1


async def test_a_reminder_page_names_the_lock_holder_and_a_row_past_expire_after(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The page said nothing of the two waits `pgwork reminder` now explains: a due reminder
    whose row an app's open transaction holds (the materialiser skips it) and a ready row past
    its channel's `expire_after` (closed unsent at its next claim)."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) VALUES "
        "('s', 'stale', now() - interval '2 hours', 'log', 'r'), "
        "('s', 'held', now() - interval '1 minute', 'log', 'r')"
    )
    await materialise(dsn, lookahead=0)
    log = ChannelConfig(name="log", kind="log", expire_after=3600.0)
    app = await psycopg.AsyncConnection.connect(dsn, application_name="billing-app")
    try:
        await app.execute("BEGIN")
        await app.execute("SELECT 1 FROM pgwork.reminder WHERE business_key = 'held' FOR UPDATE")
        async with _serving(dsn, log) as url, _client() as s:
            _, html = await _get(s, f"{url}/reminder?source=s&key=stale")
            assert "past its channel&#x27;s expire_after (1h)" in html, html
            _, html = await _get(s, f"{url}/reminder?source=s&key=held")
            assert f"row locked by pid {app.info.backend_pid}" in html, html
            assert "billing-app" in html, html
            async with s.get(f"{url}/reminder?source=s&key=held&format=json") as r:
                doc = await r.json()
        assert [h["pid"] for h in doc["locked_by"]] == [app.info.backend_pid], doc
    finally:
        await app.close()


async def test_the_reminder_page_writes_intervals_as_postgresql_does(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Its HTML and JSON wrote intervals as Python does (`7 days, 0:00:00`)."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, remind_before, channel, "
        "recipient) VALUES ('s', 'k', now() + interval '30 days', '{7 days, 0}', 'log', 'r')"
    )
    async with _serving(dsn) as url, _client() as s:
        status, html = await _get(s, f"{url}/reminder?source=s&key=k")
        async with s.get(f"{url}/reminder?source=s&key=k&format=json") as r:
            doc = await r.json()
    assert status == 200 and "7 days, 00:00:00" in html and "0:00:00," not in html
    assert doc["reminder"]["remind_before"] == ["7 days", "00:00:00"]


async def test_the_reminder_page_names_its_deadline_and_heads_only_what_it_shows(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A series' page said "Next deadline (a one-off's only one)", and a page with no work
    row left (retention took them) still had a "Work rows" heading over nothing."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, recur, channel, "
        "recipient) VALUES ('s', 'rent', (now() AT TIME ZONE 'UTC')::date + 1 + time '09:00', "
        "'UTC', 'FREQ=DAILY', 'log', 'r')"
    )
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES ('s', 'once', now() + interval '1 day', 'log', 'r')"
    )
    async with _serving(dsn) as url, _client() as s:
        _, rent = await _get(s, f"{url}/reminder?source=s&key=rent")
        _, once = await _get(s, f"{url}/reminder?source=s&key=once")
    assert "Next deadline of the series" in rent and "only one" not in rent, rent
    assert "Its deadline" in once and "Work rows" not in once, once


# -- issue 55: the page as a tool --------------------------------------------------------------


async def test_reminders_are_found_by_source_and_key_prefix_a_page_at_a_time(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The page could show one reminder whose source and whole key the operator already knew.
    `/reminders` lists a source's reminders, by a key prefix if given, one keyset page at a
    time (the source's key index), each linked to its page and with its latest work row."""
    ins = (
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "SELECT %s, format(%s, i), now() + interval '1 day', 'log', 'r' FROM generate_series(1, %s) i"
    )
    await conn.execute(ins, ("acme", "lease:%s", 60))
    await conn.execute(ins, ("acme", "invoice:%s", 3))
    await conn.execute(ins, ("other", "lease:%s", 2))
    await conn.execute(
        "UPDATE pgwork.reminder SET due_at = now() - interval '1 minute' "
        "WHERE source = 'acme' AND business_key = 'lease:1'"
    )
    await materialise(dsn)
    async with _serving(dsn) as url, _client() as s:
        status, html = await _get(s, f"{url}/")
        assert 'href="/reminders"' in html  # in the header of every page
        status, html = await _get(s, f"{url}/reminders?source=acme&prefix=lease:")
        assert status == 200, html
        keys = re.findall(r'href="/reminder\?source=acme&amp;key=([^"]+)"', html)
        assert len(keys) == 50 and all(k.startswith("lease%3A") for k in keys), keys
        assert "invoice" not in html and "other" not in keys
        assert ">ready<" in html  # lease:1's work row
        nxt = re.search(r'href="(/reminders\?[^"]+)">next page', html)
        assert nxt, html
        status, html = await _get(s, url + nxt.group(1).replace("&amp;", "&"))
        more = re.findall(r'href="/reminder\?source=acme&amp;key=([^"]+)"', html)
        assert len(more) == 10 and not set(more) & set(keys), more
        assert "next page" not in html
        _, html = await _get(s, f"{url}/reminders?source=acme")
        assert "invoice:1" in html  # a source's list without a prefix
        status, html = await _get(s, f"{url}/reminders?source=nosuch")
        assert status == 200 and "No reminders" in html


async def test_the_retrying_view_and_the_channel_page_say_what_waits_and_why(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Rows waiting for a retry were only in `pgwork dlq retrying`, and a channel's page listed
    rows without the channel's own state. `/retrying` lists them, the soonest first, with the
    last error; the channel page says PAUSED (why, by whom, since when) and offers resume to a
    signed-in operator; the overview refreshes itself and says how long ago things happened."""
    for key in ("again", "fresh"):
        await add(conn, key)
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET attempts = 2, lease = 2, available_at = now() + interval '10 minutes', "
        "last_error = 'HTTP 503 from the receiver' WHERE business_key = 'again'"
    )
    await sync_queue(conn)
    await conn.execute(
        "SELECT pgwork.pause_channel('test', 'receiver migration', 'ops@example.com')"
    )
    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        status, html = await _get(s, f"{url}/retrying")
        assert status == 200 and "HTTP 503 from the receiver" in html, html
        assert "again" in html and "fresh" not in html
        _, html = await _get(s, f"{url}/retrying?channel=log")
        assert "again" not in html
        _, html = await _get(s, f"{url}/channel/test")
        assert "PAUSED" in html and "receiver migration" in html and "ops@example.com" in html
        assert re.search(r'since <time datetime="\d{4}-\d\d-\d\d[^>]*>\d+ \w+ ago<', html), html
        assert "/channel/test/resume" not in html  # signed out: no action
        await _signed_in(s, url)
        _, html = await _get(s, f"{url}/channel/test")
        assert 'action="/channel/test/resume"' in html, html
        _, html = await _get(s, f"{url}/")
        assert '<meta http-equiv="refresh" content="15">' in html
        _, html = await _get(s, f"{url}/?refresh=0")
        assert 'http-equiv="refresh"' not in html


async def test_a_filtered_bulk_redrive_asks_first_and_leaves_an_audit_line(
    dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Dead letters could be redriven one at a time only. What the dead-letter filter selects
    (channel, source, reason, dead within) is redriven at once after a confirmation that
    states the count; a count that changed meanwhile is asked again, and the redrive is a log
    line naming who and what."""
    for key, channel in (("a", "test"), ("b", "test"), ("c", "test"), ("d", "log")):
        await add(conn, key, channel=channel)
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), attempts = 5, "
        "lease = 5, dead_reason = CASE business_key WHEN 'c' THEN 'HTTP 500 boom' "
        "ELSE 'permanent failure: HTTP 400' END"
    )
    await sync_queue(conn)

    async def statuses() -> dict[str, str]:
        got = await rows(conn, "SELECT business_key, status FROM pgwork.renewal_work")
        return {r["business_key"]: r["status"] for r in got}

    async with _serving(dsn, web_token=TOKEN) as url, _client() as s:
        _, html = await _get(s, f"{url}/dead?channel=test&reason=HTTP+400")
        assert 'action="/dead/redrive"' not in html  # signed out
        csrf, _ = await _signed_in(s, url)
        _, html = await _get(s, f"{url}/dead?channel=test&reason=HTTP+400")
        assert 'action="/dead/redrive"' in html, html
        form = {"csrf": csrf, "channel": "test", "source": "", "reason": "HTTP 400", "since": ""}
        async with s.post(f"{url}/dead/redrive", data=form) as r:
            html = await r.text()
            assert r.status == 200 and "2 dead letters match" in html, html
            assert 'name="confirm" value="2"' in html
        asked = {**form, "confirm": "2", "digest": _digest(html)}
        assert set((await statuses()).values()) == {"dead"}  # nothing before the confirmation
        async with s.post(f"{url}/dead/redrive", data={**asked, "confirm": "5"}) as r:
            assert r.status == 409 and "2 dead letters match" in await r.text()
        # Issue 68, item 12: another set of the same size was redriven without asking again.
        await conn.execute(
            "UPDATE pgwork.renewal_work SET dead_reason = CASE business_key WHEN 'b' "
            "THEN 'HTTP 500 boom' WHEN 'c' THEN 'permanent failure: HTTP 400' "
            "ELSE dead_reason END"
        )
        async with s.post(f"{url}/dead/redrive", data=asked) as r:
            html = await r.text()
            assert r.status == 409 and "changed since you were asked" in html, html
        assert set((await statuses()).values()) == {"dead"}
        asked["digest"] = _digest(html)
        with caplog.at_level("INFO", logger="pgwork"):
            async with s.post(f"{url}/dead/redrive", data=asked, allow_redirects=False) as r:
                assert r.status == 303, await r.text()
                done = r.headers["Location"]
        # Issue 68, item 8: it comes back to the list saying what it did.
        _, html = await _get(s, url + done)
        assert "2 dead letters redriven" in html, html
        # ... and the same confirmed form, sent again, asks again (nothing matches now).
        async with s.post(f"{url}/dead/redrive", data=asked) as r:
            assert r.status == 409 and "0 dead letters match" in await r.text()
    assert await statuses() == {"a": "ready", "b": "dead", "c": "ready", "d": "dead"}
    (line,) = [r for r in caplog.records if "bulk redrive" in r.getMessage()]
    assert "2 redriven" in line.getMessage() and line.__dict__["actor"] == "web@127.0.0.1"
    got = await rows(
        conn, "SELECT DISTINCT redriven_by FROM pgwork.renewal_work WHERE status = 'ready'"
    )
    assert got == [{"redriven_by": "web@127.0.0.1"}]


async def test_a_rows_page_shows_each_answer_beside_the_request_that_got_it(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The ledger on a row's page had the HTTP status and error, not what a receiver answered
    a delivery with (its receipt, kept in the ledger) nor what the request carried. The page now
    shows each attempt's answer (a bounded excerpt) and the request as the channel sends it: its
    URL, its idempotency headers with this row's values, and the configured headers by name
    only (their values can be secrets)."""
    answers = iter([Answer(status=503, body=b"down"), Answer(body=b'{"ticket": "T-4711"}')])
    with Receiver(lambda r: next(answers)) as receiver:
        hook = webhook_channel(
            receiver.url,
            headers={"Authorization": "Bearer s3cr3t"},
            signing_secrets=("whsec_" + "A" * 40,),
        )
        await add(conn, "lease:9", channel="hook")
        async with running(config(hook), dsn):

            async def delivered() -> bool:
                return await count(conn, "status = 'delivered'") == 1

            await until(delivered, what="the retried delivery")
    (row,) = await rows(conn, "SELECT id, operation_id FROM pgwork.renewal_work")
    async with _serving(dsn, hook) as url, _client() as s:
        _, html = await _get(s, f"{url}/work/{row['id']}")
    assert "T-4711" in html, html  # the delivery's answer
    assert "503" in html and "down" in html, html  # the failed attempt's
    assert f"POST {receiver.url}" in html, html
    assert f"Idempotency-Key: {row['operation_id']}" in html, html
    assert "webhook-signature" in html and "Authorization: (configured)" in html, html
    assert "s3cr3t" not in html


async def test_a_channels_page_draws_its_trend_from_what_its_daemons_recorded(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel's page showed its rows and state, not how its sends went over the last hours.
    Each daemon now counts the outcomes it made durable per channel and minute, and the page
    draws the last hours from them: deliveries and failures per minute, and how long an attempt
    took. The counts equal the ledger's, over two runs of a daemon with the same configured id
    (a restart's minutes add to the first run's, they do not replace them)."""
    monkeypatch.setattr(Trends, "EVERY", 0.2)
    with Receiver(lambda r: Answer(status=400 if b"bad:" in r.raw else 200)) as receiver:
        hook = webhook_channel(receiver.url)
        for run, keys in enumerate((("ok:1", "ok:2", "bad:1"), ("ok:3", "bad:2"))):
            for key in keys:
                await add(conn, key, channel="hook", payload=f'{{"key": "{key}"}}')
            async with running(config(hook, daemon_id="the-daemon"), dsn):

                async def finished(n: int = 3 + 2 * run) -> bool:
                    return await count(conn, "finished_at IS NOT NULL") == n

                await until(finished, what="every row delivered or dead")
    ledger = await rows(
        conn,
        "SELECT count(*) FILTER (WHERE outcome = 'delivered') AS delivered, "
        "count(*) FILTER (WHERE outcome <> 'delivered') AS failed FROM pgwork.attempt",
    )
    assert ledger == [{"delivered": 3, "failed": 2}]
    (written,) = await rows(
        conn,
        "SELECT sum(delivered)::int AS delivered, sum(failed)::int AS failed, sum(dead)::int "
        "AS dead, count(DISTINCT written_by)::int AS writers, bool_and(took_max > 0) AS timed "
        "FROM pgwork.channel_minute WHERE channel = 'hook'",
    )
    assert written == {"delivered": 3, "failed": 2, "dead": 2, "writers": 2, "timed": True}
    async with _serving(dsn, hook) as url, _client() as s:
        status, html = await _get(s, f"{url}/channel/hook")
        assert status == 200
        assert "Last 3 hours: <b>3</b> delivered" in html, html
        assert "2 failed</span> (2 dead)" in html, html
        # Each bar's numbers are its tooltip: together they are the window's.
        tips = re.findall(r"<title>\d\d:\d\d: (\d+) delivered, (\d+) failed", html)
        assert tips and sum(int(d) for d, _ in tips) == 3 and sum(int(f) for _, f in tips) == 2
        assert re.search(r"<title>\d\d:\d\d: \d+ ms on average, \d+ ms at most</title>", html)
        assert _link_to(html, "/channel/hook?hours=48")
        _, html = await _get(s, f"{url}/channel/hook?hours=48")
        assert "Last 48 hours" in html and "a bar is 16 minutes" in html, html
        _, html = await _get(s, f"{url}/channel/hook?hours=7")  # not offered: the default
        assert "Last 3 hours" in html
        _, html = await _get(s, f"{url}/channel/test")
        assert "No attempts recorded in the last 3 hours" in html, html


def _link_to(html: str, href: str) -> bool:
    return f'href="{href}"' in html


async def test_trend_minutes_older_than_two_days_are_pruned_in_batches(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """The daemons keep two days of trend: older minutes go, a batch at a time, and a full
    batch is followed by another pass at once; recent minutes stay."""
    await conn.execute(
        "INSERT INTO pgwork.channel_minute (channel, minute, written_by, delivered) "
        "SELECT 'hook', date_trunc('minute', now()) - make_interval(mins => m), 'd/1', 1 "
        "FROM generate_series(0, 3000) AS m"
    )
    pool = db.make_pool(dsn, 1, 5.0)
    async with pool:
        trends = Trends(pool, Supervisor(Metrics()), "d", Clock())
        trends.PRUNE_BATCH = 50
        trends._prune_at = 0.0
        await trends.step()
        assert trends._prune_at == 0.0  # a full batch: more to prune at the next pass
        while trends._prune_at == 0.0:
            await trends.step()
    (left,) = await rows(
        conn,
        "SELECT count(*)::int AS n, min(minute) > now() - interval '48 hours 1 minute' AS recent "
        "FROM pgwork.channel_minute",
    )
    assert left == {"n": 48 * 60, "recent": True}


async def test_an_outcome_counted_while_its_minute_is_written_is_written_next_time(
    dsn: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer forgot what changed after each write, including what was counted while the
    write was in flight: that outcome's minute, once past, was never written again. What is
    counted during a write is written by the next."""
    from pgwork import store
    from pgwork.duties.outcomes import Record

    def record(i: int) -> Record:
        return Record(i, 1, 1, "hook", "delivered", "delivered", None, 0.0, 0.01)

    pool = db.make_pool(dsn, 1, 5.0)
    async with pool:
        trends = Trends(pool, Supervisor(Metrics()), "d", Clock())
        real = store.trend_write

        async def meanwhile(conn: Any, **kw: Any) -> None:
            await real(conn, **kw)
            trends.count([record(2)], set())  # recorded while the write was under way

        async def refused(conn: Any, **kw: Any) -> None:
            raise psycopg.OperationalError("the server went away")

        trends.count([record(1)], set())
        monkeypatch.setattr(store, "trend_write", meanwhile)
        await trends.write()
        monkeypatch.setattr(store, "trend_write", real)
        await trends.write()
        # A write that fails keeps what it was to write for the next.
        trends.count([record(3)], set())
        monkeypatch.setattr(store, "trend_write", refused)
        with pytest.raises(psycopg.OperationalError):
            await trends.write()
        monkeypatch.setattr(store, "trend_write", real)
        await trends.write()
    (got,) = await rows(conn, "SELECT sum(delivered)::int AS n FROM pgwork.channel_minute")
    assert got == {"n": 3}


#: A payload whose number is not a Python float's (issue 68, item 3), as jsonb writes it.
EXACT = '{"n": 0.1000000000000000055511151231257827, "ok": true}'


async def test_a_payload_is_shown_as_stored_by_every_command_and_page(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 3: a payload stored and delivered verbatim was shown rounded or as
    Python: `dlq show` printed {'n': 0.1, 'ok': True}, its --json and the web page 0.1. Every
    view now shows the stored JSON text, byte for byte."""
    import json

    from .test_cli import pgwork

    await add(conn, "exact", "now() - interval '1 minute'", payload=EXACT)
    await materialise(dsn)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), dead_reason = 'x'"
    )
    await sync_queue(conn)
    (w,) = await rows(conn, "SELECT id FROM pgwork.renewal_work")
    shown = await anyio.to_thread.run_sync(lambda: pgwork("dlq", "show", str(w["id"]), dsn=dsn))
    assert f"payload: {EXACT}" in shown.stdout, shown.stdout
    as_json = await anyio.to_thread.run_sync(
        lambda: pgwork("dlq", "show", str(w["id"]), "--json", dsn=dsn)
    )
    assert f'"payload": {EXACT}' in as_json.stdout, as_json.stdout
    assert json.loads(as_json.stdout)["work"]["payload"] == json.loads(EXACT)
    reminder = await anyio.to_thread.run_sync(
        lambda: pgwork("reminder", "test", "exact", "--json", dsn=dsn)
    )
    assert f'"payload": {EXACT}' in reminder.stdout, reminder.stdout
    async with _serving(dsn) as url, _client() as s:
        _, page = await _get(s, f"{url}/work/{w['id']}")
        query = {"source": "test", "key": "exact"}
        _, html = await _get(s, f"{url}/reminder?" + urlencode(query))
        _, doc = await _get(s, f"{url}/reminder?" + urlencode({**query, "format": "json"}))
    assert EXACT.replace('"', "&quot;") in page, page
    assert EXACT.replace('"', "&quot;") in html, html
    assert f'"payload": {EXACT}' in doc, doc


async def test_the_pages_name_each_rows_state_and_say_when_a_list_is_empty(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, items 4, 5, 7 and 8, over HTTP (tests/test_web_views.py has each alone): the
    overview's "waiting" linked to the ready list and the channel page called a row not yet due
    "ready"; a redriven dead letter's attempts read 1 here and 2 in `dlq list`; a paused
    channel's retry read "next try … ago"; an empty list was a table of headings alone."""
    await add(conn, "later", "now() + interval '1 hour'")
    await add(conn, "failed", "now() - interval '1 minute'")
    await add(conn, "twice", "now() - interval '1 minute'", channel="log")
    await materialise(dsn, lookahead=3600)
    await conn.execute(
        "UPDATE pgwork.renewal_work SET attempts = 1, lease = 1, last_error = 'HTTP 500', "
        "available_at = now() - interval '35 seconds' WHERE business_key = 'failed'"
    )
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), dead_reason = 'x', "
        "attempts = 2, lease = 2, attempts_base = 1, redriven_at = now() "
        "WHERE business_key = 'twice'"
    )
    await sync_queue(conn)
    await conn.execute("UPDATE pgwork.work_ready SET available_at = now() - interval '35 seconds' "
                       "WHERE work_id = (SELECT id FROM pgwork.renewal_work "
                       "WHERE business_key = 'failed')")  # fmt: skip
    await conn.execute("SELECT pgwork.pause_channel('test', 'receiver upgrade', 'ops')")
    async with _serving(dsn) as url, _client() as s:
        _, overview = await _get(s, f"{url}/?refresh=0")
        _, channel = await _get(s, f"{url}/channel/test")
        _, retrying = await _get(s, f"{url}/retrying")
        _, dead = await _get(s, f"{url}/dead")
        _, none = await _get(s, f"{url}/dead?source=nosuch")
        _, quiet = await _get(s, f"{url}/retrying?channel=log")
    assert 'href="/channel/test?status=waiting">1</a>' in overview, overview
    assert "ready, not yet due" in channel, channel
    assert "PAUSED" in retrying and "receiver upgrade" in retrying and " ago)" not in retrying
    assert "2 (1 toward max_attempts)" in dead, dead
    assert "No dead letters match." in none and "<tbody></tbody>" not in none
    assert "Nothing waits for a retry on log." in quiet and "<tbody></tbody>" not in quiet
