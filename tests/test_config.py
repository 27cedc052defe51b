"""Configuration: defaults, TOML, environment overrides, and errors that name the option."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pgwork.config import ConfigError, _channel, load
from pgwork.durations import parse_duration
from pgwork.options import declared
from pgwork.settings import ChannelConfig, RetryPolicy


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pgwork.toml"
    p.write_text(text)
    return p


def test_defaults_without_a_file() -> None:
    cfg = load(None, env={})
    assert (cfg.dsn, cfg.tick, cfg.lookahead, cfg.lease) == (None, 5.0, 300.0, 60.0)
    assert list(cfg.channels) == ["log"]


def test_file_and_environment_overrides(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
[materialiser]
tick = "2s"
lookahead = "10m"
[worker]
lease = "1m30s"
[channels.hooks]
kind = "webhook"
url = "https://example.com/hook"
headers = { Authorization = "env:HOOK_TOKEN" }
max_attempts = 3
backoff_base = "500ms"
""",
    )
    cfg = load(
        p,
        env={
            "PGWORK_MATERIALISER_TICK": "250ms",
            "PGWORK_DSN": "host=db",
            "HOOK_TOKEN": "Bearer x",
        },
    )
    assert (cfg.tick, cfg.lookahead, cfg.lease, cfg.dsn) == (0.25, 600.0, 90.0, "host=db")
    ch = cfg.channels["hooks"]
    assert (ch.kind, ch.retry.max_attempts, ch.retry.base, ch.options.headers["Authorization"]) == (
        "webhook",
        3,
        0.5,
        "Bearer x",
    )


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ('[materialiser]\ntick = "soon"', {}, "materialiser.tick: not a duration"),
        ("[materialiser]\ntick = 5", {}, "materialiser.tick: expected a duration"),
        ('[materialiser]\ntick = "0s"', {}, "materialiser.tick: must be between"),
        ('[materialiser]\ntik = "1s"', {}, "materialiser.tik: unknown option"),
        # Issue 68: a slip of the keyboard suggested nothing.
        ('[worker]\nleese = "1s"', {}, "worker.leese: unknown option (did you mean worker.lease?)"),
        (
            '[channels.x]\nkind = "log"\nconcurency = 2',
            {},
            "channels.x.concurency: unknown option (did you mean concurrency?)",
        ),
        ('[materialist]\ntick = "1s"', {}, "materialist: unknown section"),
        ('[worker]\nclaim_batch = "many"', {}, "worker.claim_batch: invalid literal"),
        ('[log]\nformat = "xml"', {}, "log.format: must be one of auto, json, text"),
        ("", {"PGWORK_WORKER_LEASE": "forever"}, "worker.lease (from PGWORK_WORKER_LEASE)"),
        (
            '[channels.x]\nkind = "pigeon"',
            {},
            "channels.x.kind: must be one of log, python, webhook",
        ),
        (
            '[channels.x]\nkind = ["log"]',
            {},
            "channels.x.kind: must be one of log, python, webhook (got ['log'])",
        ),
        ('[channels.x]\nkind = "webhook"', {}, "channels.x.url: a webhook channel needs"),
        ('[channels.x]\nkind = "webhook"\nurl = "ftp://h"', {}, "channels.x.url"),
        (
            '[channels.x]\nkind = "python"\ntarget = "nocolon"',
            {},
            "channels.x.target: a python channel needs",
        ),
        (
            '[channels.x]\nkind = "log"\nconcurrency = 0',
            {},
            "channels.x.concurrency: must be between",
        ),
        ('[channels.x]\nkind = "log"\ncolour = "red"', {}, "channels.x.colour: unknown option"),
        ('[channels.Bad]\nkind = "log"', {}, "channels.Bad: channel names"),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h"\nheaders = { A = "env:NOPE" }',
            {},
            "channels.x.headers.A: environment variable NOPE is not set",
        ),
        ("this is = not toml [", {}, "is not valid TOML"),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h"\nsigning_secret = "env:NOPE"',
            {},
            "channels.x.signing_secret: environment variable NOPE is not set",
        ),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h"\nsigning_secret = "env:S"',
            {"S": "c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0"},
            "channels.x.signing_secret: secret 1 of 1: a signing secret starts with whsec_",
        ),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h"\nsigning_secret = "env:S"',
            {"S": "whsec_c2hvcnQ="},
            "channels.x.signing_secret: secret 1 of 1: the key is 5 bytes; at least 24",
        ),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h"\nsigning_secret = "env:S"',
            {"S": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw whsec_%%%"},
            "channels.x.signing_secret: secret 2 of 2: the part after whsec_ is not base64",
        ),
        (
            '[channels.x]\nkind = "log"\nsigning_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"',
            {},
            "channels.x.signing_secret: only webhook channels take signing_secret (this is log)",
        ),
        (
            # Read and then ignored before: a webhook's option on another kind did nothing.
            '[channels.x]\nkind = "python"\ntarget = "m:f"\nread_timeout = "5s"',
            {},
            "channels.x.read_timeout: only webhook channels take read_timeout (this is python)",
        ),
        (
            '[channels.x]\nkind = "log"\ncatch_up = "some"',
            {},
            "channels.x.catch_up: must be one of",
        ),
        (
            '[daemon]\nevent_loop = "fast"',
            {},
            "daemon.event_loop: must be one of",
        ),
        (
            '[channels.x]\nkind = "log"\nrate_limit = "5/fortnight"',
            {},
            "channels.x.rate_limit: unknown unit",
        ),
        (
            '[channels.x]\nkind = "log"\nrate_limit = "fast"',
            {},
            "channels.x.rate_limit: expected deliveries",
        ),
        (
            '[channels.x]\nkind = "log"\nrate_limit = 0',
            {},
            "channels.x.rate_limit: must be between",
        ),
        (
            '[channels.x]\nkind = "log"\nrate_burst = 5',
            {},
            "channels.x.rate_burst: only with a rate_limit",
        ),
        (
            '[channels.x]\nkind = "log"\nexpire_after = "soon"',
            {},
            "channels.x.expire_after: not a duration",
        ),
        (
            '[channels.x]\nkind = "log"\nretry_for = "0s"',
            {},
            "channels.x.retry_for: must be between",
        ),
        (
            '[channels.x]\nkind = "log"\nglobal_concurrency = 0',
            {},
            "channels.x.global_concurrency: must be between",
        ),
        (
            '[channels.x]\nkind = "log"\nbreaker_after = 0',
            {},
            "channels.x.breaker_after: must be between",
        ),
        (
            '[channels.x]\nkind = "log"\nbreaker_probe = "0s"',
            {},
            "channels.x.breaker_probe: must be between",
        ),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h/"\nheaders = "X-Key: 1"',
            {},
            "channels.x.headers: expected a table of header names to values",
        ),
        (
            '[channels.x]\nkind = "log"',
            {"PGWORK_CHANNELS_X_RATE_LIMIT": "lots"},
            "channels.x.rate_limit (from PGWORK_CHANNELS_X_RATE_LIMIT)",
        ),
    ],
)
def test_wrong_values_name_the_option(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, text), env=env)
    assert message in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load("/nonexistent/pgwork.toml", env={})


@pytest.mark.parametrize(
    ("text", "seconds"), [("250ms", 0.25), ("5s", 5), ("10m", 600), ("1h30m", 5400), ("2d", 172800)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_zero_is_a_duration_where_zero_is_allowed(tmp_path: Path) -> None:
    """The reference gives these options a lower bound of 0, and `0` was refused as "not a
    duration" (only `0s` worked): a bare 0 needs no unit, in the file and the environment."""
    cfg = load(
        write(tmp_path, '[retention]\nkeep = "0"\ndead_keep = 0\n[daemon]\nshutdown_grace = "0"'),
        env={"PGWORK_RETENTION_PAUSE": "0"},
    )
    assert (cfg.retention.keep, cfg.retention.dead_keep, cfg.retention.pause) == (0, 0, 0)
    assert cfg.shutdown_grace == 0
    with pytest.raises(ConfigError, match="not a duration"):
        load(write(tmp_path, '[retention]\nkeep = "5"'), env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[materialiser]\ntick = "10ms"', "must be between 50ms and 1h (got '10ms')"),
        (
            '[channels.x]\nkind = "webhook"\nurl = "http://h"\nread_timeout = "1ms"',
            "channels.x.read_timeout: must be between 10ms and 1h (got '1ms')",
        ),
    ],
)
def test_bounds_are_said_in_the_units_of_durations(tmp_path: Path, text: str, message: str) -> None:
    """ "between 0.05 and 3600 (got 0.01)": seconds, where the operator wrote '10ms'."""
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, text), env={})
    assert message in str(info.value)
    assert not re.search(r"between [0-9.]+ and [0-9.]+ \(", str(info.value)), str(info.value)


@pytest.mark.parametrize("text", ["", "5", "5 parsecs", "s5", "1h 2x"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_environment_overrides_reach_channel_options(tmp_path: Path) -> None:
    """Issue 8, item 15: PGWORK_CHANNELS_<NAME>_<OPTION>, as docs/configuration.md promises."""
    p = write(
        tmp_path,
        '[channels.lease-hooks]\nkind = "webhook"\nurl = "https://example.com/a"\n'
        "max_attempts = 3\n",
    )
    cfg = load(
        p,
        env={
            "PGWORK_CHANNELS_LEASE_HOOKS_MAX_ATTEMPTS": "7",
            "PGWORK_CHANNELS_LEASE_HOOKS_ATTEMPT_TIMEOUT": "2s",
            "PGWORK_CHANNELS_LEASE_HOOKS_URL": "https://example.com/b",
            "PGWORK_CHANNELS_AUDIT_KIND": "log",  # a channel the file does not have
        },
    )
    hooks = cfg.channels["lease-hooks"]
    assert (hooks.retry.max_attempts, hooks.attempt_timeout, hooks.options.url) == (
        7,
        2.0,
        "https://example.com/b",
    )
    assert cfg.channels["audit"].kind == "log"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PGWORK_CHANNELS_HOOK_COLOUR": "red"},
            "PGWORK_CHANNELS_HOOK_COLOUR: not a channel option",
        ),
        (
            {"PGWORK_CHANNELS_HOOK_KIND": "log", "PGWORK_CHANNELS_HOOK_ATTEMPT_TIMEOUT": "1ms"},
            r"channels.hook.attempt_timeout \(from PGWORK_CHANNELS_HOOK_ATTEMPT_TIMEOUT\): must be",
        ),
    ],
)
def test_wrong_channel_environment_overrides_name_the_variable(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load(None, env=env)


def test_delivery_edge_options(tmp_path: Path) -> None:
    cfg = load(
        write(
            tmp_path,
            '[channels.h]\nkind = "webhook"\nurl = "http://h"\nrate_limit = "3000/min"\n'
            'global_concurrency = 8\nexpire_after = "6h"\ncatch_up = "latest"\nretry_for = "2d"\n'
            'breaker_after = 20\nbreaker_probe = "1m"\n'
            '[channels.p]\nkind = "log"\nrate_limit = 2.5\nrate_burst = 10\n',
        ),
        env={"PGWORK_CHANNELS_H_CATCH_UP": "none"},
    )
    h, p = cfg.channels["h"], cfg.channels["p"]
    assert (h.rate_limit, h.rate_burst, h.global_concurrency) == (50.0, 50.0, 8)
    assert (h.expire_after, h.catch_up, h.retry.retry_for) == (6 * 3600, "none", 2 * 86400)
    assert (h.breaker_after, h.breaker_probe, p.breaker_after) == (20, 60.0, None)
    assert (p.rate_limit, p.rate_burst, p.expire_after, p.catch_up) == (2.5, 10.0, None, "all")
    # Defaults ride out a long outage: a day of retries, within a hundred attempts.
    assert (p.retry.retry_for, p.retry.max_attempts) == (86400.0, 100)


def test_a_ca_file_is_checked_at_start(tmp_path: Path) -> None:
    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    hook = '[channels.h]\nkind = "webhook"\nurl = "https://h"\n'
    cfg = load(write(tmp_path, hook + f'ca_file = "{pem}"\n'))
    assert cfg.channels["h"].options.ca_file == str(pem)
    with pytest.raises(ConfigError, match=r"channels.h.ca_file: cannot read .*nope.pem"):
        load(write(tmp_path, hook + f'ca_file = "{tmp_path}/nope.pem"\n'))
    (tmp_path / "empty.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"channels.h.ca_file: .*empty.pem holds no PEM"):
        load(write(tmp_path, hook + f'ca_file = "{tmp_path}/empty.pem"\n'))
    with pytest.raises(
        ConfigError, match=r"channels\.l\.ca_file: only webhook channels take ca_file"
    ):
        load(write(tmp_path, f'[channels.l]\nkind = "log"\nca_file = "{pem}"\n'))


def test_an_event_loop_that_cannot_be_had_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``uvloop`` asked for where it cannot be imported: refused, naming the option; ``auto``
    falls back to asyncio."""
    from pgwork import eventloop

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with pytest.raises(
        ConfigError, match=r"daemon.event_loop = \"uvloop\", but uvloop is not installed"
    ):
        eventloop.use_uvloop("uvloop")
    assert eventloop.use_uvloop("auto") is False
    assert eventloop.use_uvloop("asyncio") is False


def test_the_configuration_reference_is_generated_from_the_declarations() -> None:
    """docs/configuration.md's table is what ``python -m pgwork.reference`` writes from the
    options' declarations (pgwork.config.option): a new or changed option fails here until the
    page is regenerated."""
    from pgwork import reference

    assert reference.main(["--check"]) == 0


def _documented() -> list[str]:
    """The option names docs/configuration.md's table lists."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    return re.findall(r"^\| `([a-zA-Z_.]+)` \|", text, flags=re.M)


@pytest.mark.parametrize("name", _documented())
def test_every_documented_option_is_one_the_loader_takes(tmp_path: Path, name: str) -> None:
    """Each option the reference lists is read by ``load`` (a wrong value may be refused, never
    as unknown), and a name it does not list is refused as unknown."""
    for option, known in ((name, True), (name + "_typo", False)):
        *path, key = option.split(".")
        if path[0] == "channels":
            text = f'[channels.c]\nkind = "webhook"\nurl = "http://127.0.0.1:9/"\n{key} = "?"\n'
        else:
            text = f'[{".".join(path)}]\n{key} = "?"\n'
        try:
            load(write(tmp_path, text), env={})
        except ConfigError as e:
            assert ("unknown" not in str(e)) == known, (option, str(e))
        else:
            assert known, option


def test_the_reference_lists_every_option() -> None:
    from pgwork import reference

    assert _documented() == list(reference.options())
    assert len(_documented()) == 58


def test_an_option_is_described_once() -> None:
    """Its ``doc=`` feeds the reference; a ``#:`` comment beside it said the same and drifted."""
    import re
    from pathlib import Path

    import pgwork.config

    lines = Path(pgwork.config.__file__).read_text().splitlines()
    doubled = [
        n + 1
        for n, line in enumerate(lines[1:], 1)
        if re.match(r"\s+\w+: .*= option\(", line) and lines[n - 1].lstrip().startswith("#:")
    ]
    assert not doubled, f"pgwork/config.py lines {doubled}: the doc= says it"


def test_the_kinds_config_accepts_are_the_kinds_channels_make() -> None:
    """A kind of channel is declared by its module (``KIND``) and found by
    ``pgwork.channels.KINDS``; the configuration and its reference take exactly those."""
    from pgwork import reference
    from pgwork.channels import KINDS

    (row,) = [r for r in reference.table().splitlines() if "`channels.NAME.kind`" in r]
    assert row.split(" | ")[2] == ", ".join(f"`{k}`" for k in KINDS)
    with pytest.raises(ConfigError, match="must be one of " + ", ".join(KINDS)):
        _channel("x", {"kind": "fax"}, {})


SMS_KIND = '''"""A kind of channel that is not pgwork's: this file is all it adds."""

from __future__ import annotations

from dataclasses import dataclass

from .. import options
from ..options import ConfigError, option
from .types import DELIVERED, Kind


@dataclass(frozen=True)
class SmsOptions:
    sender: str = option("sender", "str", "PGWORK", doc="the name texts come from")
    api_key: tuple[str, ...] = option("api_key", "secrets", (), doc="the gateway's key")
    max_length: int = option("max_length", "int", 160, within=(1, 1600), doc="characters a text may have")


def _read(raw, label, env, secrets):
    key = raw.get("api_key", "")
    if key.startswith("env:"):
        key = env.get(key[4:], "")
    if not key.startswith("sk_"):
        raise ConfigError(f"{label('api_key')}: a gateway key starts with sk_")
    return options.read(SmsOptions, raw, label, api_key=(key,))


@dataclass
class SmsChannel:
    config: object

    async def deliver(self, d):
        return DELIVERED

    async def aclose(self):
        return None


KIND = Kind(name="sms", options=SmsOptions, read=_read, make=SmsChannel)
'''


def _run_in_a_copy(
    tmp_path: Path, change: Callable[[Path], None], probe: str, *args: str
) -> dict[str, Any]:
    """pgwork copied to ``tmp_path``, changed by ``change`` (given the copy's package), then
    ``probe`` run by a fresh interpreter that imports the copy; its JSON answer."""
    import json
    import shutil
    import subprocess

    import pgwork

    copy = tmp_path / "tree"
    shutil.copytree(
        Path(pgwork.__file__).parent, copy / "pgwork", ignore=shutil.ignore_patterns("__pycache__")
    )
    change(copy / "pgwork")
    out = subprocess.run(
        [sys.executable, "-c", probe, *args],
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,  # `python -c` reads modules from its directory first
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    seen: dict[str, Any] = json.loads(out.stdout)
    assert seen["package"].startswith(str(copy))
    return seen


SMS_PROBE = """
import json, sys
import pgwork
from pgwork import config, reference
from pgwork.channels import KINDS, make_channel
from pgwork.secrets import Secrets

out = {"package": pgwork.__file__, "kinds": sorted(KINDS)}
cfg = config.load(sys.argv[1], env={"SMS_KEY": "sk_live_0123456789", "PGWORK_CHANNELS_TEXT_SENDER": "ACME"})
ch = cfg.channels["text"]
out["options"] = [ch.kind, ch.options.sender, ch.options.max_length, list(ch.options.api_key)]
out["made"] = type(make_channel(ch)).__name__
out["scrubbed"] = Secrets.from_config(cfg).scrub("called with sk_live_0123456789")
out["reference"] = [r for r in reference.table().splitlines() if "sender" in r or "max_length" in r]
errors = []
for text in ('[channels.t]\\nkind = "log"\\nsender = "X"',
             '[channels.t]\\nkind = "sms"\\napi_key = "sk_1"\\nmax_length = 2000',
             '[channels.t]\\nkind = "sms"\\napi_key = "pk_1"',
             '[channels.t]\\nkind = "fax"'):
    with open(sys.argv[2], "w") as f:
        f.write(text)
    try:
        config.load(sys.argv[2], env={})
    except config.ConfigError as e:
        errors.append(str(e))
out["errors"] = errors
print(json.dumps(out))
"""


def test_a_channel_kind_is_declared_in_one_file(tmp_path: Path) -> None:
    """A new kind of channel is one new module of pgwork/channels/ and nothing else: with
    pgwork copied and only ``channels/sms.py`` added, the configuration takes its kind and its
    options (from the file and the environment, bounded as declared, each refused on another
    kind), the reference documents them, its secret is masked, and a channel of it is made. Red
    before: the kinds were a list in pgwork/channels/__init__.py and their options fields of
    ChannelConfig."""
    cfg = write(tmp_path, '[channels.text]\nkind = "sms"\napi_key = "env:SMS_KEY"\n')

    def add_kind(pkg: Path) -> None:
        (pkg / "channels" / "sms.py").write_text(SMS_KIND)

    seen = _run_in_a_copy(
        tmp_path,
        add_kind,
        SMS_PROBE,
        str(cfg),
        str(tmp_path / "other.toml"),
    )
    assert seen["kinds"] == ["log", "python", "sms", "webhook"]
    assert seen["options"] == ["sms", "ACME", 160, ["sk_live_0123456789"]]
    assert seen["made"] == "SmsChannel"
    assert "sk_live_0123456789" not in seen["scrubbed"]
    assert seen["reference"] == [
        "| `channels.NAME.sender` | `PGWORK` | text | sms: the name texts come from |",
        "| `channels.NAME.max_length` | 160 | 1 to 1,600 | sms: characters a text may have |",
    ]
    assert seen["errors"] == [
        "channels.t.sender: only sms channels take sender (this is log)",
        "channels.t.max_length: must be between 1 and 1600 (got 2000)",
        "channels.t.api_key: a gateway key starts with sk_",
        "channels.t.kind: must be one of log, python, sms, webhook (got 'fax')",
    ]


def test_nothing_outside_a_kinds_module_decides_by_its_name_or_reads_its_options() -> None:
    """The other half of "a kind is declared in one file": no code of pgwork outside a kind's
    module compares a kind with a string (``c.kind == "webhook"``), and none names one of a
    kind's options, but by reading the declarations (pgwork.options.declared). Red before:
    the web page, tracing, the CLI, the secrets and the configuration each did one of these."""
    import ast

    import pgwork
    from pgwork.channels import KINDS
    from pgwork.options import VALUE_KINDS, declared

    root = Path(pgwork.__file__).parent
    home = {
        name: root / "channels" / f"{kind.make.__module__.rsplit('.', 1)[1]}.py"
        for name, kind in KINDS.items()
    }
    keys = {key: name for name, kind in KINDS.items() for key in declared(kind.options)}
    # The same word, another thing: libpq's connection parameter.
    elsewhere = {("db.py", "connect_timeout")}
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                about_kind = any(
                    (isinstance(s, ast.Attribute) and s.attr == "kind")
                    or (isinstance(s, ast.Name) and s.id == "kind")
                    for s in sides
                )
                named = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in KINDS]
                if about_kind and any(home[n] != path for n in named):
                    found.append(f"{path.relative_to(root)}:{node.lineno} compares a kind")
            if (
                isinstance(node, ast.Constant)
                and node.value in keys
                and node.value not in VALUE_KINDS
                and home[keys[node.value]] != path
                and (str(path.relative_to(root)), node.value) not in elsewhere
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno} names {node.value!r}")
    assert found == []


def _not_default(f: Any) -> tuple[str, Any]:
    """A TOML value for option field ``f`` other than its default, and what it reads as."""
    md, default = f.metadata, f.default
    if md["choices"]:
        pick = next(c for c in md["choices"] if c != default)
        return f'"{pick}"', pick
    lo, hi = md["within"] or (0, 1_000_000)
    if md["kind"] == "int":
        v = lo + 1 if default != lo + 1 else lo + 2
        return str(v), v
    if md["kind"] == "duration":
        s = min(default * 2, hi) if default else lo * 2
        return f'"{s}s"', s
    raise AssertionError(f"no value for a {md['kind']} option here: {f.name}")


#: Read by hand (a rate, a burst that depends on it, the kind that picks the rest).
_BY_HAND = {"kind", "rate_limit", "rate_burst"}


@pytest.mark.parametrize(
    "key", sorted((set(declared(ChannelConfig)) | set(declared(RetryPolicy))) - _BY_HAND)
)
def test_every_common_channel_option_reaches_its_field(tmp_path: Path, key: str) -> None:
    """Issue 69, item 3: a channel's common options were read into ChannelConfig by a call
    listing them keyword by keyword, so one declared and not listed was accepted from TOML and
    silently kept its default (the reference's test only checked it was not "unknown"). Each
    common option, set to a value that is not its default, is what the channel's config holds."""
    owner, f = next(
        (cls, declared(cls)[key]) for cls in (ChannelConfig, RetryPolicy) if key in declared(cls)
    )
    text, want = _not_default(f)
    cfg = load(write(tmp_path, f'[channels.c]\nkind = "log"\n{key} = {text}\n'), env={})
    ch = cfg.channels["c"]
    got = getattr(ch.retry if owner is RetryPolicy else ch, f.name)
    assert got == want != f.default, (key, got, want)


NEW_OPTION = """
    priority: int = option("priority", "int", 0, within=(0, 9), doc="a test's new option")
"""

NEW_OPTION_PROBE = """
import json, sys
import pgwork
from pgwork import config
out = {"package": pgwork.__file__}
for text in ('priority = 7', 'priority = 12'):
    with open(sys.argv[1], "w") as f:
        f.write('[channels.c]\\nkind = "log"\\n' + text + '\\n')
    try:
        out[text] = config.load(sys.argv[1], env={}).channels["c"].priority
    except config.ConfigError as e:
        out[text] = str(e)
print(json.dumps(out))
"""


def test_a_common_option_declared_on_its_field_alone_is_read(tmp_path: Path) -> None:
    """The other half of item 3: with pgwork copied and only a field added to ChannelConfig
    (declared with ``option``), the configuration reads it from the file, bounded as declared.
    Red before: the channel kept the field's default, 0."""
    anchor = "    #: The kind's own options, as its module declares and reads them"

    def add_field(pkg: Path) -> None:
        text = (pkg / "settings.py").read_text()
        assert anchor in text
        (pkg / "settings.py").write_text(
            text.replace(anchor, NEW_OPTION.strip("\n") + "\n" + anchor)
        )

    seen = _run_in_a_copy(tmp_path, add_field, NEW_OPTION_PROBE, str(tmp_path / "c.toml"))
    assert seen["priority = 7"] == 7
    assert seen["priority = 12"] == "channels.c.priority: must be between 0 and 9 (got 12)"
