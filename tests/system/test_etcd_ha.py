"""A cluster whose store is a three-member etcd cluster on loopback (docs/store.md): no daemon
hosts any store, every daemon knows every member, so neither an etcd member nor any one
daemon is a single point of failure.

(a) An etcd member (the leader) and a daemon are SIGKILLed together while a 2:3-node job
    runs on three nodes: the job re-forms on the two survivors and succeeds, the survivors
    still show every job and its outcome, and a job submitted afterwards runs.
(b) The daemon that submitted the job and runs its rank 0 (n1, the one that would host the
    TCPStore in a c10d cluster) is SIGKILLed: there is no store host to lose, the others
    carry on and run the next job.  n1 observed the cluster and compacted etcd's history;
    the observer that takes its place compacts it too.

Everything waits on the daemons' own streams (job documents, node lists) with deadlines.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.etcd import EtcdCluster, require_etcd
from harness import Daemon, node_states, worker_args
from store_attack import wait_for

pytestmark = [pytest.mark.slow]

# Each round's workers meet once (gloo) and then wait for the test's gate file: the kills land
# while the three-node round runs, and the re-formed round, once seen, is let go and succeeds.
GATE = "gate"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@pytest.fixture
def ha(
    etcd_cluster_factory: Callable[..., Any], shared_tmp: Path
) -> Iterator[tuple[Any, EtcdCluster]]:
    """Three daemons (not started), clients of a three-member etcd cluster; the daemons stop
    before the members do."""
    require_etcd()
    etcd = EtcdCluster(shared_tmp / "etcd-data", members=3)
    cluster = None
    try:
        cluster = etcd_cluster_factory(3, etcd)
        yield cluster, etcd
    finally:
        if cluster is not None:
            cluster.stop()
        etcd.stop()


def states(daemon: Daemon) -> dict[str, str]:
    return {n["name"]: n["state"] for n in daemon.ctl("nodes")}


def healthy(doc: dict[str, Any]) -> int:
    return sum(1 for w in doc["workers"] if w["state"] == "HEALTHY" and w["pid"])


def loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def kill(daemon: Daemon) -> None:
    daemon.signal(signal.SIGKILL)
    daemon.wait_exit()


def assert_nothing_lost(
    survivors: list[Daemon], jobs: dict[str, str], nodes: list[str], timeout: float = 30
) -> None:
    """Every survivor shows every job (``list --all``, ``status``) in its final state, the
    finished ones as run by ``nodes``, within ``timeout`` seconds: a node's last part may
    reach the others a few seconds late (a write in flight when the etcd leader died hangs
    until it times out, then is sent again)."""
    deadline = time.monotonic() + timeout
    while (wrong := differences(survivors, jobs, nodes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not wrong, wrong


def differences(
    survivors: list[Daemon], jobs: dict[str, str], nodes: list[str]
) -> list[tuple[str, Any]]:
    wrong: list[tuple[str, Any]] = []
    for daemon in survivors:
        listed = {j["id"]: j["state"] for j in daemon.ctl("list", "--all")}
        if {job: listed.get(job) for job in jobs} != jobs:
            wrong.append((daemon.name, listed))
        for job, state in jobs.items():
            doc = daemon.ctl("status", job)
            run_by = sorted(n["node"] for n in doc["nodes"])
            if doc["state"] != state or doc["ended"] is None or run_by != nodes:
                wrong.append((daemon.name, doc))
    return wrong


def test_a_job_survives_the_etcd_leader_and_a_node_killed_together(ha, shared_tmp):
    cluster, etcd = ha
    cluster.start()
    n1 = cluster[0]
    assert states(n1) == {"n1": "up", "n2": "up", "n3": "up"}
    gate = shared_tmp / GATE
    job = n1.submit("--nnodes", "2:3", *worker_args("--ddp", "--until", str(gate)))["id"]
    doc = n1.wait_job(
        job, lambda d: d["state"] == "RUNNING" and d["world_size"] == 3 and healthy(d) == 3
    )
    first_round = doc["round"]
    victim_name = next(
        n["node"] for n in doc["nodes"] if n["group_rank"] != 0 and n["node"] != "n1"
    )
    victim = next(d for d in cluster if d.name == victim_name)
    survivors = [d for d in cluster if d is not victim]
    names = sorted(d.name for d in survivors)

    leader = etcd.leader()
    member = 0 if leader is None else leader
    etcd.kill(member)  # the leader (etcd elects another in about a second)...
    kill(victim)  # ...and a node, together
    killed = time.monotonic()
    print(f"killed etcd member m{member} (leader: {leader is not None}) and {victim_name}")

    reformed = n1.wait_job(
        job,
        lambda d: (
            d["state"] in TERMINAL
            or (d["world_size"] == 2 and d["state"] == "RUNNING" and healthy(d) == 2)
        ),
        timeout=60,
    )
    print(
        f"re-formed on {[n['node'] for n in reformed['nodes']]} {time.monotonic() - killed:.1f} s "
        f"after the kills"
    )
    assert (
        reformed["state"] == "RUNNING" and sorted(n["node"] for n in reformed["nodes"]) == names
    ), reformed
    gate.touch()
    final = n1.wait_job(job, lambda d: d["state"] in TERMINAL, timeout=120)
    assert final["state"] == "SUCCEEDED", final
    assert final["world_size"] == 2 and final["round"] > first_round, final
    assert final["restarts"] == 0, final  # losing a node is not a worker failure
    for daemon in survivors:  # both survivors see the outcome, and the lost node
        daemon.wait_job(job, lambda d: d["state"] == "SUCCEEDED", timeout=30)
        assert node_states(daemon, lambda s: s.get(victim_name) == "lost") == {
            **{name: "up" for name in names},
            victim_name: "lost",
        }

    # a job submitted after the member died, from the other survivor, runs on both survivors
    other = next(d for d in survivors if d is not n1)
    after = other.submit_wait("--nnodes", "2", *worker_args("--ddp"))
    assert after["state"] == "SUCCEEDED", after
    assert_nothing_lost(survivors, {job: "SUCCEEDED", after["id"]: "SUCCEEDED"}, names)
    assert "UNREACHABLE" not in other.ctl_run("version").stdout  # two members of three serve


def test_losing_the_first_daemon_loses_no_store(ha, shared_tmp):
    """n1 submits a 1:3-node job and starts it alone (group rank 0; ranks stay oldest
    first), the others join it; then n1 is SIGKILLed."""
    cluster, etcd = ha
    n1, n2, n3 = cluster
    n1.start()
    gate = shared_tmp / GATE
    job = n1.submit("--nnodes", "1:3", *worker_args("--ddp", "--until", str(gate)))["id"]
    n1.wait_job(job, lambda d: d["state"] == "RUNNING" and d["world_size"] == 1 and healthy(d) == 1)
    n2.start(wait=False)
    n3.start(wait=False)
    for daemon in (n2, n3):
        daemon.wait_notify("READY=1", 60)
    doc = n1.wait_job(
        job, lambda d: d["state"] == "RUNNING" and d["world_size"] == 3 and healthy(d) == 3
    )
    first_round = doc["round"]
    assert {n["node"]: n["group_rank"] for n in doc["nodes"]}["n1"] == 0
    # nobody hosts a store: no daemon runs torch's TCPStore server (nor loads torch at all)
    assert not any(loads_torch(d.proc.pid) for d in cluster)

    # the observer (n1, the first daemon) compacts etcd's history (every second here)
    wait_for(lambda: etcd.history()[1] > 0, 30, "a compaction of etcd's history")
    kill(n1)
    killed = time.monotonic()
    revision_at_kill = etcd.history()[0]
    reformed = n2.wait_job(
        job,
        lambda d: (
            d["state"] in TERMINAL
            or (d["world_size"] == 2 and d["state"] == "RUNNING" and healthy(d) == 2)
        ),
        timeout=60,
    )
    print(
        f"re-formed on {[n['node'] for n in reformed['nodes']]} {time.monotonic() - killed:.1f} s "
        f"after n1 died"
    )
    assert reformed["state"] == "RUNNING" and sorted(n["node"] for n in reformed["nodes"]) == [
        "n2",
        "n3",
    ]
    assert 0 in [n["group_rank"] for n in reformed["nodes"]]  # somebody took rank 0 over
    gate.touch()
    final = n3.wait_job(job, lambda d: d["state"] in TERMINAL, timeout=120)
    assert final["state"] == "SUCCEEDED" and final["round"] > first_round, final
    for daemon in (n2, n3):
        assert node_states(daemon, lambda s: s.get("n1") == "lost") == {
            "n1": "lost",
            "n2": "up",
            "n3": "up",
        }

    after = n3.submit_wait("--nnodes", "2", *worker_args("--ddp"))
    assert after["state"] == "SUCCEEDED", after
    assert_nothing_lost([n2, n3], {job: "SUCCEEDED", after["id"]: "SUCCEEDED"}, ["n2", "n3"])
    # the observer that took n1's place compacts too: up to revisions written after n1 died
    wait_for(lambda: etcd.history()[1] > revision_at_kill, 30, "a compaction by n1's successor")
