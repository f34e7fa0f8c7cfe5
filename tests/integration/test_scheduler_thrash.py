"""Thrash probes against the scheduler, with real daemons, real workers, real elasticctl and
two users made by the test: a *victim* whose job the scheduler may disturb, and a
*thrasher* (same priority, better fair share: its account has used nothing) that submits a
one-node job and cancels it as soon as it runs, in a loop, for LOOP seconds.

- preemption: the victim's ``--preemptible --nnodes 2`` job holds both nodes; each of the
  thrasher's jobs can start only by preempting it (the attack round saw 40 preemptions in
  49 s, the victim's job going round 0 -> 40);
- shrink to admit: the victim's ``--nnodes 1:3`` job lends two of three nodes; each of the
  thrasher's jobs takes one, and the victim grows back when it ends (the attack round: 10
  re-forms in 100 s at the default resize_interval; here growth is due at once, the worst
  case).

A job is not disturbed again within ``scheduler.min_run_time`` (MIN_RUN s here, 60 by
default) of its last start, resize or preemption: the victim is re-formed at most about
once per MIN_RUN (twice per cycle when it shrinks and grows back).  Each rank 0 of the
victim writes a line each time it starts: the rounds are counted from those lines.  Then,
the victim preempted for good, `elasticctl queue` counts its WAITED from when it stopped,
not from its submit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, worker_args
from local_users import local_users
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

MIN_RUN = 5.0  # scheduler.min_run_time in these clusters
LOOP = 30.0  # seconds the thrasher submits and cancels
SLEEP = worker_args("--sleep", "0")
STARTS = """
import os, sys, time
if os.environ["RANK"] == "0":
    with open(sys.argv[1], "a") as f:
        f.write(f"{time.time()} {os.environ['WORLD_SIZE']}\\n")
while True:
    time.sleep(1)
"""


@pytest.fixture
def users() -> Iterator[dict[str, str]]:
    with local_users("victim", "thrasher") as made:
        yield made


@pytest.fixture
def make_cluster(daemon_factory: Any, shared_tmp: Path) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(prefix: str, nodes: int) -> Cluster:
        cluster = Cluster(daemon_factory, shared_tmp, prefix=prefix)
        made.append(cluster)
        config = f"[scheduler]\nresize_interval = 1.0\nmin_run_time = {MIN_RUN}\n"
        for role in "abc"[:nodes]:
            cluster.add(role, config=config)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.stop()  # before the users go


@pytest.fixture
def script(shared_tmp: Path) -> tuple[Path, Path]:
    """The victim's script, and the file its rank 0 appends a line to at each start."""
    workdir = shared_tmp / "victim"
    workdir.mkdir()
    workdir.chmod(0o777)
    path, starts = workdir / "starts.py", workdir / "starts.log"
    path.write_text(STARTS)
    return path, starts


def starts(path: Path) -> list[float]:
    return (
        [float(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []
    )


def state(daemon: Daemon, job: str) -> str:
    reply = daemon.request("status", job=job)
    assert reply.ok, reply.message
    return reply.result["state"]


def thrash(daemon: Daemon, user: str, seconds: float) -> int:
    """Submit a one-node job as ``user`` and cancel it as soon as it runs, for ``seconds``;
    how many of them ran."""
    ran, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = daemon.submit("--nproc-per-node", "2", *SLEEP, user=user)["id"]
        while time.monotonic() < deadline and state(daemon, job) != "RUNNING":
            time.sleep(0.1)
        ran += state(daemon, job) == "RUNNING"
        daemon.ctl("cancel", job, user=user)
    return ran


def test_a_preemptible_job_is_preempted_at_most_once_per_min_run_time(
    make_cluster: Any, users: dict[str, str], script: tuple[Path, Path]
) -> None:
    a, b = make_cluster("thrp", 2)
    path, log = script
    victim = a.submit(
        "--preemptible",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        str(path),
        str(log),
        user=users["victim"],
        cwd=str(path.parent),
    )["id"]
    wait_for(lambda: len(starts(log)) == 1, 60, "the victim's first start")
    time.sleep(MIN_RUN)  # the victim has run its minimum: the thrasher may preempt it once

    began = time.time()
    ran = thrash(b, users["thrasher"], LOOP)
    took = time.time() - began
    rounds = [t for t in starts(log) if began <= t <= began + took]
    print(f"preemption thrash: {len(rounds)} restarts of the victim, {ran} jobs ran, {took:.1f} s")
    assert 1 <= len(rounds) <= took / MIN_RUN + 2, (rounds, ran, took)
    assert a.ctl("status", victim)["restarts"] == 0, "a preemption spends no restart"

    # the victim preempted for good: it waits since it stopped, not since its submit
    holder = b.submit("--nproc-per-node", "2", *SLEEP, user=users["thrasher"])["id"]
    wait_for(lambda: state(b, holder) == "RUNNING", 60, "the thrasher's last job runs")
    stopped = time.time()
    row = wait_for(
        lambda: next((r for r in a.ctl("queue")["jobs"] if r["id"] == victim), None),
        30,
        "the victim waits",
    )
    submitted = row["submitted"]
    assert row["preempted"] and row["waiting_since"] >= began > submitted + MIN_RUN, row
    assert abs(row["waiting_since"] - stopped) < 15, (row, stopped)
    text = a.ctl_run("queue").stdout.splitlines()
    line = next(line.split() for line in text if victim in line)
    waited = line[-1]
    assert waited.endswith("s") and "m" not in waited and int(waited[:-1]) < 15, line


def test_a_lending_job_is_shrunk_at_most_once_per_min_run_time(
    make_cluster: Any, users: dict[str, str], script: tuple[Path, Path]
) -> None:
    a, _b, c = make_cluster("thrs", 3)
    path, log = script
    a.submit(
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "2",
        str(path),
        str(log),
        user=users["victim"],
        cwd=str(path.parent),
    )
    wait_for(lambda: world(log) == 6, 90, "the victim on 3 nodes (6 ranks)")
    time.sleep(MIN_RUN)

    began = time.time()
    ran = thrash(c, users["thrasher"], LOOP)
    took = time.time() - began
    rounds = [t for t in starts(log) if began <= t <= began + took]
    print(f"shrink thrash: {len(rounds)} re-forms of the victim, {ran} jobs ran, {took:.1f} s")
    assert 1 <= len(rounds) <= 2 * (took / MIN_RUN + 2), (rounds, ran, took)


def world(path: Path) -> int:
    """The world size of the victim's latest start."""
    lines = path.read_text().splitlines() if path.exists() else []
    return int(lines[-1].split()[1]) if lines else 0
