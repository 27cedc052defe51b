"""The web page's views and their markup, against a real database, without a browser: each page's
rows as an operator reads them (pgwork/web/views.py builds what a page shows from store calls,
pgwork/web/html.py draws it). tests/test_web.py keeps the flows that need Chromium or HTTP:
sign-in, CSRF, the actions, no script run."""

from __future__ import annotations

import re
from datetime import UTC, timedelta
from html.parser import HTMLParser
from typing import Any

import psycopg
import pytest

from pgwork import store
from pgwork.history import attempts_text
from pgwork.web import html, views

from .helpers import add, materialise, rows, sync_queue
from .test_cli import pgwork

pytestmark = pytest.mark.anyio

SIGNED_OUT = html.Ctx(csrf="c", actions_on=True, signed_in=False)
SIGNED_IN = html.Ctx(csrf="c", actions_on=True, signed_in=True)


def text(markup: str) -> str:
    """What a reader sees: the markup without its tags, spaces folded."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", markup)).strip()


async def _made(dsn: str, conn: psycopg.AsyncConnection[Any], *keys: tuple[str, str]) -> None:
    for key, due in keys:
        await add(conn, key, due)
    await materialise(dsn, lookahead=3600)


async def test_waiting_rows_have_their_own_count_tab_and_words(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 4: the overview's "waiting" count linked to the ready list, the channel
    page had no waiting filter, and called a row not yet due "ready" (the CLI says "ready, not
    yet due"). Each count links to its own list, and a row says what the CLI says."""
    await _made(
        dsn, conn, ("now", "now() - interval '1 minute'"), ("later", "now() + interval '1 hour'")
    )
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        o = await views.overview(c)
        page = html.overview(o, SIGNED_OUT)
        assert o.counts["test"] == {"ready": 1, "waiting": 1}
        assert 'href="/channel/test?status=waiting">1</a>' in page
        assert 'href="/channel/test?status=ready">1</a>' in page
        every = await views.channel(c, "test", status="", after=None, hours=3)
        waiting = await views.channel(c, "test", status="waiting", after=None, hours=3)
        ready = await views.channel(c, "test", status="ready", after=None, hours=3)
    assert every is not None and waiting is not None and ready is not None
    assert sorted(r["business_key"] for r in every.rows) == ["later", "now"]
    assert [r["business_key"] for r in waiting.rows] == ["later"]
    assert [r["business_key"] for r in ready.rows] == ["now"]
    shown = text(html.channel(every, SIGNED_OUT))
    assert "ready, not yet due" in shown and shown.count(" ready ") >= 1, shown
    assert "waiting for their time" in text(html.channel(waiting, SIGNED_OUT))


async def _dead(conn: psycopg.AsyncConnection[Any], attempts: int, base: int) -> None:
    await conn.execute(
        "UPDATE pgwork.renewal_work SET status = 'dead', finished_at = now(), dead_reason = 'x', "
        "attempts = %s, lease = %s, attempts_base = %s, redriven_at = CASE WHEN %s > 0 THEN now() END",
        (attempts, attempts, base, base),
    )
    await sync_queue(conn)


async def test_a_redriven_dead_letters_attempts_read_the_same_everywhere(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 5: a dead letter redriven once and dead again showed 2 attempts in `dlq
    list` and `dlq show` and 1 on the web pages. Each says both: 2 (1 toward max_attempts)."""
    await _made(dsn, conn, ("twice", "now() - interval '1 minute'"))
    await _dead(conn, attempts=2, base=1)
    (w,) = await rows(conn, "SELECT id FROM pgwork.renewal_work")
    said = attempts_text(2, 1)
    assert said == "2 (1 toward max_attempts)"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        dead = await views.dead(c, views.DeadFilter(), since=None, before=None)
        work = await views.work(c, w["id"])
    assert work is not None
    assert said in text(html.dead(dead, SIGNED_OUT))
    assert said in text(html.work(work, SIGNED_OUT, None))
    listed = pgwork("dlq", "list", dsn=dsn)
    assert said in listed.stdout, listed.stdout


async def test_rows_held_by_a_paused_channel_say_so(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 7: for a paused channel, the retrying page and the channel page showed
    "next try … (35 s ago)" and never said the rows were held by the pause."""
    await _made(dsn, conn, ("failed", "now() - interval '1 minute'"))
    await conn.execute(
        "UPDATE pgwork.renewal_work SET attempts = 1, lease = 1, available_at = now() - "
        "interval '35 seconds', last_error = 'HTTP 500'"
    )
    await conn.execute("UPDATE pgwork.work_ready SET available_at = now() - interval '35 seconds'")
    await conn.execute("SELECT pgwork.pause_channel('test', 'receiver upgrade', 'ops')")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        retrying = await views.retrying(c, None)
        channel = await views.channel(c, "test", status="", after=None, hours=3)
    assert channel is not None
    shown = text(html.retrying(retrying, SIGNED_OUT))
    assert "held: channel test PAUSED" in shown and "receiver upgrade" in shown, shown
    assert "ago" not in shown
    assert "channel test PAUSED: receiver upgrade" in text(html.channel(channel, SIGNED_OUT))
    await conn.execute("SELECT pgwork.resume_channel('test', 'ops')")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        retrying = await views.retrying(c, None)
    assert "due now" in text(html.retrying(retrying, SIGNED_OUT))


async def test_every_list_says_when_it_is_empty(dsn: str) -> None:
    """Issue 68, item 8: /dead, /retrying and a channel's rows were a table of headings alone."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        dead = await views.dead(c, views.DeadFilter(), since=None, before=None)
        matching = await views.dead(c, views.DeadFilter(source="crm"), since=None, before=None)
        retrying = await views.retrying(c, "test")
        waiting = await views.channel(c, "test", status="waiting", after=None, hours=3)
        every = await views.channel(c, "test", status="", after=None, hours=3)
    assert waiting is not None and every is not None
    assert "No dead letters." in text(html.dead(dead, SIGNED_OUT))
    assert "No dead letters match." in text(html.dead(matching, SIGNED_OUT))
    assert "Nothing waits for a retry on test." in text(html.retrying(retrying, SIGNED_OUT))
    assert "No waiting for their time rows on test." in text(html.channel(waiting, SIGNED_OUT))
    assert "No live rows on test." in text(html.channel(every, SIGNED_OUT))
    for markup in (html.dead(dead, SIGNED_OUT), html.retrying(retrying, SIGNED_OUT)):
        assert "<table>" not in markup


async def test_a_bulk_redrive_says_what_it_did_in_words(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, items 8 and 11: the question said "1 dead letter match"; once done, the list
    came back with no line saying what happened."""
    f = views.DeadFilter(channel="test")
    one = text(html.redrive_ask(SIGNED_IN, f, 1, 0, "d", changed=False))
    assert "1 dead letter matches (channel test)" in one, one
    two = text(html.redrive_ask(SIGNED_IN, f, 2, 1, "d", changed=False))
    assert "2 dead letters match" in two and "1 more matches but stay dead" in two, two
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        done = await views.dead(c, f, since=None, before=None, done=(5, 0))
        some = await views.dead(c, f, since=None, before=None, done=(1, 2))
    assert "5 dead letters redriven." in text(html.dead(done, SIGNED_OUT))
    said = text(html.dead(some, SIGNED_OUT))
    assert "1 dead letter redriven; 2 left dead (their reminder was cancelled or moved" in said


async def test_a_reminder_set_aside_counts_its_tries_in_words(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Issue 68, item 11: "(1 tries; tried again at <a future time>)"."""
    from pgwork import db
    from pgwork.duties import materialise as materialiser

    from .helpers import add_in_an_unknown_zone

    await add_in_an_unknown_zone(conn)
    async with await db.connect(dsn) as c:
        await materialiser.run_once(c, lookahead=0, page_size=8, aside=materialiser.SetAside())
        h = await views.reminder(c, "mars", "base:1", None)
    said = h.set_aside_text()
    assert said is not None and "(1 try; next try 20" in said, said
    assert "tried again" not in said and "1 tries" not in said


def test_the_frame_signs_in_back_to_the_page_it_is_on() -> None:
    """Issue 68, item 11: sign-in came back to /, not to the page the operator was on."""
    ctx = html.Ctx(csrf="c", actions_on=True, signed_in=False, here="/dead?channel=crm")
    page = html.page(ctx, "Dead letters", "")
    assert '<input type="hidden" name="next" value="/dead?channel=crm">' in page


def test_a_page_left_open_reloads_unless_told_not_to() -> None:
    ctx = html.Ctx(csrf="c", actions_on=False, signed_in=False)
    assert 'http-equiv="refresh" content="15"' in html.page(ctx, "Overview", "", refresh=15)
    off = html.Ctx(csrf="c", actions_on=False, signed_in=False, no_refresh=True)
    assert "http-equiv" not in html.page(off, "Overview", "", refresh=15)


async def test_the_views_read_what_the_store_holds(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Each view is built from store calls alone: a row made, claimed and settled reads the same
    on its page as in the store."""
    await _made(dsn, conn, ("k", "now() - interval '1 minute'"))
    (w,) = await rows(conn, "SELECT id FROM pgwork.renewal_work")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        v = await views.work(c, w["id"])
        assert v is not None and v.work["business_key"] == "k"
        assert v.work["status"] == store.Status.READY and v.attempts == []
        assert "No attempt yet." in text(html.work(v, SIGNED_OUT, ["POST x"]))
        assert await views.work(c, w["id"] + 1) is None
        assert await views.channel(c, "nosuch", status="", after=None, hours=3) is None
        r = await views.reminders(c, "test", "", "")
        assert [x["business_key"] for x in r.rows] == ["k"] and r.next_after is None
    assert timedelta(0) <= (v.work["due_at"] - v.work["deadline"])


class _Fields(HTMLParser):
    """The visible form fields of some markup, each with whether a reader is told what it is
    (inside a <label>, or an aria-label of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.fields: list[tuple[str, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "label":
            self.depth += 1
        elif tag in ("input", "select", "textarea") and a.get("type") != "hidden":
            self.fields.append((a.get("name") or "?", self.depth > 0 or bool(a.get("aria-label"))))

    def handle_endtag(self, tag: str) -> None:
        if tag == "label":
            self.depth -= 1


def test_every_field_is_labelled_and_every_page_fits_a_narrow_screen() -> None:
    """Issue 68 (any screen): a phone showed the page at desktop width, zoomed out, and the
    sign-in and reason fields were named only by a placeholder, which a screen reader may not
    read and which is gone once typed in. Every page has a viewport; every visible field of
    every form the page draws has a label; a wide table scrolls within the page."""
    f = views.DeadFilter(channel="crm", source="shop", reason="410", since="2h")
    forms = [
        html.page(SIGNED_OUT, "Overview", "<p>x</p>"),
        html.action_form(SIGNED_IN, "/channel/crm/pause", "pause", reason=True),
        html.bulk_form(SIGNED_IN, f, "redrive these 3", confirm=(3, "d")),
        html.dead_filter_form(f),
        html.reminders_form("shop", "lease:"),
        html.reminder_form("shop", "lease:1"),
    ]
    seen = []
    for markup in forms:
        p = _Fields()
        p.feed(markup)
        seen += p.fields
    assert {name for name, _ in seen} >= {"token", "reason", "channel", "source", "key", "since"}
    assert [name for name, labelled in seen if not labelled] == []
    page = html.page(SIGNED_IN, "Overview", "<p>x</p>")
    assert '<meta name="viewport" content="width=device-width,initial-scale=1">' in page
    assert "overflow-x:auto" in html.STYLE


def test_a_time_reads_as_how_long_ago_with_the_instant_on_hover() -> None:
    """Issue 68 (any screen): a time was its full instant plus how long ago, 40 characters that
    made a narrow table wider. It reads '3 min ago' or 'in 2 h', the instant in its title (on
    hover) and its datetime (for machines), for instants on both sides of now at every scale."""
    import random
    from datetime import datetime

    now = datetime(2026, 12, 7, 19, 40, tzinfo=UTC)
    rnd = random.Random(68)
    offsets = [0.0, 1.0, -1.0, 59.0, 60.0, 3599.0, 3600.0, 86400.0, -86400.0]
    offsets += [rnd.uniform(-9e6, 9e6) for _ in range(300)]
    for off in offsets:
        t = now - timedelta(seconds=off)
        shown = html.ago(t, now)
        m = re.fullmatch(r'<time datetime="([^"]+)" title="([^"]+)">([^<]+)</time>', shown)
        assert m, shown
        assert datetime.fromisoformat(m[1]) == t and m[2] == html.e(t)
        assert re.fullmatch(r"\d+ (s|min|h|d) ago" if off >= 0 else r"in \d+ (s|min|h|d)", m[3])
    assert html.ago(None, now) == ""
