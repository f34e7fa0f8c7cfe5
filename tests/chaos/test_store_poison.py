"""Values no decoder expects, written by a keyless store client (docs/security.md, "The store":
"No value ends a daemon"): no value read from the store ends a daemon or changes an outcome.

The attacker is a client of the cluster's store with no key (store_attack.py): torch's own
TCPStore client on c10d (a writer the nftables rule does not stop, so store.firewall is
off), etcd's gRPC API on an etcd without users (any local user).  The daemons are real (2,
on 127.0.0.1 / 127.0.0.2), the jobs are submitted with the real elasticctl and run real
workers.  Every test runs on both backends unless it says otherwise.

Rows -> tests:

    0   ``"[" * 100000 + "]" * 100000`` at elasticd/<cluster>/epoch, written again and again
        while a two-node job runs (before the fix every daemon exited within 8 s on a
        RecursionError) ........................... test_row0_poisoned_epoch_ends_no_daemon
        the same value already in etcd when the daemons start, and again while one of
        them restarts (before the fix: a crash loop in create_epoch)
        ........................................... test_row0_poisoned_epoch_at_start_up_is_worked_around
    0   deep nesting (bare and inside an envelope), a non-finite number, a 5000-digit
        version, bytes that are not UTF-8, a lone surrogate, a MAC that is not ASCII
        (before the fix a TypeError in compare_digest) and values of the wrong types,
        each on every key a daemon reads at every heartbeat duty (epoch, the observer, the
        feed's head, a node's record, heartbeat and drain request, the node index, the
        next change-log entry, a running job's rendezvous state)
        ........................................... test_any_value_on_the_keys_read_every_duty_ends_no_daemon
        the board's counters (change log, submit order) not numbers: a daemon writes a
        count back, the board moves .............. test_a_counter_that_is_no_number_freezes_nothing
        junk in the key a daemon writes at start .. test_junk_in_the_ping_key_stops_no_start

Each asserts the safe outcome: every daemon keeps running (its process and its answers),
the job keeps its workers, RUNNING with no restart, the refusals are counted
(``elasticd_store_refused_records_total``) and logged, a key refused again and again is
logged once per interval, not at every read; and at the end the owner's cancel ends the
job everywhere.  "Never" is observed for a bounded period, stated in each test.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import Daemon, worker_args
from store_attack import Cluster, attacker, metric, wait_for
from test_store_forgery import (
    assert_still_running,
    cancel_and_check,
    observe,
    refused_counts,
    two_node_job,
)

DEEP = b"[" * 100000 + b"]" * 100000
MAC = b'"' + b"0" * 64 + b'"'
POISONS = {
    "deep": DEEP,
    "deep body": b'{"v":2,"ver":1,"body":' + DEEP + b',"mac":' + MAC + b"}",
    "infinite body": b'{"v":2,"ver":1,"body":{"epoch":1e999},"mac":' + MAC + b"}",
    "5000-digit version": b'{"v":2,"ver":' + b"9" * 5000 + b',"body":{},"mac":' + MAC + b"}",
    "not UTF-8": b'{"v":2,"ver":1,"body":"\xff\xfe","mac":' + MAC + b"}",
    "lone surrogate": b'{"v":2,"ver":1,"body":{"\\ud800":"\\udfff"},"mac":' + MAC + b"}",
    "wrong types": b'{"v":2,"ver":1,"enc":[1,{"a":null}],"mac":{}}',
    "a MAC that is not ASCII": b'{"v":2,"ver":1,"body":{},"mac":"\xc3\xa9"}',
    "a list": b"[1,2,3]",
}
WATCH = 10.0  # seconds "never" is observed while poison is written: past the 8 s it took to end every daemon


@pytest.fixture(params=["c10d", "etcd"])
def cluster(request, daemon_factory, shared_tmp) -> Iterator[Cluster]:
    """Two-node clusters on a TCPStore that n1 hosts (no nftables rule), or on a fresh etcd
    without users; the etcd is stopped after the daemons."""
    if request.param == "c10d":
        yield Cluster(daemon_factory, shared_tmp, prefix="psn", firewall=False)
        return
    from fixtures.etcd import EtcdCluster, require_etcd

    require_etcd()
    with EtcdCluster(shared_tmp / "etcd-data") as etcd:
        made = Cluster(daemon_factory, shared_tmp, prefix="psn", etcd=etcd)
        try:
            yield made
        finally:
            for daemon in made:
                daemon.stop()


def alive(cluster: Cluster) -> None:
    for daemon in cluster:
        assert daemon.proc is not None and daemon.proc.poll() is None, (
            f"{daemon.name} exited with {daemon.proc.returncode}:\n{daemon.log_text()}"
        )


def refusal_lines(daemon: Daemon, key: str) -> list[str]:
    needle = f"refused store record {key}:"
    return [
        line for line in daemon.log_path.read_text(errors="replace").splitlines() if needle in line
    ]


def envelope(raw: bytes | None) -> dict[str, Any] | None:
    """The record as JSON when it is a version-2 envelope with a body and a MAC."""
    try:
        doc = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("v") == 2 and "mac" in doc else None


class Writer:
    """Writes ``value`` at ``suffix`` again and again from a thread (every ``every`` s) while
    it is open: a daemon that repairs the key reads the poison again at its next duty."""

    def __init__(self, cluster: Cluster, suffix: str, value: bytes, every: float = 0.1) -> None:
        self._client = attacker(cluster)
        self._stop = threading.Event()
        self.writes = 0
        self._thread = threading.Thread(target=self._run, args=(suffix, value, every), daemon=True)

    def _run(self, suffix: str, value: bytes, every: float) -> None:
        while not self._stop.is_set():
            try:
                self._client.write(suffix, value)
            except Exception:  # the store is gone (its host daemon died): the test says so
                return
            self.writes += 1
            self._stop.wait(every)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.slow
def test_row0_poisoned_epoch_ends_no_daemon(cluster, shared_tmp, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    store = attacker(cluster)
    job, pids = two_node_job(n1, shared_tmp)
    epoch = envelope(store.read("epoch"))
    assert epoch is not None, store.read("epoch")
    key = store.key("epoch")
    before = refused_counts(cluster)

    def safe() -> None:
        alive(cluster)
        assert_still_running(cluster, job, pids)

    with Writer(cluster, "epoch", DEEP) as writer:
        # "never": for 10 s of poison written every 0.1 s (each daemon reads the epoch at
        # every 1 s duty), no daemon exits and the job keeps its workers
        observe(WATCH, safe)
    counts = [c - b for c, b in zip(refused_counts(cluster), before)]
    assert sum(counts) >= 2, f"the poisoned epoch was refused {counts} times"
    lines = [refusal_lines(d, key) for d in cluster]
    assert any(lines), "no daemon logged the refusal of the poisoned epoch"
    assert all("nested" in line for daemon_lines in lines for line in daemon_lines), lines
    # refused again at (nearly) every duty, logged once per interval per key
    assert all(len(daemon_lines) <= 2 for daemon_lines in lines), lines
    # repaired with the epoch the cluster had: no node took it for a reset store
    healed = wait_for(lambda: envelope(store.read("epoch")), 15, "a valid epoch back in the store")
    assert healed["body"] == epoch["body"], (healed, epoch)
    for daemon in cluster:
        assert "the store was reset" not in daemon.log_text(), daemon.log_text()
    figures.add(
        f"row 0: poisoned epoch written {writer.writes} times in {WATCH:g} s "
        f"({'etcd' if cluster.etcd else 'c10d'}): refusals counted / logged per daemon",
        " / ".join(f"{c:.0f}/{len(seen)}" for c, seen in zip(counts, lines)),
    )
    cancel_and_check(cluster, n2, job, pids)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["etcd"], indirect=True)
def test_row0_poisoned_epoch_at_start_up_is_worked_around(cluster, shared_tmp):
    """etcd only: there every daemon offers the epoch at start (c10d's store starts empty
    with its host, which writes it)."""
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    store = attacker(cluster)
    store.write("epoch", DEEP)
    cluster.start()  # both reach READY and see each other up
    key = store.key("epoch")
    assert any(refusal_lines(d, key) for d in cluster), [d.log_text() for d in cluster]
    assert envelope(store.read("epoch")) is not None, "the poisoned epoch was not replaced"
    done = n1.submit_wait("--nnodes", "2", *worker_args())
    assert done["state"] == "SUCCEEDED", done

    # a restart while the poison is written again and again: n2 starts, says so, works
    assert n2.stop() == 0
    logged = len(refusal_lines(n2, key))  # its log file goes on across the restart
    with Writer(cluster, "epoch", DEEP):
        n2.start()
        wait_for(
            lambda: len(refusal_lines(n2, key)) > logged, 15, f"{n2.name} logged the refused epoch"
        )
        alive(cluster)
    wait_for(
        lambda: all(states(d) == {n1.name: "up", n2.name: "up"} for d in cluster),
        30,
        "both nodes up after the restart",
    )
    job, pids = two_node_job(n2, shared_tmp)
    assert metric(n2, "elasticd_store_refused_records_total") >= 1
    cancel_and_check(cluster, n1, job, pids)


def states(daemon: Daemon) -> dict[str, str]:
    return {n["name"]: n["state"] for n in daemon.ctl("nodes")}


@pytest.mark.slow
def test_any_value_on_the_keys_read_every_duty_ends_no_daemon(cluster, shared_tmp, figures):
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    store = attacker(cluster)
    job, pids = two_node_job(n1, shared_tmp)
    before = refused_counts(cluster)
    # what every daemon reads at every heartbeat duty
    keys = [
        "epoch",
        "nodes/observer",
        "nodes/feed/head",
        f"nodes/{n2.name}/record",
        f"nodes/{n2.name}/hb",
        f"nodes/{n1.name}/drain",
        f"rdzv/{job}/state",
    ]
    # once: poisoned lines in the indexes (read again in whole when the board is), and the
    # next change-log entry, which every board follower waits for (its refusal makes each
    # read the whole board again); nothing else appends to these while the job runs
    for index in ("nodes/names", "jobs/index"):
        store.write(
            index, (store.read(index) or b"") + DEEP + b"\n" + POISONS["infinite body"] + b"\n"
        )
    store.write(f"jobs/log/{store.count('jobs/log') + 1}", POISONS["deep body"])

    def safe() -> None:
        alive(cluster)
        assert_still_running(cluster, job, pids)

    started = time.monotonic()
    for _name, value in POISONS.items():
        for suffix in keys:
            store.write(suffix, value)
        # each value stands until a daemon replaces it or 1.5 duties pass: a node's own
        # heartbeat is garbled for less than the 3 s that make it lost
        observe(1.5, safe)
    observe(3.0, safe)  # and the repairs after the last one
    took = time.monotonic() - started
    counts = [c - b for c, b in zip(refused_counts(cluster), before)]
    assert all(c > 0 for c in counts), f"refusals counted per daemon: {counts}"
    for suffix in ("epoch", "nodes/observer", f"nodes/{n1.name}/drain"):
        assert any(refusal_lines(d, store.key(suffix)) for d in cluster), (
            f"{suffix}'s refusals not logged"
        )
    # the epoch and the observer are repaired, the drain request stays refused: no drain
    last: dict[str, bytes | None] = {}

    def repaired() -> bool:
        last.update((k, store.read(k)) for k in ("epoch", "nodes/observer"))
        return all(envelope(raw) for raw in last.values())

    try:
        wait_for(repaired, 15, "the epoch and the observer repaired")
    except AssertionError:
        raise AssertionError(
            f"not repaired: { ({k: (v or b'')[:100] for k, v in last.items()}) }"
        ) from None
    assert states(n1) == {n1.name: "up", n2.name: "up"}, n1.ctl("nodes")
    figures.add(
        f"poison x {len(POISONS)} values x {len(keys)} keys in {took:.0f} s "
        f"({'etcd' if cluster.etcd else 'c10d'}): refusals counted (n1 / n2)",
        " / ".join(f"{c:.0f}" for c in counts),
    )
    cancel_and_check(cluster, n2, job, pids)


@pytest.mark.slow
def test_a_counter_that_is_no_number_freezes_nothing(cluster, shared_tmp, figures):
    """The board's counters hold junk, a 5000-digit number, deep nesting, nothing (each
    written once, and nobody writes a number back): every daemon and the job go on, and the
    board moves: a job submitted then succeeds and reaches the other node (its follower
    reads the change log), with a seq no other job has.  The daemon that meets the junk
    writes a count back over it (refused, counted, logged once per interval), and no
    daemon reports the store unreachable (nothing was: it is one value).  Before the fix
    the board stood still until someone wrote a number back; on c10d, where the store
    server drops the connection of an add over junk, each daemon said "store unreachable"
    every 2 s meanwhile."""
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    store = attacker(cluster)
    job, pids = two_node_job(n1, shared_tmp)
    counters = ["jobs/log", "jobs/seq"]
    before = refused_counts(cluster)
    unreachable = [unreachable_lines(d) for d in cluster]

    def safe() -> None:
        alive(cluster)
        assert_still_running(cluster, job, pids)
        for daemon in cluster:
            assert daemon.ctl("version")["elasticd"]["store_up"], f"{daemon.name}: store down"

    started = time.monotonic()
    for turn, value in enumerate((b"junk", b"9" * 5000, DEEP, b"")):
        for counter in counters:
            store.write(counter, value)
        submitter, other = (n2, n1) if turn % 2 == 0 else (n1, n2)
        done = submitter.submit_wait("--nnodes", "1", *worker_args())
        assert done["state"] == "SUCCEEDED", done
        wait_for(
            lambda: (listed(other, done["id"]) or {}).get("state") == "SUCCEEDED",
            15,
            f"{done['id']}, submitted on {submitter.name} after {value[:10]!r}..., SUCCEEDED on {other.name}",
        )
        for counter in counters:  # a count again, written by a daemon
            assert store.count(counter) is not None, (counter, store.read(counter)[:40])
        safe()
    took = time.monotonic() - started
    seqs = [j["seq"] for j in n1.ctl("list", "--all")]
    assert len(seqs) == 5 and len(set(seqs)) == 5, f"a seq taken twice: {seqs}"
    counts = [c - b for c, b in zip(refused_counts(cluster), before)]
    assert sum(counts) >= 3, f"the junk counters were refused {counts} times"
    for counter in counters:
        key = store.key(counter)
        lines = [line for d in cluster for line in refusal_lines(d, key)]
        assert lines and all("is no count" in line for line in lines), (counter, lines)
    assert [unreachable_lines(d) for d in cluster] == unreachable, [d.log_text() for d in cluster]
    figures.add(
        f"counters poisoned x 4 values ({'etcd' if cluster.etcd else 'c10d'}): a 1-node job "
        f"submitted and seen SUCCEEDED on the other node after each, in all; refusals (n1 / n2)",
        f"{took:.1f} s; " + " / ".join(f"{c:.0f}" for c in counts),
    )
    cancel_and_check(cluster, n2, job, pids)


@pytest.mark.slow
def test_junk_in_the_ping_key_stops_no_start(cluster):
    """A daemon writes elasticd/<cluster>/ping at start, to see that the store takes writes.
    It was an add: junk there (before any daemon starts on etcd; once its host runs on c10d)
    ended each daemon that started (a crash loop under systemd)."""
    n1, n2 = cluster.add("n1"), cluster.add("n2")
    if cluster.etcd is not None:
        attacker(cluster).write("ping", b"junk")
    else:
        n1.start()
        attacker(cluster).write("ping", b"junk")
    for daemon in cluster:
        if daemon.proc is None:
            daemon.start()
    wait_for(
        lambda: all(states(d) == {n1.name: "up", n2.name: "up"} for d in cluster),
        30,
        "both nodes up",
    )
    alive(cluster)


def listed(daemon: Daemon, job_id: str) -> dict[str, Any] | None:
    """The job as ``list --all`` shows it on ``daemon``: what its board follower has seen."""
    return next((j for j in daemon.ctl("list", "--all") if j["id"] == job_id), None)


def unreachable_lines(daemon: Daemon) -> list[str]:
    return [
        line
        for line in daemon.log_path.read_text(errors="replace").splitlines()
        if "unreachable" in line
    ]
