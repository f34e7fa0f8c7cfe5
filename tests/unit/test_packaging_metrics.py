"""The shipped Grafana dashboard and Prometheus rules use exactly the metrics elasticd exposes.

metrics.py is the contract: every metric name in a PromQL expression of
``packaging/grafana-dashboard.json`` or ``packaging/prometheus-rules.yml`` must be a sample
name a real ``Metrics()`` registry exposes, and the dashboard must show every metric family
(except the process_* ones listed in ``PROCESS_NOT_SHOWN``).

PyYAML is not a dependency, so the rules file is read with a small line parser; the rules
file keeps every ``expr:`` on one line for that reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest

from elasticd.core.allocation import Waiting, WaitReason
from elasticd.core.model import JobSpec, PartState
from elasticd.core.records import JobRecord, Part
from elasticd.core.schedule import Schedule
from elasticd.metrics import Metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "packaging", "grafana-dashboard.json")
RULES = os.path.join(ROOT, "packaging", "prometheus-rules.yml")

# Families of the process collector the dashboard deliberately leaves out.
PROCESS_NOT_SHOWN = {
    "process_virtual_memory_bytes",  # meaningless for a Python process that maps CUDA/torch
}

# A metric name of ours inside PromQL: not part of a longer identifier on either side.
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])((?:elasticd|process)_[a-z0-9_]+)(?![A-Za-z0-9_:])")
_NODE_FILTER = 'instance=~"$node"'


# -- what the daemon exposes --------------------------------------------------------------


def _exercised() -> Metrics:
    """A Metrics with one sample in every labelled family, through the daemon's own calls."""
    m = Metrics()
    m.round_joined("initial", 0.2)
    m.worker_exited(0)
    m.worker_exited(-9)
    m.restarted()
    m.barrier_waited(1.5)
    m.count_nodes(["up", "up", "lost"])

    async def value() -> bytes:
        return b"value"

    async def unreachable() -> None:
        raise ConnectionError("store down")

    asyncio.run(m.store_call("get", value()))
    with pytest.raises(ConnectionError):
        asyncio.run(m.store_call("get", unreachable()))
    m.control_requests.labels("submit", "ok").inc()
    m.refused_records.inc()
    m.loop_fault("heartbeat")
    m.output_dropped(4096, "No space left on device")
    m.state_write_failed("history", "database or disk is full")
    m.history_quarantined.inc()
    m.history_skipped.inc()
    m.detector_message("in")
    m.detector_refused("mac")
    m.detector_lost(0.4)
    for what, label, value in (
        ("gpus_out", "", 1),
        ("gpu_fault", "xid 79", 1),
        ("xid", "79", 1),
        ("gpu_slowdown", "0", 1),
    ):
        m.gpu_news(what, label, value)
    m.job_usage.source = lambda: {
        "j-1a2b3c": {"cpu_seconds": 1.5, "memory_peak": 1 << 20, "oom_kills": 0, "standbys": 2}
    }
    _exercise_sharing(m)
    m.checkpoint_saved(0.4, 0.2)
    m.checkpoint_on_disk(1.5)
    m.checkpoint_held("j-1a2b3c", 1 << 20)
    m.checkpoint_restored("copy", 1 << 20)
    return m


def _exercise_sharing(m: Metrics) -> None:
    """The scheduler's metrics: a job submitted here that started and used this node, one
    that waits, a plan that grew a job, a reclaim."""
    now = time.time()
    spec = JobSpec(
        id="j-1",
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1000,
        gid=1000,
        user="u",
        submitted_on="n1",
        created=now - 20,
    )
    ran = JobRecord(
        spec, 1, {"n1": Part("n1", PartState.RUNNING, started=now - 10, ran=now - 10, slots=1)}
    )
    waits = JobRecord(
        JobSpec(
            id="j-2",
            argv=("t.py",),
            python="/p",
            workdir="/w",
            uid=1000,
            gid=1000,
            user="u",
            account="ml",
            created=now - 5,
        ),
        2,
    )
    jobs: list[JobRecord] = []
    schedule = Schedule(
        1, 2, {"j-1": frozenset({"n1", "n2"})}, (Waiting("j-2", WaitReason.RESOURCES),)
    )
    m.sharing.watch("n1", lambda: jobs, lambda: schedule, lambda: schedule)
    jobs += [ran, waits]
    m.count_jobs(jobs, "n1")
    m.planned(Schedule(1, 1, {"j-1": frozenset({"n1"})}), schedule, 0.002)
    m.reclaimed()


@pytest.fixture(scope="module")
def metrics() -> Metrics:
    return _exercised()


@pytest.fixture(scope="module")
def exposed(metrics: Metrics) -> set[str]:
    """Sample names in the text a scrape of /metrics returns."""
    text = generate_latest(metrics.registry).decode()
    return {
        re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0)
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


@pytest.fixture(scope="module")
def families(metrics: Metrics) -> dict[str, set[str]]:
    """Metric family name -> the sample names it exposes (``_total``, ``_bucket``, ...)."""
    return {
        family.name: {sample.name for sample in family.samples}
        for family in metrics.registry.collect()
    }


def test_every_family_is_exercised(families: dict[str, set[str]], exposed: set[str]) -> None:
    """Guards the checks below: a family without samples would hide its names from them."""
    empty = sorted(name for name, samples in families.items() if not samples)
    assert not empty, f"families without samples (exercise them in _exercised()): {empty}"
    assert set().union(*families.values()) == exposed


# -- reading the packaging files ----------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows and panels, including the panels inside collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
    return found


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in _all_panels(dashboard) if panel["type"] != "row"]


def _dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """PromQL of every panel target and of every query variable."""
    exprs = [value for key, value in _walk(dashboard["panels"]) if key == "expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1].replace("''", "'")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return json.loads(value)  # close enough to YAML's double-quoted scalars for PromQL
    return value


def _rules() -> list[dict[str, str]]:
    """Each alerting rule's one-line keys (alert, expr, for, severity, summary, description).

    Only the keys this test needs, read line by line; a block scalar is recorded as such so
    that an ``expr: |`` (which this parser cannot read) fails loudly instead of passing.
    """
    rules: list[dict[str, str]] = []
    with open(RULES, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            assert "\t" not in line, f"{RULES}:{number}: tab in YAML"
            text = line.strip()
            if text.startswith("#"):
                continue
            if text.startswith("- alert:"):
                rules.append({"alert": text.removeprefix("- alert:").strip(), "line": str(number)})
                continue
            key, sep, value = text.partition(":")
            if rules and sep and key in ("expr", "for", "severity", "summary", "description"):
                rules[-1][key] = _unquote(value.strip())
    return rules


def _names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def _balanced(expr: str) -> bool:
    """Brackets match outside string literals (a cheap guard against a mangled expression)."""
    pairs, stack, quote = {")": "(", "]": "[", "}": "{"}, [], None
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and quote is None


# -- the dashboard ------------------------------------------------------------------------


def test_dashboard_uses_only_exposed_metrics(exposed: set[str]) -> None:
    exprs = _dashboard_exprs(_dashboard())
    assert exprs
    for expr in exprs:
        assert _balanced(expr), expr
        unknown = _names(expr) - exposed
        assert not unknown, f"{sorted(unknown)} not exposed by elasticd (in {expr!r})"


def test_dashboard_shows_every_family(families: dict[str, set[str]]) -> None:
    used = set().union(*map(_names, _dashboard_exprs(_dashboard())))
    assert PROCESS_NOT_SHOWN <= families.keys(), (
        "PROCESS_NOT_SHOWN names a family that does not exist"
    )
    assert all(name.startswith("process_") for name in PROCESS_NOT_SHOWN)
    missing = sorted(
        name
        for name, samples in families.items()
        if name not in PROCESS_NOT_SHOWN and not samples & used
    )
    assert not missing, f"metric families with no panel on the dashboard: {missing}"
    shown_anyway = sorted(name for name in PROCESS_NOT_SHOWN if families[name] & used)
    assert not shown_anyway, f"shown on the dashboard, drop from PROCESS_NOT_SHOWN: {shown_anyway}"


def test_dashboard_selects_only_elasticd_targets() -> None:
    """Every selector is filtered by the node variable: process_* names are common to every
    Python exporter, and ``$node`` only lists elasticd instances."""
    for expr in _dashboard_exprs(_dashboard()):
        if expr.startswith("label_values("):
            continue
        for match in _METRIC.finditer(expr):
            selector = re.match(r"\{[^}]*\}", expr[match.end() :])
            assert selector and _NODE_FILTER in selector.group(0), (
                f"{match.group(1)} is not filtered by {_NODE_FILTER} in {expr!r}"
            )


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    node = variables["node"]
    query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
    assert query == "label_values(elasticd_build_info, instance)"
    # no allValue: "All" must expand to the listed instances, not to ".*" (see the test above)
    assert node["includeAll"] and not node.get("allValue")

    ids = [p["id"] for p in _all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _panels(dashboard):
        title = panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${DS_PROMETHEUS}", (
                title
            )
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), title

    cells: dict[tuple[int, int], str] = {}  # (the panels of a collapsed row are not laid out)
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


# -- the alerting rules -------------------------------------------------------------------


def test_rules_use_only_exposed_metrics(exposed: set[str]) -> None:
    rules = _rules()
    assert rules
    for rule in rules:
        expr = rule.get("expr", "")
        assert expr and expr[0] not in "|>", (
            f"{rule['alert']} (line {rule['line']}): keep expr on one line"
        )
        assert _balanced(expr), expr
        unknown = _names(expr) - exposed
        assert not unknown, f"{rule['alert']}: {sorted(unknown)} not exposed by elasticd"


def test_rules_are_complete() -> None:
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        where = f"{rule['alert']} (line {rule['line']})"
        assert re.fullmatch(r"\d+[smhdwy]", rule.get("for", "")), f"{where}: for: missing or bad"
        assert rule.get("severity") in ("critical", "warning", "info"), f"{where}: severity"
        assert rule.get("summary") and rule.get("description"), f"{where}: annotations"
    # the alerts the operations guide promises
    used = {name for rule in rules for name in _names(rule["expr"])}
    assert any('up{job="elasticd"}' in r["expr"] for r in rules)
    for name in (
        "elasticd_store_up",
        "elasticd_store_refused_records_total",
        "elasticd_nodes",
        "elasticd_jobs_finished_total",
        "elasticd_worker_restarts_total",
        "elasticd_rendezvous_duration_seconds_bucket",
        "elasticd_exit_barrier_wait_seconds_bucket",
        "elasticd_longest_wait_seconds",
    ):
        assert name in used, f"no alert on {name}"


# -- with promtool, where it is installed (Debian: apt-get install prometheus) --------------

_GRAFANA_VARIABLES = {
    "$node": "gpu-node-01:9464",
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "6h",
}


def _promtool_check(path: str) -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", path], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")
def test_promtool_accepts_rules() -> None:
    _promtool_check(RULES)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")
def test_promtool_accepts_dashboard_queries(tmp_path) -> None:
    """The dashboard's PromQL, with Grafana's variables filled in, as recording rules."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for number, expr in enumerate(_dashboard_exprs(_dashboard())):
        if expr.startswith("label_values("):  # Grafana's, not PromQL
            continue
        for variable in sorted(_GRAFANA_VARIABLES, key=len, reverse=True):
            expr = expr.replace(variable, _GRAFANA_VARIABLES[variable])
        assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
        lines += [f"      - record: dashboard:query_{number}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text("\n".join(lines) + "\n")
    _promtool_check(str(path))


_WAITING_TEST = """rule_files:
  - {rules}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'elasticd_longest_wait_seconds{{job="elasticd", instance="a:9464", reason="Resources"}}'
        values: '0+60x60'
      - series: 'elasticd_longest_wait_seconds{{job="elasticd", instance="b:9464", reason="Resources"}}'
        values: '0+30x60'
      - series: 'elasticd_longest_wait_seconds{{job="elasticd", instance="a:9464", reason="Held"}}'
        values: '0+60x60'
    alert_rule_test:
      - eval_time: 34m
        alertname: ElasticdJobWaitingLong
        exp_alerts: []
      - eval_time: 40m
        alertname: ElasticdJobWaitingLong
        exp_alerts:
          - exp_labels: {{severity: warning, job: elasticd, reason: Resources}}
            exp_annotations:
              summary: "An elasticd job has waited 40m 0s to start (reason Resources)"
              description: {description}
"""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")
def test_promtool_a_job_waiting_over_30_minutes_alerts_once_for_the_cluster(tmp_path) -> None:
    """Pending from the first sample over 1800 s (31 m), firing 5 m later: one alert for the
    cluster per reason (every node reports the same wait), none for held jobs (their own)."""
    rule = next(r for r in _rules() if r["alert"] == "ElasticdJobWaitingLong")
    path = tmp_path / "waiting-test.yml"
    path.write_text(
        _WAITING_TEST.format(
            rules=RULES,
            description=json.dumps(_description(rule).replace("{{ $labels.reason }}", "Resources")),
        )
    )
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _description(rule: dict[str, str]) -> str:
    """A folded block's text, as YAML reads it (``_rules`` keeps only its first line)."""
    with open(RULES, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = int(rule["line"])
    at = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("description: >-"))
    folded = []
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        folded.append(line.strip())
    return " ".join(folded)
