"""Anyone who reaches the store port against the schedule's keys (DESIGN's attacker 3), on
both store backends: a keyless client writes "1" at ``schedule/mark/<head version + 1>``
and at the 1,000 versions after it, the wake-up keys the daemons wait on for the next
schedule.  A mark's presence alone changes nothing (a follower then reads the signed
head), and a wake-up that brought no newer schedule backs off: the daemons' CPU stays
where it was (before, every daemon busy-looped on the key: 0-1% -> 30-65% of a core, and
etcd itself 3% -> 40%), and jobs still start and make way as the schedule says.

Real daemons (3 on 127.0.0.x, 2 slots each) on a TCPStore one of them hosts, or on a
one-member etcd that none hosts; the attacker is torch's TCPStore client or etcd's gRPC
API spoken directly (tests/store_attack.py).  The CPU is each process's own (user +
system, psutil), over a window of WINDOW seconds before and during the attack; its bound
is for a loaded machine (an idle daemon here uses a few percent of a core).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import Daemon, worker_args
from store_attack import Cluster, attacker, wait_for

WINDOW = 8.0  # seconds of CPU time measured, before and during the attack
MARKS = 1001  # the next version's wake-up key and the 1,000 after it
CPU_BOUND = 8.0  # % of one core a daemon may use meanwhile (idle: 0.2-1.5%; a busy loop: 16-65%)
SLEEP = worker_args("--sleep", "0")


@pytest.fixture(params=["c10d", "etcd"])
def cluster(
    request: pytest.FixtureRequest, daemon_factory: Any, shared_tmp: Path
) -> Iterator[Cluster]:
    """Three daemons on the backend; they stop before the etcd does."""
    with contextlib.ExitStack() as stack:
        etcd = None
        if request.param == "etcd":
            from fixtures.etcd import EtcdCluster, require_etcd

            require_etcd()
            etcd = stack.enter_context(EtcdCluster(shared_tmp / "etcd-data"))
        made = Cluster(daemon_factory, shared_tmp, prefix="mark", etcd=etcd)
        stack.callback(made.stop)
        for role in "abc":
            made.add(role)
        yield made.start()


def head_version(cluster: Cluster) -> int | None:
    """The version of the schedule's signed head (its envelope says it in the clear)."""
    store = attacker(cluster)
    try:
        raw = store.read("schedule/head")
    finally:
        getattr(store, "close", lambda: None)()
    return json.loads(raw)["ver"] if raw is not None else None


def followed(daemon: Daemon) -> tuple[int, int] | None:
    doc = daemon.ctl("queue")
    return tuple(doc["schedule"]) if doc["schedule"] else None


def cpu_percent(pids: dict[str, int], window: float) -> dict[str, float]:
    """Each process's CPU (user + system) over ``window`` seconds, in % of one core."""
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    began = time.monotonic()
    time.sleep(window)
    took = time.monotonic() - began
    return {
        name: round(100 * (sum(p.cpu_times()[:2]) - before[name]) / took, 1)
        for name, p in procs.items()
    }


def test_forged_wake_up_keys_leave_the_daemons_idle_and_jobs_scheduled(
    cluster: Cluster, figures: Any
) -> None:
    a, b, c = cluster
    version = wait_for(lambda: head_version(cluster), 30, "a schedule in the store")
    wait_for(lambda: all(followed(d) for d in cluster), 30, "every node follows a schedule")
    pids = {d.name: d.proc.pid for d in cluster}
    if cluster.etcd is not None:
        pids["etcd"] = cluster.etcd.pid(0)
    quiet = cpu_percent(pids, WINDOW)

    store = attacker(cluster)
    try:
        for ahead in range(1, MARKS + 1):
            store.write(f"schedule/mark/{version + ahead}", b"1")
    finally:
        getattr(store, "close", lambda: None)()
    attacked = cpu_percent(pids, WINDOW)
    backend = "etcd" if cluster.etcd is not None else "c10d"
    figures.add(f"schedule marks [{backend}]: CPU % before", json.dumps(quiet))
    figures.add(f"schedule marks [{backend}]: CPU % under 1,001 forged marks", json.dumps(attacked))
    for daemon in cluster:
        assert attacked[daemon.name] < CPU_BOUND, (daemon.name, quiet, attacked)

    # jobs still start, and make way, by schedules that come while the keys stand
    full = a.submit("--nnodes", "3", "--nproc-per-node", "2", *SLEEP)["id"]
    a.wait_running(full, 6, timeout=60)
    waiting = b.submit("--nproc-per-node", "2", *SLEEP)["id"]
    wait_for(
        lambda: [row["id"] for row in c.ctl("queue")["jobs"]] == [waiting],
        30,
        "the new job waits (a newer schedule reached c)",
    )
    a.ctl("cancel", full)
    b.wait_running(waiting, 2, timeout=60)
    assert head_version(cluster) > version
