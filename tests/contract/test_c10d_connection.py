"""c10d specifics of the contract: torch's blocking client's error mapping, connect back-off and
reconnect after a restart (against our server, in a child process: store_servers.py); where
our server listens and what it says when it cannot."""

from __future__ import annotations

import socket
import time

import pytest
from hostwide import free_port
from store_servers import ServerProcess

from elasticd.errors import StoreConnectionError
from elasticd.store.c10d import connect
from elasticd.store.tcpserver import TCPStoreServer


def test_connect_to_a_dead_endpoint_fails_within_connect_timeout_naming_it():
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as raised:
        connect(endpoint, connect_timeout=1.0)
    assert endpoint in str(raised.value)
    assert 0.9 <= time.monotonic() - started < 3.0


def test_connect_retries_until_the_server_comes_up():
    import threading

    port = free_port()
    servers: list[ServerProcess] = []
    timer = threading.Timer(0.5, lambda: servers.append(ServerProcess("127.0.0.1", port)))
    timer.start()
    try:
        store = connect(f"127.0.0.1:{port}", connect_timeout=20.0)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        store.close()
    finally:
        timer.join()
        for server in servers:
            server.close()


def test_a_restarted_server_raises_once_then_reconnects():
    server = ServerProcess("127.0.0.1", 0)
    port = server.port
    store = connect(server.endpoint, timeout=5.0, connect_timeout=5.0)
    store.set("k", b"v")
    server.close()
    with pytest.raises(StoreConnectionError) as raised:
        store.get("k")
    assert server.endpoint in str(raised.value)
    server = ServerProcess("127.0.0.1", port)
    try:
        assert store.get("k") is None  # the data went with the old server
        store.set("k", b"again")
        assert store.get("k") == b"again"
    finally:
        store.close()
        server.close()


def test_the_server_listens_on_its_host_address_only():
    """A store hosted on 127.0.0.1 (standalone) must not be reachable on any other address."""
    server = TCPStoreServer("127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", server.port), timeout=5).close()
    finally:
        server.close()


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            StoreConnectionError, match=f"cannot host the store on 127.0.0.1:{port}"
        ):
            TCPStoreServer("127.0.0.1", port)
