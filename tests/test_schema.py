"""The schema: migrate, the SQL API other apps use, and bad input refused with a clear error."""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import errors

from pgwork import SCHEMA_VERSION, db, migration, store
from pgwork.duties import outcomes

from .helpers import add, rows
from .history import old_schema

pytestmark = pytest.mark.anyio


# -- migrate ---------------------------------------------------------------------------------


async def test_migrate_installs_then_is_idempotent(empty_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        assert await db.schema_version(c) is None
        with pytest.raises(db.SchemaError, match="pgwork migrate"):
            await db.check_schema(c)
        assert "installed" in await migration.migrate(c)
        assert "already" in await migration.migrate(c)
        assert await db.schema_version(c) == SCHEMA_VERSION
        await db.check_schema(c)


async def test_concurrent_migrations_install_once(empty_dsn: str) -> None:
    results: list[str] = []

    async def one() -> None:
        async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
            results.append(await migration.migrate(c))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert sorted(r.split()[0] for r in results) == ["installed", "pgwork", "pgwork", "pgwork"]


async def test_newer_schema_is_refused(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("UPDATE pgwork.schema_version SET version = version + 1")
    with pytest.raises(db.SchemaError, match="newer than this pgwork"):
        await db.check_schema(conn)
    with pytest.raises(db.SchemaError, match="refusing"):
        await migration.migrate(conn)


async def test_the_claimed_row_is_declared_once_and_checked_at_start(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """pgwork.claimed is the one declaration of the row a claim hands a worker: claim_work and
    the page return it (tests/test_hot_path.py reads both through store.Claimed), and a daemon
    starting on a database whose type disagrees with store.Claimed stops with an error that
    names both, instead of handing its workers fields filled with the wrong values."""
    assert await store.type_fields(conn, "pgwork.claimed") == store.Claimed._fields
    await db.check_schema(conn)
    await conn.execute("ALTER TYPE pgwork.claimed RENAME ATTRIBUTE recipient TO recipients")
    with pytest.raises(db.SchemaError, match=r"recipients.*this pgwork reads.*recipient,"):
        await db.check_schema(conn)


async def test_the_outcome_record_is_declared_once_and_checked_at_start(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """pgwork.outcome is the one declaration of an outcome record as record_outcomes reads it
    (its JSON array as rows of the type); the keys the daemon's records carry are checked
    against it when a daemon starts (tests/test_cli.py: exit 2): a key the statement would
    silently drop, a NULL where a value was sent, is named."""
    await outcomes.check_shape(conn)
    await conn.execute("ALTER TYPE pgwork.outcome RENAME ATTRIBUTE throttle TO throttle_s")
    with pytest.raises(db.SchemaError, match="declares throttle_s and not throttle than"):
        await outcomes.check_shape(conn)


async def _catalog(c: psycopg.AsyncConnection[Any]) -> dict[str, list[Any]]:
    """pgwork's schema as the catalog describes it: columns, constraints, indexes, functions,
    triggers, views and comments."""
    q = {
        "columns": "SELECT table_name, column_name, data_type, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = 'pgwork' ORDER BY 1, 2",
        "constraints": "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE connamespace = 'pgwork'::regnamespace ORDER BY 1, 2",
        "indexes": "SELECT indexdef FROM pg_indexes WHERE schemaname = 'pgwork' ORDER BY 1",
        "functions": "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p "
        "WHERE p.pronamespace = 'pgwork'::regnamespace ORDER BY 1",
        "triggers": "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
        "WHERE tgrelid::regclass::text LIKE 'pgwork.%' AND NOT tgisinternal ORDER BY 1",
        "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'pgwork' ORDER BY 1",
        "comments": "SELECT c.relname, d.objsubid, d.description FROM pg_description d "
        "JOIN pg_class c ON c.oid = d.objoid WHERE c.relnamespace = 'pgwork'::regnamespace "
        "ORDER BY 1, 2",
        "grants": "SELECT grantee, table_name, privilege_type FROM information_schema.role_table_grants "
        "WHERE table_schema = 'pgwork' AND grantee LIKE 'pgwork\\_%' ORDER BY 1, 2, 3",
        "usage": "SELECT grantee, object_name, object_type FROM information_schema.role_usage_grants "
        "WHERE object_schema = 'pgwork' AND grantee LIKE 'pgwork\\_%' ORDER BY 1, 2, 3",
        "function_comments_and_acls": "SELECT p.proname, pg_get_function_identity_arguments(p.oid), "
        "obj_description(p.oid, 'pg_proc'), p.proacl::text FROM pg_proc p "
        "WHERE p.pronamespace = 'pgwork'::regnamespace ORDER BY 1, 2",
        "policies": "SELECT tablename, policyname, permissive, roles::text, cmd, qual, with_check "
        "FROM pg_policies WHERE schemaname = 'pgwork' ORDER BY 1, 2",
        "types": "SELECT t.typname, t.typtype, pg_catalog.format_type(t.typbasetype, t.typtypmod) "
        "FROM pg_type t WHERE t.typnamespace = 'pgwork'::regnamespace AND t.typrelid = 0 "
        "AND t.typelem = 0 ORDER BY 1",
        "version": "SELECT version FROM pgwork.schema_version",
    }
    out: dict[str, list[Any]] = {}
    for k, sql in q.items():
        cur = await c.execute(sql)
        out[k] = await cur.fetchall()
    return out


@pytest.mark.parametrize(
    "old", [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]
)
async def test_upgrade_equals_a_fresh_install(
    old: int, empty_dsn: str, dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Every migration brings an existing database to exactly the schema a fresh install has."""
    schema = old_schema(old)
    await assert_upgrade_equals_a_fresh_install(schema, old, empty_dsn, conn)


async def assert_upgrade_equals_a_fresh_install(
    schema: str, old: int, empty_dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """``schema`` (a fresh install of version ``old``), with a reminder, migrated: the catalog
    is ``conn``'s (a fresh install of this tree) and the reminder is kept."""
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(schema)
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('test', 'python')")
        await add(c, "kept-through-upgrade", "now() + interval '1 day'")
        said = await migration.migrate(c)
        # The snapshot of this version (a fresh install before the code had its own files)
        # must equal a fresh install of this tree too.
        expected = (
            f"upgraded pgwork schema from version {old} to {SCHEMA_VERSION}"
            if old < SCHEMA_VERSION
            else f"pgwork schema already at version {old}"
        )
        assert expected in said
        await db.check_schema(c)
        upgraded = await _catalog(c)
        assert len(await rows(c, "SELECT * FROM pgwork.reminder_status")) == 1
    fresh = await _catalog(conn)
    for part in fresh:
        assert upgraded[part] == fresh[part], part


async def test_an_upgrade_drops_a_signature_the_code_no_longer_has(
    empty_dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A database installed by a commit whose function had another signature than the one its
    version ended with (d7e7eec, the first schema 14: materialise_page without ``aside``) kept
    that overload: the code's ``COMMENT ON FUNCTION pgwork.materialise_page`` then failed on every
    upgrade ('function name "pgwork.materialise_page" is not unique', exit 3, no way forward).
    The code is the one definition of its functions: an overload it does not define is dropped."""
    schema = old_schema(21)
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(schema)
        await c.execute(
            "CREATE FUNCTION pgwork.materialise_page(coordinate boolean, cutoff_at timestamptz,"
            " lookahead interval, after_at timestamptz, after_id bigint, page_limit integer,"
            " origin text, take jsonb, claim_lease interval, daemon_id text) RETURNS bigint"
            " LANGUAGE sql AS 'SELECT 1::bigint'"
        )
        with caplog.at_level("INFO", logger="pgwork.migration"):
            said = await migration.migrate(c)
        assert f"upgraded pgwork schema from version 21 to {SCHEMA_VERSION}" in said
        await db.check_schema(c)
        upgraded = await _catalog(c)
    fresh = await _catalog(conn)
    assert upgraded["function_comments_and_acls"] == fresh["function_comments_and_acls"]
    # Issue 68: it was a warning quoting the whole signature (13 types): what an upgrade does is
    # said in a line, by name.
    said_of = [r.getMessage() for r in caplog.records if "old definition" in r.getMessage()]
    assert (
        "migrate: pgwork.materialise_page takes new arguments; its old definition is dropped"
        in said_of
    )
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and "DROP" in r.getMessage()
    ]


async def test_an_upgrade_names_keys_the_new_space_rule_refuses(empty_dsn: str) -> None:
    """Schema 11 refuses Unicode spaces at either end of a key: an upgrade over a reminder that
    has one stops, says how many and how to find them, and changes nothing."""
    schema = old_schema(10)
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(schema)
        await c.execute("INSERT INTO pgwork.channel (name, kind) VALUES ('test', 'python')")
        await add(c, "invoice-7\u00a0", "now() + interval '1 day'")
        with pytest.raises(errors.RaiseException) as info:
            await migration.migrate(c)
        assert "1 reminders have a source or business_key" in str(info.value)
        assert "pgwork.is_trimmed" in (info.value.diag.message_hint or "")
        assert (await rows(c, "SELECT version FROM pgwork.schema_version"))[0]["version"] == 10


# -- the SQL API -----------------------------------------------------------------------------


async def test_schedule_with_instant_local_time_and_offsets(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES ('lease-renewal', 'property:7/lease:42', '2027-06-01 09:00+00', 'log', 'a@example.com')"
    )
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, remind_before, channel, recipient) "
        "VALUES ('lease-renewal', 'property:7/lease:43', '2027-06-01 09:00', 'Europe/London', "
        "'{30 days, 7 days, 1 day}', 'log', 'b@example.com')"
    )
    got = await rows(
        conn,
        "SELECT business_key, remind_before, send_at, status FROM pgwork.reminder_status ORDER BY business_key, send_at",
    )
    assert [(r["business_key"], r["send_at"], r["status"]) for r in got] == [
        ("property:7/lease:42", datetime(2027, 6, 1, 9, tzinfo=UTC), "scheduled"),
        # 09:00 London in summer is 08:00 UTC; offsets count in London's calendar.
        ("property:7/lease:43", datetime(2027, 5, 2, 8, tzinfo=UTC), "scheduled"),
        ("property:7/lease:43", datetime(2027, 5, 25, 8, tzinfo=UTC), "scheduled"),
        ("property:7/lease:43", datetime(2027, 5, 31, 8, tzinfo=UTC), "scheduled"),
    ]
    kept = await rows(
        conn,
        "SELECT due_local, due_tz FROM pgwork.reminder WHERE business_key = 'property:7/lease:43'",
    )
    assert kept[0]["due_tz"] == "Europe/London"  # the intent is kept as written
    assert str(kept[0]["due_local"]) == "2027-06-01 09:00:00"


async def test_move_local_deadline_recomputes_instant(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
        "VALUES ('s', 'k', '2027-01-10 09:00', 'America/New_York', 'log', 'r')"
    )
    await conn.execute(
        "UPDATE pgwork.reminder SET due_local = '2027-07-10 09:00' WHERE business_key = 'k'"
    )
    got = await rows(conn, "SELECT due_at FROM pgwork.reminder")
    assert got[0]["due_at"] == datetime(2027, 7, 10, 13, tzinfo=UTC)  # EDT is UTC-4


@pytest.mark.parametrize(
    ("tz", "local", "expected_utc", "why"),
    [
        # 2026-03-08 02:00 -> 03:00 in New York: 02:30 never happens; shifted forward to 03:30 EDT.
        ("America/New_York", "2026-03-08 02:30", datetime(2026, 3, 8, 7, 30, tzinfo=UTC), "gap"),
        # 2026-11-01 02:00 -> 01:00: 01:30 happens twice; the earlier (EDT) instant is chosen.
        (
            "America/New_York",
            "2026-11-01 01:30",
            datetime(2026, 11, 1, 5, 30, tzinfo=UTC),
            "ambiguous",
        ),
        ("America/New_York", "2026-11-01 03:30", datetime(2026, 11, 1, 8, 30, tzinfo=UTC), "after"),
        # 2026-03-29 01:00 -> 02:00 in London: 01:30 shifted forward to 02:30 BST.
        ("Europe/London", "2026-03-29 01:30", datetime(2026, 3, 29, 1, 30, tzinfo=UTC), "gap"),
        # 2026-10-25 02:00 -> 01:00: 01:30 twice; the earlier (BST) instant.
        (
            "Europe/London",
            "2026-10-25 01:30",
            datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
            "ambiguous",
        ),
        ("Europe/London", "2026-07-01 12:00", datetime(2026, 7, 1, 11, 0, tzinfo=UTC), "plain"),
    ],
)
async def test_dst_policy(
    conn: psycopg.AsyncConnection[Any], tz: str, local: str, expected_utc: datetime, why: str
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
        "VALUES ('s', %s, %s, %s, 'log', 'r')",
        (why, local, tz),
    )
    got = await rows(conn, "SELECT due_at FROM pgwork.reminder")
    assert got[0]["due_at"] == expected_utc, why


# -- bad input -------------------------------------------------------------------------------

BAD_ROWS = [
    (
        "missing key",
        "(source, due_at, channel, recipient) VALUES ('s', now(), 'log', 'r')",
        errors.NotNullViolation,
        "business_key",
    ),
    (
        "blank key",
        "(source, business_key, due_at, channel, recipient) VALUES ('s', '', now(), 'log', 'r')",
        errors.CheckViolation,
        "reminder_business_key_valid",
    ),
    (
        "no deadline",
        "(source, business_key, channel, recipient) VALUES ('s', 'k', 'log', 'r')",
        errors.NotNullViolation,
        "has no deadline",
    ),
    (
        "local time without zone",
        "(source, business_key, due_local, channel, recipient) VALUES ('s', 'k', '2027-01-01 09:00', 'log', 'r')",
        errors.CheckViolation,
        "only one of due_local and due_tz",
    ),
    (
        "unknown zone",
        "(source, business_key, due_local, due_tz, channel, recipient) "
        "VALUES ('s', 'k', '2027-01-01 09:00', 'Mars/Olympus_Mons', 'log', 'r')",
        errors.InvalidParameterValue,
        'unknown time zone "Mars/Olympus_Mons"',
    ),
    (
        "abbreviation, not an IANA zone",
        "(source, business_key, due_local, due_tz, channel, recipient) "
        "VALUES ('s', 'k', '2027-01-01 09:00', 'PDT', 'log', 'r')",
        errors.InvalidParameterValue,
        'unknown time zone "PDT"',
    ),
    (
        "both instant and local",
        "(source, business_key, due_at, due_local, due_tz, channel, recipient) "
        "VALUES ('s', 'k', now(), '2027-01-01 09:00', 'UTC', 'log', 'r')",
        errors.CheckViolation,
        "both due_at and due_local",
    ),
    (
        "negative offset",
        "(source, business_key, due_at, remind_before, channel, recipient) VALUES ('s', 'k', now(), '{-1 day}', 'log', 'r')",
        errors.CheckViolation,
        'remind_before entry "-1 days" with a negative part',
    ),
    (
        # Positive as a whole (23 hours): only the trigger sees the negative part.
        "offset with a negative part",
        "(source, business_key, due_at, remind_before, channel, recipient) "
        "VALUES ('s', 'k', now(), '{1 day -1 hour}', 'log', 'r')",
        errors.CheckViolation,
        'remind_before entry "1 day -01:00:00" with a negative part',
    ),
    (
        "absurd offset",
        "(source, business_key, due_at, remind_before, channel, recipient) "
        "VALUES ('s', 'k', now(), '{5 years}', 'log', 'r')",
        errors.CheckViolation,
        "reminder_remind_before_between_0_and_400_days",
    ),
    (
        "empty offsets",
        "(source, business_key, due_at, remind_before, channel, recipient) VALUES ('s', 'k', now(), '{}', 'log', 'r')",
        errors.CheckViolation,
        "reminder_remind_before_1_to_16_entries",
    ),
    (
        "duplicate offsets",
        "(source, business_key, due_at, remind_before, channel, recipient) "
        "VALUES ('s', 'k', now(), '{1 day, 24 hours}', 'log', 'r')",
        errors.CheckViolation,
        "same remind_before entry twice",
    ),
    (
        "payload too big",
        "(source, business_key, due_at, channel, recipient, payload) "
        "VALUES ('s', 'k', now(), 'log', 'r', jsonb_build_object('x', (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 2100) g)))",
        errors.CheckViolation,
        "at most 65536 (64 KiB) as JSON text",
    ),
    (
        "payload not an object",
        "(source, business_key, due_at, channel, recipient, payload) VALUES ('s', 'k', now(), 'log', 'r', '[1]')",
        errors.CheckViolation,
        "reminder_payload_is_object",
    ),
    (
        "unknown channel",
        "(source, business_key, due_at, channel, recipient) VALUES ('s', 'k', now(), 'sms', 'r')",
        errors.ForeignKeyViolation,
        "reminder_channel_known",
    ),
    (
        "absurd deadline",
        "(source, business_key, due_at, channel, recipient) VALUES ('s', 'k', '0200-01-01', 'log', 'r')",
        errors.CheckViolation,
        "reminder_due_at_sane",
    ),
]


@pytest.mark.parametrize(
    ("what", "values", "exc", "message"), BAD_ROWS, ids=[b[0] for b in BAD_ROWS]
)
async def test_bad_row_is_refused_and_nothing_else_changes(
    conn: psycopg.AsyncConnection[Any], what: str, values: str, exc: type[Exception], message: str
) -> None:
    await add(conn, "keep-me", "now() + interval '1 day'", channel="log")
    before = await rows(conn, "SELECT * FROM pgwork.reminder")
    with pytest.raises(exc) as info:
        await conn.execute(f"INSERT INTO pgwork.reminder {values}")
    text = str(info.value) + " " + str(getattr(info.value.diag, "constraint_name", ""))  # type: ignore[attr-defined]
    assert message in text, text
    assert await rows(conn, "SELECT * FROM pgwork.reminder") == before


async def test_bad_row_in_a_batch_refuses_the_statement_only(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    with pytest.raises(errors.InvalidParameterValue):
        await conn.execute(
            "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
            "VALUES ('s', 'a', '2027-01-01 09:00', 'UTC', 'log', 'r'), ('s', 'b', '2027-01-01 09:00', 'Nowhere/X', 'log', 'r')"
        )
    assert await rows(conn, "SELECT * FROM pgwork.reminder") == []


#: Unicode's White_Space characters, whatever the database's locale calls a space (a C-locale
#: database's \s is ASCII only).
EDGE_SPACES = [
    " ",
    "\t",
    "\n",
    "\u0085",
    "\u00a0",
    "\u1680",
    "\u2000",
    "\u2007",
    "\u200a",
    "\u2028",
    "\u2029",
    "\u202f",
    "\u205f",
    "\u3000",
]


@pytest.mark.parametrize("space", EDGE_SPACES, ids=[f"U+{ord(c):04X}" for c in EDGE_SPACES])
@pytest.mark.parametrize("column", ["source", "business_key"])
async def test_a_key_with_a_space_at_either_end_is_refused(
    conn: psycopg.AsyncConnection[Any], column: str, space: str
) -> None:
    """ "No leading or trailing space" means any Unicode space: a no-break space or a line
    separator at either end of a key is as invisible to whoever reads it as an ASCII one. Inside
    a key, any character is kept."""
    values = {"source": "s", "business_key": "k"}
    for key in (space + "x", "x" + space):
        with pytest.raises(errors.CheckViolation) as info:
            await conn.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES (%(source)s, %(business_key)s, now(), 'log', 'r')",
                {**values, column: key},
            )
        assert info.value.diag.constraint_name == f"reminder_{column}_valid", str(info.value)
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
        "VALUES (%(source)s, %(business_key)s, now(), 'log', 'r')",
        {**values, column: "x" + space + "y"},
    )


BAD_UPDATES = [
    ("recipient = ''", "reminder_recipient_valid"),
    ("payload = '[1]'", "reminder_payload_is_object"),
    ("remind_before = '{500 days}'", "reminder_remind_before_between_0_and_400_days"),
    ("remind_before = '{}'", "reminder_remind_before_1_to_16_entries"),
    ("traceparent = '00-xyz'", "reminder_traceparent_w3c"),
    ("tracestate = E'a\\nb'", "reminder_tracestate_valid"),
    ("due_at = '0200-01-01'", "reminder_due_at_sane"),
]


@pytest.mark.parametrize(("change", "rule"), BAD_UPDATES, ids=[b[1] for b in BAD_UPDATES])
async def test_a_bad_value_written_by_an_update_is_refused(
    conn: psycopg.AsyncConnection[Any], change: str, rule: str
) -> None:
    """An app's UPDATE of one column meets that column's value rule as its INSERT did (most of
    the rules are domains now, which check a value where it is written)."""
    await add(conn, "k", channel="log")
    before = await rows(conn, "SELECT * FROM pgwork.reminder")
    with pytest.raises(errors.CheckViolation) as info:
        await conn.execute(f"UPDATE pgwork.reminder SET {change}")
    assert info.value.diag.constraint_name == rule, str(info.value)
    assert await rows(conn, "SELECT * FROM pgwork.reminder") == before


async def test_operation_id_is_the_digest_of_the_occurrence(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """The idempotency key receivers store: md5 over the occurrence's identity (reminder id,
    source, business key, deadline and offset as epoch seconds), the same in every version."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_at, remind_before, channel, recipient) "
        "VALUES ('lease-renewal', 'property:7/lease:42', '2027-06-01 09:00:00.25+00', '{7 days, 0}', 'log', 'r')"
    )
    got = await rows(
        conn,
        "SELECT r.id, b AS occurrence, pgwork.operation_id(r.id, r.source, r.business_key, r.due_at, b) AS op "
        "FROM pgwork.reminder r CROSS JOIN LATERAL unnest(r.remind_before) AS b ORDER BY b",
    )
    deadline = datetime(2027, 6, 1, 9, 0, 0, 250000, tzinfo=UTC).timestamp()
    for r in got:
        text = "\x1f".join(
            [
                str(r["id"]),
                "lease-renewal",
                "property:7/lease:42",
                f"{deadline:.6f}",
                f"{r['occurrence'].total_seconds():.6f}",
            ]
        )
        assert str(r["op"]) == str(uuid.UUID(hashlib.md5(text.encode()).hexdigest())), r


async def test_identity_cannot_change(conn: psycopg.AsyncConnection[Any]) -> None:
    await add(conn, "k", channel="log")
    with pytest.raises(errors.CheckViolation, match="cannot change"):
        await conn.execute("UPDATE pgwork.reminder SET business_key = 'other'")


async def test_local_deadline_cannot_be_moved_through_due_at(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, channel, recipient) "
        "VALUES ('s', 'k', '2027-01-10 09:00', 'UTC', 'log', 'r')"
    )
    with pytest.raises(errors.CheckViolation, match="local-time deadline"):
        await conn.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '1 hour'")
    # Switching to an instant explicitly is allowed.
    await conn.execute(
        "UPDATE pgwork.reminder SET due_at = '2027-02-01 00:00+00', due_local = NULL, due_tz = NULL"
    )


# -- roles -----------------------------------------------------------------------------------


async def test_app_role_can_schedule_move_cancel_and_nothing_else(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    app = f"app_{abs(hash(dsn)) % 10**8}"
    await conn.execute(f"CREATE ROLE {app} LOGIN IN ROLE pgwork_app")
    try:
        from psycopg.conninfo import make_conninfo

        async with await psycopg.AsyncConnection.connect(
            make_conninfo(dsn, user=app), autocommit=True
        ) as a:
            await a.execute(
                "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
                "VALUES ('s', 'k', now() + interval '1 day', 'log', 'r')"
            )
            await a.execute("UPDATE pgwork.reminder SET due_at = due_at + interval '1 day'")
            assert len(await rows(a, "SELECT * FROM pgwork.reminder_status")) == 1
            await a.execute("DELETE FROM pgwork.reminder")
            for forbidden in (
                "SELECT * FROM pgwork.renewal_work",
                "UPDATE pgwork.renewal_work SET status = 'delivered'",
                "SELECT * FROM pgwork.attempt",
                "INSERT INTO pgwork.channel (name, kind) VALUES ('x', 'log')",
                "UPDATE pgwork.reminder SET next_fire_at = NULL",
                "UPDATE pgwork.config SET retention_paused = true",
            ):
                with pytest.raises(errors.InsufficientPrivilege):
                    await a.execute(forbidden)
    finally:
        await conn.execute(f"DROP OWNED BY {app}")
        await conn.execute(f"DROP ROLE {app}")


def test_the_top_level_schema_is_the_one_pgwork_installs() -> None:
    """The layout puts schema.sql at the top of the repository, and the package reads
    pgwork/sql/schema.sql: one file under two names (a link), so an edit of either is an edit of
    both. An editor that writes a new file in the link's place (`sed -i`) left the top-level one
    stale."""
    root = Path(__file__).resolve().parent.parent
    assert (root / "pgwork" / "sql" / "schema.sql").is_symlink()
    assert (root / "pgwork" / "sql" / "schema.sql").resolve() == (root / "schema.sql").resolve()


def test_every_named_statement_has_one_typed_function() -> None:
    """pgwork.store binds each statement of sql/queries/ once; the package calls nothing else."""
    import inspect

    from pgwork import store
    from pgwork.queries import Q

    bound = {n for n, f in inspect.getmembers(store, inspect.iscoroutinefunction)}
    # Run inside another function's transaction: batch_limits and retention_lock in
    # retention_delete_batch's, commit_synchronously in materialise_page's, record_without_waiting
    # in materialise_record_pass's (a pass that made nothing), the retire steps in
    # channel_retire's; or one of two a function chooses (history_work, migration_request and
    # migration_clear: the legacy protocol's or the owner's row; migrate_lock: a table or, for
    # an install, an advisory key, after its wait bound).
    inner = {
        "batch_limits",
        "retention_lock",
        "commit_synchronously",
        "record_without_waiting",
        "channel_retire_hold",
        "channel_retire_cancel",
        "channel_retire_close_work",
        "history_work_of_reminder",
        "history_work_of_key",
        "migration_request_legacy",
        "migration_clear_legacy",
        "migrate_lock_install",
        "migrate_wait",
    }
    assert set(Q) - inner <= bound, set(Q) - bound
    package = Path(__file__).resolve().parent.parent / "pgwork"
    for path in package.rglob("*.py"):
        if path.parent.name != "store" and path.name != "queries.py":
            text = path.read_text()
            assert 'Q["' not in text and "fetch_all(" not in text, path


def test_every_statement_is_bound_in_its_own_room() -> None:
    """The house rule of the binding layer: the statements of sql/queries/ROOM.sql are named in
    pgwork/store/ROOM.py and in no other module of pgwork.store, and every room has both halves.
    A statement is named where a binding passes it (``(conn, "name"``, ``(cur, "name"``) or
    reads it (``Q["name"]``)."""
    import re

    from pgwork.queries import Q, rooms

    store_dir = Path(__file__).resolve().parent.parent / "pgwork" / "store"
    modules = {p.stem: p.read_text() for p in store_dir.glob("*.py") if p.stem != "__init__"}
    by_room = rooms()
    passed = re.compile(r'(?:\(\s*(?:conn|cur),\s*|Q\[)"([a-z_]+)"')
    assert set(by_room) == set(modules) - {"_bind"}, (sorted(by_room), sorted(modules))
    for module, text in modules.items():
        named = set(passed.findall(text))
        own = set(by_room.get(module, {}))
        assert named <= own, f"store/{module}.py runs statements of another room: {named - own}"
    for room, statements in by_room.items():
        # Inner statements are run by another statement's binding of the same room, some chosen
        # by a condition (``"a" if legacy else "b"``): each is quoted there.
        named = set(re.findall(r'"([a-z_]+)"', modules[room])) & set(Q)
        assert set(statements) <= named, (
            f"queries/{room}.sql: not bound in its room: {set(statements) - named}"
        )


async def test_is_terminal_agrees_with_the_table(conn: psycopg.AsyncConnection[Any]) -> None:
    """The statements ask ``pgwork.is_terminal``; the table's constraint and its index spell the
    terminal statuses out. All three must name the same set, and the planner must still use the
    terminal index for a query that asks the function."""
    statuses = ["ready", "claimed", "delivered", "dead", "cancelled", "superseded"]
    terminal = {
        r["s"]
        for r in await rows(
            conn, "SELECT s FROM unnest(%s::text[]) s WHERE pgwork.is_terminal(s)", [statuses]
        )
    }
    index = await rows(
        conn,
        "SELECT pg_get_expr(indpred, indrelid) AS pred FROM pg_index"
        " WHERE indexrelid = 'pgwork.work_terminal'::regclass",
    )
    named = {s for s in statuses if f"'{s}'" in index[0]["pred"]}
    assert terminal == named == {"delivered", "dead", "cancelled", "superseded"}
    async with conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        plan = await rows(
            conn,
            "EXPLAIN SELECT min(finished_at) FROM pgwork.renewal_work"
            " WHERE pgwork.is_terminal(status)",
        )
    assert "work_terminal" in "\n".join(r["QUERY PLAN"] for r in plan)


async def test_row_level_security_keeps_apps_to_their_own_sources(
    dsn: str, conn: psycopg.AsyncConnection[Any]
) -> None:
    """Two app roles, each granted one source: with row-level security on, neither can read,
    move or cancel the other's reminders, or write into its source; the daemon (the owner)
    still sees all."""
    import os

    a, b = f"app_a_{os.getpid()}", f"app_b_{os.getpid()}"
    for role, source in ((a, "leases"), (b, "billing")):
        await conn.execute(f'CREATE ROLE "{role}" LOGIN IN ROLE pgwork_app')
        await conn.execute("INSERT INTO pgwork.app_source VALUES (%s, %s)", (role, source))
    try:
        await conn.execute("ALTER TABLE pgwork.reminder ENABLE ROW LEVEL SECURITY")
        await add(conn, "theirs", source="billing", channel="log")
        before = await rows(
            conn, "SELECT due_at FROM pgwork.reminder WHERE business_key = 'theirs'"
        )

        async def as_role(role: str, sql: str, params: Any = None) -> list[dict[str, Any]]:
            async with await psycopg.AsyncConnection.connect(dsn, user=role, autocommit=True) as c:
                cur = await c.execute(sql, params)
                return (
                    [
                        dict(zip([d.name for d in cur.description], r, strict=True))
                        for r in await cur.fetchall()
                    ]
                    if cur.description
                    else [{"rowcount": cur.rowcount}]
                )

        insert = (
            "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient) "
            "VALUES (%s, %s, now() + interval '1 day', 'log', 'r') RETURNING business_key"
        )
        assert await as_role(a, insert, ("leases", "mine")) == [{"business_key": "mine"}]
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            await as_role(a, insert, ("billing", "sneaky"))
        assert await as_role(a, "SELECT business_key FROM pgwork.reminder") == [
            {"business_key": "mine"}
        ]
        assert await as_role(a, "SELECT business_key FROM pgwork.reminder_status") == [
            {"business_key": "mine"}
        ]
        moved = "UPDATE pgwork.reminder SET due_at = due_at + interval '1 day' WHERE business_key = 'theirs'"
        assert await as_role(a, moved) == [{"rowcount": 0}]
        cancelled = "DELETE FROM pgwork.reminder WHERE business_key = 'theirs'"
        assert await as_role(a, cancelled) == [{"rowcount": 0}]
        # Moving one's own reminder into another source is refused too.
        with pytest.raises(psycopg.errors.CheckViolation):
            await as_role(
                a, "UPDATE pgwork.reminder SET source = 'billing' WHERE business_key = 'mine'"
            )
        assert await as_role(b, "SELECT business_key FROM pgwork.reminder_status") == [
            {"business_key": "theirs"}
        ]
        # The owner (what the daemon connects as) sees every source.
        got = await rows(conn, "SELECT business_key FROM pgwork.reminder_status ORDER BY 1")
        assert [r["business_key"] for r in got] == ["mine", "theirs"]
        after = await rows(conn, "SELECT due_at FROM pgwork.reminder WHERE business_key = 'theirs'")
        assert after == before  # neither moved nor cancelled
    finally:
        for role in (a, b):
            await conn.execute(f'DROP OWNED BY "{role}"')
            await conn.execute(f'DROP ROLE "{role}"')


async def test_a_send_before_the_deadline_never_fires_after_it_in_a_dst_gap(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """Issue 25 (also): on Lord Howe Island clocks go from 02:00 to 02:30. A deadline at 02:30
    (the first valid minute) with a send one minute before: 02:29 does not exist, and shifted
    forward by the gap it fired at 02:59, half an hour after its own deadline. It is clamped to
    the deadline."""
    await conn.execute(
        "INSERT INTO pgwork.reminder (source, business_key, due_local, due_tz, remind_before,"
        " channel, recipient) VALUES ('s', 'gap', '2027-10-03 02:30', 'Australia/Lord_Howe',"
        " '{1 minute, 10 minutes, 0}', 'log', 'r')"
    )
    got = await rows(
        conn,
        "SELECT remind_before, send_at, deadline FROM pgwork.reminder_status"
        " WHERE business_key = 'gap' ORDER BY remind_before",
    )
    deadline = datetime(2027, 10, 2, 15, 30, tzinfo=UTC)
    assert [(r["send_at"], r["deadline"]) for r in got] == [
        (deadline, deadline),  # 0
        (deadline, deadline),  # 1 minute: 02:29 is in the gap; clamped to the deadline
        # 10 minutes: 02:20 is in the gap too; shifted forward (02:50 local) it would be late
        (deadline, deadline),
    ]
    (r,) = await rows(conn, "SELECT next_fire_at, due_at FROM pgwork.reminder")
    assert r["next_fire_at"] <= r["due_at"]


# -- where the SQL lives ---------------------------------------------------------------------

SQL = Path(__file__).resolve().parent.parent / "pgwork" / "sql"
_DEFINES = re.compile(
    r"^CREATE (?:OR REPLACE )?(FUNCTION|TRIGGER|VIEW|POLICY) (pgwork\.\w+|\w+)", re.MULTILINE
)


def _definitions(text: str) -> list[tuple[str, str]]:
    return [(kind, name) for kind, name in _DEFINES.findall(text)]


def test_every_function_trigger_view_and_policy_is_defined_in_one_code_file() -> None:
    from pgwork.queries import CODE

    files = sorted(p.stem for p in (SQL / "code").glob("*.sql"))
    assert sorted(CODE) == files, "pgwork.queries.CODE lists every code file, once"
    seen: dict[tuple[str, str], str] = {}
    for name in CODE:
        for d in _definitions((SQL / "code" / f"{name}.sql").read_text()):
            assert d not in seen, f"{d} is defined in {seen[d]} and {name}"
            seen[d] = name
    assert len(seen) > 40
    # The tables file holds tables; the only function there is the domains' value rule.
    assert _definitions((SQL / "schema.sql").read_text()) == [("FUNCTION", "pgwork.is_trimmed")]


def test_migrations_carry_table_changes_and_no_copy_of_the_code() -> None:
    """A migration from 15 on defines no function, trigger, view or policy: those are the code
    files' (re-applied by migrate). Older steps keep what is history: earlier versions of the
    code, which their own later statements use; never a copy of the code as it is now."""
    from pgwork import SCHEMA_VERSION
    from pgwork.queries import CODE

    code = "\n".join((SQL / "code" / f"{n}.sql").read_text() for n in CODE)
    bodies = {
        m.group(1): m.group(2)
        for m in re.finditer(
            r"^CREATE OR REPLACE FUNCTION (pgwork\.\w+)\(.*?((\$\w*\$).*?\3)", code, re.M | re.S
        )
    }
    assert len(bodies) > 20
    #: 010's version of the status view (history) calls rls_exempt before the code is applied.
    needed_by_history = {10: {"pgwork.rls_exempt"}}
    for step in range(2, SCHEMA_VERSION + 1):
        text = (SQL / "migrations" / f"{step:03d}.sql").read_text()
        if step >= 15:
            assert not _definitions(text), f"{step:03d}.sql defines code: move it to code/"
        copied = {n for n, b in bodies.items() if b in text} - needed_by_history.get(step, set())
        assert not copied, f"{step:03d}.sql repeats the code of {sorted(copied)}"


def test_a_migration_from_25_on_changes_a_table() -> None:
    """From schema 25 on a code change is applied by its checksum (no version): a migration that
    changes no table (comment-only ones, like 018, 019 and 021, which existed only to ship code)
    is refused here. A table change: a table, column, index, constraint, type, domain, role,
    grant or row the tables hold."""
    from pgwork import SCHEMA_VERSION
    from pgwork.db import CODE_SINCE

    ddl = re.compile(
        r"^\s*(CREATE|ALTER|DROP)\s+(TABLE|INDEX|TYPE|DOMAIN|ROLE|SEQUENCE|EXTENSION)\b"
        r"|^\s*(CREATE\s+(UNIQUE\s+)?INDEX|GRANT|REVOKE|INSERT|UPDATE|DELETE)\b",
        re.I | re.M,
    )
    assert ddl.search("ALTER TABLE pgwork.x ADD COLUMN y int;")
    assert not ddl.search("-- ALTER TABLE in a comment\nSELECT 1;".split("\n", 1)[1])
    for step in range(CODE_SINCE, SCHEMA_VERSION + 1):
        text = re.sub(r"--[^\n]*", "", (SQL / "migrations" / f"{step:03d}.sql").read_text())
        assert ddl.search(text), f"{step:03d}.sql changes no table: a code change needs none"


async def test_a_migration_waits_for_a_lock_a_bounded_time_and_tries_again(empty_dsn: str) -> None:
    """An upgrade whose lock an app's transaction holds no longer queues for as long as that
    transaction lasts, with every later app statement on the table queued behind it: it gives
    up the lock request after migration.MIGRATE_LOCK_TIMEOUT, so the app queued behind it goes on, and
    tries again, succeeding once the holder is done."""
    import time

    schema = old_schema(13)
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(schema)
    holder = await psycopg.AsyncConnection.connect(empty_dsn)
    other = await psycopg.AsyncConnection.connect(empty_dsn)
    migrator = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    waited: list[float] = []
    said: list[str] = []
    try:
        # An open transaction that wrote pgwork.retired (schema 14 indexes it: a SHARE lock).
        await holder.execute("LOCK TABLE pgwork.retired IN ROW EXCLUSIVE MODE")

        async def migrating() -> None:
            said.append(await migration.migrate(migrator))

        async def app_write() -> None:
            await anyio.sleep(0.5)  # the migration's lock request is queued by now
            t = time.monotonic()
            await other.execute("LOCK TABLE pgwork.retired IN ROW EXCLUSIVE MODE")
            waited.append(time.monotonic() - t)
            await other.commit()

        async with anyio.create_task_group() as tg:
            tg.start_soon(migrating)
            tg.start_soon(app_write)
            await anyio.sleep(3.5)
            await holder.commit()  # the holder ends: the next attempt gets its lock
    finally:
        for c2 in (holder, other, migrator):
            await c2.close()
    assert said == [f"upgraded pgwork schema from version 13 to {SCHEMA_VERSION}"]
    assert waited and waited[0] < 2.5, waited  # not the 3.5 s the holder held on


def test_migrations_pass_the_migration_linter() -> None:
    """squawk (squawk-cli) over every migration, with .squawk.toml: a landed step's warnings are
    accepted for its whole file, as history; a new step may accept one only beside its statement,
    with the reason on the line above (squawk reads the ignore on the line just before)."""
    import shutil
    import subprocess
    import sys

    squawk = shutil.which("squawk", path=str(Path(sys.executable).parent)) or shutil.which("squawk")
    assert squawk, "squawk-cli is a dev dependency (pyproject.toml)"
    root = SQL.parent.parent
    files = sorted((SQL / "migrations").glob("*.sql"))
    r = subprocess.run(
        [squawk, "-c", str(root / ".squawk.toml"), "--reporter", "gcc", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for f in files:
        lines = f.read_text().splitlines()
        if int(f.stem) > 14:
            assert not any("squawk-ignore-file" in ln for ln in lines), f"{f.name}: per statement"
        for n, line in enumerate(lines):
            if line.startswith("-- squawk-ignore ") and int(f.stem) > 14:
                assert n > 0 and lines[n - 1].startswith("-- ") and len(lines[n - 1]) > 20, (
                    f"{f.name}:{n + 1}: say why it is safe on the line above"
                )


async def test_an_index_built_after_the_commit_is_built_again_when_left_invalid(
    empty_dsn: str,
) -> None:
    """Schema 14's index on the tombstones is built concurrently after the migration commits
    (it never stops an app's delete); a build an interruption left invalid is dropped and built
    again by the next `pgwork migrate`."""
    schema = old_schema(13)
    valid = (
        "SELECT i.indisvalid FROM pg_index i "
        "WHERE i.indexrelid = 'pgwork.retired_series_deadline'::regclass"
    )
    async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
        await c.execute(schema)
        await migration.migrate(c)
        assert (await rows(c, valid))[0]["indisvalid"] is True
        # What an interrupted CREATE INDEX CONCURRENTLY leaves behind.
        await c.execute(
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = 'pgwork.retired_series_deadline'::regclass"
        )
        assert "already" in await migration.migrate(c)
        assert (await rows(c, valid))[0]["indisvalid"] is True


async def test_the_status_names_are_the_tables(conn: psycopg.AsyncConnection[Any]) -> None:
    """store.Status spells what pgwork.renewal_work's constraint allows, no more, no less."""
    from pgwork.store import Status

    got = await rows(
        conn,
        "SELECT pg_get_constraintdef(oid) AS d FROM pg_constraint "
        "WHERE conrelid = 'pgwork.renewal_work'::regclass AND contype = 'c' "
        "AND pg_get_constraintdef(oid) LIKE '%%status = ANY%%'",
    )
    allowed = set(re.findall(r"'(\w+)'::text", got[0]["d"]))
    assert allowed == {s.value for s in Status}


def _ones_payload(text_bytes: int) -> str:
    """A payload of exactly ``text_bytes`` bytes as JSON text (as PostgreSQL writes jsonb:
    ``{"a": [1, 1, …], "p": "xx…"}``), most of it an array of ones: the densest binary form,
    about four times its text."""
    ones = (text_bytes - 40) // 3
    head = '{"a": [' + ", ".join(["1"] * ones) + '], "p": "'
    return head + "x" * (text_bytes - len(head) - 2) + '"}'


@pytest.mark.parametrize("how", ["insert", "update"])
async def test_the_payload_limit_is_64_kib_of_json_text_on_both_sides(
    conn: psycopg.AsyncConnection[Any], how: str
) -> None:
    """The documented limit is 64 KiB as JSON text. A table constraint measured the binary jsonb
    before compression instead: an array of 6,000 ones (18 KB of text, 72 KB binary) was
    refused. At 65,536 bytes of text, in the densest binary form, a payload is accepted; one
    byte more is refused, naming the limit."""
    at, over = _ones_payload(65536), _ones_payload(65537)
    for text, size in ((at, 65536), (over, 65537)):
        got = await rows(conn, "SELECT octet_length(%s::jsonb::text) AS n", (text,))
        assert got[0]["n"] == size
    await add(conn, "k", channel="log")
    write = (
        "INSERT INTO pgwork.reminder (source, business_key, due_at, channel, recipient, payload) "
        "VALUES ('s', 'big', now() + interval '1 day', 'log', 'r', %s::jsonb)"
        if how == "insert"
        else "UPDATE pgwork.reminder SET payload = %s::jsonb WHERE business_key = 'k'"
    )
    with pytest.raises(errors.CheckViolation, match=r"at most 65536 \(64 KiB\) as JSON text"):
        await conn.execute(write, (over,))
    await conn.execute(write, (at,))
    got = await rows(
        conn, "SELECT octet_length(payload::text) AS n FROM pgwork.reminder WHERE payload ? 'a'"
    )
    assert got == [{"n": 65536}]
