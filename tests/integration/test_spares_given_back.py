"""Hot spares are the first capacity a node gives back (issue 27), end to end: real daemon,
real elasticctl, real workers (examples/elastic_train.py, gloo)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness import ROOT
from store_attack import Cluster, metric, wait_for

pytestmark = pytest.mark.slow

EXAMPLE = str(ROOT / "examples" / "elastic_train.py")
WORKER = str(ROOT / "tests" / "fixtures" / "worker.py")


@pytest.fixture
def node(daemon_factory: Any, shared_tmp: Path) -> Any:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="shed")
    cluster.add("a")  # 2 slots
    return cluster.start()[0]


def commits(report: Path) -> list[dict[str, Any]]:
    path = report / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, (x for x in lines if x.endswith("}"))) if e["event"] == "commit"]


def parked(daemon: Any, job: str) -> tuple[int, int] | None:
    """(its rank 0's pid, its spare's pid) once the job trains here with its spare parked."""
    doc = daemon.ctl("status", job)
    ranks = {w["rank"]: w["pid"] for w in doc["workers"] if w["state"] == "HEALTHY"}
    if [n["spares"] for n in doc["nodes"]] == [1] and 0 in ranks and -1 in ranks:
        return ranks[0], ranks[-1]
    return None


def test_a_job_that_needs_the_room_of_a_spare_gets_it_and_the_job_trains_on(node: Any, shared_tmp: Path) -> None:
    """A (1 worker, --spares 1) fills the node's 2 slots; B (1 worker) is submitted: A's
    parked spare is stopped, B runs in its slot, A trains on in the same process and shows
    0 spares."""
    report = shared_tmp / "report"
    report.mkdir(mode=0o777)
    a = node.submit("--in-place", "--nnodes", "1", "--nproc-per-node", "1", "--spares", "1",
                    EXAMPLE, "--", "--batches", "100000", "--commit-every", "5", "--step-time", "0.02",
                    "--report", str(report))["id"]
    rank0, spare = wait_for(lambda: parked(node, a), 120, "A trains and its spare parks")
    assert metric(node, "elasticd_spare_workers") == 1

    asked_at = time.time()
    b = node.submit("--nnodes", "1", "--nproc-per-node", "1", WORKER, "--", "--sleep", "0")["id"]
    running = wait_for(lambda: [w for w in node.ctl("status", b)["workers"] if w["state"] == "HEALTHY"],
                       60, "B runs in the spare's slot")
    assert not psutil.pid_exists(spare) or psutil.Process(spare).status() == psutil.STATUS_ZOMBIE, \
        "the spare was reaped before B started"
    assert running[0]["pid"] != spare
    doc = node.ctl("status", a)
    assert [n["spares"] for n in doc["nodes"]] == [0] and doc["state"] == "RUNNING"
    assert [w["pid"] for w in doc["workers"] if w["rank"] == 0] == [rank0], "A kept its process"
    wait_for(lambda: any(e["pid"] == rank0 and e["time"] > asked_at for e in commits(report)), 60,
             "A trains on")
    assert metric(node, "elasticd_spare_workers") == 0
    assert f"job {a}: gave back 1 spare slots to job {b}" in node.log_text()
    assert node.ctl("status", a)["restarts"] == 0
    node.ctl("cancel", a)
    node.ctl("cancel", b)
