"""The bindings of room inspect: the statements of what an operator reads and redrives: dead
letters, rows, a reminder's history, pages of the web view (``pgwork/sql/queries/inspect.sql``),
one typed function each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from ..jsontext import JsonText
from ._bind import Conn, _dicts, _rows, _value


@dataclass(frozen=True)
class DeadLetter:
    id: int
    source: str
    business_key: str
    channel: str
    deadline: datetime
    occurrence: timedelta
    due_at: datetime
    attempts: int
    #: The attempts it had when last redriven (0: never): its budget counts from there.
    attempts_base: int
    dead_reason: str
    finished_at: datetime
    operation_id: UUID


async def dlq_list(
    conn: Conn,
    *,
    channel: str | None,
    source: str | None,
    older_than: timedelta | None,
    limit: int,
) -> list[DeadLetter]:
    return await _rows(
        conn,
        "dlq_list",
        DeadLetter,
        {"channel": channel, "source": source, "older_than": older_than, "limit": limit},
    )


async def work_get(conn: Conn, *, id: int) -> list[dict[str, Any]]:
    """Every column of one work row and its reminder, for ``pgwork dlq show``; the payload as
    its stored text (``JsonText``)."""
    return [_payload_as_text(r) for r in await _dicts(conn, "work_get", {"id": id})]


def _payload_as_text(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("payload") is not None:
        row["payload"] = JsonText(row["payload"])
    return row


async def work_attempts(conn: Conn, *, id: int) -> list[dict[str, Any]]:
    """The attempt ledger of one work row, every column, for ``pgwork dlq show``."""
    return await _dicts(conn, "work_attempts", {"id": id})


@dataclass(frozen=True)
class Redriven:
    id: int
    #: ok, or why not: cancelled, superseded.
    verdict: str
    notified: int


async def dlq_redrive(
    conn: Conn,
    *,
    all: bool,
    ids: list[int],
    channel: str | None,
    operator: str,
    since: timedelta | None = None,
    reason_like: str | None = None,
    source: str | None = None,
) -> list[Redriven]:
    return await _rows(
        conn,
        "dlq_redrive",
        Redriven,
        {
            "all": all,
            "ids": ids,
            "channel": channel,
            "source": source,
            "operator": operator,
            "since": since,
            "reason_like": reason_like,
        },
    )


async def live_page(
    conn: Conn,
    *,
    channel: str,
    statuses: list[str],
    after: tuple[str, datetime, int] | None,
    limit: int,
) -> list[dict[str, Any]]:
    """One keyset page of a channel's live rows (``after``: the last row's source, available_at
    and id; None: the first page)."""
    src, at, id_ = after or ("", datetime.min.replace(tzinfo=UTC), 0)
    return await _dicts(
        conn,
        "live_page",
        {
            "channel": channel,
            "statuses": statuses,
            "after_source": src,
            "after_at": at,
            "after_id": id_,
            "limit": limit,
        },
    )


async def dead_page(
    conn: Conn,
    *,
    channel: str | None,
    source: str | None,
    reason_like: str | None,
    before: tuple[datetime, int] | None,
    limit: int,
    since: timedelta | None = None,
) -> list[dict[str, Any]]:
    """One keyset page of dead letters, newest first (``before``: the last row's finished_at and
    id; None: the first page)."""
    at, id_ = before or (datetime.max.replace(tzinfo=UTC), 2**63 - 1)
    return await _dicts(
        conn,
        "dead_page",
        {
            "channel": channel,
            "source": source,
            "since": since,
            "reason_like": reason_like,
            "before_at": at,
            "before_id": id_,
            "limit": limit,
        },
    )


async def reminders_page(
    conn: Conn, *, source: str, prefix: str, after: str, limit: int, scan: int = 2000
) -> list[dict[str, Any]]:
    """A source's reminders whose key starts with ``prefix``, by key, after ``after`` ('' for
    the first page), each with its latest work row's status."""
    return await _dicts(
        conn,
        "reminders_page",
        {"source": source, "prefix": prefix, "after": after, "limit": limit, "scan": scan},
    )


@dataclass(frozen=True)
class WorkStatus:
    id: int
    status: str


async def work_statuses(conn: Conn, ids: Sequence[int]) -> list[WorkStatus]:
    return await _rows(conn, "work_statuses", WorkStatus, {"ids": list(ids)})


async def channel_exists(conn: Conn, name: str) -> bool:
    return await _value(conn, "channel_exists", bool, {"name": name})


async def retrying(conn: Conn, *, channel: str | None, limit: int) -> list[dict[str, Any]]:
    """Rows waiting for their next try, the soonest first (``pgwork dlq retrying``)."""
    return await _dicts(conn, "retrying", {"channel": channel, "limit": limit})


async def history_reminder(conn: Conn, *, source: str, business_key: str) -> dict[str, Any] | None:
    """The reminder as stored, or None (``pgwork reminder``)."""
    got = await _dicts(conn, "history_reminder", {"source": source, "business_key": business_key})
    return _payload_as_text(got[0]) if got else None


async def history_upcoming(conn: Conn, *, source: str, business_key: str) -> list[dict[str, Any]]:
    """Its next occurrences and where each stands (``pgwork.reminder_status``)."""
    return await _dicts(conn, "history_upcoming", {"source": source, "business_key": business_key})


async def history_lockers(conn: Conn, *, reminder_id: int) -> list[dict[str, Any]]:
    """The sessions whose open transaction holds its row (the materialiser skips it meanwhile)."""
    return await _dicts(conn, "history_lockers", {"reminder_id": reminder_id})


async def history_work(
    conn: Conn, *, reminder_id: int | None, source: str, business_key: str, limit: int
) -> list[dict[str, Any]]:
    """Its work rows, the latest first: by the reminder's id, or by source and key once the
    reminder is gone."""
    if reminder_id is not None:
        return await _dicts(
            conn, "history_work_of_reminder", {"reminder_id": reminder_id, "limit": limit}
        )
    return await _dicts(
        conn,
        "history_work_of_key",
        {"source": source, "business_key": business_key, "limit": limit},
    )


async def history_attempts(conn: Conn, *, work_ids: Sequence[int]) -> list[dict[str, Any]]:
    """The attempt ledger of these work rows."""
    return await _dicts(conn, "history_attempts", {"work_ids": list(work_ids)})


async def history_retired(conn: Conn, *, reminder_id: int, limit: int) -> list[dict[str, Any]]:
    """The tombstones retention left of its older occurrences."""
    return await _dicts(conn, "history_retired", {"reminder_id": reminder_id, "limit": limit})


async def sources_unknown(conn: Conn, *, sources: Sequence[str]) -> list[str]:
    """Of ``sources``, those with no reminder at all."""
    got = await _dicts(conn, "sources_unknown", {"sources": list(sources)})
    return [r["source"] for r in got]
