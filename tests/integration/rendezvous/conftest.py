"""Rendezvous on a real TCPStore over loopback: participants as threads and as processes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

# A wait that times out makes TCPStore log a C++ warning; a flaky resolver can stall
# TCPStore's reverse lookup of each new peer for 5 s (see elasticd.store.c10d).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

from blocking_rendezvous import BlockingRendezvous
from rendezvous_support import INTERVAL, Participant
from store_servers import ServerProcess

from elasticd.rendezvous import RendezvousSettings
from elasticd.store.c10d import C10dStore, connect
from elasticd.store.signing import Signer, create_key, load_key


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = ServerProcess()
    yield server
    server.close()


@pytest.fixture
def store(server: ServerProcess) -> Iterator[C10dStore]:
    store = connect(server.endpoint, timeout=30.0, connect_timeout=10.0)
    yield store
    store.close()


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    create_key(str(path))
    return str(path)


@pytest.fixture
def signer(key_file: str) -> Signer:
    return Signer(load_key(key_file), "c")


@pytest.fixture
def prefix(request) -> str:
    return f"elasticd/test/rdzv/{request.node.name}"


@pytest.fixture
def make_handler(store, signer, prefix) -> Iterator[Callable[..., BlockingRendezvous]]:
    """``make_handler(node, settings, **kwargs)``; every handler is shut down afterwards."""
    made: list[BlockingRendezvous] = []

    def make(node: str, config: RendezvousSettings, **kwargs) -> BlockingRendezvous:
        kwargs.setdefault("prefix", prefix)
        handler = BlockingRendezvous(
            kwargs.pop("store", store), signer, config, node, f"{node}.addr", **kwargs
        )
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler.shutdown()
    for handler in made:
        handler.shutdown(wait=True)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


@pytest.fixture
def spawn(server, key_file, prefix) -> Iterator[Callable[..., Participant]]:
    """``spawn(node, min, max, *extra_args)`` starts participant.py; all are killed afterwards."""
    started: list[Participant] = []

    def start(node: str, min_nodes: int, max_nodes: int, *extra: str) -> Participant:
        participant = Participant(
            [
                server.endpoint,
                prefix,
                node,
                key_file,
                str(min_nodes),
                str(max_nodes),
                "--interval",
                str(INTERVAL),
                *extra,
            ]
        )
        started.append(participant)
        return participant

    yield start
    for participant in started:
        participant.kill()
