"""Hostile neighbours (issue 9): rows no app may write, payloads that must arrive exactly as
stored, and one bad row that must not hurt the others."""

from __future__ import annotations

import gzip
import json
import logging
import signal
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import errors

from pgwork.channels import parse_retry_after

from . import sink
from .helpers import add, config, materialise, rows, running, settled, until, webhook_channel, work
from .processes import DaemonProcess, hook, toml
from .receiver import Answer, Receiver, Request

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("clean_sink")]


async def _refused(
    conn: psycopg.AsyncConnection[Any], sql: str, exc: type[Exception], *words: str
) -> psycopg.Error:
    before = await rows(conn, "SELECT * FROM pgwork.reminder ORDER BY id")
    with pytest.raises(exc) as info:
        await conn.execute(sql)
    assert await rows(conn, "SELECT * FROM pgwork.reminder ORDER BY id") == before
    err = info.value
    assert isinstance(err, psycopg.Error)
    for w in words:
        assert w in str(err), (w, str(err))
    return err


# -- items 1 and 2: payload depth and size -----------------------------------------------------


async def test_deep_payload_is_refused_at_write_time(conn: psycopg.AsyncConnection[Any]) -> None:
    deep = "[" * 5000 + "]" * 5000
    err = await _refused(
        conn,
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, payload) "
        f"VALUES ('s', 'k', now(), 'log', 'r', '{{\"a\": {deep}}}')",
        errors.CheckViolation,
        "nested deeper than 64 levels",
    )
    assert err.diag.column_name == "payload"
    # 64 levels are fine.
    ok = "[" * 63 + "]" * 63
    await add(conn, "ok", payload=f'{{"a": {ok}}}', channel="log")


@pytest.mark.parametrize("via", ["insert-select", "update"])
async def test_payload_size_is_measured_as_json_text(
    conn: psycopg.AsyncConnection[Any], via: str
) -> None:
    # 4 MiB of one repeated character compresses to a few KiB: the old CHECK let it through.
    big = "jsonb_build_object('x', repeat('a', 4 * 1024 * 1024))"
    if via == "insert-select":
        sql = (
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, payload) "
            f"SELECT 's', 'k', now(), 'log', 'r', {big}"
        )
    else:
        await add(conn, "k", channel="log")
        sql = f"UPDATE pgwork.reminder SET payload = {big}"
    err = await _refused(conn, sql, errors.CheckViolation, "at most 65536 (64 KiB)")
    assert err.diag.column_name == "payload"


async def test_an_undecodable_payload_fails_one_row_and_the_batch_proceeds(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """A row already stored before the write check (or by a superuser) with a payload Python
    cannot decode: that row is dead with its reason; the other rows of the batch are delivered."""
    for i in range(20):
        await add(conn, f"k{i:02d}")
    deep = "[" * 3000 + "]" * 3000
    await conn.execute("ALTER TABLE pgwork.reminder DISABLE TRIGGER reminder_before_update")
    await conn.execute(
        f"UPDATE pgwork.reminder SET payload = '{{\"a\": {deep}}}' WHERE business_key = 'k07'"
    )
    await conn.execute("ALTER TABLE pgwork.reminder ENABLE TRIGGER reminder_before_update")
    async with running(config(), dsn):
        await until(lambda: settled(conn, 20), what="every row settled")
    ws = {w["business_key"]: w for w in await work(conn)}
    assert ws["k07"]["status"] == "dead" and "payload cannot be decoded" in ws["k07"]["dead_reason"]
    assert all(ws[k]["status"] == "delivered" for k in ws if k != "k07")
    assert len(sink.DELIVERED) == 19


# -- item 3: payloads arrive exactly as stored -------------------------------------------------


async def test_payload_numbers_reach_the_webhook_exactly(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    payload = (
        '{"p": 0.1000000000000000055511151231257827, "tiny": 1e-400, '
        '"big": 123456789012345678901234567890, "f": 1.5}'
    )
    (stored,) = await rows(conn, "SELECT %s::jsonb::text AS t", (payload,))
    with Receiver() as receiver:
        async with running(config(webhook_channel(receiver.url)), dsn):
            await add(conn, "exact", channel="hook", payload=payload)
            (req,) = await anyio.to_thread.run_sync(receiver.wait_for, 1)
    raw = req.raw.decode()
    sent = raw[raw.index('"payload":') + len('"payload":') : -1]
    assert sent == stored["t"]
    assert "0.1000000000000000055511151231257827" in sent
    assert "123456789012345678901234567890" in sent
    # Everything else in the document is as before.
    doc = json.loads(raw)
    assert doc["business_key"] == "exact" and doc["attempt"] == 1


# -- item 4: remind_before entries that would fire after the deadline --------------------------


@pytest.mark.parametrize(
    "before",
    [
        '{"1 mon -30 days", 0}',
        '{"-1 mon 40 days", 0}',
        '{"1 day -1 hour", 0}',
        # Alone, it equals {0} as an interval array: found by the generated-writes test.
        '{"1 mon -30 days"}',
    ],
)
async def test_mixed_sign_remind_before_is_refused(
    conn: psycopg.AsyncConnection[Any], before: str
) -> None:
    err = await _refused(
        conn,
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, remind_before) "
        f"VALUES ('s', 'k', '2027-03-31', 'log', 'r', '{before}')",
        errors.CheckViolation,
        "negative part",
        "could fire after the deadline",
    )
    assert err.diag.column_name == "remind_before"


# -- item 5: time zones ------------------------------------------------------------------------


async def test_every_iana_zone_the_server_knows_is_accepted(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
        "SELECT 'tz', name, '2027-06-01 09:00', name, 'log', 'r' FROM pg_timezone_names "
        "WHERE name !~ '^(posix|right)/' AND name NOT IN ('localtime', 'posixrules')"
    )
    got = await rows(conn, "SELECT due_tz FROM pgwork.reminder WHERE due_tz IN ('GMT', 'Japan')")
    assert sorted(r["due_tz"] for r in got) == ["GMT", "Japan"]


async def test_names_that_are_not_iana_zones_are_refused(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    names = await rows(conn, "SELECT name FROM pgwork.time_zone ORDER BY name")
    refused = ["EST5EDT,M3.2.0,M11.1.0", "<+03>-3", "UTC+3", "PDT", "localtime", "posixrules"]
    for n in [r["name"] for r in names[::25]]:
        refused += [f"posix/{n}", f"right/{n}"]
        if n.lower() != n:
            refused.append(n.lower())
    for tz in refused:
        await _refused(
            conn,
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
            f"VALUES ('s', 'k', '2027-06-01 09:00', '{tz}', 'log', 'r')",
            errors.InvalidParameterValue,
            "unknown time zone",
        )


# -- item 6: every refusal names the column and the rule ---------------------------------------


async def test_refusals_an_app_role_can_provoke_name_the_column(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute("CREATE ROLE hostile_app LOGIN IN ROLE pgwork_app")
    try:
        await add(conn, "k", channel="log")
        await conn.execute("SET ROLE hostile_app")
        err = await _refused(
            conn,
            "UPDATE pgwork.reminder SET business_key = 'other'",
            errors.CheckViolation,
            "cannot change",
        )
        assert err.diag.column_name == "business_key"
        err = await _refused(
            conn,
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
            "VALUES ('s', 'k2', 'infinity', 'Europe/London', 'log', 'r')",
            errors.CheckViolation,
            "due_local",
        )
        assert err.diag.column_name == "due_local"
        err = await _refused(
            conn,
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, remind_before) "
            "VALUES ('s', 'k3', now(), 'log', 'r', '{{1 day, 0}, {2 days, 0}}')",
            errors.CheckViolation,
            "not a list of intervals",
        )
        assert err.diag.column_name == "remind_before"
    finally:
        await conn.execute("RESET ROLE")
        await conn.execute("DROP ROLE hostile_app")


# -- items 10 and 11: abusive answers ----------------------------------------------------------


@pytest.mark.slow
async def test_a_gzip_bomb_does_not_grow_the_daemon(
    dsn: str, conn: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    bomb = gzip.compress(b"\0" * (256 << 20), 9)  # 256 MiB inflated, ~250 KiB sent

    def script(r: Request) -> Answer:
        return Answer(status=200, body=bomb, headers={"Content-Encoding": "gzip"})

    with Receiver(script) as receiver:
        d = DaemonProcess(dsn, tmp_path, toml(channel=hook(receiver.url)), "bomb")
        try:
            await anyio.to_thread.run_sync(d.wait_ready)
            for i in range(4):
                await add(conn, f"k{i}", channel="hook")
            await until(lambda: settled(conn, 4), timeout=30, what="4 deliveries")
            peak_mb = _peak_rss_mb(d.proc.pid)
            d.signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(d.wait) == 0
        finally:
            d.kill()
    assert peak_mb < 150, f"daemon peaked at {peak_mb:.0f} MB"
    (a,) = await rows(conn, "SELECT receipt FROM pgwork.attempt LIMIT 1")
    assert "gzip-encoded body not decoded" in a["receipt"]["body"]


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_garbage_retry_after_keeps_the_http_status(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    assert parse_retry_after("²") is None and parse_retry_after("Mon, 99 Foo") is None

    def script(r: Request) -> Answer:
        if r.n == 1:
            return Answer(status=503, headers={"Retry-After": "²"}, body=b"busy")
        return Answer()

    with Receiver(script) as receiver:
        async with running(config(webhook_channel(receiver.url)), dsn):
            await add(conn, "k", channel="hook")
            await until(lambda: settled(conn, 1), what="delivered on the second attempt")
    ledger = await rows(conn, "SELECT outcome, http_status FROM pgwork.attempt ORDER BY lease")
    assert [(x["outcome"], x["http_status"]) for x in ledger] == [
        ("retry", 503),
        ("delivered", 200),
    ]


# -- item 7: no app can hold the coordination lock ---------------------------------------------


async def test_an_app_cannot_stop_materialisation_with_a_lock(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    await add(conn, "k")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as app:
        # The key the old coordination lock used, held by some session for as long as it likes.
        await app.execute("SELECT pg_advisory_lock(hashtext('pgwork.materialise'))")
        with anyio.fail_after(5):
            res = await materialise(dsn)
        assert res.made == 1
    # And the table lock that coordinates now is out of an app role's reach, in every mode but
    # ACCESS SHARE (which conflicts with neither the pages' nor retention's), and so is the row
    # lock that coordinated before it.
    await conn.execute("CREATE ROLE lock_probe LOGIN IN ROLE pgwork_app")
    try:
        await conn.execute("SET ROLE lock_probe")
        for mode in ("ROW SHARE", "ROW EXCLUSIVE", "SHARE", "EXCLUSIVE", "ACCESS EXCLUSIVE"):
            with pytest.raises(errors.InsufficientPrivilege):
                async with conn.transaction():
                    await conn.execute(f"LOCK TABLE pgwork.materialiser_state IN {mode} MODE")
        with pytest.raises(errors.InsufficientPrivilege):
            await conn.execute("SELECT 1 FROM pgwork.materialiser_state FOR UPDATE")
    finally:
        await conn.execute("RESET ROLE")
        await conn.execute("DROP ROLE lock_probe")


# -- item 8: a reminder held locked is named -------------------------------------------------


async def test_a_reminder_held_locked_is_named_in_a_warning_and_a_metric(
    dsn: str,
    conn: psycopg.AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pgwork.duties import materialise as m

    monkeypatch.setattr(m, "LOCKED_WARNING", 0.5)
    caplog.set_level(logging.WARNING, logger="pgwork.materialiser")
    ids = [await add(conn, f"k{i}") for i in range(5)]
    async with await psycopg.AsyncConnection.connect(dsn) as app:
        await app.execute("SELECT 1 FROM pgwork.reminder WHERE id = %s FOR UPDATE", (ids[2],))
        async with running(config(), dsn) as d:
            await until(lambda: settled(conn, 4), what="the four others delivered")
            await until(lambda: _locked_metric(d, 0.5), what="the lock visible in the metric")
            await app.rollback()
            await until(lambda: settled(conn, 5), what="the fifth delivered once unlocked")
            await until(lambda: _locked_metric(d, None), what="the metric back to 0")
    named = [r for r in caplog.records if getattr(r, "reminder_id", None) == ids[2]]
    assert named and "row lock" in named[0].getMessage()


async def _locked_metric(d: Any, above: float | None) -> bool:
    v = d.metrics.registry.get_sample_value("pgwork_materialiser_locked_seconds") or 0.0
    return v == 0.0 if above is None else v > above
