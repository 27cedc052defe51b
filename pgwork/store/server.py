"""The bindings of room server: the statements of the server itself: its clock, standby or primary,
LISTEN, a ping (``pgwork/sql/queries/server.sql``), one typed function each."""

from __future__ import annotations

from datetime import datetime

from ._bind import Conn, _exec, _value


async def db_now(conn: Conn) -> datetime:
    return await _value(conn, "db_now", datetime)


async def is_standby(conn: Conn) -> bool:
    return await _value(conn, "is_standby", bool)


async def listen(conn: Conn) -> None:
    await _exec(conn, "listen")


async def ping(conn: Conn) -> None:
    await _exec(conn, "ping")
