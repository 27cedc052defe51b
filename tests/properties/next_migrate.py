"""A next-version `pgwork migrate` for the nemesis to kill: its one step sleeps three seconds in
the migration's transaction. ``python -m tests.properties.next_migrate DSN``."""

from __future__ import annotations

import sys

import anyio
import psycopg

from pgwork import SCHEMA_VERSION, migration


async def main(dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name="pgwork nemesis migrate"
    )
    await migration.migrate(
        conn,
        version=SCHEMA_VERSION + 1,
        steps={SCHEMA_VERSION + 1: "SELECT pg_sleep(3);"},
        step_aside_within=60,
    )


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
