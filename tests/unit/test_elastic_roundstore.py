"""elasticd.elastic.roundstore: a round's store opened on a thread, in one process (real
TCPStores on 127.0.0.1, milliseconds each)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from elasticd.elastic import runtime
from elasticd.elastic.errors import GroupAborted
from elasticd.elastic.roundstore import RoundStore

BOUND = 10.0  # seconds: a bound for a loaded machine, never waited for when all is well


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(rank: int, port: int, size: int = 2) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(size)}


def opening(rank: int, port: int, stop=lambda: False) -> RoundStore:
    return RoundStore(1, env(rank, port), "gloo", stop, runtime._socket_fds).start()


def test_a_client_placed_before_its_host_waits_then_shares_the_hosts_store() -> None:
    port = free_port()
    client = opening(1, port)
    assert not client._done.wait(0.05)  # nothing listens yet: the client waits for it
    host = opening(0, port)
    host.take().set("seen", "yes")
    assert client.take().get("seen") == b"yes"
    # the keys are where env:// puts them (PrefixStore "default_pg")
    assert client.take().check(["seen"]) and host._store.check(["default_pg/seen"])


@pytest.mark.parametrize("how", ["aborted", "cancelled"])
def test_a_round_given_up_stops_waiting_for_its_host(how: str) -> None:
    stopped = threading.Event()
    client = opening(1, free_port(), stop=stopped.is_set)
    assert not client._done.wait(0.05)
    stopped.set() if how == "aborted" else client.cancel()
    started = time.monotonic()
    with pytest.raises(GroupAborted, match="aborted before its store opened"):
        client.take()
    assert time.monotonic() - started < BOUND


def test_an_abort_frees_a_get_blocked_on_the_store_through_the_sockets_it_noted() -> None:
    """What an abort during the group's forming does (runtime._abort): the store's sockets,
    noted when it opened, are shut down, and a rank waiting for a dead peer's key is freed
    instead of waiting for the store's timeout (30 minutes)."""
    port = free_port()
    host = opening(0, port)
    client = opening(1, port)
    store = client.take()
    host.take()
    assert client.sockets, "the client's connection was noted"
    failed: list[BaseException] = []

    def wait_for_a_dead_peer() -> None:
        try:
            store.get("never-set")
        except Exception as error:  # what gloo's rendezvous would see
            failed.append(error)
    waiter = threading.Thread(target=wait_for_a_dead_peer, daemon=True)
    waiter.start()
    assert not failed and waiter.is_alive()
    runtime._shut_down(client.sockets)
    waiter.join(BOUND)
    assert failed, "the blocked get was not freed"
