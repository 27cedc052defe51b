"""What happened to one reminder: the reminder, its next occurrences, every work row with its
attempts, and what retention kept of older ones (``pgwork reminder``, the web page's
``/reminder``). Read-only, from the daemon's role."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from . import store
from .db import one_rows_doing
from .durations import say_duration
from .store import Conn

#: How many occurrences (work rows, tombstones) are shown, the latest first.
DEFAULT_LIMIT = 100


@dataclass(frozen=True)
class History:
    source: str
    business_key: str
    #: As stored; None when it was deleted (or never existed).
    reminder: dict[str, Any] | None
    #: The next occurrence per remind_before entry (``pgwork.reminder_status``).
    upcoming: list[dict[str, Any]]
    #: Work rows, the latest deadline first, each with its ``attempts_ledger``.
    occurrences: list[dict[str, Any]]
    #: Older occurrences whose rows retention removed: identity and outcome only.
    retired: list[dict[str, Any]]
    now: datetime
    #: Why its next occurrences cannot be worked out (a row the triggers never checked, a zone
    #: the server no longer knows: the materialiser sets such a reminder aside); None: they can.
    upcoming_error: str | None = None
    #: A daemon's record of setting it aside (``pgwork.set_aside``), while it stays unmade.
    set_aside: dict[str, Any] | None = None
    #: Sessions whose open transaction holds its row: the materialiser skips it until they end.
    locked_by: list[dict[str, Any]] = field(default_factory=list)

    def locked_text(self) -> str | None:
        """Who holds its row, as the materialiser's wait is explained to an operator."""
        if not self.locked_by:
            return None
        who = "; ".join(
            f"pid {h['pid']}"
            + "".join(
                f" {label} {h[k]}"
                for label, k in (("role", "role"), ("app", "application_name"))
                if h[k]
            )
            + (f" from {h['client_addr']}" if h["client_addr"] else "")
            + (f", {h['state']}" if h["state"] else "")
            + (
                f", transaction open since {h['xact_start'].isoformat(sep=' ', timespec='seconds')}"
                if h["xact_start"]
                else ""
            )
            for h in self.locked_by
        )
        return (
            f"row locked by {who}: the materialiser skips it (its due sends wait) until that "
            "transaction ends"
        )

    def set_aside_text(self) -> str | None:
        """Who set it aside, since when, and when it is tried again."""
        a = self.set_aside
        if a is None:
            return None
        since, again = (
            a[k].isoformat(sep=" ", timespec="seconds") for k in ("since", "next_try_at")
        )
        tries = f"{a['tries']} {'try' if a['tries'] == 1 else 'tries'}"
        return (
            f"set aside by {a['daemon_id']} since {since} ({tries}; next try {again}): {a['error']}"
        )

    @property
    def known(self) -> bool:
        return self.reminder is not None or bool(self.occurrences)

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "business_key": self.business_key,
            "reminder": self.reminder,
            "upcoming": self.upcoming,
            "upcoming_error": self.upcoming_error,
            "set_aside": self.set_aside,
            "locked_by": self.locked_by,
            "occurrences": self.occurrences,
            "retired": self.retired,
        }


def attempts_text(attempts: int, base: int) -> str:
    """A row's attempts as every view says them: all of them, and, when some do not count
    against its budget (those before a redrive, which gave it a fresh one, or refused by a
    paused channel's 410), those that do: ``3 (1 toward max_attempts)``."""
    return f"{attempts} ({attempts - base} toward max_attempts)" if base else str(attempts)


def took_ms(took: timedelta | None) -> str | None:
    """An attempt's duration as people read it (``12 ms``)."""
    return None if took is None else f"{took.total_seconds() * 1000:.0f} ms"


def state(
    row: dict[str, Any],
    now: datetime,
    channel: store.ChannelState | None = None,
    expire_after: float | None = None,
) -> str:
    """A work row's status, saying when a ready row is not claimable yet: a look-ahead row
    before its due time, a retry before its next try, or its channel (``channel``) paused or
    throttled; and when it will not be sent at all: past its channel's ``expire_after``
    (seconds, as the daemon's config says) by the time it can be claimed."""
    if row["status"] != store.Status.READY:
        return str(row["status"])
    base = "ready"
    if row["available_at"] > now:
        base = "retry waiting" if row["attempts"] else "ready, not yet due"
    if expire_after is not None:
        # As the claim decides: from the later of its due time and its last redrive.
        since = max(t for t in (row["due_at"], row["redriven_at"]) if t is not None)
        ends = since + timedelta(seconds=expire_after)
        if ends < max(now, row["available_at"]):
            base += (
                f", past its channel's expire_after ({say_duration(expire_after)}) since "
                f"{ends.isoformat(sep=' ', timespec='seconds')}: its next claim closes it as "
                "expired, not sent"
            )
    if channel is not None and channel.paused:
        return (
            f"{base}, channel {channel.name} PAUSED: {channel.paused_reason or 'no reason given'}"
            f" (by {channel.paused_by})"
        )
    if channel is not None and channel.throttled:
        return f"{base}, channel {channel.name} THROTTLED: {channel.throttle_reason or ''}"
    return base


def _at(t: datetime | None) -> str:
    return "-" if t is None else t.isoformat(sep=" ", timespec="seconds")


def channel_state(c: store.ChannelState) -> tuple[str, str]:
    """A channel's state in a word (``running``, ``PAUSED``, ``THROTTLED``) and why, as
    ``channel list``, ``status`` and the web page say it."""
    if c.paused:
        return "PAUSED", (
            f"{c.paused_reason or 'no reason given'} (by {c.paused_by}, {_at(c.paused_at)})"
        )
    if c.throttled:
        if c.throttled_for_seconds:
            return "THROTTLED", (
                f"{c.throttle_reason or ''}; held {c.throttled_for_seconds:.1f}s more"
                + (f", then at most {c.throttle_limit} claimed at once" if c.throttle_limit else "")
            )
        return "THROTTLED", (
            f"{c.throttle_reason or ''}; {c.claimed} of at most {c.throttle_limit} claimed"
        )
    if c.recovering:
        return "running", (
            f"recovering from a throttle ({c.throttle_reason or ''}): at most "
            f"{c.throttle_limit} claimed at once, one more per success, lifted at "
            f"{c.throttle_from}"
        )
    return "running", ""


async def reminder_history(
    conn: Conn,
    *,
    source: str,
    business_key: str,
    limit: int = DEFAULT_LIMIT,
    expire_after: Mapping[str, float | None] | None = None,
) -> History:
    """``expire_after``: each channel's, in seconds, from the config (the daemon's setting, not
    stored in the database); a channel missing from it is not judged."""
    expiries = expire_after or {}
    reminder = await store.history_reminder(conn, source=source, business_key=business_key)
    rid = reminder["id"] if reminder else None
    upcoming: list[dict[str, Any]] = []
    upcoming_error = None
    if reminder:
        try:
            async with conn.transaction():  # a savepoint when the caller holds a transaction
                upcoming = await store.history_upcoming(
                    conn, source=source, business_key=business_key
                )
        except psycopg.DatabaseError as e:
            if not one_rows_doing(e):
                raise
            # Its row's doing (the class decides, as for the materialiser's pages): the rest
            # of what happened to it is still shown.
            upcoming_error = str(e).strip().splitlines()[0]
    work = await store.history_work(
        conn, reminder_id=rid, source=source, business_key=business_key, limit=limit
    )
    ledger: dict[int, list[dict[str, Any]]] = {w["id"]: [] for w in work}
    if work:
        for a in await store.history_attempts(conn, work_ids=list(ledger)):
            ledger[a.pop("work_id")].append(a)
    now = await store.db_now(conn)
    held = {w["channel"] for w in work if w["status"] == store.Status.READY}
    channels = (
        {c.name: c for c in await store.channel_states(conn) if c.name in held} if held else {}
    )
    occurrences = [
        {
            **w,
            "state": state(w, now, channels.get(w["channel"]), expiries.get(w["channel"])),
            "attempts_ledger": ledger[w["id"]],
        }
        for w in work
    ]
    # A next send whose work row is shown below is in that row's state (a ready row not due yet,
    # a retry waiting), so the two never disagree; one not made yet is in the view's status.
    made = {(w["deadline"], w["occurrence"]): w["state"] for w in occurrences}
    upcoming = [
        {**u, "state": made.get((u["deadline"], u["remind_before"]), u["status"])} for u in upcoming
    ]
    retired = await store.history_retired(conn, reminder_id=rid, limit=limit) if rid else []
    aside = await store.set_aside_list(conn, reminder_id=rid, limit=1) if rid else []
    locked_by = await store.history_lockers(conn, reminder_id=rid) if rid else []
    return History(
        source,
        business_key,
        reminder,
        upcoming,
        occurrences,
        retired,
        now,
        upcoming_error,
        asdict(aside[0]) if aside else None,
        locked_by,
    )
