"""One store contract, many backends: every test here runs against each backend."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from store_servers import ServerProcess

# A wait that times out makes TCPStore log a C++ warning; and a flaky resolver can stall
# TCPStore's reverse lookup of each new peer for 5 s (see elasticd.store.c10d).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture(scope="module")
def c10d_server():
    """Our TCPStore server (what a daemon hosts), in a child process (store_servers.py)."""
    server = ServerProcess(kind="elasticd")
    yield server
    server.close()


@pytest.fixture(scope="module")
def torch_server():
    """torch's own (libuv) TCPStore server: the reference our client is checked against."""
    server = ServerProcess(kind="torch")
    yield server
    server.close()


def _memory_store(request):
    from elasticd.store.memory import MemoryStore

    return MemoryStore()


def _c10d_store(request):
    from elasticd.store.c10d import connect

    server = request.getfixturevalue("c10d_server")
    return connect(server.endpoint, timeout=10.0, connect_timeout=10.0)


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory):
    """A one-member etcd cluster, plain TCP, no authentication."""
    from fixtures.etcd import EtcdCluster, require_etcd

    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def etcd_tls_cluster(tmp_path_factory):
    """A one-member etcd cluster that wants TLS with a client certificate, and a password."""
    from fixtures.etcd import EtcdCluster, require_etcd

    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd-tls"), tls=True, password="s3cret") as cluster:
        yield cluster


class OnALoop:
    """A Store's coroutines (TCPStoreClient, EtcdStore) called from any thread (the contract
    is written for blocking backends): the client runs on a loop of its own."""

    def __init__(self, client) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = client

    def __getattr__(self, name: str):
        method = getattr(self._client, name)
        return lambda *args: asyncio.run_coroutine_threadsafe(method(*args), self._loop).result()

    def close(self) -> None:
        """Closes the client; the loop stays for calls after close (they must fail)."""
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()


def _tcpstore_client(request):
    from elasticd.store.tcpstore import TCPStoreClient

    return OnALoop(TCPStoreClient(request.getfixturevalue("c10d_server").endpoint, timeout=10.0))


def _tcpstore_client_on_torch(request):
    from elasticd.store.tcpstore import TCPStoreClient

    return OnALoop(TCPStoreClient(request.getfixturevalue("torch_server").endpoint, timeout=10.0))


def _on_etcd(cluster) -> OnALoop:
    """An EtcdStore for the cluster (its TLS files and user), connected."""
    from elasticd.store.etcd import EtcdStore

    store = OnALoop(EtcdStore(cluster.endpoints, timeout=10.0, **cluster.store_options()))
    store.connect(10.0)
    return store


def _etcd_store(request):
    return _on_etcd(request.getfixturevalue("etcd_cluster"))


def _etcd_tls_store(request):
    return _on_etcd(request.getfixturevalue("etcd_tls_cluster"))


BACKENDS = {
    "memory": _memory_store,
    "c10d": _c10d_store,
    "tcpstore": _tcpstore_client,
    "tcpstore-on-torch": _tcpstore_client_on_torch,
    "etcd": _etcd_store,
    "etcd-tls": _etcd_tls_store,
}


@pytest.fixture(params=sorted(BACKENDS))
def store(request):
    backend = BACKENDS[request.param](request)
    yield backend
    backend.close()


@pytest.fixture
def key(request) -> str:
    """A key no other test uses (the c10d server and the etcd clusters are shared by the module)."""
    return f"contract/{request.node.name}"
