"""Hung ranks with real daemons (docs/operations.md, "Hung ranks"): two daemons on 127.0.0.x,
one worker each, --hang-timeout 5; rank 1 sleeps forever inside its step while rank 0 waits
for it in all_reduce.  Each node dumps its rank's stack into the job's logs (the library's
faulthandler signal); the node whose rank is not inside a collective fails it, naming it in
``elasticctl status``; in place the job goes on without it (its replacement joins), a classic
job restarts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

WORKER = str(ROOT / "tests" / "fixtures" / "hang_worker.py")


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="hung")
    for role in ("a", "b"):
        cluster.add(role)
    return cluster.start()


@pytest.fixture
def report(shared_tmp: Path) -> Path:
    path = shared_tmp / "report"
    path.mkdir(mode=0o777)
    return path


def events(report: Path) -> list[dict[str, Any]]:
    path = report / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def hung_at(report: Path) -> float | None:
    return next((e["time"] for e in events(report) if e["event"] == "hang"), None)


def stepped_after(report: Path, since: float, world: int) -> bool:
    return any(
        e["event"] == "step" and e["time"] > since and e["world"] == world for e in events(report)
    )


def assert_hung_and_named(daemon: Any, job: str, report: Path) -> float:
    hung = wait_for(lambda: hung_at(report), 120, "rank 1 hung")
    doc = wait_for(
        lambda: (d := daemon.ctl("status", job))["hung"] and d, 60, "status names the hung rank"
    )
    assert len(doc["hung"]) == 1, doc["hung"]
    cause = doc["hung"][0]
    assert "rank 1 on" in cause and "not inside a collective" in cause and "step_body" in cause
    text = daemon.ctl_run("status", job).stdout
    assert "hung:" in text and "rank 1 on" in text
    logs = daemon.ctl_run("logs", job).stdout
    # every rank's stack is in the job's logs: rank 0 waiting in all_reduce, rank 1 asleep
    assert "in all_reduce" in logs, logs[-4000:]
    assert "in step_body" in logs, logs[-4000:]
    return hung


def test_in_place_a_hung_rank_is_named_and_replaced_and_the_job_goes_on(
    cluster: Cluster, report: Path
) -> None:
    a, _b = cluster
    job = a.submit(
        "--in-place",
        "--nnodes",
        "2:2",
        "--max-restarts",
        "3",
        "--hang-timeout",
        "5",
        WORKER,
        "--",
        str(report),
        "inplace",
    )["id"]
    hung = assert_hung_and_named(a, job, report)
    wait_for(lambda: stepped_after(report, hung + 5, 2), 180, "a round of two trains again")
    doc = a.ctl("status", job)
    assert doc["state"] == "RUNNING"
    first = {e["pid"] for e in events(report) if e["event"] == "start" and e["time"] < hung}
    again = {e["pid"] for e in events(report) if e["event"] == "step" and e["time"] > hung + 5}
    assert len(first & again) == 1, "rank 0 kept its process; rank 1's was replaced"
    a.ctl("cancel", job)


def test_a_classic_job_with_a_hung_rank_restarts(cluster: Cluster, report: Path) -> None:
    a, _b = cluster
    job = a.submit(
        "--nnodes",
        "2:2",
        "--max-restarts",
        "3",
        "--hang-timeout",
        "5",
        WORKER,
        "--",
        str(report),
        "classic",
    )["id"]
    hung = assert_hung_and_named(a, job, report)
    wait_for(lambda: stepped_after(report, hung + 5, 2), 180, "the restarted job trains again")
    doc = a.ctl("status", job)
    assert doc["state"] == "RUNNING" and doc["restarts"] >= 1
    a.ctl("cancel", job)
