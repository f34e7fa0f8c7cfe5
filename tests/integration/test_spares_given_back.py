"""Hot spares are the first capacity a node gives back (docs/in-place.md), end to end: real daemon,
real elasticctl, real workers (examples/elastic_train.py, gloo)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import ROOT, alive
from store_attack import Cluster, metric, wait_for

from elasticd.core.model import JobSpec, WorkerState
from elasticd.core.part.pool import standby
from elasticd.shell.workers import LocalWorkers

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
    return [
        e for e in map(json.loads, (x for x in lines if x.endswith("}"))) if e["event"] == "commit"
    ]


def parked(daemon: Any, job: str) -> tuple[int, int] | None:
    """(its rank 0's pid, its spare's pid) once the job trains here with its spare parked."""
    doc = daemon.ctl("status", job)
    ranks = {w["rank"]: w["pid"] for w in doc["workers"] if w["state"] == "HEALTHY"}
    if [n["spares"] for n in doc["nodes"]] == [1] and 0 in ranks and -1 in ranks:
        return ranks[0], ranks[-1]
    return None


def test_a_job_that_needs_the_room_of_a_spare_gets_it_and_the_job_trains_on(
    node: Any, shared_tmp: Path
) -> None:
    """A (1 worker, --spares 1) fills the node's 2 slots; B (1 worker) is submitted: A's
    parked spare is stopped, B runs in its slot, A trains on in the same process and shows
    0 spares."""
    report = shared_tmp / "report"
    report.mkdir(mode=0o777)
    a = node.submit(
        "--in-place",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "--spares",
        "1",
        EXAMPLE,
        "--",
        "--batches",
        "100000",
        "--commit-every",
        "5",
        "--step-time",
        "0.02",
        "--report",
        str(report),
    )["id"]
    rank0, spare = wait_for(lambda: parked(node, a), 120, "A trains and its spare parks")
    # the job gauges are recounted at most every 0.5 s after a change: wait for it
    wait_for(lambda: metric(node, "elasticd_spare_workers") == 1, 10, "the spare counted")

    asked_at = time.time()
    b = node.submit("--nnodes", "1", "--nproc-per-node", "1", WORKER, "--", "--sleep", "0")["id"]
    running = wait_for(
        lambda: [w for w in node.ctl("status", b)["workers"] if w["state"] == "HEALTHY"],
        60,
        "B runs in the spare's slot",
    )
    assert not alive(spare), "the spare was reaped before B started"
    assert running[0]["pid"] != spare
    doc = node.ctl("status", a)
    assert [n["spares"] for n in doc["nodes"]] == [0] and doc["state"] == "RUNNING"
    assert [w["pid"] for w in doc["workers"] if w["rank"] == 0] == [rank0], "A kept its process"
    wait_for(
        lambda: any(e["pid"] == rank0 and e["time"] > asked_at for e in commits(report)),
        60,
        "A trains on",
    )
    wait_for(lambda: metric(node, "elasticd_spare_workers") == 0, 10, "the spare uncounted")
    assert f"job {a}: gave back 1 spare slots to job {b}" in node.log_text()
    assert node.ctl("status", a)["restarts"] == 0
    node.ctl("cancel", a)
    node.ctl("cancel", b)


@pytest.mark.parametrize(
    "script",
    ["trap '' TERM; sleep 600 & wait", "(trap '' TERM; sleep 600) & wait"],
    ids=["the-spare-ignores-sigterm", "only-its-child-does"],
)
def test_a_spare_given_back_is_stopped_alone_even_if_it_ignores_sigterm(
    tmp_path: Path, script: str
) -> None:
    """The shell's half (LocalWorkers.stop_slots), real processes, no daemon: the spare in
    slot 1 (or only its child) ignores SIGTERM, and the child is in its process group; both
    are gone when stop_slots returns (the child may hold the slot's GPU), it shows STOPPED
    (not failed), and the worker in slot 0 runs on."""
    spec = JobSpec(
        id="j-000001",
        argv=("/bin/sh", "-c", script),
        kind="exec",
        python="/bin/sh",
        workdir=str(tmp_path),
        uid=os.getuid(),
        gid=os.getgid(),
        user=pwd.getpwuid(os.getuid()).pw_name,
        in_place=True,
        spares=1,
    )

    async def run() -> tuple[Any, list[int], list[int]]:
        workers = LocalWorkers(
            spec, standby(spec.id, "n1", 2), str(tmp_path / "out"), stop_grace=0.3
        )
        await workers.warm([0, 1])
        spare = workers.group.workers[1].pid
        deadline = time.monotonic() + 10
        while not _child_of(spare) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        family = [spare, *_child_of(spare)]
        await workers.stop_slots((1,))
        left = [p for p in family if alive(p)]
        group = workers.group
        await workers.stop()
        return group, family, left

    group, family, left = asyncio.run(run())
    assert len(family) == 2 and left == [], "the spare and its child are gone"
    assert [w.state for w in group.workers] == [WorkerState.HEALTHY, WorkerState.STOPPED]


def _child_of(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []
