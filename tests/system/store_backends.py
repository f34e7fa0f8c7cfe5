"""The two store backends that the system tests run on (docs/store.md): ``c10d``, a TCPStore that
daemon n1 hosts, and ``etcd``, an etcd cluster that no daemon hosts (every daemon is a
client; see tests/fixtures/etcd.py for the members).

A test that takes the ``store_backend`` fixture (directly or through a cluster fixture)
runs once per backend; ``@pytest.mark.c10d_only("why")`` keeps it on c10d.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

C10D, ETCD = "c10d", "etcd"
BACKENDS = (C10D, ETCD)


def with_keys(config: str, table: str, lines: str) -> str:
    """The TOML ``config`` with ``lines`` (``key = value`` lines, newline-terminated) in its
    ``table``, which is made if it has none (a table may not be defined twice)."""
    header = f"[{table}]\n"
    if header in config:
        return config.replace(header, header + lines, 1)
    return config + header + lines


def with_store(config: str, lines: str) -> str:
    """The TOML ``config`` with ``lines`` in its [store] table."""
    return with_keys(config, "store", lines)


def etcd_store_lines(endpoints: list[str]) -> str:
    """A daemon's [store] keys for an etcd cluster without TLS or users.  Its observer
    compacts etcd's history every second (300 s by default), so every test on etcd runs its
    jobs, watches and followers against a store that keeps little history."""
    return f'backend = "etcd"\nendpoints = {json.dumps(endpoints)}\ncompact_interval = 1\n'


class SyncEtcd:
    """elasticd's EtcdStore called from the test's thread: the client runs on a loop of its
    own (as tests/contract/conftest.py drives it).  get/set/delete; close when done."""

    def __init__(self, endpoints: list[str], timeout: float = 10.0) -> None:
        from elasticd.store.etcd import EtcdStore

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = EtcdStore(endpoints, timeout=timeout)
        self._run(self._client.connect(timeout))

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def get(self, key: str) -> bytes | None:
        return self._run(self._client.get(key))

    def set(self, key: str, value: bytes) -> None:
        self._run(self._client.set(key, value))

    def delete(self, key: str) -> bool:
        return self._run(self._client.delete(key))

    def close(self) -> None:
        try:
            self._run(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
