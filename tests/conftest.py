"""Test fixtures: a real PostgreSQL server for the whole session, a migrated template database,
and a fresh clone of it per test. Never a mock of the database, and no skip for want of one.

The server is the embedded one (PostgreSQL 18 from the wheel) unless ``PGWORK_TEST_PGBIN`` names
another bin directory (CI runs the suite again with Debian's PostgreSQL 15), or
``PGWORK_TEST_DSN`` points at an existing server (an admin DSN that may create databases).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgwork import migration
from pgwork.embedded import LocalServer

from .helpers import FAST_SETTINGS

_counter = itertools.count()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def admin_dsn() -> Iterator[str]:
    given = os.environ.get("PGWORK_TEST_DSN")
    if given:
        yield given
        return
    bin_dir = os.environ.get("PGWORK_TEST_PGBIN")
    tmp = Path(tempfile.mkdtemp(prefix="pgwork-test-"))
    os.chmod(tmp, 0o755)
    server = LocalServer(tmp / "data", Path(bin_dir) if bin_dir else None, settings=FAST_SETTINGS)
    try:
        server.start()
        yield server.dsn()
    finally:
        server.destroy()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def template_db(admin_dsn: str) -> Iterator[str]:
    name = f"pgwork_tpl_{os.getpid()}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')

    async def setup() -> None:
        conn = await psycopg.AsyncConnection.connect(
            make_conninfo(admin_dsn, dbname=name), autocommit=True
        )
        try:
            await migration.migrate(conn)
            await conn.execute(
                "INSERT INTO pgwork.channel (name, kind) VALUES ('log', 'log'), ('test', 'python'), "
                "('hook', 'webhook')"
            )
        finally:
            await conn.close()

    anyio.run(setup)
    try:
        yield name
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_db(admin_dsn: str, template: str | None) -> tuple[str, str]:
    name = f"pgwork_t_{os.getpid()}_{next(_counter)}"
    tpl = f' TEMPLATE "{template}" STRATEGY FILE_COPY' if template else ""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{tpl}')
    return name, make_conninfo(admin_dsn, dbname=name)


def drop_db(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def dsn(admin_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    name, conninfo = create_db(admin_dsn, template_db)
    try:
        yield conninfo
    finally:
        drop_db(admin_dsn, name)


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A fresh database without the pgwork schema."""
    name, conninfo = create_db(admin_dsn, None)
    try:
        yield conninfo
    finally:
        drop_db(admin_dsn, name)


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A plain connection, as another app would have (no pgwork session settings). When the
    test is done, the queue's invariant must hold in its database (pgwork.work_invariant: every
    live work row has one ready or lease row, a terminal one neither), whatever it did."""
    c = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        yield c
        if not c.closed and c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            cur = await c.execute(
                "SELECT to_regprocedure('pgwork.work_invariant()') IS NOT NULL"
                " AND to_regclass('pgwork.work_ready') IS NOT NULL"
            )
            row = await cur.fetchone()
            if row is not None and row[0]:
                cur = await c.execute("SELECT * FROM pgwork.work_invariant() LIMIT 10")
                broken = await cur.fetchall()
                assert broken == [], f"the queue's invariant is broken: {broken}"
    finally:
        await c.close()


@pytest.fixture
def clean_sink() -> Iterator[None]:
    """The Python test channel (tests/sink.py) starts and ends empty."""
    from . import sink

    sink.reset()
    yield
    sink.reset()


from .pgbouncer import pgbouncer  # noqa: E402, F401  (a transaction-pooling PgBouncer)
from .processes import procs  # noqa: E402, F401  (the daemon-process fixture)
