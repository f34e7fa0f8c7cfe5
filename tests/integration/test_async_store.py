"""AsyncStore against a real TCPStore: the event loop's one path to the blocking store.

What is proven here: waits are bounded and a wait whose caller gave up frees its thread for
the next one; ``wait_then`` reads after the wait in the same trip; a store that went silent
gives the caller StoreTimeout, not a hang, and the next call gets a fresh thread; ``close``
ends blocked calls and leaves no thread in the backend.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import pytest

from elasticd.errors import StoreTimeout
from elasticd.store.aio import AsyncStore
from elasticd.store.c10d import C10dServer, connect

STORE_HOST = """
import sys, time
from elasticd.store.c10d import C10dServer
server = C10dServer("127.0.0.1", 0)
print(server.endpoint, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def server():
    server = C10dServer("127.0.0.1", 0, timeout=30.0)
    yield server
    server.close()


def store_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("t-")]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_wait_whose_caller_gave_up_frees_its_thread_for_the_next(server):
    """One wait thread: the abandoned 60 s wait must not hold the second wait behind it
    (the second would time out after its 5 s instead of seeing its key)."""
    async def scenario():
        store = AsyncStore(connect(server.endpoint), timeout=5.0, waits=1, name="t")
        try:
            abandoned = asyncio.create_task(store.wait_for("never", 60.0))
            await asyncio.sleep(0.1)
            abandoned.cancel()
            second = asyncio.create_task(store.wait_for("later", 5.0))
            await store.set("later", b"1")
            return await second
        finally:
            await store.close()

    assert run(scenario()) is True


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


def test_wait_then_reads_after_the_wait_in_one_trip(server):
    async def scenario():
        store = AsyncStore(connect(server.endpoint), timeout=5.0, name="t")
        try:
            waiting = asyncio.create_task(store.wait_then("rev", 5.0, lambda b: (b.get("state"), b.get("rev"))))
            await store.batch(lambda b: (b.set("state", b"s1"), b.set("rev", b"1")))
            timed_out = await store.wait_then("absent", 0.2, lambda b: b.get("state"))
            return await waiting, timed_out
        finally:
            await store.close()

    (found, read), timed_out = run(scenario())
    assert found and read == (b"s1", b"1")
    assert timed_out == (False, b"s1")


@pytest.fixture
def store_host():
    """A TCPStore hosted by another process, to be SIGSTOPped: a partition as a client sees
    it (the connection is up, nothing answers)."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
    try:
        yield host, host.stdout.readline().strip()
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()


def test_a_silent_store_times_out_and_the_next_call_gets_a_fresh_thread(store_host):
    """The call ends with StoreTimeout at the AsyncStore deadline, and once the host answers
    again the next call on the same AsyncStore succeeds."""
    host, endpoint = store_host

    async def scenario():
        store = AsyncStore(connect(endpoint, timeout=30.0), timeout=1.0, quick=1, name="t")
        try:
            await store.set("k", b"before")
            os.kill(host.pid, signal.SIGSTOP)
            with pytest.raises(StoreTimeout):
                await store.get("k")
            os.kill(host.pid, signal.SIGCONT)
            return await store.get("k")
        finally:
            await store.close()

    assert run(scenario()) == b"before"


def test_close_aborts_a_call_stuck_on_a_silent_store(store_host):
    """A call given up at its deadline still sits in TCPStore (its own timeout is 30 s);
    close ends it and returns with no thread left."""
    host, endpoint = store_host

    async def scenario():
        store = AsyncStore(connect(endpoint, timeout=30.0), timeout=0.5, quick=1, name="t")
        await store.set("k", b"v")
        os.kill(host.pid, signal.SIGSTOP)
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
