"""Helpers of the rendezvous integration tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from elasticd.rendezvous import RendezvousSettings

INTERVAL = 0.2  # keep-alive interval in these tests: a silent node is dead after 0.6 s
PARTICIPANT = Path(__file__).with_name("participant.py")


def settings(min_nodes: int, max_nodes: int, **overrides) -> RendezvousSettings:
    fields = {
        "join_timeout": 60.0,
        "last_call_timeout": 0.3,
        "keep_alive_interval": INTERVAL,
        "keep_alive_max_attempt": 3,
    } | overrides
    return RendezvousSettings(run_id="job", min_nodes=min_nodes, max_nodes=max_nodes, **fields)


def join(pool: ThreadPoolExecutor, handlers: list, nproc: int = 1) -> list[Future]:
    """Every handler calls next_rendezvous in its own thread; master_port = 29400 + index."""
    return [pool.submit(h.next_rendezvous, nproc, 29400 + i) for i, h in enumerate(handlers)]


def results(futures: list[Future], timeout: float = 30.0) -> list:
    return [f.result(timeout=timeout) for f in futures]


class Participant:
    """A participant in its own process (participant.py), reporting events on stdout."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PARTICIPANT), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
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
                raise AssertionError(
                    f"participant exited ({self.process.wait()}): {self.process.stderr.read()}"
                )
            if item["event"] == event:
                return item

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
