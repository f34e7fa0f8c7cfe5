"""The cluster's scheduler (docs/scheduler.md) with real daemons, real workers and real elasticctl
on 127.0.0.x, on both store backends (a TCPStore, an etcd no daemon hosts):

- an elastic job lends the nodes above its min and gives one back, in place, when another
  user's job needs it, and grows again when that job ends;
- priority, then fair share, then age order the waiting jobs of two users, and
  `elasticctl queue` says so, with Slurm's reasons;
- a user's quota keeps their second job waiting while slots idle; their first may borrow
  the idle nodes, and gives one up to another user's job before a job that lends does;
- a preemptible job is stopped below its min for a job of higher priority, requeued
  without a restart spent, and resumed from its checkpoint when that job ends;
- the allocator's daemon SIGKILLed while jobs run and wait: another node takes over within
  dead_after, the running jobs go on, and a waiting job starts when room appears.

Each test waits on what the daemons say (job streams, `queue`, the workers' own reports),
never on a sleep."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, wait_gone, worker_args
from local_users import local_users
from store_attack import Cluster, attacker, wait_for
from test_in_place import EXAMPLE, committed, events, formed, report  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

FAST = "[scheduler]\nresize_interval = 1.0\nmin_run_time = 0.0\n"
SLEEP = worker_args("--sleep", "0")  # a light worker that runs until it is stopped
DEAD_AFTER = 3.0  # rendezvous.keep_alive_interval x keep_alive_max_attempt, by default


@pytest.fixture(params=["c10d", "etcd"])
def backend(request: pytest.FixtureRequest, shared_tmp: Path) -> Iterator[Any]:
    """None for a TCPStore that a daemon hosts; else a fresh one-member etcd without users,
    SIGKILLed after the test's daemons stopped."""
    if request.param == "c10d":
        yield None
        return
    from fixtures.etcd import EtcdCluster, require_etcd

    require_etcd()
    with EtcdCluster(shared_tmp / "etcd-data") as etcd:
        yield etcd


@pytest.fixture
def make_cluster(
    daemon_factory: Any, shared_tmp: Path, backend: Any
) -> Iterator[Callable[..., Cluster]]:
    """``make(prefix, config, nodes=3, store_apart=False)``: a started cluster of ``nodes``
    daemons (2 slots each) with ``config`` (TOML) on the test's backend, each following the
    allocator's schedule; its daemons stop before the etcd does."""
    made: list[Cluster] = []

    def make(prefix: str, config: str = FAST, nodes: int = 3, store_apart: bool = False) -> Cluster:
        cluster = Cluster(
            daemon_factory, shared_tmp, prefix=prefix, etcd=backend, store_apart=store_apart
        )
        made.append(cluster)
        for role in "abcdefgh"[:nodes]:
            cluster.add(role, config=config)
        cluster.start()
        for daemon in cluster.daemons:  # a node without a schedule yet places jobs first come
            follows_a_schedule(daemon)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()


def queue(daemon: Daemon) -> list[tuple[str, str]]:
    """`elasticctl queue` as (job, reason) in start order; a preempted job's reason says so."""
    doc = daemon.ctl("queue")
    assert doc["scheduler"], doc
    return [
        (row["id"], row["reason"] + (" (preempted)" if row["preempted"] else ""))
        for row in doc["jobs"]
    ]


def equals(get: Callable[[], Any], wanted: Any, timeout: float, what: str) -> None:
    """Poll ``get()`` until it returns ``wanted``; fail with what it returned last."""
    deadline = time.monotonic() + timeout
    while (got := get()) != wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not {wanted!r} within {timeout} s, last {got!r}")
        time.sleep(0.2)


def follows_a_schedule(daemon: Daemon, timeout: float = 30) -> None:
    equals(lambda: daemon.ctl("queue")["scheduler"], True, timeout, f"{daemon.name}'s schedule")


def queue_is(daemon: Daemon, wanted: list[tuple[str, str]], timeout: float = 30) -> None:
    """Until ``daemon``'s queue is ``wanted`` (a node follows the schedule a moment after the
    allocator wrote it: the checks that follow ask the same node)."""
    equals(lambda: queue(daemon), wanted, timeout, f"the queue on {daemon.name}")


def queue_text(daemon: Daemon) -> list[list[str]]:
    """The rows of `elasticctl queue`'s table as a user reads them: #, ID, ..., REASON."""
    done = daemon.ctl_run("queue")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["#", "ID"], done.stdout
    return [line.split() for line in lines[1:]]


def allocation(daemon: Daemon) -> dict[str, int]:
    """Each open job's ALLOC in `elasticctl list`: the nodes the schedule gives it."""
    return {row["id"]: row["allocated"] for row in daemon.ctl("list") if "allocated" in row}


def allocation_is(daemon: Daemon, wanted: dict[str, int], timeout: float = 30) -> None:
    equals(lambda: allocation(daemon), wanted, timeout, f"the allocation on {daemon.name}")


def running_on(
    daemon: Daemon, job: str, nodes: int, workers: int, timeout: float = 60
) -> dict[str, Any]:
    """The job's document once it runs ``workers`` healthy workers on ``nodes`` nodes."""

    def ready() -> dict[str, Any] | None:
        doc = daemon.ctl("status", job)
        healthy = [w for w in doc["workers"] if w["state"] == "HEALTHY" and w["pid"]]
        on = {w["node"] for w in healthy}
        return (
            doc
            if doc["state"] == "RUNNING" and len(healthy) == workers and len(on) == nodes
            else None
        )

    return wait_for(ready, timeout, f"job {job} running {workers} workers on {nodes} nodes")


def trained(report: Path, pids: set[int], world: int, after: float) -> bool:
    """Every one of ``pids`` committed a batch in a world of ``world`` ranks since ``after``."""
    return pids <= {
        e["pid"]
        for e in events(report)
        if e["event"] == "commit" and e["world"] == world and e["time"] >= after
    }


def pids(doc: dict[str, Any]) -> set[int]:
    return {w["pid"] for w in doc["workers"] if w["pid"]}


# -- 1. shrink to admit, in place; grow to fill ------------------------------------------------


def test_an_elastic_job_gives_a_node_to_another_users_job_in_place_and_grows_back(
    make_cluster: Callable[..., Cluster], report: Path
) -> None:
    a, b, _c = make_cluster("sched")
    big = a.submit(
        "--in-place",
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--last-call-timeout",
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
    three = wait_for(lambda: formed(report, 3), 120, "3 ranks training")
    since = time.time()
    wait_for(lambda: committed(report, set(three), since, 0), 60, "every rank committed")

    # another user's job that needs a whole node (2 slots): only reclaiming one of big's can admit it
    submitted, wall = time.monotonic(), time.time()
    small = b.submit("--nproc-per-node", "2", *SLEEP, user="nobody")["id"]
    b.wait_running(small, 2, timeout=60)
    started = time.monotonic() - submitted
    two = wait_for(lambda: formed(report, 2, wall), 60, "big re-formed as 2")
    assert set(two) < set(three), "the survivors kept their processes"
    after = time.time()
    wait_for(lambda: trained(report, set(two), 2, after), 60, "big trains on at world size 2")
    doc = a.ctl("status", big)
    assert doc["state"] == "RUNNING" and doc["restarts"] == 0, doc
    assert started < 10, f"the waiting job ran {started:.1f} s after its submit"

    # the small job ends: big grows back to 3 (in place: the two survivors keep their processes)
    b.ctl("cancel", small, user="nobody")
    ended = time.time()
    again = wait_for(lambda: formed(report, 3, ended), 90, "big grew back to 3")
    assert set(two) < set(again)
    after = time.time()
    wait_for(lambda: trained(report, set(again), 3, after), 60, "big trains on at world size 3")
    assert a.ctl("status", big)["restarts"] == 0
    a.ctl("cancel", big)


# -- 2. the order: priority, then fair share, then age -----------------------------------------


def test_priority_then_fair_share_order_two_users_waiting_jobs(
    make_cluster: Callable[..., Cluster],
) -> None:
    """alpha may ask --priority 5.  alpha's job runs first (alpha's account has used nodes,
    beta's none); then, the cluster full: alpha's job (0), beta's (0), alpha's (5), in that
    order of submits.  They start (and `queue` lists them) in the order 5, beta's, alpha's 0."""
    with local_users("alpha", "beta") as users:
        alpha, beta = users["alpha"], users["beta"]
        cluster = make_cluster("prio", FAST + f"priority_users = {{{alpha} = 5}}\n")
        a, b, c = cluster
        try:
            used = a.submit("--nnodes", "2", "--nproc-per-node", "2", *SLEEP, user=alpha)["id"]
            running_on(a, used, 2, 4)
            full = a.submit("--nproc-per-node", "2", *SLEEP)["id"]  # root's, on the third node
            running_on(a, full, 1, 2)
            old = a.submit("--nproc-per-node", "2", *SLEEP, user=alpha)["id"]
            fair = b.submit("--nproc-per-node", "2", *SLEEP, user=beta)["id"]
            high = c.submit(
                "--nnodes", "2", "--nproc-per-node", "2", "--priority", "5", *SLEEP, user=alpha
            )["id"]
            queue_is(a, [(high, "Resources"), (fair, "Resources"), (old, "Resources")])
            usage = {row["account"]: row["node_seconds"] for row in a.ctl("usage")["accounts"]}
            assert usage.get(alpha, 0) > 0 and usage.get(beta, 0) == 0, usage

            # a node frees: high cannot start on it and keeps it; the others wait for it (Priority)
            a.ctl("cancel", full)
            queue_is(b, [(high, "Resources"), (fair, "Priority"), (old, "Priority")])
            rows = queue_text(b)
            assert [(r[0], r[1], r[-2]) for r in rows] == [
                ("1", high, "Resources"),
                ("2", fair, "Priority"),
                ("3", old, "Priority"),
            ], rows
            assert [r[3] for r in rows] == [alpha, beta, alpha] and [r[5] for r in rows] == [
                "5",
                "0",
                "0",
            ]
            assert allocation(b) == {used: 2, high: 0, fair: 0, old: 0}, (
                "the free node idles for high"
            )

            # room for two: the high one and beta's start, alpha's older one waits
            a.ctl("cancel", used)
            running_on(a, high, 2, 4)
            running_on(b, fair, 1, 2)
            queue_is(c, [(old, "Resources")])
            assert a.ctl("status", old)["state"] == "PENDING"
        finally:
            cluster.stop()  # before its users go


# -- 3. quotas -----------------------------------------------------------------------------------


def test_a_users_quota_keeps_their_second_job_waiting_and_what_they_borrow_is_reclaimed_first(
    make_cluster: Callable[..., Cluster],
) -> None:
    """nobody's quota: 1 node (scheduler.users; scheduler.user_quota would bind root's jobs
    too: every user's).  nobody's elastic job is admitted at its min (1 node) and grows
    into the idle nodes, borrowing over the quota; nobody's second job waits QuotaUser while
    a slot idles on every node.  A job that needs a slot when none is free takes it from
    the borrower (even of higher priority) before a job that only lends above its min."""
    a, b, c = make_cluster(
        "quota", FAST + "priority_users = {nobody = 1}\nusers = {nobody = {nodes = 1}}\n"
    )
    first = a.submit(
        "--priority", "1", "--nnodes", "1:3", "--nproc-per-node", "1", *SLEEP, user="nobody"
    )["id"]
    running_on(a, first, 3, 3)  # 3 nodes for a quota of 1
    second = b.submit("--nproc-per-node", "1", *SLEEP, user="nobody")["id"]
    queue_is(a, [(second, "QuotaUser")])
    assert queue_text(a)[0][-2] == "QuotaUser"
    assert allocation(a) == {first: 3, second: 0}  # while one slot idles on every node

    # root's elastic job fills the idle slots (it lends above its min 1)
    lender = c.submit("--nnodes", "1:3", "--nproc-per-node", "1", *SLEEP)["id"]
    running_on(c, lender, 3, 3)
    # a slot is wanted when none is free: the borrower gives one up, not the lender
    wanted = c.submit("--nproc-per-node", "1", *SLEEP)["id"]
    running_on(c, wanted, 1, 1)
    doc = running_on(a, first, 2, 2)
    assert doc["restarts"] == 0, "a reclaim spends no restart"
    allocation_is(b, {first: 2, lender: 3, wanted: 1, second: 0})
    queue_is(b, [(second, "QuotaUser")])

    # nobody's first job ends: the second is within the quota now and starts
    a.ctl("cancel", first, user="nobody")
    running_on(b, second, 1, 1)
    queue_is(a, [])


# -- 4. preemption -------------------------------------------------------------------------------

CHECKPOINTED = """
import json, os, sys, time
rank = int(os.environ["RANK"])
progress = "progress"  # in the job's workdir: a step a line, rank 0 appends one every 0.1 s
lines = open(progress).read().split() if os.path.exists(progress) else []
step = int(lines[-1]) if lines else 0
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "rank": rank, "step": step, "time": time.time(),
                        "world": int(os.environ["WORLD_SIZE"])}) + "\\n")
while True:
    time.sleep(0.1)
    step += 1
    if rank == 0:
        with open(progress, "a") as f:
            f.write(f"{step}\\n")
"""


def starts_of(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        if path.exists()
        else []
    )


def test_a_preemptible_job_is_requeued_for_a_higher_priority_and_resumes_from_its_checkpoint(
    make_cluster: Callable[..., Cluster], shared_tmp: Path
) -> None:
    a, b, c = make_cluster("preempt")
    workdir = shared_tmp / "preempted"
    workdir.mkdir()
    script, starts = workdir / "train.py", workdir / "starts.jsonl"
    script.write_text(CHECKPOINTED)
    low = a.submit(
        "--preemptible",
        "--nnodes",
        "3",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(script),
        str(starts),
        cwd=str(workdir),
    )["id"]
    first = pids(running_on(a, low, 3, 6))
    progress = workdir / "progress"
    wait_for(
        lambda: progress.exists() and len(progress.read_text().split()) >= 5, 30, "5 steps done"
    )

    # a job of higher priority needs a whole node: low, at its min, is stopped and requeued
    high = b.submit("--priority", "5", "--nproc-per-node", "2", *SLEEP)["id"]
    running_on(b, high, 1, 2)
    queue_is(c, [(low, "Resources (preempted)")])
    assert wait_gone(list(first)) == [], "low's workers were stopped"
    doc = wait_for(
        lambda: (d := c.ctl("status", low))["state"] != "RUNNING" and d, 30, "low stopped"
    )
    assert doc["state"] == "RESTARTING" and doc["restarts"] == 0, doc  # requeued: not FAILED
    row = queue_text(c)[0]
    assert row[1] == low and row[-3:-1] == ["Resources", "(preempted)"], row
    stopped_at = int(progress.read_text().split()[-1])

    # high ends: low starts again on its 3 nodes and goes on from its checkpoint
    b.ctl("cancel", high)
    again = pids(running_on(a, low, 3, 6))
    assert not again & first, "its workers started again"
    resumed = wait_for(
        lambda: [s for s in starts_of(starts) if s["pid"] in again and s["rank"] == 0],
        30,
        "rank 0 started again",
    )
    assert resumed[0]["step"] == stopped_at > 0, (resumed, stopped_at)
    assert a.ctl("status", low)["restarts"] == 0, "the preemption spent no restart"
    queue_is(c, [])
    a.ctl("cancel", low)


# -- 5. the allocator's daemon dies --------------------------------------------------------------


def observer(cluster: Cluster) -> tuple[str, int] | None:
    """The node that observes (and so allocates), and its term, from the store's record."""
    store = attacker(cluster)
    try:
        raw = store.read("nodes/observer")
    finally:
        getattr(store, "close", lambda: None)()
    envelope = json.loads(raw) if raw is not None else None
    return (envelope["body"]["name"], envelope["ver"]) if envelope is not None else None


def schedule_term(daemon: Daemon) -> int:
    """The term of the schedule ``daemon`` follows (0: none)."""
    doc = daemon.ctl("queue")
    return doc["schedule"][0] if doc["schedule"] else 0


def test_the_allocators_daemon_killed_another_takes_over_and_jobs_run_and_start(
    make_cluster: Callable[..., Cluster],
) -> None:
    """The allocator's node D dies while a job runs elsewhere (rigid), another runs on D and
    one other node (elastic, of higher priority: nothing of it is reclaimed), and a third
    waits.  Another node allocates within dead_after; the job elsewhere goes on untouched,
    the one on D goes on without it (no restart spent); the waiting job starts when the
    first ends."""
    cluster = make_cluster(
        "takeover", store_apart=True
    )  # (c10d: the store stays when any node dies)
    name, term = wait_for(lambda: observer(cluster), 30, "an observer")
    wait_for(
        lambda: all(schedule_term(d) == term for d in cluster),
        30,
        f"every node follows term {term}",
    )
    (dying,) = [d for d in cluster if d.name == name]
    first, second = [d for d in cluster if d is not dying]
    rigid = first.submit("--nproc-per-node", "2", "--exclude", dying.name, *SLEEP)["id"]
    before = running_on(first, rigid, 1, 2)
    elastic = second.submit("--priority", "1", "--nnodes", "1:2", "--nproc-per-node", "1", *SLEEP)[
        "id"
    ]
    on_both = running_on(second, elastic, 2, 2)
    assert dying.name in {w["node"] for w in on_both["workers"]}
    waiting = second.submit("--nproc-per-node", "2", "--exclude", dying.name, *SLEEP)["id"]
    queue_is(first, [(waiting, "Resources")])

    killed = time.monotonic()
    dying.signal(signal.SIGKILL)
    dying.wait_exit(30)
    wait_for(
        lambda: schedule_term(first) > term and schedule_term(second) > term,
        30,
        "a schedule of a later term",
    )
    took = time.monotonic() - killed
    new_name, new_term = observer(cluster)
    assert new_name in (first.name, second.name) and new_term > term
    assert took < DEAD_AFTER + 7, f"the next allocator published {took:.1f} s after the kill"

    # the rigid job goes on untouched, the elastic one without the dead node; one still waits
    doc = first.ctl("status", rigid)
    assert doc["state"] == "RUNNING" and doc["restarts"] == 0 and pids(doc) == pids(before), doc

    def without_the_dead_node() -> dict[str, Any] | None:  # its rank is listed, LOST, until then
        doc = running_on(second, elastic, 1, 1)
        return doc if dying.name not in {w["node"] for w in doc["workers"]} else None

    doc = wait_for(without_the_dead_node, 60, "the elastic job re-formed without the dead node")
    assert doc["restarts"] == 0, doc
    queue_is(second, [(waiting, "Resources")])

    # room appears: the new allocator starts the waiting job
    first.ctl("cancel", rigid)
    running_on(second, waiting, 1, 2)
    queue_is(second, [])
    # (the new observer judges the old one lost only after its own dead_after: until then
    # the schedule may still give the elastic job the dead node)
    allocation_is(second, {elastic: 1, waiting: 1})
    assert schedule_term(second) == new_term
