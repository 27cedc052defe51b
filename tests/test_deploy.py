"""The shipped systemd units, Prometheus rules and Grafana dashboard are valid (checked with the
real tools)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNITS = ["pgwork.service", "pgwork-cleanup.service", "pgwork-cleanup.timer"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed here (.ci/run installs it where the registry has it)")
    return path


def test_units_verify(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    pgwork = Path(sys.executable).parent / "pgwork"
    for unit in UNITS:
        text = (
            (ROOT / "systemd" / unit)
            .read_text()
            .replace("/opt/pgwork/venv/bin/pgwork", str(pgwork))
        )
        (tmp_path / unit).write_text(text)
    r = subprocess.run(
        [analyze, "verify", *[str(tmp_path / u) for u in UNITS]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in (r.stdout + r.stderr).splitlines()
        if line.strip() and "EnvironmentFile" not in line and "/etc/pgwork" not in line
    ]
    assert r.returncode == 0 and not problems, problems


@pytest.mark.parametrize("unit", ["pgwork.service", "pgwork-cleanup.service"])
def test_unit_exposure_is_low(unit: str) -> None:
    analyze = _tool("systemd-analyze")
    r = subprocess.run(
        [analyze, "security", "--offline=yes", str(ROOT / "systemd" / unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
    assert m is not None, r.stdout[-500:] + r.stderr
    assert float(m.group(1)) <= 2.0


def test_service_stop_timeout_exceeds_grace() -> None:
    from pgwork.config import Config
    from pgwork.duties.deliver import Deliveries

    text = (ROOT / "systemd" / "pgwork.service").read_text()
    stop = int(re.search(r"^TimeoutStopSec=(\d+)s$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert stop > Config().shutdown_grace + Deliveries.FINAL_STEPS_TIMEOUT
    assert "Type=notify" in text and re.search(r"^WatchdogSec=", text, re.MULTILINE)


def test_alert_rules_check() -> None:
    promtool = _tool("promtool")
    r = subprocess.run(
        [promtool, "check", "rules", str(ROOT / "prometheus" / "pgwork.rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 10 rules found" in r.stdout


def test_each_alert_rule_fires_on_what_it_is_for_and_not_on_the_rest() -> None:
    """Issue 68: the rules were checked for syntax only, and a deliberate pause paged (the lag
    alerts had no channel or paused label; the dead-letter alert was global).
    prometheus/pgwork.rules.test.yml gives each rule series that should fire it and series that
    should not, with the labels and texts an operator gets: a late source pages, a late source
    on a paused channel is a ticket, per channel the same, dead letters per channel and source."""
    promtool = _tool("promtool")
    r = subprocess.run(
        [promtool, "test", "rules", str(ROOT / "prometheus" / "pgwork.rules.test.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    rules = re.findall(r"- alert: (\w+)", (ROOT / "prometheus" / "pgwork.rules.yml").read_text())
    tested = set(
        re.findall(r"alertname: (\w+)", (ROOT / "prometheus" / "pgwork.rules.test.yml").read_text())
    )
    assert set(rules) <= tested, set(rules) - tested


def test_every_metric_in_the_rules_exists() -> None:
    from pgwork.metrics import Metrics

    names = {s.name for fam in Metrics().registry.collect() for s in fam.samples} | {
        fam.name for fam in Metrics().registry.collect()
    }
    used = set(
        re.findall(r"pgwork_[a-z_]+", (ROOT / "prometheus" / "pgwork.rules.yml").read_text())
    )
    # Families with labels have no samples until first use; compare against family names too.
    families = {fam.name for fam in Metrics().registry.collect()}
    missing = {u for u in used if u not in names and u.removesuffix("_total") not in families}
    assert missing == set()


def test_every_alert_has_a_runbook_section() -> None:
    """docs/runbook.md answers each alert of the rules, in their order, and nothing else."""
    alerts = re.findall(r"- alert: (\w+)", (ROOT / "prometheus" / "pgwork.rules.yml").read_text())
    sections = re.findall(r"^## (\w+)$", (ROOT / "docs" / "runbook.md").read_text(), re.M)
    assert len(alerts) == 10
    assert sections == alerts


def test_the_readme_links_resolve() -> None:
    """The README is the front door into docs/ (which mkdocs checks with --strict): each of its
    relative links names a file of the repository."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    assert [link for link in local if not (ROOT / link).exists()] == []


# -- the Grafana dashboard ---------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    import json

    doc: dict[str, Any] = json.loads((ROOT / "grafana" / "pgwork.json").read_text())
    return doc


def _expressions() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def test_dashboard_is_current_and_well_formed() -> None:
    """The JSON is what grafana/build.py writes, with the datasource, instance and channel
    variables, unique panel ids, and every panel and query on the chosen datasource."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("build", ROOT / "grafana" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    doc = _dashboard()
    assert doc == json.loads(json.dumps(build.dashboard())), "run python grafana/build.py"
    variables = {v["name"]: v["type"] for v in doc["templating"]["list"]}
    assert variables == {"datasource": "datasource", "instance": "query", "channel": "query"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["description"], p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every panel's expression, with Grafana's variables filled in, passes promtool as a
    recording rule."""
    promtool = _tool("promtool")
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(_expressions()):
        concrete = (
            expr.replace("$__rate_interval", "5m")
            .replace("$instance", ".*")
            .replace("$channel", ".*")
        )
        assert "$" not in concrete, concrete
        rules += [f"      - record: pgwork:dashboard_{i}", f"        expr: '{concrete}'"]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text("\n".join(rules) + "\n")
    r = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_expressions())} rules found" in r.stdout


def test_every_metric_on_the_dashboard_exists() -> None:
    from pgwork.metrics import Metrics

    families = {fam.name for fam in Metrics().registry.collect()}
    used = set(re.findall(r"pgwork_[a-z_]+", " ".join(_expressions())))
    suffixes = ("_total", "_bucket", "_sum", "_count")
    missing = {
        u
        for u in used
        if u not in families
        and not any(u.endswith(s) and u[: -len(s)] in families for s in suffixes)
    }
    assert used and missing == set()


def test_env_example_reads_the_same_in_systemd_and_a_shell() -> None:
    """The documented shell line (``set -a && . pgwork.env``) and systemd's EnvironmentFile= give
    the same values: every value is double-quoted (both strip the quotes) with nothing either
    would expand or unescape differently ($, backquote, backslash; systemd.exec(5))."""
    path = ROOT / "systemd" / "pgwork.env.example"
    systemd_reads: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, value = line.partition("=")
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", name), line
        assert re.fullmatch(r'"[^"$`\\]*"', value), f"quote {name}'s value, without $ ` \\: {line}"
        systemd_reads[name] = value[1:-1]
    r = subprocess.run(
        ["sh", "-c", 'set -a && . "$1" && env -0', "sh", str(path)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=10,
    )
    assert r.returncode == 0, r.stderr
    shell_reads = dict(kv.split("=", 1) for kv in r.stdout.split("\0") if kv)
    assert {k: shell_reads.get(k) for k in systemd_reads} == systemd_reads
    assert systemd_reads["CRM_TOKEN"] == "Bearer CHANGE-ME"
