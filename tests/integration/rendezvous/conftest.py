"""Rendezvous on a real TCPStore over loopback: participants as threads and as processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

# A wait that times out makes TCPStore log a C++ warning; a flaky resolver can stall
# TCPStore's reverse lookup of each new peer for 5 s (see elasticd.store.c10d).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

from elasticd.rendezvous import RendezvousHandler, RendezvousSettings  # noqa: E402
from elasticd.store.c10d import C10dServer, C10dStore, connect  # noqa: E402
from elasticd.store.signing import Signer, create_key  # noqa: E402

INTERVAL = 0.2  # keep-alive interval in these tests: a silent node is dead after 0.6 s
PARTICIPANT = Path(__file__).with_name("participant.py")


@pytest.fixture(scope="module")
def server() -> Iterator[C10dServer]:
    server = C10dServer("127.0.0.1", 0, timeout=30.0)
    yield server
    server.close()


@pytest.fixture
def store(server: C10dServer) -> Iterator[C10dStore]:
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
    from elasticd.store.signing import load_key

    return Signer(load_key(key_file))


@pytest.fixture
def prefix(request) -> str:
    return f"elasticd/test/rdzv/{request.node.name}"


def settings(min_nodes: int, max_nodes: int, **overrides) -> RendezvousSettings:
    fields = {"join_timeout": 60.0, "last_call_timeout": 0.3, "keep_alive_interval": INTERVAL,
              "keep_alive_max_attempt": 3} | overrides
    return RendezvousSettings(run_id="job", min_nodes=min_nodes, max_nodes=max_nodes, **fields)


@pytest.fixture
def make_handler(store, signer, prefix) -> Iterator[Callable[..., RendezvousHandler]]:
    """``make_handler(node, settings, **kwargs)``; every handler is shut down afterwards."""
    made: list[RendezvousHandler] = []

    def make(node: str, config: RendezvousSettings, **kwargs) -> RendezvousHandler:
        kwargs.setdefault("prefix", prefix)
        handler = RendezvousHandler(kwargs.pop("store", store), signer, config, node, f"{node}.addr", **kwargs)
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


def join(pool: ThreadPoolExecutor, handlers: list[RendezvousHandler], nproc: int = 1) -> list[Future]:
    """Every handler calls next_rendezvous in its own thread; master_port = 29400 + index."""
    return [pool.submit(h.next_rendezvous, nproc, 29400 + i) for i, h in enumerate(handlers)]


def results(futures: list[Future], timeout: float = 30.0) -> list:
    return [f.result(timeout=timeout) for f in futures]


class Participant:
    """A participant in its own process (participant.py), reporting events on stdout."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PARTICIPANT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=os.environ.copy())
        self._events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._events.put(json.loads(line))
        self._events.put(None)

    def expect(self, event: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            item = self._events.get(timeout=max(deadline - time.monotonic(), 0.01))
            if item is None:
                raise AssertionError(f"participant exited ({self.process.wait()}): {self.process.stderr.read()}")
            if item["event"] == event:
                return item

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def spawn(server, key_file, prefix) -> Iterator[Callable[..., Participant]]:
    """``spawn(node, min, max, *extra_args)`` starts participant.py; all are killed afterwards."""
    started: list[Participant] = []

    def start(node: str, min_nodes: int, max_nodes: int, *extra: str) -> Participant:
        participant = Participant([server.endpoint, prefix, node, key_file, str(min_nodes), str(max_nodes),
                                   "--interval", str(INTERVAL), *extra])
        started.append(participant)
        return participant

    yield start
    for participant in started:
        participant.kill()
