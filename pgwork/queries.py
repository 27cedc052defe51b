"""Every SQL statement pgwork runs, loaded by name from ``sql/queries.sql``."""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString, cast

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def compact(sql: str) -> str:
    """``sql`` without its ``--`` comments and with every run of whitespace outside quotes made
    one space. Quoted text ('literals', "identifiers") is kept exactly. The statements are sent
    this way: psycopg caches the conversion of its ``%(name)s`` placeholders only for queries of
    up to 4 KiB, and parsing a longer one again costs ~0.2 ms of Python per execution."""
    out: list[str] = []
    i, n = 0, len(sql)
    space = False
    while i < n:
        ch = sql[i]
        if ch in "'\"":
            j = i + 1
            while j < n:
                if sql[j] == ch:
                    if j + 1 < n and sql[j + 1] == ch:  # a doubled quote inside
                        j += 2
                        continue
                    break
                j += 1
            if j >= n:
                raise ValueError(f"unterminated {ch} quote at offset {i}")
            if space and out:
                out.append(" ")
            space = False
            out.append(sql[i : j + 1])
            i = j + 1
        elif sql.startswith("--", i):
            nl = sql.find("\n", i)
            i = n if nl < 0 else nl
            space = True
        elif ch.isspace():
            space = True
            i += 1
        else:
            if space and out:
                out.append(" ")
            space = False
            out.append(ch)
            i += 1
    return "".join(out)


def _load(text: str) -> dict[str, LiteralString]:
    parts = _NAME.split(text)
    queries: dict[str, LiteralString] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise RuntimeError(f"queries.sql names {name!r} twice")
        queries[name] = cast(LiteralString, compact(body))  # type: ignore[redundant-cast]
    return queries


def _read(name: str) -> str:
    return resources.files("pgwork").joinpath("sql", name).read_text(encoding="utf-8")


Q: dict[str, LiteralString] = _load(_read("queries.sql"))


def schema_sql() -> LiteralString:
    """The full current schema (``schema.sql``)."""
    return cast(LiteralString, _read("schema.sql"))  # type: ignore[redundant-cast]


def migration_sql(version: int) -> LiteralString:
    """The step that brings the schema from ``version - 1`` to ``version`` (``migrations/NNN.sql``)."""
    return cast(LiteralString, _read(f"migrations/{version:03d}.sql"))  # type: ignore[redundant-cast]
