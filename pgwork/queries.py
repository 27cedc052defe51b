"""Every SQL statement pgwork runs, loaded by name from ``sql/queries/``: a file per room (the
schema, the materialiser, delivery, ...), each statement named once across them, bound in the
``pgwork.store`` module of the same name. Runtime code holds no other SQL."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any, LiteralString, NamedTuple, cast

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def _load(text: str) -> dict[str, LiteralString]:
    parts = _NAME.split(text)
    queries: dict[str, LiteralString] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise RuntimeError(f"a room names {name!r} twice")
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        queries[name] = cast(LiteralString, "\n".join(lines).strip())  # type: ignore[redundant-cast]
    return queries


def _read(name: str) -> str:
    return resources.files("pgwork").joinpath("sql", name).read_text(encoding="utf-8")


def rooms() -> dict[str, dict[str, LiteralString]]:
    """Each room's statements, by the room's name (its file's, and its store module's)."""
    found = resources.files("pgwork").joinpath("sql", "queries")
    return {
        f.name.removesuffix(".sql"): _load(f.read_text(encoding="utf-8"))
        for f in sorted(found.iterdir(), key=lambda f: f.name)
        if f.name.endswith(".sql")
    }


def _all() -> dict[str, LiteralString]:
    queries: dict[str, LiteralString] = {}
    for room, statements in rooms().items():
        for name, sql in statements.items():
            if name in queries:
                raise RuntimeError(f"queries/{room}.sql names {name!r}, named in another room too")
            queries[name] = sql
    return queries


Q: dict[str, LiteralString] = _all()

#: psycopg converts ``%(name)s`` to ``$n`` on every execute, and caches the conversion only for
#: statements up to 4,096 characters (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``); the
#: longer ones (record_outcomes: per batch) are converted here once instead
#: (bench/README.md, "Per-delivery code"; tests/test_hot_path.py::
#: test_long_statements_are_sent_as_psycopg_would_send_them).
LONG = 4096

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%|%")


class Positional(NamedTuple):
    """A statement with ``$n`` placeholders, for a raw cursor, and the names they stand for."""

    sql: LiteralString
    names: tuple[str, ...]

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        return [params[n] for n in self.names]


def positional(sql: str) -> Positional:
    """``sql`` as psycopg would send it: each distinct ``%(name)s`` becomes ``$n`` in order of
    first use, ``%%`` becomes ``%``; any other ``%`` is an error, as it is for psycopg."""
    names: list[str] = []

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "%%":
            return "%"
        if m.group(1) is None:
            raise ValueError(f"a lone % at {m.start()} in: {sql[:60]!r}")
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    text = _PLACEHOLDER.sub(one, sql)
    return Positional(cast(LiteralString, text), tuple(names))  # type: ignore[redundant-cast]


#: The statements longer than LONG, converted once.
P: dict[str, Positional] = {name: positional(sql) for name, sql in Q.items() if len(sql) > LONG}


#: The code files (functions, triggers, views, policies, grants), one per concern, in the order
#: they are applied: each uses only what the tables and the files before it define.
CODE = (
    "occurrence",
    "recurrence",
    "work",
    "claim",
    "reminder_triggers",
    "channel_control",
    "daemons",
    "tenancy",
    "app_views",
    "series",
    "page",
    "migrate",
    "roles",
)

#: In a migration, what follows this line runs after the code files: a backfill that calls the
#: new code (the rest of the migration runs before them, with the code of the version it left).
AFTER_CODE = "-- pgwork: after the code"
#: In a migration, what follows this line (its last part) runs after the migration's commit,
#: outside any transaction: ``CREATE INDEX CONCURRENTLY IF NOT EXISTS`` statements, which never
#: stop the apps' writes; one an interruption left invalid is built again by the next migrate.
CONCURRENTLY = "-- pgwork: concurrently"


def tables_sql() -> LiteralString:
    """The tables of a fresh install (``schema.sql``)."""
    return cast(LiteralString, _read("schema.sql"))  # type: ignore[redundant-cast]


#: Code statements that lock a table apps write (a trigger, a policy) or read (a view) until
#: the migration commits: applied last, after the backfills, so apps wait only for the commit.
_ATTACHES = re.compile(
    r"\s*(?:--[^\n]*\n\s*)*(CREATE OR REPLACE (TRIGGER|VIEW)|(CREATE|DROP) POLICY|COMMENT ON VIEW)"
)


def code_sql() -> tuple[LiteralString, LiteralString]:
    """Every code file, in order, as two parts: the functions, which lock no table apps use;
    then the triggers, policies and views that attach them to tables, and the grants (the last
    file: they name the view)."""
    functions: list[str] = []
    attaches: list[str] = []
    for name in CODE:
        for statement in statements(_read(f"code/{name}.sql")):
            last = name == CODE[-1]
            (attaches if last or _ATTACHES.match(statement) else functions).append(statement)
    return (
        cast(LiteralString, "".join(functions)),  # type: ignore[redundant-cast]
        cast(LiteralString, "".join(attaches)),  # type: ignore[redundant-cast]
    )


def code_checksum() -> str:
    """The checksum of the SQL code (every file of ``sql/code/``, named, in order): stored beside
    the schema version by `pgwork migrate`, compared by every daemon and command."""
    h = hashlib.sha256()
    for name in CODE:
        h.update(f"{name}\0".encode())
        h.update(_read(f"code/{name}.sql").encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


_CREATES_FUNCTION = re.compile(r"\s*(?:--[^\n]*\n\s*)*CREATE OR REPLACE FUNCTION pgwork\.(\w+)\(")


def code_functions() -> tuple[LiteralString, tuple[str, ...]]:
    """The code's CREATE OR REPLACE FUNCTION statements, in order, and the names they define."""
    creates: list[str] = []
    names: list[str] = []
    for name in CODE:
        for statement in statements(_read(f"code/{name}.sql")):
            if m := _CREATES_FUNCTION.match(statement):
                creates.append(statement)
                names.append(m.group(1))
    return cast(LiteralString, "".join(creates)), tuple(names)  # type: ignore[redundant-cast]


_DOLLAR = re.compile(r"\$\w*\$")


def statements(text: str) -> list[str]:
    """``text`` split after each top-level ``;`` (not inside quotes, dollar quotes or comments),
    each statement with the comment lines before it."""
    out: list[str] = []
    start = i = 0
    n = len(text)
    while i < n:
        if text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text[i] == "'":
            j = i + 1
            while True:
                j = text.find("'", j)
                if j < 0 or not text.startswith("''", j):
                    break
                j += 2
            i = n if j < 0 else j + 1
        elif (m := _DOLLAR.match(text, i)) is not None:
            j = text.find(m.group(0), m.end())
            i = n if j < 0 else j + len(m.group(0))
        elif text[i] == ";":
            out.append(text[start : i + 1] + "\n")
            start = i = i + 1
        else:
            i += 1
    if text[start:].strip():
        out.append(text[start:])
    return out


class Step(NamedTuple):
    """One migration: what runs before the code files, what after them (``AFTER_CODE``), and
    the indexes built after the commit (``CONCURRENTLY``), one statement each."""

    before: LiteralString
    after: LiteralString
    concurrently: tuple[LiteralString, ...]


def migration_sql(version: int) -> Step:
    """The step that brings the tables from ``version - 1`` to ``version``
    (``migrations/NNN.sql``)."""
    return split_migration(_read(f"migrations/{version:03d}.sql"))


def split_migration(text: str) -> Step:
    text, _, concurrent = text.partition(CONCURRENTLY)
    before, _, after = text.partition(AFTER_CODE)
    return Step(
        cast(LiteralString, before),  # type: ignore[redundant-cast]
        cast(LiteralString, after),  # type: ignore[redundant-cast]
        tuple(cast(LiteralString, s) for s in statements(concurrent) if s.strip()),  # type: ignore[redundant-cast]
    )


def migration_count() -> int:
    """How many migration files ship (the last one's number)."""
    names = resources.files("pgwork").joinpath("sql", "migrations").iterdir()
    return max(int(p.name[:3]) for p in names if p.name.endswith(".sql"))
