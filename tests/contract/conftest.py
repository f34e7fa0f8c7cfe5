"""One store contract, many backends: every test here runs against each backend."""

from __future__ import annotations

import os

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


BACKENDS = {"memory": _memory_store, "c10d": _c10d_store}


@pytest.fixture(params=sorted(BACKENDS))
def store(request):
    backend = BACKENDS[request.param](request)
    yield backend
    backend.close()


@pytest.fixture
def key(request) -> str:
    """A key no other test uses (the c10d server is shared by the module)."""
    return f"contract/{request.node.name}"
