"""Node loss by a network partition instead of a kill: each daemon runs in its own
network namespace (see netns.py) and one host's switch port goes down.

The tests reach the daemons only through their control sockets and sd_notify sockets (Unix
sockets work across network namespaces); nothing in the root namespace ever connects to a
test-host address.

Each test runs on both store backends (docs/store.md): c10d, the TCPStore that n1 hosts on host 1,
and etcd, a one-member etcd cluster that runs on host 1 beside n1 (which does not host it):
either way a partitioned host is cut off from the store and from its peers.
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from harness import Daemon, alive, node_states, wait_gone, worker_args
from store_backends import ETCD, etcd_store_lines, with_store

from elasticd.store.signing import create_key

pytestmark = [pytest.mark.root, pytest.mark.slow]

STORE_PORT = 29400  # every host has a fresh network stack: no port is taken


class NetnsDaemon(Daemon):
    """A harness Daemon whose process runs inside a test host's network namespace."""

    def __init__(self, hosts: netns.Hosts, index: int, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.hosts, self.index = hosts, index

    def start(self, timeout: float = 60.0, *, wait: bool = True) -> NetnsDaemon:
        return super().start(timeout, wait=wait)

    def argv(self) -> list[str]:
        return self.hosts.exec_argv(self.index, super().argv())


class NetnsCluster:
    """The system tests' Cluster, one daemon per test host; n1 (host 1) hosts the store, or
    with ``etcd`` (an EtcdCluster on host 1) every daemon is a client of that."""

    def __init__(self, hosts: netns.Hosts, base: Path, config: str = "", etcd: Any = None) -> None:
        self.hosts = hosts
        key = base / "cluster.key"
        create_key(str(key))
        path = base / "cluster.toml"
        if etcd is not None:
            config = with_store(config, etcd_store_lines(etcd.endpoints))
        # the tests run as root; a job grows again at once after a resize, and may be shrunk
        fast = (
            ""
            if "[scheduler]" in config
            else "[scheduler]\nresize_interval = 1.0\nmin_run_time = 0.0\n"
        )
        path.write_text("[jobs]\nallow_root = true\n" + fast + config)
        store = () if etcd is not None else ("--store", f"{hosts.addr(1)}:{STORE_PORT}")
        name = f"test-{uuid.uuid4().hex[:6]}"  # of this cluster alone, as conftest's are
        self.daemons = []
        for i in range(1, hosts.count + 1):
            # No --node-address, no --store-host: each daemon finds, inside its own network
            # namespace, that the endpoint is its own address (host 1) and which address of
            # its own routes to the store (with etcd: to the first member, on host 1).
            args = (
                "--cluster",
                name,
                *store,
                "--cluster-key",
                str(key),
                "--config",
                str(path),
                "--slots",
                "1",
            )
            self.daemons.append(NetnsDaemon(hosts, i, base, f"n{i}", args=args, standalone=False))

    def __getitem__(self, index: int) -> NetnsDaemon:
        return self.daemons[index]

    def by_name(self, name: str) -> NetnsDaemon:
        return next(d for d in self.daemons if d.name == name)

    def start(self) -> NetnsCluster:
        for daemon in self.daemons:
            daemon.start()
        return self

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.stop()


@pytest.fixture(scope="session")
def subnet() -> Iterator[netns.Subnet]:
    """This session's test subnet, guarded by an unreachable route until the very end."""
    why = netns.usable()
    if why:
        pytest.skip(why)
    claimed = netns.Subnet.claim()
    yield claimed
    claimed.release()


@pytest.fixture
def netns_cluster(
    subnet: netns.Subnet, shared_tmp: Path, store_backend: str, request: pytest.FixtureRequest
) -> Callable[..., NetnsCluster]:
    """Make N namespaced hosts with one daemon each (and with etcd, its member on host 1);
    everything goes on failure too."""

    def make(count: int, config: str = "") -> NetnsCluster:
        hosts = subnet.hosts(count)
        request.addfinalizer(hosts.down)  # runs last: kills leftovers by PID, deletes namespaces
        hosts.up()
        etcd = None
        if store_backend == ETCD:
            from fixtures.etcd import EtcdCluster, require_etcd

            require_etcd()
            etcd = EtcdCluster(
                shared_tmp / "etcd-data",
                host=hosts.addr(1),
                wrap=lambda argv: hosts.exec_argv(1, argv),
            )
            request.addfinalizer(etcd.stop)  # after the daemons stopped
        cluster = NetnsCluster(hosts, shared_tmp, config, etcd)
        request.addfinalizer(cluster.stop)  # then a clean SIGTERM of each daemon...
        request.addfinalizer(hosts.heal_all)  # ...once a failed test's partition is healed
        return cluster.start()

    return make


def healthy(doc: dict[str, Any]) -> int:
    return sum(1 for w in doc["workers"] if w["state"] == "HEALTHY" and w["pid"])


def test_survivors_reform_when_a_node_is_partitioned_and_it_rejoins_when_healed(netns_cluster):
    cluster = netns_cluster(3)
    n1 = cluster[0]
    node_states(n1, lambda s: s == {"n1": "up", "n2": "up", "n3": "up"})
    # each found its own address (the route to the store) without --node-address
    assert {n["name"]: n["address"] for n in n1.ctl("nodes")} == {
        f"n{i}": cluster.hosts.addr(i) for i in (1, 2, 3)
    }
    # --ddp: the workers meet at rank 0's MASTER_ADDR, across the namespaces, each round.
    # gloo's pairs bind to the address of the hostname, 127.0.0.1 here in every namespace
    # (each rank would then connect to itself and fail a few seconds into the round): eth0.
    job = n1.submit(
        "--nnodes", "2:3", "--env", "GLOO_SOCKET_IFNAME=eth0", *worker_args("--ddp", "--sleep", "0")
    )["id"]
    doc = n1.wait_job(
        job, lambda d: d["state"] == "RUNNING" and d["world_size"] == 3 and healthy(d) == 3
    )
    victim = cluster.by_name(
        next(n["node"] for n in doc["nodes"] if n["node"] != "n1" and n["group_rank"] != 0)
    )
    survivors = sorted({"n1", "n2", "n3"} - {victim.name})

    cluster.hosts.partition(victim.index)
    cut = time.monotonic()
    doc = n1.wait_job(
        job,
        lambda d: d["state"] == "RUNNING" and d["world_size"] == 2 and healthy(d) == 2,
        timeout=60,
    )
    reformed = time.monotonic() - cut
    print(f"survivors re-formed {reformed:.1f} s after the partition")
    assert sorted(n["node"] for n in doc["nodes"]) == survivors
    assert reformed < 15  # heartbeats (3 x 1 s), not a collective or store timeout
    assert doc["restarts"] == 0  # losing a node is not a worker failure
    node_states(n1, lambda s: s[victim.name] == "lost")

    # The cut-off daemon keeps its worker and keeps answering from its own registry.
    assert victim.request("version").ok
    assert victim.ctl("status", job)["state"] == "RUNNING"

    cluster.hosts.heal(victim.index)
    healed = time.monotonic()
    node_states(n1, lambda s: s[victim.name] == "up", timeout=60)
    doc = n1.wait_job(
        job,
        lambda d: d["state"] == "RUNNING" and d["world_size"] == 3 and healthy(d) == 3,
        timeout=60,
    )  # below max: the healed node is taken back
    print(f"healed node back in the job after {time.monotonic() - healed:.1f} s")
    assert victim.name in [n["node"] for n in doc["nodes"]]
    victim.wait_job(job, lambda d: d["world_size"] == 3 and healthy(d) == 3)  # its view agrees
    n1.ctl("cancel", job)
    for daemon in cluster.daemons:
        assert daemon.wait_job(job, lambda d: d["state"] == "CANCELLED")["state"] == "CANCELLED"


def test_partition_below_min_waits_then_fails_clearly(netns_cluster):
    cluster = netns_cluster(2)
    n1, n2 = cluster[0], cluster[1]
    node_states(n1, lambda s: s == {"n1": "up", "n2": "up"})
    job = n1.submit("--nnodes", "2", "--join-timeout", "4", *worker_args("--sleep", "0"))["id"]
    n1.wait_job(job, lambda d: d["state"] == "RUNNING" and d["world_size"] == 2 and healthy(d) == 2)

    cluster.hosts.partition(2)
    cut = time.monotonic()
    doc = n1.wait_job(job, lambda d: d["state"] in ("FAILED", "SUCCEEDED", "CANCELLED"), timeout=60)
    print(f"failed {time.monotonic() - cut:.1f} s after the partition: {doc['error']}")
    assert doc["state"] == "FAILED"
    message = doc["error"]["message"]
    assert "1" in message and "2" in message and ("node" in message or "min" in message), message

    # Healed, the cut-off node learns the job's end and stops its worker.
    cluster.hosts.heal(2)
    assert n2.wait_job(job, lambda d: d["state"] == "FAILED", timeout=60)["state"] == "FAILED"
    assert n2.wait_status(
        lambda line: (
            line.startswith("STATUS=0 jobs running, 0 workers") and "unreachable" not in line
        ),
        timeout=60,
    )


def test_a_partitioned_daemon_reports_the_store_unreachable(netns_cluster):
    """Issue 4: a daemon that cannot reach the store says so (STATUS=, metric) and rejoins."""
    cluster = netns_cluster(2, config="[store]\ntimeout = 5.0\n")
    n1, n2 = cluster[0], cluster[1]
    node_states(n1, lambda s: s == {"n1": "up", "n2": "up"})
    cluster.hosts.partition(2)
    # a store operation may take store.timeout (5 s); then the next heartbeat reports it
    n2.wait_status(lambda line: "unreachable" in line, timeout=20)
    cluster.hosts.heal(2)
    n2.wait_status(lambda line: "unreachable" not in line, timeout=60)
    node_states(n1, lambda s: s == {"n1": "up", "n2": "up"}, timeout=60)


def test_a_partitioned_daemon_still_stops_on_sigterm(netns_cluster):
    """docs/concepts.md, "Stopping the daemon": SIGTERM stops the workers (grace 10 s) and exits 0, store or not."""
    cluster = netns_cluster(2)
    n1, n2 = cluster[0], cluster[1]
    node_states(n1, lambda s: s == {"n1": "up", "n2": "up"})
    job = n1.submit("--nnodes", "1:2", *worker_args("--sleep", "0"))["id"]
    doc = n2.wait_job(job, lambda d: d["state"] == "RUNNING" and healthy(d) == 2)
    mine = [w["pid"] for w in doc["workers"] if w["node"] == "n2"]
    cluster.hosts.partition(2)
    n2.signal(signal.SIGTERM)
    try:
        code = n2.wait_exit(timeout=20)  # stop_grace (10 s) and then some
    except subprocess.TimeoutExpired:
        left = [p for p in mine if alive(p)]
        n2.signal(signal.SIGKILL)  # it would not go by itself: no need to wait for it again
        raise AssertionError(
            f"n2 still running 20 s after SIGTERM; of its workers {mine} alive: "
            f"{left}\n{n2.log_text()}"
        ) from None
    assert code == 0
    assert wait_gone(mine) == []
