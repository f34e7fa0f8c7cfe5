"""The store attacker of tests/chaos/test_store_*.py and the cluster it attacks: real
daemons of one cluster on this host, and a client of their store with no key: torch's own
TCPStore client, or etcd's gRPC API spoken directly (an etcd without users: anyone who
reaches it may write)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness import Daemon, free_port

from elasticd.store.base import counter_value
from elasticd.store.signing import create_key

REFUSED = "elasticd_store_refused_records_total"


class Cluster:
    """Daemons of one cluster on this host: the first hosts the store on 127.0.0.1, node i has
    the address 127.0.0.i, 2 slots and its own TOML config (jobs.allow_root, store.firewall,
    a free peer port).  Node names carry a random tag ("n2" is n2-<tag>): a daemon's job
    cgroups are named after its node and it kills what it finds in them at start, so two
    test runs on one host must not share node names."""

    def __init__(
        self,
        factory: Callable[..., Daemon],
        base: Path,
        *,
        prefix: str,
        firewall: bool | str = "auto",
        etcd: Any = None,
        store_apart: bool = False,
    ) -> None:
        """``etcd``: an EtcdCluster without TLS or users (tests/fixtures/etcd.py) that every
        daemon is a client of; no daemon hosts a store then.  ``store_apart`` (c10d): the
        TCPStore is hosted by a daemon of a cluster of its own (``store_host``; clusters may
        share a store, each under its own keys), so that any node of this one may die and
        the store stays."""
        self.factory = factory
        self.etcd = etcd
        self.base = base
        self.tag = uuid.uuid4().hex[:6]
        self.name = f"{prefix}{self.tag}"
        self.port = free_port()
        self.key = base / f"{self.name}.key"
        self.firewall = firewall
        create_key(str(self.key))
        self.daemons: list[Daemon] = []
        self.store_host = self._host_apart() if store_apart and etcd is None else None

    def _host_apart(self) -> Daemon:
        name = f"{self.name}-store"
        key, path = self.base / f"{name}.key", self.base / f"{name}.toml"
        create_key(str(key))
        path.write_text(
            f"[jobs]\nallow_root = true\n[node]\npeer_port = {free_port()}\n"
            f"[store]\nfirewall = {json.dumps(self.firewall)}\n"
        )
        args = (
            "--cluster",
            name,
            "--store",
            f"127.0.0.1:{self.port}",
            "--store-host",
            "--node-address",
            "127.0.0.1",
            "--cluster-key",
            str(key),
            "--slots",
            "1",
            "--config",
            str(path),
        )
        return self.factory(
            f"store-{self.tag}", args=args, standalone=False, metrics_port=free_port()
        )

    def add(
        self,
        role: str,
        *,
        allow_root: bool = True,
        firewall: bool | str | None = None,
        config: str = "",
        args: tuple[str, ...] = (),
    ) -> Daemon:
        """A node named ``<role>-<tag>``; ``config``: more TOML (other sections than these);
        ``args``: more flags (``--gpus 2``)."""
        index = len(self.daemons) + 1
        node = f"{role}-{self.tag}"
        path = self.base / f"{self.name}-{node}.toml"
        fw = json.dumps(
            self.firewall if firewall is None else firewall
        )  # "auto", true, false: as in TOML
        store = (
            f"firewall = {fw}\n"
            if self.etcd is None
            else f'backend = "etcd"\nendpoints = {json.dumps(self.etcd.endpoints)}\n'
        )
        # a job grows again at once after a resize, and may be shrunk again at once, unless
        # the test says otherwise (the interval and the minimum run time are the scheduler
        # tests' subject)
        fast = (
            ""
            if "[scheduler]" in config
            else "[scheduler]\nresize_interval = 1.0\nmin_run_time = 0.0\n"
        )
        path.write_text(
            f"[jobs]\nallow_root = {json.dumps(allow_root)}\n"
            f"[node]\npeer_port = {free_port()}\n[store]\n{store}{fast}{config}"
        )
        hosts = index == 1 and self.store_host is None
        where = (
            ()
            if self.etcd is not None
            else (
                "--store",
                f"127.0.0.1:{self.port}",
                "--store-host" if hosts else "--no-store-host",
            )
        )
        flags = (
            "--cluster",
            self.name,
            *where,
            "--node-address",
            f"127.0.0.{index}",
            "--cluster-key",
            str(self.key),
            "--slots",
            "2",
            "--config",
            str(path),
            *args,
        )
        daemon = self.factory(node, args=flags, standalone=False, metrics_port=free_port())
        self.daemons.append(daemon)
        return daemon

    def start(self) -> Cluster:
        """The store host first (with etcd there is none), then the others together; then
        until every node sees all."""
        first = 0 if self.etcd is not None or self.store_host is not None else 1
        if self.store_host is not None:
            self.store_host.start()
        if first:
            self.daemons[0].start()
        for daemon in self.daemons[first:]:
            daemon.start(wait=False)
        for daemon in self.daemons[first:]:
            daemon.wait_notify("READY=1", 60)
        names = sorted(d.name for d in self.daemons)
        wait_for(
            lambda: all(node_states(d) == {n: "up" for n in names} for d in self.daemons),
            20,
            "every node sees every node up",
        )
        return self

    def stop(self) -> None:
        """Every node, then the store's host when it is apart (with etcd: before the etcd)."""
        for daemon in self.daemons:
            daemon.stop()
        if self.store_host is not None:
            self.store_host.stop()

    def __iter__(self) -> Iterator[Daemon]:
        return iter(self.daemons)

    def __getitem__(self, index: int) -> Daemon:
        return self.daemons[index]


class Attacker:
    """torch's TCPStore client, keyless, connected to the cluster's store."""

    def __init__(self, cluster: Cluster, timeout: float = 10.0) -> None:
        from torch.distributed import TCPStore

        self.prefix = f"elasticd/{cluster.name}/"
        self.store = TCPStore(
            "127.0.0.1",
            cluster.port,
            is_master=False,
            use_libuv=True,
            timeout=timedelta(seconds=timeout),
        )

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    def read(self, suffix: str) -> bytes | None:
        key = self.key(suffix)
        return self.store.get(key) if self.store.check([key]) else None

    def exists(self, suffix: str) -> bool:
        return self.store.check([self.key(suffix)])

    def count(self, suffix: str) -> int | None:
        """The counter at ``suffix`` as a number (0: none), None when it holds no count."""
        raw = self.read(suffix)
        return counter_value(raw) if raw else 0

    def write(self, suffix: str, data: bytes) -> None:
        self.store.set(self.key(suffix), data)

    def delete(self, suffix: str) -> bool:
        return self.store.delete_key(self.key(suffix))

    def add(self, suffix: str, amount: int) -> int:
        return self.store.add(self.key(suffix), amount)

    def append(self, suffix: str, data: bytes) -> None:
        self.store.append(self.key(suffix), data)


class EtcdAttacker:
    """etcd's KV API over plain gRPC, as anyone who reaches an etcd without users could use
    it: the same reads and writes as :class:`Attacker` (no elasticd code, no key)."""

    def __init__(self, cluster: Cluster) -> None:
        import grpc
        from aetcd import rpc

        self._rpc = rpc
        self.prefix = f"elasticd/{cluster.name}/"
        self._channel = grpc.insecure_channel(cluster.etcd.endpoints[0])
        self._kv = rpc.KVStub(self._channel)

    def key(self, suffix: str) -> str:
        return self.prefix + suffix

    def read(self, suffix: str) -> bytes | None:
        found = self._kv.Range(
            self._rpc.RangeRequest(key=self.key(suffix).encode()), timeout=10
        ).kvs
        return found[0].value if found else None

    def exists(self, suffix: str) -> bool:
        return self.read(suffix) is not None

    def count(self, suffix: str) -> int | None:
        """The counter at ``suffix`` as a number (0: none), None when it holds no count.  An
        elasticd counter on etcd is kept as a marked offset, its count being the offset plus
        the key's version (an add of 1 is a put that keeps the value)."""
        found = self._kv.Range(
            self._rpc.RangeRequest(key=self.key(suffix).encode()), timeout=10
        ).kvs
        if not found or not found[0].value:
            return 0
        raw, mark = found[0].value, b"\0elasticd-count:"
        if raw.startswith(mark):
            offset = raw[len(mark) :]
            return int(offset) + found[0].version if offset.lstrip(b"-").isdigit() else None
        return counter_value(raw)

    def write(self, suffix: str, data: bytes) -> None:
        self._kv.Put(self._rpc.PutRequest(key=self.key(suffix).encode(), value=data), timeout=10)

    def delete(self, suffix: str) -> bool:
        done = self._kv.DeleteRange(
            self._rpc.DeleteRangeRequest(key=self.key(suffix).encode()), timeout=10
        )
        return done.deleted > 0

    def close(self) -> None:
        self._channel.close()


def attacker(cluster: Cluster) -> Attacker | EtcdAttacker:
    """A keyless client of the cluster's store, whichever it is."""
    return EtcdAttacker(cluster) if cluster.etcd is not None else Attacker(cluster)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``condition`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(interval)


def metric(daemon: Daemon, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def node_states(daemon: Daemon) -> dict[str, str]:
    """Each node's state as ``daemon`` lists it now (asked over the control protocol: a
    poll that started elasticctl each time took seconds a round on a loaded machine)."""
    reply = daemon.request("nodes")
    assert reply.ok, f"{daemon.name}: nodes: {reply.code}: {reply.message}"
    return {n["name"]: n["state"] for n in reply.result}
