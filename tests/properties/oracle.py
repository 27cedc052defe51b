"""The oracle: what a run's record must show, from the apps' writes alone.

The wanted occurrences are worked out here, not read from pgwork: a one-off's are its deadline
with each `remind_before` entry; a series' come from its rule by python-dateutil, from the
moment the series (re)started (docs/sql.md, "What each edit does": deadlines before it are
history) to the cutoff. What is judged:

- **one key**: every request for an occurrence carries the same idempotency key;
- **delivered**: every occurrence the final reminder wants that fired before the cutoff, on a
  channel some daemon serves at the end, got a 2xx (every probe of the other app too), unless
  the schedule's receiver made it a dead letter (a 400) and nobody redrove it;
- **closed means closed**: once an edit that drops an occurrence (a moved deadline, a deleted
  reminder, a dropped entry, a series edited, skipped, ended or paused) has committed, no request
  for it goes out but the attempt the edit found in flight (its lease; one more when that lease
  had expired, which a claim that read the reminder before the edit may have reissued), until
  an edit wants it again;
- **moved means moved**: after a reminder's channel changed, no request for its occurrences goes
  out on the old channel but the attempt in flight;
- **the recipient edited**: a request after the edit, past the attempt in flight, carries the new
  recipient;
- **isolation** (load schedules): every probe of the other app is delivered within
  ``ISOLATION_BOUND`` seconds of its due time plus one turn of the flood's sources (their number
  over the rate the channel delivered the flood at: the claim serves every source with due work
  in turn, docs/how-it-works.md, "One app cannot delay another")."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from dateutil.rrule import rrulestr

from .world import Record, Sent, Version, lateness

#: How late another app's reminder may be delivered beside any flood, seconds after its due
#: time (README.md and docs/how-it-works.md, "One app cannot delay another").
ISOLATION_BOUND = 2.0

Identity = tuple[str, str, str, float]


@dataclass(frozen=True)
class Window:
    """From ``t`` (wall clock) until ``end``: requests for ``identity`` past attempt
    ``allowed`` break a rule (``channel``: only those on that channel; ``recipient``: only
    those not carrying it)."""

    identity: Identity
    t: float
    end: float
    allowed: int
    what: str
    channel: str | None = None
    recipient: str | None = None


def _utc(d: datetime) -> str:
    return d.astimezone(UTC).isoformat()


def _series(row: dict[str, Any]) -> bool:
    return row.get("recur") is not None


def _restarts(versions: list[Version]) -> list[datetime | None]:
    """For each version, the moment its series (re)started (None for a one-off)."""
    out: list[datetime | None] = []
    prev: dict[str, Any] | None = None
    started: datetime | None = None
    for v in versions:
        row = v.row
        if row is None or not _series(row):
            out.append(None)
            prev = row
            continue
        keys = ("recur", "due_local", "due_tz", "before", "recur_until", "recur_skip", "paused")
        if prev is None or started is None or any(row[k] != prev[k] for k in keys):
            started = v.t_db
        out.append(started)
        prev = row
    return out


@functools.lru_cache(maxsize=256)
def _rule_near(recur: str, first: datetime) -> tuple[datetime, ...]:
    """A rule's local deadlines from an hour before its first deadline to four hours after
    (every run lasts minutes; its series are written at the run's start). Evaluated once per
    rule: a yearly rule with every month, day, hour and minute takes dateutil 0.2 s."""
    rule = rrulestr(recur, dtstart=first)
    return tuple(rule.between(first - timedelta(hours=1), first + timedelta(hours=4), inc=True))


def _rule_has(row: dict[str, Any], local: datetime) -> bool:
    near = _rule_near(row["recur"], row["due_local"])
    if near and near[0] <= local <= row["due_local"] + timedelta(hours=4):
        return local in near
    rule = rrulestr(row["recur"], dtstart=row["due_local"])
    return bool(rule.between(local, local, inc=True))


def _member(row: dict[str, Any], local: datetime) -> bool:
    """Whether a series' rule (with its skips, end and pause) has this local deadline."""
    if row["paused"]:
        return False
    if row["recur_until"] is not None and local > row["recur_until"]:
        return False
    if local in (row["recur_skip"] or []):
        return False
    return _rule_has(row, local)


def _deadlines(row: dict[str, Any], lo: datetime, hi: datetime) -> Iterator[datetime]:
    """A series' local deadlines whose instants fall within [lo, hi] (within the run)."""
    zone = ZoneInfo(row["due_tz"])
    lo_l = lo.astimezone(zone).replace(tzinfo=None) - timedelta(hours=1)
    hi_l = hi.astimezone(zone).replace(tzinfo=None) + timedelta(hours=1)
    for local in _rule_near(row["recur"], row["due_local"]):
        if lo_l <= local <= hi_l and lo <= local.replace(tzinfo=zone) <= hi and _member(row, local):
            yield local


def _instant(row: dict[str, Any], local: datetime) -> datetime:
    return local.replace(tzinfo=ZoneInfo(row["due_tz"]))


def _wants(row: dict[str, Any] | None, source: str, key: str, ident: Identity) -> bool:
    """Whether a reminder (as one version left it) still has this occurrence at all (whatever
    its time: a series' deadline before its restart is history, yet kept if already made)."""
    if row is None:
        return False
    if ident[3] not in row["before"]:
        return False
    if not _series(row):
        return ident[2] == _utc(row["due_at"])
    try:
        local = datetime.fromisoformat(ident[2])
    except ValueError:
        return False
    return local.tzinfo is None and _member(row, local)


def _has(
    row: dict[str, Any], source: str, key: str, lo: datetime, hi: datetime
) -> Iterator[tuple[Identity, datetime]]:
    """The occurrences of a version whose sends fire within [lo, hi], with their fire times."""
    if not _series(row):
        for b in row["before"]:
            fire = row["due_at"] - timedelta(seconds=b)
            if lo <= fire <= hi:
                yield (source, key, _utc(row["due_at"]), b), fire
        return
    most = max(row["before"], default=0.0)
    for local in _deadlines(row, lo, hi + timedelta(seconds=most)):
        at = _instant(row, local)
        for b in row["before"]:
            fire = at - timedelta(seconds=b)
            if lo <= fire <= hi:
                yield (source, key, local.isoformat(), b), fire


def owed(rec: Record) -> set[Identity]:
    """What must have been delivered by the cutoff (see the module's docstring)."""
    assert rec.cutoff is not None
    out: set[Identity] = set()
    for (source, key), versions in rec.versions.items():
        last = versions[-1]
        row = last.row
        if row is None or row["channel"] not in rec.served_at_end:
            continue
        start = _restarts(versions)[-1]
        lo = start if start is not None else datetime(2000, 1, 1, tzinfo=UTC)
        for ident, _fire in _has(row, source, key, lo - timedelta(days=1), rec.cutoff):
            if start is not None and _instant(row, datetime.fromisoformat(ident[2])) < start:
                continue  # a deadline before the series (re)started: history
            out.add(ident)
    return out


def _answered(rec: Record) -> tuple[set[Identity], set[Identity]]:
    """Occurrences a request for got a 2xx; and those whose last request got the script's
    400 (a dead letter the schedule made)."""
    ok: set[Identity] = set()
    last: dict[Identity, Sent] = {}
    for x in rec.sent:
        if 200 <= x.status < 300:
            ok.add(x.identity)
        last[x.identity] = x
    dead = {i for i, x in last.items() if x.status == 400}
    return ok, dead


def missing(rec: Record) -> set[Identity]:
    """What is owed and not (yet) delivered; probes named as (their source, key, "", 0)."""
    ok, dead = _answered(rec)
    left = owed(rec) - ok - dead
    got = {x.key for x in rec.sent if x.source.startswith("other") and 200 <= x.status < 300}
    left |= {(_probe_source(k), k, "", 0.0) for k in rec.probes if k not in got}
    return left


def _probe_source(key: str) -> str:
    """The other app of a probe: each probe is another source's one reminder (``probe3`` is
    ``other3``'s): a source with several reminders due at once gets one per turn."""
    return "other" + key.removeprefix("probe")


def windows(rec: Record, horizon: float) -> Iterator[Window]:
    """The rules each edit set up (see the module's docstring). ``horizon``: how far past an
    edit an occurrence of the old version may have been made (the look-ahead, and some)."""
    for (source, key), versions in rec.versions.items():
        for i in range(1, len(versions)):
            old, new = versions[i - 1], versions[i]
            if old.row is None:
                continue
            lo = old.t_db - timedelta(minutes=10)
            hi = new.t_db + timedelta(seconds=horizon + 120)
            for ident, _fire in _has(old.row, source, key, lo, hi):
                attempts, expiring = new.leases.get(ident, (0, False))
                allowed = attempts + int(expiring)
                end = _reopened(versions[i + 1 :], source, key, ident)
                if not _wants(new.row, source, key, ident):
                    yield Window(ident, new.t_wall, end, allowed, f"closed by {new.what}")
                    continue
                assert new.row is not None
                if new.row["channel"] != old.row["channel"]:
                    yield Window(
                        ident,
                        new.t_wall,
                        _moved_back(versions[i + 1 :], old.row["channel"]),
                        allowed,
                        f"moved off {old.row['channel']} by {new.what}",
                        channel=old.row["channel"],
                    )
                if new.row["recipient"] != old.row["recipient"]:
                    yield Window(
                        ident,
                        new.t_wall,
                        _recipient_changed(versions[i + 1 :], new.row["recipient"]),
                        allowed,
                        f"recipient {new.row['recipient']} since {new.what}",
                        recipient=new.row["recipient"],
                    )


def _reopened(later: Iterable[Version], source: str, key: str, ident: Identity) -> float:
    for v in later:
        if _wants(v.row, source, key, ident):
            return v.t_wall
    return float("inf")


def _moved_back(later: Iterable[Version], channel: str) -> float:
    for v in later:
        if v.row is not None and v.row["channel"] == channel:
            return v.t_wall
    return float("inf")


def _recipient_changed(later: Iterable[Version], recipient: str) -> float:
    for v in later:
        if v.row is None or v.row["recipient"] != recipient:
            return v.t_wall
    return float("inf")


def judge(rec: Record) -> None:
    """Every rule of the module's docstring, as violations appended to ``rec``."""
    v = rec.violations
    keys: dict[Identity, set[str]] = {}
    for x in rec.sent:
        keys.setdefault(x.identity, set()).add(x.op)
    for ident, ops in keys.items():
        if len(ops) > 1:
            v.append(f"{ident} was sent under {len(ops)} idempotency keys: {sorted(ops)}")
    left = missing(rec)
    if left:
        v.append(f"{len(left)} owed occurrence(s) never delivered: {sorted(left)[:8]}")
    by_ident: dict[Identity, list[Sent]] = {}
    for x in rec.sent:
        by_ident.setdefault(x.identity, []).append(x)
    for w in windows(rec, rec.schedule.knobs.lookahead):
        for x in by_ident.get(w.identity, []):
            if not (w.t < x.t < w.end) or x.attempt <= w.allowed:
                continue
            if w.channel is not None and x.channel != w.channel:
                continue
            if w.recipient is not None and x.recipient == w.recipient:
                continue
            v.append(
                f"{w.identity} sent (attempt {x.attempt} on {x.channel} to {x.recipient}) "
                f"{x.t - w.t:.2f}s after it was {w.what} (attempt {w.allowed} was in flight)"
            )
    if rec.schedule.family == "load":
        bound = isolation_bound(rec)
        late = lateness(rec)
        worst = {k: s for k, s in late.items() if s > bound}
        if worst:
            v.append(
                f"the other app's reminders delivered late (bound {bound:.2f}s): "
                + ", ".join(f"{k} {s:.1f}s" for k, s in sorted(worst.items()))
            )
    if rec.stale_request is not None:
        v.append(
            "a killed migrate's request to step aside was still standing at the end, after "
            f"daemons had started again ({rec.stale_request})"
        )


def isolation_bound(rec: Record) -> float:
    """``ISOLATION_BOUND`` plus one turn of the flood's sources at the rate the run's receiver
    got the flood's requests."""
    from .schedule import Flood

    sources = sum(st.sources for st in rec.schedule.steps if isinstance(st, Flood))
    times = [x.t for x in rec.sent if x.source.startswith("noisy")]
    if len(times) < 2 or max(times) <= min(times):
        return ISOLATION_BOUND
    rate = len(times) / (max(times) - min(times))
    return ISOLATION_BOUND + sources / rate
