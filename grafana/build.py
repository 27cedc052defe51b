"""Writes grafana/pgwork.json, the dashboard, from the panel list below:
``python grafana/build.py``. Each panel answers one question an operator asks at 3 a.m.; the
test (tests/test_deploy.py) checks every expression with promtool and every metric name against
what pgwork exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INST = 'instance=~"$instance"'
C = 'channel=~"$channel"'
R = "$__rate_interval"

#: (title, question it answers, unit, kind, [(legend, expr), ...]); kind: timeseries or stat.
PANELS: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    (
        "Lag",
        "How late is the oldest overdue reminder, materialised or not?",
        "s",
        "stat",
        [("lag", f"max(pgwork_lag_seconds{{{INST}}})")],
    ),
    (
        "Oldest ready row",
        "How long has the oldest claimable row waited?",
        "s",
        "stat",
        [("oldest ready", f"max(pgwork_oldest_ready_seconds{{{INST}}})")],
    ),
    (
        "Dead letters",
        "How many occurrences need an operator (pgwork dlq list)?",
        "short",
        "stat",
        [("dead", f"max(pgwork_dead_letters{{{INST}}})")],
    ),
    (
        "Listener up",
        "Is every daemon's LISTEN connection up (0: waiting for the tick)?",
        "short",
        "stat",
        [("{{instance}}", f"min by (instance) (pgwork_listener_up{{{INST}}})")],
    ),
    (
        "Lag over time",
        "Is the backlog growing or shrinking?",
        "s",
        "timeseries",
        [
            ("lag", f"max(pgwork_lag_seconds{{{INST}}})"),
            ("oldest ready", f"max(pgwork_oldest_ready_seconds{{{INST}}})"),
        ],
    ),
    (
        "Lag by source",
        "Which app is late: one source's backlog, or everyone's?",
        "s",
        "timeseries",
        [("{{source}}", f"max by (source) (pgwork_source_lag_seconds{{{INST}}})")],
    ),
    (
        "Attempts by outcome",
        "What are the receivers answering, per channel?",
        "ops",
        "timeseries",
        [
            (
                "{{channel}} {{outcome}}",
                f"sum by (channel, outcome) (rate(pgwork_attempts_total{{{INST}, {C}}}[{R}]))",
            )
        ],
    ),
    (
        "Deliveries",
        "How many reminders go out per second, per channel?",
        "ops",
        "timeseries",
        [
            (
                "{{channel}}",
                f'sum by (channel) (rate(pgwork_attempts_total{{{INST}, {C}, outcome=~"delivered|duplicate"}}[{R}]))',
            )
        ],
    ),
    (
        "Lateness",
        "How late are deliveries against their due time (p50, p99)?",
        "s",
        "timeseries",
        [
            (
                "{{channel}} p50",
                f"histogram_quantile(0.5, sum by (le, channel) (rate(pgwork_lateness_seconds_bucket{{{INST}, {C}}}[{R}])))",
            ),
            (
                "{{channel}} p99",
                f"histogram_quantile(0.99, sum by (le, channel) (rate(pgwork_lateness_seconds_bucket{{{INST}, {C}}}[{R}])))",
            ),
        ],
    ),
    (
        "Delivery duration",
        "How long do receivers take per attempt (p50, p99)?",
        "s",
        "timeseries",
        [
            (
                "{{channel}} p50",
                f"histogram_quantile(0.5, sum by (le, channel) (rate(pgwork_delivery_duration_seconds_bucket{{{INST}, {C}}}[{R}])))",
            ),
            (
                "{{channel}} p99",
                f"histogram_quantile(0.99, sum by (le, channel) (rate(pgwork_delivery_duration_seconds_bucket{{{INST}, {C}}}[{R}])))",
            ),
        ],
    ),
    (
        "Live and dead rows",
        "Where is the work: ready, waiting, claimed, dead, per channel?",
        "short",
        "timeseries",
        [("{{channel}} {{status}}", f"max by (channel, status) (pgwork_work_rows{{{INST}, {C}}})")],
    ),
    (
        "Channel state",
        "Is a channel paused (operator, 410) or throttled by its receiver?",
        "short",
        "timeseries",
        [
            ("{{channel}} paused", f"max by (channel) (pgwork_channel_paused{{{INST}, {C}}})"),
            (
                "{{channel}} throttled",
                f"max by (channel) (pgwork_channel_throttled{{{INST}, {C}}})",
            ),
            ("{{channel}} claimed", f"max by (channel) (pgwork_channel_claimed{{{INST}, {C}}})"),
        ],
    ),
    (
        "Closed without sending",
        "What did the claim close instead of sending (cancelled, superseded, dead, expired)?",
        "ops",
        "timeseries",
        [
            (
                "{{channel}} {{reason}}",
                f"sum by (channel, reason) (rate(pgwork_closed_at_claim_total{{{INST}, {C}}}[{R}]))",
            )
        ],
    ),
    (
        "Duty failures",
        "Is any loop failing and being retried?",
        "short",
        "timeseries",
        [("{{duty}}", f"sum by (duty) (increase(pgwork_duty_failures_total{{{INST}}}[{R}]))")],
    ),
    (
        "Retention",
        "Is retention keeping up (rows deleted, oldest row kept, paused)?",
        "short",
        "timeseries",
        [
            ("deleted/s", f"sum(rate(pgwork_retention_deleted_rows_total{{{INST}}}[{R}]))"),
            ("oldest kept (s)", f"max(pgwork_retention_oldest_terminal_age_seconds{{{INST}}})"),
            ("paused", f"max(pgwork_retention_paused{{{INST}}})"),
        ],
    ),
    (
        "xmin horizon",
        "Is a long transaction or a slot holding back vacuum?",
        "s",
        "timeseries",
        [("age", f"max(pgwork_xmin_horizon_age_seconds{{{INST}}})")],
    ),
    (
        "Materialiser",
        "Is the materialiser passing (rows made, stuck on a locked row)?",
        "short",
        "timeseries",
        [
            ("rows/s", f"sum(rate(pgwork_materialised_rows_total{{{INST}}}[{R}]))"),
            ("locked (s)", f"max(pgwork_materialiser_locked_seconds{{{INST}}})"),
        ],
    ),
]


def panel(
    n: int, title: str, question: str, unit: str, kind: str, targets: list[tuple[str, str]]
) -> dict[str, Any]:
    stats = sum(1 for p in PANELS[:n] if p[3] == "stat")
    if kind == "stat":
        pos = {"h": 4, "w": 6, "x": 6 * (stats % 4), "y": 0}
    else:
        k = n - sum(1 for p in PANELS if p[3] == "stat")
        pos = {"h": 8, "w": 12, "x": 12 * (k % 2), "y": 4 + 8 * (k // 2)}
    return {
        "id": n + 1,
        "type": kind,
        "title": title,
        "description": question,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": pos,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    def var(name: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": name,
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name},
            "definition": query,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
            "refresh": 2,
        }

    return {
        "title": "pgwork",
        "uid": "pgwork",
        "description": "pgwork: lag, deliveries, receivers, channel state, retention, duties.",
        "tags": ["pgwork", "postgres", "queue"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                var("instance", "label_values(pgwork_listener_up, instance)"),
                var("channel", "label_values(pgwork_attempts_total, channel)"),
            ]
        },
        "panels": [panel(n, *p) for n, p in enumerate(PANELS)],
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("pgwork.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")  # noqa: T201 (a script)
