"""Hostile app writes, generated (issue 9): through a pgwork_app member, against a real server with
a daemon process running. Each write either succeeds with a valid row or fails with an error that
names a column or a rule; a refusal changes nothing; a canary reminder keeps being delivered
within a second; no refused row is ever delivered."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import rows
from .processes import DaemonProcess, toml

_n = itertools.count()

COLUMNS = (
    "source",
    "business_key",
    "due_at",
    "due_local",
    "due_tz",
    "remind_before",
    "channel",
    "recipient",
    "payload",
)

# Each field: values that must be accepted, and values that must be refused.
GOOD: dict[str, Any] = {
    "source": st.sampled_from(["app", "billing", "lease-renewal"]),
    "due": st.one_of(
        st.integers(-3, 3).map(lambda s: ("at", f"now() + interval '{s} seconds'")),
        st.just(("at", "'2027-01-01'")),
        st.tuples(
            st.just("local"),
            st.sampled_from(["2027-03-28 01:30", "2026-10-25 01:30", "2027-01-01 09:00"]),
            st.sampled_from(["Europe/London", "GMT", "Japan", "UTC", "America/New_York"]),
        ),
    ),
    "before": st.lists(
        st.sampled_from(["0", "1 second", "2 seconds", "1 day", "1 mon", "400 days"]),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(lambda xs: "{" + ",".join(f'"{x}"' for x in xs) + "}"),
    "channel": st.just("log"),
    "recipient": st.sampled_from(["r@example.com", "x" * 1000]),
    "payload": st.one_of(
        st.just("{}"),
        st.just('{"n": 0.1000000000000000055511151231257827, "big": 1234567890123456789012345}'),
        st.integers(1, 63).map(lambda d: '{"a": ' + "[" * d + "]" * d + "}"),
        st.integers(100, 60_000).map(lambda n: json.dumps({"s": "x" * n})),
    ),
}
BAD: dict[str, Any] = {
    "source": st.sampled_from([" app", "", "x" * 101]),
    "due": st.one_of(
        st.sampled_from([("at", "'infinity'"), ("at", "'1960-01-01'"), ("at", "NULL")]),
        st.tuples(
            st.just("local"),
            st.sampled_from(["infinity", "1969-12-31 23:00", "2027-01-01 09:00"]),
            st.sampled_from(
                ["posix/Europe/London", "europe/london", "EST5EDT,M3.2.0,M11.1.0", "PDT", ""]
            ),
        ),
    ),
    "before": st.one_of(
        st.sampled_from(["{}", '{"1 mon -30 days"}', '{"-1 day"}', '{"401 days"}', "{0, 0}"]),
        st.just("{{1 day},{2 days}}"),
    ),
    "channel": st.just("nope"),
    "recipient": st.sampled_from(["", "y" * 1001]),
    "payload": st.one_of(
        st.integers(65, 300).map(lambda d: '{"a": ' + "[" * d + "]" * d + "}"),
        st.just('{"a": ' + "[" * 5000 + "]" * 5000 + "}"),
        st.integers(66_000, 80_000).map(lambda n: json.dumps({"s": "x" * n})),
        st.sampled_from(["[1, 2]", '"text"', "3", "null"]),
    ),
}


@st.composite
def rows_(draw: Any) -> dict[str, Any]:
    """A row that is valid, or valid but for one hostile field."""
    r = {k: draw(v) for k, v in GOOD.items()}
    bad = draw(st.sampled_from([None, None, None, *BAD]))
    if bad is not None:
        r[bad] = draw(BAD[bad])
    r["hostile"] = bad
    return r


writes = st.one_of(
    st.tuples(st.just("insert"), st.lists(rows_(), min_size=1, max_size=3)),
    st.tuples(st.just("update"), st.sampled_from(COLUMNS), rows_()),
    st.tuples(st.just("delete"), st.booleans()),
)


def _values(r: dict[str, Any], key: str) -> tuple[str, list[Any]]:
    """One VALUES tuple (SQL with placeholders for the hostile strings) and its parameters."""
    due = r["due"]
    if due[0] == "at":
        at, local, tz = due[1], "NULL", None
    else:
        at, local, tz = "NULL", "%s::timestamp", due[2]
    sql = f"(%s, %s, {at}, {local}, %s, %s::interval[], %s, %s, %s::jsonb)"
    params: list[Any] = [r["source"], key]
    if due[0] == "local":
        params.append(due[1])
    params += [tz, r["before"], r["channel"], r["recipient"], r["payload"]]
    return sql, params


def _names_a_column_or_rule(e: psycopg.Error) -> bool:
    d = e.diag
    if d.column_name or d.constraint_name:
        return True
    return any(c in str(e) for c in COLUMNS)


async def _fingerprint(c: psycopg.AsyncConnection[Any]) -> Any:
    """What apps wrote: every reminder's own columns. Not the whole row: the daemon running
    beside this test advances a reminder's materialiser progress (next_fire_at) whenever it
    likes, and a refused write in the meantime once looked like a write that changed something."""
    (r,) = await rows(
        c,
        "SELECT count(*) AS n, md5(coalesce(string_agg(("
        "r.id, r.source, r.business_key, r.due_at, r.due_local, r.due_tz, r.remind_before, "
        "r.channel, r.recipient, r.payload)::text, ',' ORDER BY r.id), '')) AS h "
        "FROM pgwork.reminder r",
    )
    return (r["n"], r["h"])


@pytest.mark.slow
def test_generated_hostile_writes(dsn: str, tmp_path: Path) -> None:
    d = DaemonProcess(dsn, tmp_path, toml(channel='[channels.log]\nkind = "log"'), "hostile")
    refused_keys: list[str] = []
    written_keys: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE ROLE hostile_writer LOGIN IN ROLE pgwork_app")
    try:
        d.wait_ready()

        @settings(
            max_examples=60,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(write=writes)
        def one(write: tuple[Any, ...]) -> None:
            anyio.run(_one, dsn, write, refused_keys, written_keys)

        one()
        anyio.run(_never_delivered, dsn, refused_keys)
    finally:
        d.kill()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("DROP ROLE hostile_writer")
    assert refused_keys and written_keys  # both outcomes were exercised


async def _one(
    dsn: str, write: tuple[Any, ...], refused_keys: list[str], written_keys: list[str]
) -> None:
    n = next(_n)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        await c.execute("SET ROLE hostile_writer")
        before = await _fingerprint(c)
        keys: list[str] = []
        must_refuse: bool | None = None  # known for inserts: refused exactly when a row is hostile
        if write[0] == "insert":
            must_refuse = any(r["hostile"] for r in write[1])
            parts, params = [], []
            for i, r in enumerate(write[1]):
                keys.append(f"w{n}-{i}")
                sql, p = _values(r, keys[-1])
                parts.append(sql)
                params += p
            stmt = (
                "INSERT INTO pgwork.reminder (source, business_key, due_at, due_local, due_tz, "
                "remind_before, channel, recipient, payload) VALUES " + ", ".join(parts)
            )
        elif write[0] == "update" and written_keys:
            column, r = write[1], write[2]
            sql, p = _values(r, f"moved{n}")
            value = dict(zip(COLUMNS, _split(sql), strict=True))[column]
            param = dict(zip(COLUMNS, _params(r, f"moved{n}"), strict=True))[column]
            stmt = f"UPDATE pgwork.reminder SET {column} = {value} WHERE business_key = %s"
            params = ([] if param is _NO_PARAM else [param]) + [written_keys[n % len(written_keys)]]
        elif write[0] == "delete" and written_keys:
            stmt = "DELETE FROM pgwork.reminder WHERE business_key = %s"
            params = [written_keys[n % len(written_keys)]]
        else:
            return
        try:
            await c.execute(stmt, params)
        except psycopg.Error as e:
            assert must_refuse is not False, f"a valid write was refused: {e}"
            assert _names_a_column_or_rule(e), f"{e.sqlstate}: {e}"
            assert await _fingerprint(c) == before, "a refused write changed something"
            refused_keys += keys
        else:
            assert must_refuse is not True, f"a hostile write was accepted: {write}"
            written_keys += keys
            got = await rows(
                c,
                "SELECT jsonb_typeof(payload) AS t, octet_length(payload::text) AS size, "
                "cardinality(remind_before) AS n, due_at FROM pgwork.reminder "
                "WHERE business_key = ANY(%s)",
                (keys,),
            )
            assert len(got) == len(keys)
            for g in got:
                assert g["t"] == "object" and g["size"] <= 65536 and 1 <= g["n"] <= 16
        await c.execute("RESET ROLE")
        # The daemon keeps delivering: a canary due now is delivered within a second.
        canary = f"canary{n}"
        await c.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES ('canary', %s, now(), 'log', 'ops')",
            (canary,),
        )
        t0 = time.monotonic()
        while True:
            got = await rows(
                c,
                "SELECT 1 FROM pgwork.renewal_work WHERE business_key = %s AND status = 'delivered'",
                (canary,),
            )
            if got:
                break
            assert time.monotonic() - t0 < 1.0, "the canary was not delivered within a second"
            await anyio.sleep(0.01)


_NO_PARAM = object()


def _split(values_sql: str) -> list[str]:
    """The nine value expressions of one VALUES tuple."""
    inner = values_sql[1:-1]
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    out.append(cur.strip())
    return out


def _params(r: dict[str, Any], key: str) -> list[Any]:
    """The parameter each of the nine expressions takes (``_NO_PARAM`` when it takes none)."""
    due = r["due"]
    local = due[1] if due[0] == "local" else _NO_PARAM
    tz = due[2] if due[0] == "local" else None
    return [
        r["source"],
        key,
        _NO_PARAM,
        local,
        tz,
        r["before"],
        r["channel"],
        r["recipient"],
        r["payload"],
    ]


async def _never_delivered(dsn: str, keys: list[str]) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        got = await rows(
            c, "SELECT business_key FROM pgwork.renewal_work WHERE business_key = ANY(%s)", (keys,)
        )
    assert got == [], "a refused row was materialised"
