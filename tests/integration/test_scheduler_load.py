"""A long queue does not stall the daemon that allocates (the attack round's first break),
with real daemons, real workers and real elasticctl: three daemons (2 slots each) on a
TCPStore that a daemon of a cluster of its own hosts (so any node may die), jobs.max_per_user
= 0, 1,200 one-node jobs submitted over one connection (tests/fixtures/submit_many.py): three
run, the rest wait.  Then a node that neither observes nor hosts anything is SIGKILLed.

Before, each plan of that queue took 6-9.5 s on the allocating daemon's event loop: its
heartbeat duty stalled, the observer was re-elected again and again (term 1 -> 66 in 9
minutes), the lost node was shown lost after 46-125 s, `elasticctl version` took up to 15 s.
Now: the observer keeps its term, the node is shown lost (within LOST_BOUND, a bound for a
loaded machine: 3 s here), every `elasticctl version` answers, and the queue still moves (a
job cancelled, the first waiting one starts).  Timings are bench_schedule.py's."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import FIXTURES, PY, Daemon, worker_args
from store_attack import Cluster, attacker, node_states, wait_for

pytestmark = pytest.mark.slow

JOBS = 1200
LOST_BOUND = 30.0  # seconds: the dead_after is 3 s; before, 46-125 s
SLEEP = worker_args("--sleep", "0")


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Iterator[Cluster]:
    made = Cluster(daemon_factory, shared_tmp, prefix="load", store_apart=True)
    try:
        for role in "abc":  # root submits: jobs.max_per_user does not bind it
            made.add(role)
        yield made.start()
    finally:
        made.stop()


def observer(cluster: Cluster) -> tuple[str, int]:
    store = attacker(cluster)
    try:
        envelope = json.loads(store.read("nodes/observer"))
    finally:
        getattr(store, "close", lambda: None)()
    return envelope["body"]["name"], envelope["ver"]


def waiting(daemon: Daemon) -> int:
    return len(daemon.ctl("queue")["jobs"])


def test_a_long_queue_leaves_the_allocator_observing_and_a_lost_node_seen(
    cluster: Cluster,
) -> None:
    submitted = subprocess.run(
        [PY, str(FIXTURES / "submit_many.py"), cluster[0].socket, str(JOBS), "0"]
        + ["--nproc-per-node", "2", *SLEEP],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    accepted = json.loads(submitted.stdout.splitlines()[-1])["accepted"]
    assert len(accepted) == JOBS, submitted.stdout[-2000:]
    name, term = wait_for(lambda: observer(cluster), 30, "an observer")
    wait_for(lambda: waiting(cluster[0]) == JOBS - 3, 300, f"{JOBS - 3} jobs wait, 3 run")

    victim = next(d for d in cluster if d.name != name)
    others = [d for d in cluster if d is not victim]
    killed = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.wait_exit(30)
    for daemon in others:
        wait_for(
            lambda daemon=daemon: node_states(daemon).get(victim.name) == "lost",
            LOST_BOUND,
            f"{daemon.name} shows {victim.name} lost",
        )
    seen = time.monotonic() - killed
    for daemon in others:  # the control socket answers (elasticctl's own timeout bounds it)
        assert daemon.ctl("version")["elasticd"]
    time.sleep(3 * 3.0)  # three dead_afters more: a stalled observer would be replaced by now
    assert observer(cluster) == (name, term), "the allocating observer kept its term"
    print(f"1,200 jobs: lost node shown lost after {seen:.1f} s; observer {name} term {term}")

    # the queue moves: a job running on a live node cancelled, the first waiting one starts
    live = {d.name for d in others}
    running = next(
        r["id"]
        for r in others[0].ctl("list")
        if r["state"] == "RUNNING"
        and {w["node"] for w in others[0].ctl("status", r["id"])["workers"]} <= live
    )
    first = others[0].ctl("queue")["jobs"][0]["id"]
    others[0].ctl("cancel", running)
    wait_for(
        lambda: others[0].ctl("status", first)["state"] == "RUNNING",
        120,
        "the first waiting job runs",
    )
