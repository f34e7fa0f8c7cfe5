"""One store contract, many backends: every test here runs against each backend."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

# A wait that times out makes TCPStore log a C++ warning; and a flaky resolver can stall
# TCPStore's reverse lookup of each new peer for 5 s (see elasticd.store.c10d).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture(scope="module")
def c10d_server():
    from elasticd.store.c10d import C10dServer

    server = C10dServer("127.0.0.1", 0, timeout=10.0)
    yield server
    server.close()


def _memory_store(request):
    from elasticd.store.memory import MemoryStore

    return MemoryStore()


def _c10d_store(request):
    from elasticd.store.c10d import connect

    server = request.getfixturevalue("c10d_server")
    return connect(server.endpoint, timeout=10.0, connect_timeout=10.0)


class OnALoop:
    """A TCPStoreClient's coroutines called from any thread (the contract is written for
    blocking backends): the client runs on a loop of its own."""

    def __init__(self, endpoint: str, timeout: float = 10.0) -> None:
        from elasticd.store.tcpstore import TCPStoreClient

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = TCPStoreClient(endpoint, timeout=timeout)

    def __getattr__(self, name: str):
        method = getattr(self._client, name)
        return lambda *args: asyncio.run_coroutine_threadsafe(method(*args), self._loop).result()

    def close(self) -> None:
        """Closes the client; the loop stays for calls after close (they must fail)."""
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()


def _tcpstore_client(request):
    return OnALoop(request.getfixturevalue("c10d_server").endpoint)


BACKENDS = {"memory": _memory_store, "c10d": _c10d_store, "tcpstore": _tcpstore_client}


@pytest.fixture(params=sorted(BACKENDS))
def store(request):
    backend = BACKENDS[request.param](request)
    yield backend
    backend.close()


@pytest.fixture
def key(request) -> str:
    """A key no other test uses (the c10d server is shared by the module)."""
    return f"contract/{request.node.name}"
