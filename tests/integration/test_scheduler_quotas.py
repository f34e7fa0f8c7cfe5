"""A GPU quota against a job sized by the node (``--nproc-per-node gpu``), with real daemons,
real workers and real elasticctl: node g1 has 1 GPU, node g2 has 2 (``--gpus``, so a
worker's CUDA_VISIBLE_DEVICES names them), and a user made by the test may hold 1 GPU
(scheduler.users).  The job's share is a whole node's GPUs: 1 on g1, 2 on g2.  It must be
charged what it will hold where it lands: it starts on g1 only, and while g1 is taken it
waits (QuotaUser) with g2 idle.  Before, it was charged its smallest share anywhere (1
GPU), landed on g2 and held 2 for good."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, worker_args
from local_users import local_users
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

SLEEP = worker_args("--sleep", "0")


@pytest.fixture
def user() -> Iterator[str]:
    with local_users("gpuq") as users:
        yield users["gpuq"]


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path, user: str) -> Iterator[Cluster]:
    made = Cluster(daemon_factory, shared_tmp, prefix="gpuq")
    config = f"[scheduler]\nresize_interval = 1.0\nmin_run_time = 0.0\nusers = {{{user} = {{gpus = 1}}}}\n"
    try:
        made.add("g1", config=config, args=("--gpus", "1"))
        made.add("g2", config=config, args=("--gpus", "2"))
        yield made.start()
    finally:
        made.stop()  # before the user goes


def workers_on(daemon: Daemon, job: str) -> dict[str, int]:
    """The job's healthy workers per node, once it runs."""
    doc = daemon.ctl("status", job)
    on: dict[str, int] = {}
    for worker in doc["workers"]:
        if doc["state"] == "RUNNING" and worker["state"] == "HEALTHY" and worker["pid"]:
            on[worker["node"]] = on.get(worker["node"], 0) + 1
    return on


def reason(daemon: Daemon, job: str) -> str | None:
    rows = [row for row in daemon.ctl("queue")["jobs"] if row["id"] == job]
    return rows[0]["reason"] if rows else None


def test_a_job_sized_by_the_node_is_charged_the_gpus_of_the_node_it_lands_on(
    cluster: Cluster, user: str
) -> None:
    g1, g2 = cluster
    # root's one-GPU job takes g1 (root has no quota here)
    blocker = g1.submit("--nproc-per-node", "1", "--nodes", g1.name, *SLEEP)["id"]
    wait_for(lambda: workers_on(g1, blocker) == {g1.name: 1}, 60, "root's job on g1")

    # the user's job fits only g2, where it would hold 2 GPUs: it waits, g2 idles
    sized = g2.submit("--nproc-per-node", "gpu", *SLEEP, user=user)["id"]
    # each daemon reads the queue from the store in its own time: both are waited for
    wait_for(
        lambda: reason(g2, sized) == reason(g1, sized) == "QuotaUser",
        30,
        "the job waits on its quota, as both daemons see it",
    )
    assert workers_on(g2, sized) == {}
    assert {row["id"]: row.get("allocated") for row in g1.ctl("list")} == {blocker: 1, sized: 0}

    # g1 frees: it starts there, one worker on the one GPU
    g1.ctl("cancel", blocker)
    wait_for(lambda: workers_on(g2, sized) == {g1.name: 1}, 60, "the job on g1, 1 worker")
    # a second such job of the user's: over its quota anywhere (it holds 1 GPU), g2 idles
    second = g2.submit("--nproc-per-node", "gpu", *SLEEP, user=user)["id"]
    wait_for(lambda: reason(g1, second) == "QuotaUser", 30, "the second job waits on its quota")
    assert workers_on(g2, second) == {} and workers_on(g1, sized) == {g1.name: 1}
