"""Every SQL statement pgwork runs, loaded by name from ``sql/queries.sql``."""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString, cast

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def _load(text: str) -> dict[str, LiteralString]:
    parts = _NAME.split(text)
    queries: dict[str, LiteralString] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise RuntimeError(f"queries.sql names {name!r} twice")
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        queries[name] = cast(LiteralString, "\n".join(lines).strip())  # type: ignore[redundant-cast]
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
