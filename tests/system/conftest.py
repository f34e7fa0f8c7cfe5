"""Several real elasticd daemons on this host forming one cluster: distinct node names, state
dirs, sockets and 127.0.0.x addresses, one of them (n1) the store host."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from harness import Daemon, free_port
from elasticd.store.signing import create_key


class Cluster:
    def __init__(self, base: Path, size: int, *, slots: int = 2, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.base = base
        self.port = free_port()
        self.key = str(base / "cluster.key")
        if not os.path.exists(self.key):
            create_key(self.key)
        self.config = base / "cluster.toml"
        self.config.write_text("[jobs]\nallow_root = true\n")  # the tests run as root
        self.daemons = [self._daemon(i + 1, slots, env, extra) for i in range(size)]

    def _daemon(self, index: int, slots: int, env: dict[str, str] | None,
                extra: tuple[str, ...]) -> Daemon:
        args = ("--cluster", "test", "--store", f"127.0.0.1:{self.port}",
                "--node-address", f"127.0.0.{index}", "--cluster-key", self.key,
                "--slots", str(slots), "--store-host" if index == 1 else "--no-store-host",
                "--config", str(self.config), *extra)
        return Daemon(self.base, f"n{index}", args=args, env=env, standalone=False,
                      metrics_port=free_port())

    def __getitem__(self, index: int) -> Daemon:
        return self.daemons[index]

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


@pytest.fixture
def cluster_factory(shared_tmp: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(size: int, **kw: Any) -> Cluster:
        cluster = Cluster(shared_tmp, size, **kw)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
