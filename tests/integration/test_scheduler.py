"""The cluster's scheduler (issue 26) with real daemons, real workers and real elasticctl
on 127.0.0.x: an elastic job lends the nodes above its min and gives one back, in place,
when another job needs it, and grows again when that job ends."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from harness import worker_args
from store_attack import Cluster, wait_for
from test_in_place import EXAMPLE, committed, events, formed, report  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

FAST = "[scheduler]\nresize_interval = 1.0\n"


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="sched")
    for role in ("a", "b", "c"):
        cluster.add(role, config=FAST)
    return cluster.start()


def parts_of(daemon: Any, job: str) -> dict[str, str]:
    doc = daemon.ctl("status", job)
    return {node: part["state"] for node, part in doc.get("parts", {}).items()}


def test_an_elastic_job_gives_a_node_to_a_waiting_job_in_place_and_grows_back(
        cluster: Cluster, report: Path, shared_tmp: Path) -> None:
    a, b, c = cluster
    big = a.submit("--in-place", "--nnodes", "1:3", "--nproc-per-node", "1", "--max-restarts", "0",
                   "--last-call-timeout", "1", EXAMPLE, "--", "--batches", "100000", "--commit-every", "5",
                   "--step-time", "0.02", "--report", str(report))["id"]
    three = wait_for(lambda: formed(report, 3), 120, "3 ranks training")
    since = time.time()
    wait_for(lambda: committed(report, set(three), since, 0), 60, "every rank committed")

    # another job that needs a whole node (2 slots): only reclaiming one of big's can admit it
    small = b.submit("--nproc-per-node", "2", *worker_args("--sleep", "8"))["id"]
    submitted = time.time()
    b.wait_running(small, 2, timeout=60)
    started = time.time() - submitted
    two = wait_for(lambda: formed(report, 2, submitted), 60, "big re-formed as 2")
    assert set(two) < set(three), "the survivors kept their processes"
    after = time.time()
    wait_for(lambda: committed(report, set(two), after, 0), 60, "big trains on at world size 2")
    doc = a.ctl("status", big)
    assert doc["state"] == "RUNNING" and doc["restarts"] == 0, doc
    assert started < 30, f"the waiting job started {started:.1f} s after its submit"

    # the small job ends: big grows back to 3 (in place: the two survivors keep their processes)
    a.wait_job(small, lambda d: d["state"] == "SUCCEEDED", timeout=60)
    ended = time.time()
    again = wait_for(lambda: formed(report, 3, ended), 90, "big grew back to 3")
    assert set(two) < set(again)
    assert a.ctl("status", big)["restarts"] == 0
    a.ctl("cancel", big)
