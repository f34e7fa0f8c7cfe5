"""Several real elasticd daemons on this host forming one cluster: distinct node names, state
dirs, sockets, 127.0.0.x addresses and ports.  What a cluster's daemons hold on the host is
theirs alone, so that tests run at once (pytest-xdist, or another checkout's run): the
cluster's name is unique (store keys, nftables tables), and so are its ports (store, peer,
metrics: tests/hostwide.py) and its directories (job cgroups are named after the state dir).  Their store is a TCPStore that n1 hosts (backend
``c10d``) or a one-member etcd cluster on loopback that none of them hosts (``etcd``, a
fresh one per test): every test that uses ``cluster_factory`` (or ``store_backend``) runs on
both, unless marked ``@pytest.mark.c10d_only("why")`` (see store_backends.py)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import START_TIMEOUT, Daemon, free_port
from store_backends import BACKENDS, C10D, ETCD, SyncEtcd, etcd_store_lines, with_keys

from elasticd.store.signing import create_key


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "c10d_only(reason): a system test about the TCPStore "
        "(its host, its port), run on the c10d backend only",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store_backend" in metafunc.fixturenames:
        backends = [C10D] if metafunc.definition.get_closest_marker("c10d_only") else list(BACKENDS)
        metafunc.parametrize("store_backend", backends, indirect=True)


@pytest.fixture
def store_backend(request: pytest.FixtureRequest) -> str:
    """The store backend this run of the test uses (it is parametrized over both)."""
    return request.param


class Node(Daemon):
    """A daemon of a Cluster.  Its config is the cluster's (``cluster.config``, which a test
    may change before a start) with a peer port of its own (node.peer_port, unless the
    test's config sets one), written to ``<name>.toml`` at each start."""

    def __init__(self, cluster_config: Path, config: Path, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cluster_config, self.config = cluster_config, config
        self.peer_port = free_port()

    def start(self, timeout: float = 60.0, *, wait: bool = True) -> Node:
        config = self.cluster_config.read_text()
        if not re.search(r"^peer_port\s*=", config, re.M):
            config = with_keys(config, "node", f"peer_port = {self.peer_port}\n")
        self.config.write_text(config)
        return super().start(timeout, wait=wait)


class Cluster:
    """``size`` daemons n1..n<size> on 127.0.0.1..; ``backend`` c10d: n1 hosts the store (at
    ``port``); etcd: every daemon is a client of ``etcd`` (a tests/fixtures/etcd.py
    EtcdCluster, which the caller owns), no daemon hosts anything.  The cluster's ``name``
    is ``test-<tag>``, of this cluster alone."""

    def __init__(
        self,
        base: Path,
        size: int,
        *,
        slots: int = 2,
        env: dict[str, str] | None = None,
        extra: tuple[str, ...] = (),
        backend: str = C10D,
        etcd: Any = None,
        resize_interval: float | None = 1.0,
    ) -> None:
        assert (backend == ETCD) == (etcd is not None), (
            "an etcd cluster is given for backend etcd only"
        )
        self.base = base
        self.backend = backend
        self.etcd = etcd
        self.name = f"test-{uuid.uuid4().hex[:6]}"
        self.port = free_port() if backend == C10D else None
        self.key = str(base / "cluster.key")
        if not os.path.exists(self.key):  # before any daemon starts (with etcd, none makes it)
            create_key(self.key)
        self.config = base / "cluster.toml"
        # the tests run as root; a job grows again soon after a resize, and may be shrunk
        # again at once (the interval and the minimum run time are the scheduler tests'
        # subject: tests/integration/test_scheduler*.py; None: the defaults)
        config = "[jobs]\nallow_root = true\n"
        if resize_interval is not None:
            config += f"[scheduler]\nresize_interval = {resize_interval}\nmin_run_time = 0.0\n"
        if etcd is not None:
            config += "[store]\n" + etcd_store_lines(etcd.endpoints)
        self.config.write_text(config)
        self.daemons = [self._daemon(i + 1, slots, env, extra) for i in range(size)]

    def _daemon(
        self, index: int, slots: int, env: dict[str, str] | None, extra: tuple[str, ...]
    ) -> Daemon:
        store = (
            ()
            if self.etcd is not None
            else (
                "--store",
                f"127.0.0.1:{self.port}",
                "--store-host" if index == 1 else "--no-store-host",
            )
        )
        config = self.base / f"n{index}.toml"
        args = (
            "--cluster",
            self.name,
            *store,
            "--node-address",
            f"127.0.0.{index}",
            "--cluster-key",
            self.key,
            "--slots",
            str(slots),
            "--config",
            str(config),
            *extra,
        )
        return Node(
            self.config,
            config,
            self.base,
            f"n{index}",
            args=args,
            env=env,
            standalone=False,
            metrics_port=free_port(),
        )

    def __getitem__(self, index: int) -> Daemon:
        return self.daemons[index]

    def __iter__(self) -> Iterator[Daemon]:
        return iter(self.daemons)

    def add(self, slots: int = 2, env: dict[str, str] | None = None) -> Daemon:
        daemon = self._daemon(len(self.daemons) + 1, slots, env, ())
        self.daemons.append(daemon)
        return daemon

    def start(self) -> Cluster:
        """The store's host first (with etcd there is none), then the others together."""
        first = 0 if self.etcd is not None else 1
        for daemon in self.daemons[:first]:
            daemon.start()
        for daemon in self.daemons[first:]:
            daemon.start(wait=False)
        for daemon in self.daemons[first:]:
            daemon.wait_notify("READY=1", START_TIMEOUT)
        self.wait_acquainted()
        return self

    def wait_acquainted(self, timeout: float = START_TIMEOUT) -> None:
        """Until every daemon lists every other: started together, a daemon may have read
        the node records before another wrote its own, and learns of it (and of its peer
        key: a log request from it is refused until then) at its next heartbeat duty."""
        names = {d.name for d in self.daemons}
        deadline = time.monotonic() + timeout
        for daemon in self.daemons:
            while not names <= {n["name"] for n in daemon.request("nodes").result}:
                assert time.monotonic() < deadline, f"{daemon.name} does not list all of {names}"
                time.sleep(0.05)

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.stop()

    def store_client(self) -> Any:
        """A client of the cluster's store with no key (get/set/delete/close), as anyone
        who reaches the store could use."""
        if self.etcd is not None:
            return SyncEtcd(self.etcd.endpoints)
        from elasticd.store.c10d import connect

        return connect(f"127.0.0.1:{self.port}", connect_timeout=10)


@pytest.fixture
def cluster_factory(shared_tmp: Path, store_backend: str) -> Iterator[Callable[..., Cluster]]:
    """Makes Clusters on the test's backend; with etcd, all of a test's clusters share one
    fresh one-member etcd (started here, SIGKILLed after the daemons stopped)."""
    etcd = None
    if store_backend == ETCD:
        from fixtures.etcd import EtcdCluster, require_etcd

        require_etcd()
        etcd = EtcdCluster(shared_tmp / "etcd-data")
    try:
        with _clusters(shared_tmp, backend=store_backend, etcd=etcd) as make:
            yield make
    finally:
        if etcd is not None:
            etcd.stop()


@pytest.fixture
def etcd_cluster_factory(shared_tmp: Path) -> Iterator[Callable[..., Cluster]]:
    """``make(size, etcd, **kw)``: a Cluster of daemons that are clients of ``etcd`` (an
    EtcdCluster that the test owns and stops after them); the daemons stop at tear-down."""
    with _clusters(shared_tmp) as make:
        yield lambda size, etcd, **kw: make(size, backend=ETCD, etcd=etcd, **kw)


@contextlib.contextmanager
def _clusters(base: Path, **defaults: Any) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(size: int, **kw: Any) -> Cluster:
        cluster = Cluster(base, size, **{**defaults, **kw})
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


# modules whose REPORT lines (a timeline, what torchrun did beside) go to the summary
REPORTS = {
    "test_deb": "debian package on three systemd hosts",
    "test_elasticrun_nodes": "elasticrun's private daemons, torchrun beside",
    "test_slurm": "elasticrun under Slurm",
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """The REPORTS modules' lines go with the report of each of their tests' tear-down (so
    that they reach the summary from a pytest-xdist worker too)."""
    outcome = yield
    if call.when != "teardown":
        return
    for module, title in REPORTS.items():
        found = sys.modules.get(module)
        if found is not None and found.REPORT:
            outcome.get_result().user_properties.extend((title, line) for line in found.REPORT)
            found.REPORT.clear()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """test_deb.py's timeline (the three-host systemd cluster) and what torchrun did beside
    elasticrun (test_elasticrun_nodes.py, test_slurm.py), when they ran."""
    for title in REPORTS.values():
        lines = [
            value
            for reports in terminalreporter.stats.values()
            for report in reports
            if getattr(report, "when", None) == "teardown"
            for key, value in getattr(report, "user_properties", ())
            if key == title
        ]
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
