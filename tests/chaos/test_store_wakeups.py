"""No unsigned value can make a daemon work: the keys a daemon waits on, written or woken by a
keyless client of the store, against a real two-node cluster on both backends.

A daemon waits on keys between its duties: the node feed's next entry (the heartbeat loop),
the job board's next change (the board follower), a watched round's next revision (the
rendezvous keeper), a missing member's exit-barrier arrival.  Anyone who reaches the store
can end such a wait: write the key (here: junk at the next 200 numbers of each), or, on
TCPStore, merely read it while it is missing (torch's server wakes a key's waiters on a
compare-and-set of a missing key; here a flood of them at the next keys, leaving no key
behind).  Before, a wake with nothing behind it was followed by the same wait at once: a
keyless client's single write busy-looped every daemon (the schedule's key: 30-65% CPU; the
feed's: 3,654 heartbeat duties in 3 s).  Now each such wake backs off (aio.BackOff).

Asserted over a window of the attack, on every daemon: its CPU stays low (a generous bound:
a spin takes a core), its store reads stay within a small multiple of a quiet window's,
each forged record is logged at most once per interval; and the jobs run on: a running job
keeps its workers with no restart, a job at its exit barrier ends SUCCEEDED once its other
member finishes, and not before.  The figures are printed at the end of the run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from harness import Daemon, worker_args
from store_attack import Attacker, Cluster, attacker, metric, wait_for
from test_store_forgery import ENDED, assert_still_running, cancel_and_check, status, two_node_job

WINDOW = 8.0  # seconds each window is measured
AHEAD = 200  # junk written at this many next numbers of each key
READS = 'elasticd_store_latency_seconds_count{op="get_many"}'
CPU_BOUND = 0.25  # of one core: a daemon that spins takes all of one


@pytest.fixture(params=["c10d", "etcd"])
def cluster(request, daemon_factory, shared_tmp) -> Iterator[Cluster]:
    """Two nodes on a TCPStore that a daemon of a cluster of its own hosts (no nftables
    rule: the attacker is one it does not stop), or on a fresh etcd without users.  The
    store's host is apart so that what the nodes measured spend is their own work, not the
    serving of the attacker's requests (a store's host pays for those as torchrun's does;
    a full run measured a hosting n1 at 25 % of a core under a flood)."""
    if request.param == "c10d":
        yield Cluster(daemon_factory, shared_tmp, prefix="wak", firewall=False, store_apart=True)
        return
    from fixtures.etcd import EtcdCluster, require_etcd

    require_etcd()
    with EtcdCluster(shared_tmp / "etcd-data") as etcd:
        made = Cluster(daemon_factory, shared_tmp, prefix="wak", etcd=etcd)
        try:
            yield made
        finally:
            for daemon in made:
                daemon.stop()


def body(raw: bytes | None) -> dict[str, Any]:
    """A signed record's envelope (its body is in the clear unless sealed secret)."""
    assert raw is not None
    return json.loads(raw)


class Targets:
    """The keys each daemon waits on next, as a keyless reader of the store finds them."""

    def __init__(self, store: Any, jobs: list[str], barrier: tuple[str, int, str]) -> None:
        self.store, self.jobs, self.barrier = store, jobs, barrier

    def next_keys(self, ahead: int = 1) -> list[str]:
        """The feed's, the change log's and each job's next ``ahead`` keys."""
        feed = body(self.store.read("nodes/feed/head"))["body"]["number"]
        log = self.store.count("jobs/log") or 0
        keys = [f"nodes/feed/{feed + n}" for n in range(1, ahead + 1)]
        keys += [f"jobs/log/{log + n}" for n in range(1, ahead + 1)]
        for job in self.jobs:
            version = body(self.store.read(f"rdzv/{job}/state"))["ver"]
            keys += [f"rdzv/{job}/rev/{version + n}" for n in range(1, ahead + 1)]
        return keys

    def forged_arrival(self) -> str:
        job, round_, node = self.barrier
        return f"rdzv/{job}/round/{round_}/exit/{node}"


class Flood:
    """A thread of its own, some 2,000 a second: on TCPStore a compare-and-set of each
    missing next key (which wakes that key's waiters and writes nothing); on etcd a write of
    junk at each (etcd's watches wake on writes).  The targets are read again every 0.5 s."""

    def __init__(self, cluster: Cluster, targets: Targets) -> None:
        self._client = attacker(cluster)
        self._targets = Targets(attacker(cluster), targets.jobs, targets.barrier)  # its own
        self._tcpstore = isinstance(self._client, Attacker)
        self._stop = threading.Event()
        self.sent = 0
        self.extra: list[str] = []  # more keys to wake, as given
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        keys: list[str] = []
        looked = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() - looked > 0.5:
                    keys, looked = self._targets.next_keys(), time.monotonic()
                for key in keys + self.extra:
                    if self._tcpstore:
                        self._client.store.compare_set(self._client.key(key), "x", "y")
                    else:
                        self._client.write(key, b"junk")
                    self.sent += 1
                self._stop.wait(0.002)  # some 2,000 a second: the store host serves them too
            except Exception:  # the store is gone: the test says so
                return

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)


def measure(cluster: Cluster, seconds: float) -> tuple[list[float], list[float]]:
    """Each daemon's CPU (of one core) and store reads over ``seconds``."""
    procs = [psutil.Process(d.proc.pid) for d in cluster]
    cpu = [sum(p.cpu_times()[:2]) for p in procs]
    reads = [metric(d, READS) for d in cluster]
    started = time.monotonic()
    time.sleep(seconds)  # the window measured: what the daemons do meanwhile is the figure
    took = time.monotonic() - started
    return (
        [(sum(p.cpu_times()[:2]) - c) / took for p, c in zip(procs, cpu)],
        [metric(d, READS) - r for d, r in zip(cluster, reads)],
    )


def barrier_job(n1: Daemon, release: Any) -> tuple[str, int, str, str]:
    """A two-node job whose group rank 0 ends at once (its node waits at the exit barrier)
    and group rank 1 works until ``release`` exists: (job, round, the working node, the
    waiting node)."""
    job = n1.submit("--nnodes", "2", *worker_args("--hold-group", f"1:{release}"))["id"]
    doc = n1.wait_job(
        job,
        lambda d: (
            d["state"] == "RUNNING"
            and any(p["state"] == "BARRIER" for p in d["nodes"])
            and any(p["state"] == "RUNNING" for p in d["nodes"])
        ),
        timeout=60,
    )
    working = next(p["node"] for p in doc["nodes"] if p["state"] == "RUNNING")
    waiting = next(p["node"] for p in doc["nodes"] if p["state"] == "BARRIER")
    return job, doc["round"], working, waiting


@pytest.mark.slow
@pytest.mark.parametrize("how", ["written", "flooded"])
def test_forged_wake_ups_make_no_daemon_work_and_the_jobs_run_on(cluster, shared_tmp, figures, how):
    n1, _n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    store = attacker(cluster)
    running, pids = two_node_job(n1, shared_tmp)
    release = shared_tmp / "release"
    barrier, round_, working, _ = barrier_job(n1, release)
    targets = Targets(store, [running, barrier], (barrier, round_, working))
    backend = "etcd" if cluster.etcd else "c10d"

    quiet_cpu, quiet_reads = measure(cluster, WINDOW)
    forged = targets.forged_arrival()
    store.write(forged, b'{"v":2,"ver":0,"body":{"node":"%s"},"mac":"00"}' % working.encode())
    if how == "written":
        for key in targets.next_keys(AHEAD):
            store.write(key, b"junk")
        cpu, reads = measure(cluster, WINDOW)
        sent = AHEAD * 4 + 1
    else:
        with Flood(cluster, targets) as flood:
            cpu, reads = measure(cluster, WINDOW)
        sent = flood.sent

    figures.add(
        f"wake-ups ({backend}, {how}: {sent} forged): CPU per daemon, quiet -> attacked",
        " / ".join(f"{q * 100:.0f}% -> {a * 100:.0f}%" for q, a in zip(quiet_cpu, cpu)),
    )
    figures.add(
        f"wake-ups ({backend}, {how}): store reads per daemon in {WINDOW:g} s, quiet -> attacked",
        " / ".join(f"{q:.0f} -> {a:.0f}" for q, a in zip(quiet_reads, reads)),
    )
    assert all(c < CPU_BOUND for c in cpu), (cpu, quiet_cpu)
    assert all(a <= 3 * q + 20 * WINDOW for q, a in zip(quiet_reads, reads)), (reads, quiet_reads)
    for daemon in cluster:  # each forged record said at most once an interval
        lines = [
            line
            for line in daemon.log_path.read_text(errors="replace").splitlines()
            if f"refused store record {store.key(forged)}:" in line
        ]
        assert len(lines) <= 2, lines

    # the jobs run on: the running one as it was; the one at its barrier ends once its
    # working member does, and not before
    assert_still_running(cluster, running, pids)
    for daemon in cluster:
        assert status(daemon, barrier)["state"] == "RUNNING", status(daemon, barrier)
    release.touch()
    for daemon in cluster:
        final = daemon.wait_job(barrier, lambda d: d["state"] in ENDED, timeout=60)
        assert final["state"] == "SUCCEEDED", (daemon.name, final)
    cancel_and_check(cluster, n1, running, pids)
    assert all(d.proc.poll() is None for d in cluster)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["written", "flooded"])
def test_forged_join_log_and_revisions_make_no_joiner_work(cluster, shared_tmp, figures, how):
    """Nodes that joined a round still forming (a 3-node job on two nodes, placement without
    the scheduler) wait on the next revision, or on a number of the join log taken but not
    written yet.  The attacker writes junk at the next revisions, takes 60 numbers of the
    round's join counter, writes junk at half of them and, flooding, wakes the rest."""
    config = "[scheduler]\nenabled = false\n"
    n1, _n2 = cluster.add("n1", config=config), cluster.add("n2", config=config)
    cluster.start()
    store = attacker(cluster)
    job = n1.submit("--nnodes", "3", *worker_args())["id"]
    joins = f"rdzv/{job}/round/0/joins"
    entries = f"rdzv/{job}/round/0/join"

    wait_for(lambda: store.count(joins) == 2, 60, "both nodes joined the forming round")
    backend = "etcd" if cluster.etcd else "c10d"
    quiet_cpu, quiet_reads = measure(cluster, WINDOW)
    state = store.read(f"rdzv/{job}/state")  # none while the first round forms
    version = body(state)["ver"] if state is not None else 0
    for n in range(1, AHEAD + 1):
        store.write(f"rdzv/{job}/rev/{version + n}", b"junk")
    store.write(joins, b"60")  # 3..60 taken, never written
    for n in range(3, 31):
        store.write(f"{entries}/{n}", b'{"v":2,"ver":0,"body":{},"mac":"00"}')
    if how == "written":
        cpu, reads = measure(cluster, WINDOW)
    else:
        holes = [f"{entries}/{n}" for n in range(31, 61)]
        targets = Targets(store, [], (job, 0, "nobody"))
        with Flood(cluster, targets) as flood:
            flood.extra = holes
            cpu, reads = measure(cluster, WINDOW)
    figures.add(
        f"joiners ({backend}, {how}): CPU per daemon, quiet -> attacked",
        " / ".join(f"{q * 100:.0f}% -> {a * 100:.0f}%" for q, a in zip(quiet_cpu, cpu)),
    )
    figures.add(
        f"joiners ({backend}, {how}): store reads per daemon in {WINDOW:g} s, quiet -> attacked",
        " / ".join(f"{q:.0f} -> {a:.0f}" for q, a in zip(quiet_reads, reads)),
    )
    assert all(c < CPU_BOUND for c in cpu), (cpu, quiet_cpu)
    assert all(a <= 3 * q + 20 * WINDOW for q, a in zip(quiet_reads, reads)), (reads, quiet_reads)
    for daemon in cluster:  # still waiting for a third node, not failed, not started
        doc = status(daemon, job)
        assert doc["state"] in ("PENDING", "RENDEZVOUS") and doc["restarts"] == 0, doc
    assert n1.ctl("cancel", job)["state"] == "CANCELLED"
    assert all(d.proc.poll() is None for d in cluster)
