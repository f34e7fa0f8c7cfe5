"""AsyncStore, the thread adapter for blocking backends, against a real TCPStore client.

What is proven here: waits are bounded; a call stuck in a backend is ended at close (the
backend's abort) and no thread is left.  A wait whose caller gave up frees its thread: in
test_tcpstore_client.py, with the same test for both.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from elasticd.errors import StoreTimeout
from elasticd.store.aio import AsyncStore
from elasticd.store.c10d import C10dServer, connect
from elasticd.store.memory import MemoryStore

@pytest.fixture
def server():
    server = C10dServer("127.0.0.1", 0, timeout=30.0)
    yield server
    server.close()


def store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("t-")]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_waits_are_bounded_and_each_is_answered(server):
    async def scenario():
        store = AsyncStore(connect(server.endpoint), timeout=5.0, quick=1, waits=2, name="t")
        try:
            waits = [asyncio.create_task(store.wait_for(f"k{i}", 10.0)) for i in range(6)]
            await asyncio.sleep(0.2)
            peak = len([n for n in store_threads() if n.startswith("t-wait")])
            for i in range(6):
                await store.set(f"k{i}", b"x")
            return peak, await asyncio.gather(*waits)
        finally:
            await store.close()

    peak, found = run(scenario())
    assert peak == 2
    assert found == [True] * 6


class Stuck(MemoryStore):
    """A backend whose get blocks until abort(): a call on a silent connection."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = threading.Event()

    def get(self, key: str) -> bytes | None:
        self.aborted.wait(60)
        return super().get(key)

    def abort(self) -> None:
        self.aborted.set()
        super().abort()


def test_close_aborts_a_call_stuck_in_the_backend():
    async def scenario():
        store = AsyncStore(Stuck(), timeout=0.3, quick=1, name="t")
        with pytest.raises(StoreTimeout):
            await store.get("k")
        await store.close()
        return store_threads()

    assert run(scenario()) == []


def test_close_ends_a_blocked_wait_and_leaves_no_thread(server):
    async def scenario():
        store = AsyncStore(connect(server.endpoint), timeout=5.0, name="t")
        blocked = asyncio.create_task(store.wait_for("never", 60.0))
        await asyncio.sleep(0.2)
        await store.close()
        blocked.cancel()
        return store_threads()

    assert run(scenario()) == []
