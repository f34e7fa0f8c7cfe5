"""Several real elasticd daemons on this host forming one cluster: distinct node names, state
dirs, sockets and 127.0.0.x addresses.  Their store is a TCPStore that n1 hosts (backend
``c10d``) or a one-member etcd cluster on loopback that none of them hosts (``etcd``, a
fresh one per test): every test that uses ``cluster_factory`` (or ``store_backend``) runs on
both, unless marked ``@pytest.mark.c10d_only("why")`` (see store_backends.py)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon, free_port
from store_backends import BACKENDS, C10D, ETCD, SyncEtcd, etcd_store_lines

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


class Cluster:
    """``size`` daemons n1..n<size> on 127.0.0.1..; ``backend`` c10d: n1 hosts the store (at
    ``port``); etcd: every daemon is a client of ``etcd`` (a tests/fixtures/etcd.py
    EtcdCluster, which the caller owns), no daemon hosts anything."""

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
        self.name = "test"
        self.port = free_port() if backend == C10D else None
        self.key = str(base / "cluster.key")
        if not os.path.exists(self.key):  # before any daemon starts (with etcd, none makes it)
            create_key(self.key)
        self.config = base / "cluster.toml"
        # the tests run as root; a job grows again soon after a resize (the interval is the
        # scheduler tests' subject: tests/integration/test_scheduler.py; None: the default)
        config = "[jobs]\nallow_root = true\n"
        if resize_interval is not None:
            config += f"[scheduler]\nresize_interval = {resize_interval}\n"
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
            str(self.config),
            *extra,
        )
        return Daemon(
            self.base, f"n{index}", args=args, env=env, standalone=False, metrics_port=free_port()
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
        for daemon in self.daemons:
            daemon.start()
        return self

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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """test_deb.py's timeline (the three-host systemd cluster) and what torchrun did beside
    elasticrun (test_elasticrun_nodes.py, test_slurm.py), when they ran."""
    import sys

    for module, title in (
        ("test_deb", "debian package on three systemd hosts"),
        ("test_elasticrun_nodes", "elasticrun's private daemons, torchrun beside"),
        ("test_slurm", "elasticrun under Slurm"),
    ):
        found = sys.modules.get(module)
        if found is not None and found.REPORT:
            terminalreporter.section(title)
            for line in found.REPORT:
                terminalreporter.write_line(line)
