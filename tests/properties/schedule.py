"""Schedules: what the nemesis does, as data made from a seed, and how a failing one is shrunk.

A schedule is plain frozen dataclasses, so that its ``repr`` is the Python that builds it again
(a failing schedule, shrunk, is pasted into ``test_nemesis.py`` as a regular test). Times are
seconds from the start of the run (``at``) or from the moment of a write (``due_in``); the
database's clock decides what is due, the run's clock only when each step starts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

#: The series rules a schedule writes, one of every documented kind, each with a deadline every
#: minute (so that a run of seconds sees them fire; `remind_before` entries 10 s apart make a
#: send every 10 s). ``{h}`` is the hour of the first deadline and the next, in the series' zone,
#: ``{until}`` a local time an hour after it: filled in when the series is written.
_EVERY_HOUR = ",".join(str(h) for h in range(24))
_EVERY_MINUTE = ",".join(str(m) for m in range(60))
RULES: dict[str, str] = {
    "daily": f"FREQ=DAILY;BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE}",
    "weekly": f"FREQ=WEEKLY;BYDAY=MO,TU,WE,TH,FR,SA,SU;BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE}",
    "monthly by day": (
        "FREQ=MONTHLY;BYMONTHDAY="
        + ",".join(str(d) for d in range(1, 32))
        + f";BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE}"
    ),
    "monthly by weekday": (
        f"FREQ=MONTHLY;BYDAY=MO,TU,WE,TH,FR,SA,SU;BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE}"
    ),
    "yearly": (
        "FREQ=YEARLY;BYMONTH="
        + ",".join(str(m) for m in range(1, 13))
        + ";BYMONTHDAY="
        + ",".join(str(d) for d in range(1, 32))
        + f";BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE}"
    ),
    "set positions": (
        "FREQ=DAILY;BYHOUR={h};BYMINUTE="
        + _EVERY_MINUTE
        + ";BYSETPOS="
        + ",".join(str(p) for p in range(1, 121))
    ),
    "count": f"FREQ=DAILY;BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE};COUNT=1000",
    "until": f"FREQ=DAILY;BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE};UNTIL={{until}}",
    "interval": f"FREQ=DAILY;INTERVAL=1;BYHOUR={_EVERY_HOUR};BYMINUTE={_EVERY_MINUTE};WKST=SU",
}
#: Zones series are written in (none changes its offset in the weeks around a run's date,
#: which the oracle does not need to know: it converts with zoneinfo either way).
ZONES = ("UTC", "Asia/Kolkata", "America/New_York", "Australia/Eucla", "Pacific/Chatham")

#: How a channel's receiver answers: ``ok`` 200 at once; ``flaky`` 500 to the first attempt of
#: about half the keys; ``throttle`` 429 (Retry-After 1) to the first attempt of some keys;
#: ``slow`` 200 after up to a second; ``gone`` 410 to the first request of the run (the channel
#: pauses; the run's operator resumes it a moment later).
Answers = Literal["ok", "flaky", "throttle", "slow", "gone"]

#: The points of a send's life an edit may wait for: ``now`` (whenever the step's time comes);
#: ``unmade`` (before its work row exists: the edit goes in at once, the send is later);
#: ``ready`` (made, not yet due); ``in flight`` (the receiver holds its request while the edit
#: runs); ``retrying`` (its first attempt was answered 500 with Retry-After 3); ``dead`` (answered
#: 400: a dead letter, redriven after the edit); ``redriven`` (dead, redriven, then edited).
When = Literal["now", "unmade", "ready", "in flight", "retrying", "dead", "redriven"]

FaultKind = Literal[
    "kill", "stop", "db crash", "migrate killed", "pid reused", "app lock", "app transaction"
]


@dataclass(frozen=True)
class Knobs:
    """The daemons' configuration and the receivers' behaviour."""

    lookahead: float = 0.0
    page_size: int = 1000
    claim_batch: int = 100
    concurrency: int = 16
    synchronous_claims: bool = False
    lease: float = 3.0
    tick: float = 0.5
    channels: tuple[str, ...] = ("a",)
    #: The channels each daemon process serves (one entry per daemon).
    serve: tuple[tuple[str, ...], ...] = (("a",),)
    #: How each channel's receiver answers, in the order of ``channels``.
    answers: tuple[Answers, ...] = ("ok",)
    max_attempts: int = 25


@dataclass(frozen=True)
class Write:
    """An app writes reminders of one source, one per key, each due ``due_in`` seconds after
    the write (negative: overdue); a series when ``rule`` names one of ``RULES``."""

    at: float
    source: str
    keys: tuple[str, ...]
    due_in: float = 2.0
    #: ``remind_before`` entries, seconds.
    before: tuple[float, ...] = (0.0,)
    channel: str = "a"
    rule: str | None = None
    zone: str = "UTC"
    #: The payload's size in bytes (about).
    payload: int = 0


@dataclass(frozen=True)
class Flood:
    """One app's flood: ``n`` one-offs over ``sources`` sources, due now: inserted in one
    statement, or written a month ahead before the run and moved to now by one UPDATE."""

    at: float
    n: int
    sources: int = 1
    how: Literal["insert", "update"] = "insert"
    channel: str = "a"


@dataclass(frozen=True)
class Probes:
    """Other apps' reminders, one every ``every`` seconds from ``at``, each due ``due_in``
    seconds after it is written, each of a source of its own (``other0``, ``other1``…): each must
    be delivered within the isolation bound."""

    at: float
    count: int = 5
    every: float = 1.0
    due_in: float = 1.5
    channel: str = "a"
    #: ``at`` counts from the moment the flood's write committed (an UPDATE of 200,000 rows
    #: takes seconds: the reminders it moves are due only then), not from the run's start.
    after_flood: bool = False


@dataclass(frozen=True)
class Fault:
    """``kill``: SIGKILL daemon ``daemon``, started again after ``hold`` seconds, serving
    ``then_serve`` if given. ``stop``: SIGSTOP it for ``hold`` seconds (past its lease), then
    SIGCONT. ``db crash``: the database server stopped immediately and started again after
    ``hold`` seconds. ``migrate killed``: a next-version `pgwork migrate` SIGKILLed at ``step``
    (``asked``: while the daemons step aside; ``in transaction``: inside its migration).
    ``pid reused``: after such a kill, a new unrelated session gets the killed migrate's pid
    and stays for ``hold`` seconds. ``app lock``: an app's transaction holds the row locks of
    ``source``'s reminders for ``hold`` seconds; ``app transaction``: an app's transaction
    (holding no lock pgwork needs) stays open for ``hold`` seconds."""

    at: float
    kind: FaultKind
    daemon: int = 0
    hold: float = 1.0
    then_serve: tuple[str, ...] | None = None
    step: Literal["asked", "in transaction"] = "asked"
    source: str = ""


@dataclass(frozen=True)
class Edit:
    """An app edits one reminder's ``column`` to ``value`` (``delete``: removes it), once its
    send has reached ``when`` (waited for up to ``within`` seconds, then done anyway); with
    ``racing``, that fault is set off right after the edit, while the send is held."""

    at: float
    source: str
    key: str
    column: str
    value: str = ""
    when: When = "now"
    within: float = 12.0
    racing: Fault | None = None


Step = Write | Flood | Probes | Fault | Edit


@dataclass(frozen=True)
class Schedule:
    seed: int
    family: Literal["load", "faults"]
    knobs: Knobs
    steps: tuple[Step, ...]
    #: How long after the last step's time the run waits for every wanted occurrence, seconds.
    settle: float = 30.0
    #: Flood rows written before the run (the UPDATE floods'), for the record.
    notes: tuple[str, ...] = field(default=())

    def code(self) -> str:
        """The Python that builds this schedule (for a regular test)."""
        return repr(self)

    @property
    def faults(self) -> list[Fault]:
        out = [s for s in self.steps if isinstance(s, Fault)]
        out += [s.racing for s in self.steps if isinstance(s, Edit) and s.racing is not None]
        return out

    @property
    def edits(self) -> list[Edit]:
        return [s for s in self.steps if isinstance(s, Edit)]


# -- generation ------------------------------------------------------------------------------

#: Edits an app may make of a one-off, and of a series (``delete`` removes the reminder).
ONE_OFF_EDITS = ("due_at", "channel", "recipient", "payload", "remind_before", "delete")
SERIES_EDITS = (
    "channel", "recipient", "payload", "remind_before", "due_tz", "recur", "recur_skip",
    "paused", "recur_until", "delete",
)  # fmt: skip
LIFE_POINTS: tuple[When, ...] = ("unmade", "ready", "in flight", "retrying", "dead", "redriven")


def generate(seed: int, family: str | None = None, *, big: bool = True) -> Schedule:
    """The schedule of ``seed``: the same seed gives the same schedule. ``family``: ``load``
    (floods and another app's probes, for the isolation bound) or ``faults`` (writes, edits and
    faults, for the delivery promises); by default the seed chooses. ``big``: floods up to
    200,000 reminders (else up to 20,000, for a quick run)."""
    rnd = random.Random(seed)
    fam = family or rnd.choice(("load", "faults", "faults"))
    if fam == "load":
        return _load(seed, rnd, big)
    return _faults(seed, rnd)


def _load(seed: int, rnd: random.Random, big: bool) -> Schedule:
    knobs = Knobs(
        lookahead=rnd.choice((0.0, 0.0, 5.0, 300.0, 3600.0)),
        page_size=rnd.choice((100, 500, 1000, 1000, 5000)),
        claim_batch=rnd.choice((10, 100)),
        concurrency=rnd.choice((4, 16)),
        synchronous_claims=rnd.random() < 0.3,
        lease=30.0,
        channels=("a",),
        serve=(("a",),) * rnd.choice((1, 1, 2)),
        answers=("ok",),
    )
    n = rnd.choice((20_000, 50_000, 200_000, 200_000) if big else (2_000, 5_000, 20_000))
    flood = Flood(
        at=0.5,
        n=n,
        sources=rnd.choice((1, 1, 20, 2000)),
        how=rnd.choice(("insert", "update")),
    )
    steps: list[Step] = [flood]
    # The other app writes while the flood is being made: its first probe a moment after the
    # flood, then more while the pass that makes it is under way.
    after = rnd.random() < 0.5
    steps.append(
        Probes(
            at=rnd.uniform(0.0, 2.0) if after else flood.at + rnd.uniform(0.2, 3.0),
            count=rnd.randint(4, 8),
            every=rnd.uniform(0.5, 2.0),
            due_in=rnd.choice((0.0, 1.0, 2.0, 2.0)),
            after_flood=after,
        )
    )
    if rnd.random() < 0.3:
        # The flooding app also holds its own rows in an open transaction for a while.
        steps.append(
            Fault(at=flood.at + 0.1, kind="app lock", hold=rnd.uniform(1, 5), source="noisy0")
        )
    if rnd.random() < 0.3:
        steps.append(
            Write(at=rnd.uniform(0, 3), source="small", keys=tuple(f"s{i}" for i in range(20)),
                  due_in=rnd.uniform(-5, 5))
        )  # fmt: skip
    return Schedule(seed, "load", knobs, tuple(steps), settle=40.0)


def _faults(seed: int, rnd: random.Random) -> Schedule:
    channels = ("a", "b", "c")[: rnd.choice((1, 2, 2, 3))]
    daemons = rnd.choice((1, 2, 2, 3))
    serve: list[tuple[str, ...]] = []
    for d in range(daemons):
        if d == 0 or rnd.random() < 0.5:
            serve.append(channels)
        else:
            serve.append(tuple(c for c in channels if rnd.random() < 0.6) or channels[:1])
    knobs = Knobs(
        lookahead=rnd.choice((0.0, 2.0, 300.0, 3600.0)),
        page_size=rnd.choice((1, 7, 100, 1000)),
        claim_batch=rnd.choice((1, 5, 100)),
        concurrency=rnd.choice((1, 4, 16)),
        synchronous_claims=rnd.random() < 0.5,
        lease=rnd.choice((2.0, 3.0)),
        tick=rnd.choice((0.2, 0.5, 1.0)),
        channels=channels,
        serve=tuple(serve),
        answers=tuple(
            rnd.choice(("ok", "ok", "flaky", "throttle", "slow", "gone")) for _ in channels
        ),
        max_attempts=25,
    )
    steps: list[Step] = []
    # (source, key, series, written at, its channel then)
    keys: list[tuple[str, str, bool, float, str]] = []
    for s in range(rnd.randint(1, 3)):
        source = f"app{s}"
        n = rnd.randint(3, 12)
        batch = tuple(f"k{s}.{i}" for i in range(n))
        at = rnd.uniform(0, 4)
        channel = rnd.choice(channels)
        steps.append(
            Write(
                at=at,
                source=source,
                keys=batch,
                due_in=rnd.uniform(-3, 8),
                before=rnd.choice(((0.0,), (0.0,), (0.0, 1.0), (3.0, 0.0), (60.0, 2.0))),
                channel=channel,
                payload=rnd.choice((0, 0, 200, 5000, 60000)),
            )
        )
        keys += [(source, k, False, at, channel) for k in batch]
    for i in range(rnd.choice((0, 0, 1, 2, 3))):
        key = f"series{i}"
        at = rnd.uniform(0, 3)
        channel = rnd.choice(channels)
        steps.append(
            Write(
                at=at,
                source="series",
                keys=(key,),
                due_in=0,
                before=rnd.choice(((0.0,), (0.0, 10.0, 20.0, 30.0, 40.0, 50.0), (0.0, 30.0))),
                channel=channel,
                rule=rnd.choice(sorted(RULES)),
                zone=rnd.choice(ZONES),
            )
        )
        keys.append(("series", key, True, at, channel))
    fault_kinds: tuple[FaultKind, ...] = (
        "kill", "kill", "stop", "db crash", "migrate killed", "app lock", "app transaction",
    )  # fmt: skip
    for _ in range(rnd.randint(2, 8)):
        source, key, series, written, channel = rnd.choice(keys)
        # A move to another channel is the edit with the most ways to go wrong (a send in
        # flight, a lease expiring on the old channel, daemons serving either): a third of them.
        if len(channels) > 1 and rnd.random() < 0.33:
            column = "channel"
        else:
            column = rnd.choice(SERIES_EDITS if series else ONE_OFF_EDITS)
        when: When = rnd.choice(LIFE_POINTS) if rnd.random() < 0.8 else "now"
        racing = None
        if when == "in flight" and rnd.random() < 0.6:
            racing = _fault(rnd, "kill" if rnd.random() < 0.7 else "stop", knobs, daemons)
        steps.append(
            Edit(
                at=written + rnd.uniform(0.1, 6),
                source=source,
                key=key,
                column=column,
                # A move goes to another channel than the one it was written on.
                value=_value(rnd, column, tuple(c for c in channels if c != channel) or channels),
                when=when,
                racing=racing,
            )
        )
    for _ in range(rnd.randint(0, 2)):
        kind = rnd.choice(fault_kinds)
        steps.append(replace(_fault(rnd, kind, knobs, daemons), at=rnd.uniform(1, 10)))
        if kind == "migrate killed" and rnd.random() < 0.6:
            steps.append(Fault(at=rnd.uniform(10, 14), kind="pid reused", hold=rnd.uniform(5, 15)))
    steps.sort(key=lambda s: s.at)
    return Schedule(seed, "faults", knobs, tuple(steps), settle=45.0)


def _fault(rnd: random.Random, kind: FaultKind, knobs: Knobs, daemons: int) -> Fault:
    d = rnd.randrange(daemons)
    if kind == "kill":
        then = None
        if rnd.random() < 0.4:
            then = tuple(c for c in knobs.channels if rnd.random() < 0.5) or knobs.channels[-1:]
        return Fault(at=0, kind="kill", daemon=d, hold=rnd.uniform(0.2, 3), then_serve=then)
    if kind == "stop":
        return Fault(at=0, kind="stop", daemon=d, hold=knobs.lease + rnd.uniform(0.5, 3))
    if kind == "db crash":
        return Fault(at=0, kind="db crash", hold=rnd.uniform(0.2, 2))
    if kind == "migrate killed":
        return Fault(at=0, kind="migrate killed", step=rnd.choice(("asked", "in transaction")))
    if kind == "app lock":
        return Fault(
            at=0, kind="app lock", hold=rnd.uniform(1, 6), source=rnd.choice(("app0", "series"))
        )
    return Fault(at=0, kind=kind, hold=rnd.uniform(1, 6))


def _value(rnd: random.Random, column: str, channels: tuple[str, ...]) -> str:
    """An edit's new value, as the SQL text the world writes (``world.EDIT_SQL`` says how)."""
    if column == "due_at":
        return f"{rnd.uniform(-3, 8):.2f}"  # seconds from the edit
    if column == "channel":
        return rnd.choice(channels)
    if column == "recipient":
        return f"r{rnd.randrange(1000)}"
    if column == "payload":
        return str(rnd.choice((0, 100, 3000)))
    if column == "remind_before":
        return rnd.choice(("{0}", "{0, 1 second}", "{2 seconds}", "{0, 10 seconds, 20 seconds}"))
    if column == "due_tz":
        return rnd.choice(ZONES)
    if column == "recur":
        return rnd.choice(sorted(RULES))
    if column == "paused":
        return rnd.choice(("true", "false"))
    if column in ("recur_skip", "recur_until", "delete"):
        return ""
    raise ValueError(column)


# -- shrinking -------------------------------------------------------------------------------


def shrinks(s: Schedule) -> Iterator[Schedule]:
    """Smaller schedules to try, most promising first: without one step (the later ones
    first), without an edit's racing fault, with an edit done at once, with one daemon fewer
    (the last), with a flood a tenth the size."""
    steps = list(s.steps)
    for i in reversed(range(len(steps))):
        yield replace(s, steps=tuple(steps[:i] + steps[i + 1 :]))
    for i, st in enumerate(steps):
        if isinstance(st, Edit) and st.racing is not None:
            yield replace(s, steps=(*steps[:i], replace(st, racing=None), *steps[i + 1 :]))
        if isinstance(st, Edit) and st.when != "now":
            yield replace(s, steps=(*steps[:i], replace(st, when="now"), *steps[i + 1 :]))
        if isinstance(st, Flood) and st.n > 1000:
            yield replace(s, steps=(*steps[:i], replace(st, n=st.n // 10), *steps[i + 1 :]))
    k = s.knobs
    if len(k.serve) > 1:
        used = max([f.daemon for f in s.faults if f.kind in ("kill", "stop")], default=-1)
        if used < len(k.serve) - 1:
            yield replace(s, knobs=replace(k, serve=k.serve[:-1]))
