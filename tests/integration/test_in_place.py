"""In-place elasticity end to end: real daemons on 127.0.0.x, real workers running
examples/elastic_train.py (gloo, DDP, TorchState), real elasticctl.

What each test holds the product to: survivors keep their processes through a node loss, a
node coming back and a worker failure; after every change all ranks hold equal parameters
and train on from the committed batch (no checkpoint file exists); a survivor blocked in a
collective on a frozen peer is freed by the daemon's notice, long before gloo's timeout; a
survivor that never rejoins is stopped and the job falls back to a group restart.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT, alive, free_port
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

EXAMPLE = str(ROOT / "examples" / "elastic_train.py")


def events(report: Path) -> list[dict[str, Any]]:
    path = report / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def starts(report: Path, world: int, since: float = 0.0) -> dict[int, dict[str, Any]]:
    """The newest ``start`` event of each pid in a world of ``world`` ranks after ``since``."""
    found: dict[int, dict[str, Any]] = {}
    for event in events(report):
        if event["event"] == "start" and event["world"] == world and event["time"] >= since:
            found[event["pid"]] = event
    return found


def formed(report: Path, world: int, since: float = 0.0) -> dict[int, dict[str, Any]] | None:
    """``world`` ranks started in one round after ``since`` (by pid), else None."""
    by_round: dict[int, dict[int, dict[str, Any]]] = {}
    for pid, event in starts(report, world, since).items():
        by_round.setdefault(event["round"], {})[pid] = event
    full = [group for group in by_round.values() if len(group) == world]
    return full[-1] if full else None


def committed(report: Path, pids: set[int], after: float, batch_past: int) -> bool:
    """Every one of ``pids`` committed a batch past ``batch_past`` since ``after``."""
    seen = {
        e["pid"]
        for e in events(report)
        if e["event"] == "commit" and e["time"] >= after and e["batch"] > batch_past
    }
    return pids <= seen


def assert_equal_state(group: dict[int, dict[str, Any]]) -> None:
    """All ranks of a formed round start from the same batch and the same parameters."""
    batches = {e["batch"] for e in group.values()}
    sums = {e["checksum"] for e in group.values()}
    assert len(batches) == 1 and len(sums) == 1, group


def commits_agree(report: Path) -> None:
    """At every (round, batch) every rank that committed holds the same parameters."""
    seen: dict[tuple[int, int], set[float]] = {}
    for e in events(report):
        if e["event"] == "commit":
            seen.setdefault((e["round"], e["batch"]), set()).add(e["checksum"])
    assert seen and all(len(sums) == 1 for sums in seen.values()), {
        k: v for k, v in seen.items() if len(v) > 1
    }


def submit(
    daemon: Any,
    report: Path,
    *extra: str,
    nnodes: str = "2:3",
    restarts: int = 3,
    args: tuple[str, ...] = (),
    script: str = EXAMPLE,
) -> str:
    doc = daemon.submit(
        "--in-place",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--max-restarts",
        str(restarts),
        "--last-call-timeout",
        "1",
        *extra,
        script,
        "--",
        "--batches",
        "100000",
        "--commit-every",
        "5",
        "--step-time",
        "0.02",
        "--report",
        str(report),
        *args,
    )
    return doc["id"]


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="inplace")
    for role in ("a", "b", "c"):
        cluster.add(role)
    return cluster.start()


@pytest.fixture
def report(shared_tmp: Path) -> Path:
    path = shared_tmp / "report"
    path.mkdir(mode=0o777)
    return path


def test_survivors_keep_their_processes_through_node_loss_and_return(
    cluster: Cluster, report: Path
) -> None:
    a, _b, c = cluster
    job = submit(a, report)
    three = wait_for(lambda: formed(report, 3), 120, "3 ranks training")
    assert_equal_state(three)
    since = time.time()
    wait_for(lambda: committed(report, set(three), since, 0), 60, "every rank committed")
    survivors = {pid for pid, e in three.items() if e["rank"] in (0, 1)}  # a and b, oldest first
    lost = (set(three) - survivors).pop()

    killed_at = time.time()
    c.signal(signal.SIGKILL)  # the node dies: its daemon, and with it its worker
    c.wait_exit(30)
    two = wait_for(lambda: formed(report, 2, killed_at), 60, "the survivors re-formed as 2")
    assert set(two) == survivors, "the survivors kept their processes"
    assert_equal_state(two)
    resumed = next(iter(two.values()))["batch"]
    last_commit = max(
        e["batch"]
        for e in events(report)
        if e["event"] == "commit" and e["time"] < killed_at and e["rank"] == 0
    )
    assert resumed >= last_commit and resumed % 5 == 0, (resumed, last_commit)
    wait_for(lambda: committed(report, survivors, killed_at, resumed), 60, "training went on")

    back_at = time.time()
    c.start()
    three_again = wait_for(lambda: formed(report, 3, back_at), 120, "the job grew back to 3")
    assert survivors < set(three_again) and lost not in three_again
    assert_equal_state(three_again)
    assert next(iter(three_again.values()))["batch"] > resumed
    wait_for(lambda: committed(report, set(three_again), back_at, 0), 60, "3 ranks train on")
    commits_agree(report)
    assert not list(report.glob("*.pt")), "no checkpoint file was ever written or read"
    a.ctl("cancel", job)


@pytest.fixture
def pair(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="inplace2")
    for role in ("a", "b"):
        cluster.add(role)
    return cluster.start()


def test_at_min_nodes_a_lost_worker_does_not_stop_its_peer(pair: Cluster, report: Path) -> None:
    """--nnodes 2:2 (docs/in-place.md, "A member with no workers"): b's only worker is SIGKILLed.  b stays a member with no
    workers while a new one warms up, so a's worker trains on alone in the same process
    (WORLD_SIZE 1) instead of waiting; the new one then joins it, and both agree."""
    a, _b = pair
    job = submit(a, report, nnodes="2:2")
    two = wait_for(lambda: formed(report, 2), 120, "2 ranks training")
    since = time.time()
    wait_for(lambda: committed(report, set(two), since, 0), 60, "both ranks committed")
    survivor = next(pid for pid, e in two.items() if e["rank"] == 0)
    lost = next(pid for pid, e in two.items() if e["rank"] == 1)

    killed_at = time.time()
    os.kill(lost, signal.SIGKILL)
    alone = wait_for(lambda: formed(report, 1, killed_at), 60, "the survivor trained on alone")
    assert set(alone) == {survivor}, "the survivor kept its process"
    resumed = alone[survivor]["batch"]
    wait_for(
        lambda: committed(report, {survivor}, killed_at, resumed), 60, "a commit in the world of 1"
    )
    again = wait_for(lambda: formed(report, 2, killed_at), 120, "the new worker joined")
    assert survivor in again and lost not in again
    assert_equal_state(again)
    assert next(iter(again.values()))["batch"] > resumed, "the survivor's training was kept"
    commits_agree(report)
    assert a.ctl("status", job)["restarts"] == 1
    a.ctl("cancel", job)


# A first-round worker (placed before it started: RANK is set) whose model is still being
# built when a third node's round forms: it calls elastic.run only once that node's worker
# trains alone.
LATE_FIRST = """import json, os, runpy, sys, time
report = sys.argv[sys.argv.index("--report") + 1]
def alone():
    try:
        lines = open(os.path.join(report, "events.jsonl")).read().splitlines()
    except OSError:
        return False
    return any('"world": 1' in line and '"start"' in line for line in lines)
deadline = time.time() + 120
while "RANK" in os.environ and not alone() and time.time() < deadline:
    time.sleep(0.1)
sys.argv[0] = {example!r}
runpy.run_path({example!r}, run_name="__main__")
"""


def test_a_node_that_comes_while_the_first_round_builds_its_model_is_trained_with(
    pair: Cluster, report: Path, shared_tmp: Path
) -> None:
    """bench_recovery hung twice at its 3-node formation: c's scale-up round formed while
    a's and b's first-round workers still built their model, so a and b joined it with no
    worker placed (c's trained alone).  Their workers, once in elastic.run, must neither
    take their round-0 place (its peers moved on) nor count as placed: a scale-up round
    takes them in, and the job trains at 3."""
    a, _b = pair
    c = pair.add("c")
    script = shared_tmp / "late_first.py"
    script.write_text(LATE_FIRST.format(example=EXAMPLE))
    script.chmod(0o644)
    job = submit(a, report, script=str(script))
    wait_for(lambda: a.ctl("status", job).get("round") == 0, 60, "the first round (a and b)")
    c.start()
    alone = wait_for(lambda: formed(report, 1), 120, "c's worker trained alone (a and b hold none)")
    three = wait_for(lambda: formed(report, 3), 120, "a's and b's workers taken in: 3 ranks")
    assert set(alone) < set(three)
    assert_equal_state(three)
    a.ctl("cancel", job)


def spares_of(daemon: Any, job: str, nodes: int) -> dict[str, int]:
    """node -> the pid of its parked spare (a worker that holds no rank), once ``nodes`` have one."""
    doc = daemon.ctl("status", job)
    parked = {n["node"] for n in doc["nodes"] if n["spares"] == 1 and n["state"] == "RUNNING"}
    pids = {
        w["node"]: w["pid"]
        for w in doc["workers"]
        if w["rank"] < 0 and w["state"] == "HEALTHY" and w["node"] in parked
    }
    return pids if len(pids) == nodes else {}


def gone(pids: set[int]) -> bool:
    return not any(alive(pid) for pid in pids)


def test_spares_take_the_places_of_a_lost_worker_and_of_a_lost_node(
    cluster: Cluster, report: Path
) -> None:
    """--spares 1 (docs/in-place.md, "Hot spares"): each node keeps a warm worker beside its placed one.
    b's placed worker is SIGKILLed: b's spare (the same process, past its imports and its
    model) is the new rank, and a new spare warms up.  Node c dies: the survivors' round
    takes a's spare, so the job is back at 3 ranks with no process started.  A cancel ends
    every worker and spare."""
    a, b, c = cluster
    job = submit(a, report, "--spares", "1", nnodes="2:3")
    three = wait_for(lambda: formed(report, 3), 120, "3 ranks training")
    spares = wait_for(lambda: spares_of(a, job, 3), 120, "a warm spare parked on each node")
    assert not set(spares.values()) & set(three), "a spare holds no rank"
    where = {w["pid"]: w["node"] for w in a.ctl("status", job)["workers"]}
    lost = next(pid for pid in three if where[pid] == b.name)

    killed_at = time.time()
    os.kill(lost, signal.SIGKILL)
    again = wait_for(lambda: formed(report, 3, killed_at), 60, "back at 3 ranks")
    assert spares[b.name] in again and lost not in again, "b's spare took the lost worker's place"
    assert_equal_state(again)

    lost_at = time.time()  # b's new spare warms up meanwhile
    c.signal(signal.SIGKILL)
    c.wait_exit(30)
    filled = wait_for(lambda: formed(report, 3, lost_at), 60, "back at 3 ranks on 2 nodes")
    survivors = {pid for pid in again if where.get(pid) != c.name}
    assert survivors < set(filled) and spares[a.name] in filled, "a's spare filled in for c"
    assert_equal_state(filled)
    fresh = wait_for(lambda: spares_of(a, job, 1), 120, "b warmed a new spare")
    assert set(fresh) == {b.name} and fresh[b.name] not in (lost, spares[b.name])
    assert a.ctl("status", job)["restarts"] == 1, "only the worker's failure spent a restart"
    a.ctl("cancel", job)
    everyone = {*filled, fresh[b.name]}
    wait_for(lambda: gone(everyone), 30, "no worker or spare outlives the cancel")


def test_a_rank_that_raises_mid_step_makes_every_rank_restore_the_last_commit(
    cluster: Cluster, report: Path
) -> None:
    a, _b, _c = cluster
    job = submit(a, report, nnodes="3", args=("--fail-at-batch", "23", "--fail-rank", "1"))
    three = wait_for(lambda: formed(report, 3), 120, "3 ranks training")
    survivors = {pid for pid, e in three.items() if e["rank"] != 1}
    wait_for(lambda: (report / "failed-once").exists(), 60, "rank 1 raised")
    failed_at = os.stat(report / "failed-once").st_mtime
    two = wait_for(lambda: formed(report, 2, failed_at), 60, "the others trained on")
    assert set(two) == survivors, "the ranks that did not fail kept their processes"
    assert_equal_state(two)
    assert next(iter(two.values()))["batch"] == 20, "every rank went back to the commit at 20"
    again = wait_for(lambda: formed(report, 3, failed_at), 120, "3 ranks again, with the new one")
    assert survivors < set(again)
    assert_equal_state(again)
    doc = a.ctl("status", job)
    assert doc["restarts"] == 1
    a.ctl("cancel", job)


def test_a_survivor_blocked_on_a_frozen_peer_is_freed_by_the_daemon(
    cluster: Cluster, report: Path
) -> None:
    """Node c freezes (SIGSTOP: its daemon and worker hold their sockets open and answer
    nothing, as a host that hangs or drops off the network): a and b sit in all_reduce.
    gloo would wait for its 30-minute timeout; the daemons see c's heartbeat stop and tell
    their workers, which abort the group and re-form without c."""
    a, _b, c = cluster
    submit(a, report)
    three = wait_for(lambda: formed(report, 3), 120, "3 ranks training")
    since = time.time()
    wait_for(lambda: committed(report, set(three), since, 0), 60, "every rank committed")
    frozen = [pid for pid, e in three.items() if e["rank"] == 2]
    frozen_at = time.time()
    for pid in [c.proc.pid, *frozen]:
        os.kill(pid, signal.SIGSTOP)
    try:
        two = wait_for(lambda: formed(report, 2, frozen_at), 30, "a and b re-formed without c")
        took = min(e["time"] for e in two.values()) - frozen_at
        assert took < 15, f"freed after {took:.1f} s"
        assert set(two) <= set(three)
    finally:
        for pid in [c.proc.pid, *frozen]:
            os.kill(pid, signal.SIGCONT)


# Rank 1 stops calling into its group once told to (a "freeze" file): a worker stuck where
# an abort does not reach it.  ``stubborn``: its runtime never gives that round up either
# (as one whose runtime is wedged), so that its daemon's rejoin timer is what ends it.
STUBBORN = """
import json, os, signal, sys, time
import torch, torch.distributed as dist
from elasticd import elastic
report, mode = sys.argv[1], sys.argv[2]
if mode == "stubborn":
    os.environ["ELASTICD_REJOIN_TIMEOUT"] = "1e9"
elastic.init("gloo")
state = elastic.ObjectState(batch=0)

def note(event):
    with open(os.path.join(report, "events.jsonl"), "a") as f:
        f.write(json.dumps({"event": event, "pid": os.getpid(), "rank": dist.get_rank(),
                            "world": dist.get_world_size(), "round": int(os.environ["ELASTICD_ROUND"]),
                            "time": time.time()}) + "\\n")

@elastic.run
def train(state):
    note("start")
    while True:
        if dist.get_rank() == 1 and os.path.exists(os.path.join(report, "freeze")):
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
            note("frozen")
            while True:  # never calls into the group again, never asks for its place
                time.sleep(1)
        dist.all_reduce(torch.ones(1))
        state.batch += 1
        state.commit()
        time.sleep(0.02)

train(state)
"""


def freeze_rank_1_then_lose_c(
    cluster: Cluster, report: Path, shared_tmp: Path, mode: str, rejoin_timeout: int
) -> tuple[str, dict[int, dict[str, Any]], float]:
    """STUBBORN (``mode``) on a, b and c; once rank 1 (b) stopped calling into its group, c
    is SIGKILLed: a change whose abort b's worker never acts on.  The job, the three ranks
    of the first round, and when c was killed."""
    a, _b, c = cluster
    script = shared_tmp / f"{mode}.py"
    script.write_text(STUBBORN)
    job = a.submit(
        "--in-place",
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--rejoin-timeout",
        str(rejoin_timeout),
        "--last-call-timeout",
        "1",
        str(script),
        "--",
        str(report),
        mode,
    )["id"]
    first = wait_for(lambda: formed(report, 3), 120, "3 ranks")
    (report / "freeze").touch()
    wait_for(lambda: [e for e in events(report) if e["event"] == "frozen"], 30, "rank 1 froze")
    (report / "freeze").unlink()
    changed_at = time.time()
    c.signal(signal.SIGKILL)  # a change: a and b are told to abort and take their new places
    return job, first, changed_at


def test_a_survivor_that_does_not_rejoin_is_stopped_and_the_job_restarts_every_worker(
    cluster: Cluster, report: Path, shared_tmp: Path
) -> None:
    a, b, _c = cluster
    job, first, changed_at = freeze_rank_1_then_lose_c(cluster, report, shared_tmp, "stubborn", 3)
    # b's worker never asks for its place: after 3 s b stops it, and every worker restarts
    fresh = wait_for(lambda: formed(report, 2, changed_at), 90, "2 fresh ranks")
    assert not set(fresh) & set(first), "every worker was restarted, none kept"
    status = a.ctl("status", job)
    assert status["restarts"] == 1, "the fallback spends one restart"
    assert "did not rejoin" in b.log_text() or "stalled" in b.log_text()
    a.ctl("cancel", job)


def test_a_survivor_stuck_in_its_aborted_round_is_replaced_and_the_others_keep_theirs(
    cluster: Cluster, report: Path, shared_tmp: Path
) -> None:
    """As a node frozen mid-allreduce leaves its worker when it comes back (gloo's waitSend
    ends only at the group's timeout: test_detector): b's worker never leaves its aborted
    round.  At half the rejoin timeout it ends itself; its node replaces it, a keeps its
    worker, and no restart is spent."""
    a, b, _c = cluster
    job, first, changed_at = freeze_rank_1_then_lose_c(cluster, report, shared_tmp, "stuck", 6)
    on_a = {pid for pid, e in first.items() if e["rank"] == 0}
    two = wait_for(lambda: formed(report, 2, changed_at), 120, "a and b's new worker at 2")
    assert on_a <= set(two), "a's worker went on in its own process"
    assert not set(two) & {pid for pid, e in first.items() if e["rank"] == 1}, "b's was replaced"
    assert a.ctl("status", job)["restarts"] == 0
    assert "still in it after 3 s" in b.log_path.read_text()  # the whole log: not its tail
    a.ctl("cancel", job)


def test_a_fixed_master_port_serves_rounds_that_follow_each_other_in_place(
    pair: Cluster, report: Path
) -> None:
    """``--master-port P``: the survivors of a round stay in its group (and its store) while
    the next round forms, so the daemon of a node first in both cannot serve them one port.
    The job grows 2 -> 3 and shrinks back to 2, in place: every change keeps the survivors'
    processes, and each round's store is at P or P + 1 on its first node."""
    a, _b = pair
    port = free_port()
    job = submit(a, report, "--master-port", str(port))
    two = wait_for(lambda: formed(report, 2), 120, "2 ranks training")
    since = time.time()
    wait_for(lambda: committed(report, set(two), since, 0), 60, "both ranks committed")
    c = pair.add("c")
    c.start()
    three = wait_for(lambda: formed(report, 3, since), 120, "c taken in: 3 ranks")
    assert set(two) < set(three), "a's and b's workers kept their processes"
    assert_equal_state(three)
    grown = time.time()
    wait_for(lambda: committed(report, set(three), grown, 0), 60, "3 ranks committed")
    lost = next(pid for pid in three if pid not in two)
    killed_at = time.time()
    c.signal(signal.SIGKILL)
    c.wait_exit(30)
    again = wait_for(lambda: formed(report, 2, killed_at), 60, "the survivors re-formed as 2")
    assert set(again) == set(two) and lost not in again
    assert_equal_state(again)
    wait_for(lambda: committed(report, set(two), killed_at, 0), 60, "training went on")
    ports = {e["master_port"] for e in events(report) if e["event"] == "start"}
    assert ports <= {port, port + 1}, ports
    commits_agree(report)
    assert a.ctl("status", job)["restarts"] == 0
    a.ctl("cancel", job)
