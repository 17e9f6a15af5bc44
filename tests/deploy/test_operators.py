"""The operators' files in deploy/: the Grafana dashboard and the Prometheus alerting rules load,
and every query in them names only series the collector exports (the names are the collector's
own, from :meth:`~antdt.watch.metrics.JobsCollector.describe`). Prometheus's own ``promtool``
(Debian's ``prometheus`` package, ``make test-tools``) checks the rules and runs each alert
against series that should fire it and series that should not."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from antdt.watch.metrics import JobsCollector

ROOT = Path(__file__).resolve().parent.parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "antdt.json"
ALERTS = ROOT / "deploy" / "prometheus" / "antdt-alerts.yml"

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}


def exported() -> set[str]:
    """The sample names the collector exports: a counter family's samples end in ``_total``."""
    return {family.name + ("_total" if family.type == "counter" else "")
            for family in JobsCollector(None, list).describe()}


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression reads (or a Grafana ``label_values(series, label)``)."""
    values = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if values:
        return {values.group(1)}
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)  # label matchers, ranges
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = re.findall(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", bare)
    return {name for name in names if name.lower() not in PROMQL_WORDS}


def test_the_promql_reader_finds_the_series_and_nothing_else() -> None:
    assert metric_names('sum by (job_id, kind) (rate(a_total{job_id=~"$job_id"}[1m])) / b '
                        '> bool 0') == {"a_total", "b"}
    assert metric_names("label_values(dask_antdt_job_info, job_id)") == {"dask_antdt_job_info"}
    assert "dask_antdt_job_leases_total" in exported() and "dask_antdt_job_state" in exported()


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    queries += [variable["query"]["query"] for variable in board["templating"]["list"]
                if variable["type"] == "query"]
    return queries


def test_every_dashboard_query_names_exported_series_only() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    names = exported()
    for query in queries:
        found = metric_names(query)
        assert found and found <= names, f"{query!r} names {sorted(found - names)}"
    used = {name for query in queries for name in metric_names(query)}
    assert {"dask_antdt_worker_state", "dask_antdt_job_rows_done",
            "dask_antdt_worker_rows_per_second"} <= used


def alert_rules() -> list[dict[str, Any]]:
    """The rules of the alerting file, checked against the shape of a Prometheus rule file."""
    raw = yaml.safe_load(ALERTS.read_text())
    assert set(raw) == {"groups"} and raw["groups"]
    rules = []
    for group in raw["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and isinstance(group["name"], str)
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels",
                                 "annotations"}, rule
            assert re.fullmatch(r"[A-Za-z_]\w*", rule["alert"]) and isinstance(rule["expr"], str)
            assert re.fullmatch(r"(\d+[smhdwy])+", rule.get("for", "0s")), rule
            for key in ("labels", "annotations"):
                assert all(isinstance(k, str) and isinstance(v, str)
                           for k, v in rule.get(key, {}).items()), rule
            rules.append(rule)
    return rules


def test_the_alert_rules_parse_and_name_exported_series_only() -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {"AntdtWorkerHung", "AntdtPersistentStraggler",
                                           "AntdtRowsLost", "AntdtJobFailed"}
    names = exported()
    for rule in rules:
        found = metric_names(rule["expr"])
        assert found and found <= names, f"{rule['alert']}: {sorted(found - names)}"
        assert rule["labels"]["severity"] in ("warning", "critical")


WORKER = {"job_id": "j1", "worker": "tcp://10.0.0.2:4000", "agent": "worker1"}
CASES = {
    # alert: (the series that fire it and its value, a series that must not)
    "AntdtWorkerHung": (("dask_antdt_worker_state", {**WORKER, "state": "hung"}, 1),
                        ("dask_antdt_worker_state", {**WORKER, "agent": "worker0",
                                                     "state": "hung"}, 0)),
    "AntdtPersistentStraggler": (("dask_antdt_worker_state", {**WORKER, "state": "persistent"},
                                  1),
                                 ("dask_antdt_worker_state", {**WORKER, "state": "ok"}, 1)),
    "AntdtRowsLost": (("dask_antdt_job_rows_lost", {"job_id": "j1"}, 512),
                      ("dask_antdt_job_rows_lost", {"job_id": "j2"}, 0)),
    "AntdtJobFailed": (("dask_antdt_job_state", {"job_id": "j1", "state": "failed"}, 1),
                       ("dask_antdt_job_state", {"job_id": "j1", "state": "running"}, 1)),
}


def rendered(text: str, labels: dict[str, str], value: float) -> str:
    """``text`` with its ``{{ $labels.x }}`` and ``{{ $value }}`` filled in, as Prometheus
    fills them (the only template parts the rules use)."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], text)
    return re.sub(r"\{\{\s*\$value\s*\}\}", f"{value:g}", text)


def minutes(duration: str) -> int:
    """A rule's ``for`` in whole minutes (the rules say minutes, or nothing)."""
    if duration == "0s":
        return 0
    found = re.fullmatch(r"(\d+)m", duration)
    assert found, f"a for of whole minutes, found {duration!r}"
    return int(found.group(1))


def series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def test_promtool_checks_the_rules_and_each_alert_fires_when_it_should(tmp_path: Path) -> None:
    assert shutil.which("promtool"), "promtool is not installed: make test-tools"
    check = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(CASES) == set(rules)
    tests = []
    for alert, ((name, labels, value), (other, quiet, quiet_value)) in CASES.items():
        rule = rules[alert]
        tests.append({
            "interval": "1m",
            "input_series": [{"series": series(name, labels), "values": f"{value}x30"},
                             {"series": series(other, quiet), "values": f"{quiet_value}x30"}],
            "alert_rule_test": [{
                "eval_time": f"{minutes(rule.get('for', '0s')) + 1}m", "alertname": alert,
                "exp_alerts": [{"exp_labels": {**labels, **rule["labels"]},
                                "exp_annotations": {k: rendered(v, labels, value) for k, v in
                                                    rule["annotations"].items()}}]}]})
    spec = tmp_path / "alerts.test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
                                    "tests": tests}))
    result = subprocess.run(["promtool", "test", "rules", str(spec)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
