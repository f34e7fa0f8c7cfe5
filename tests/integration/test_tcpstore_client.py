"""TCPStoreClient against a TCPStore server, ours (what a daemon hosts) and torch's (the
reference), each in a child process: what the contract suite does not show.

The contract suite (tests/contract) runs every store operation against it; here: torch's own
clients see the same keys, a timed-out wait is cancelled on the wire and its connection kept,
a wait whose caller gave up frees its place, a silent store gives StoreTimeout and no hang,
close ends a blocked wait at once, the store coming up late or restarting, and a peer that
is not a TCPStore.  No thread is ever started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest
from hostwide import free_port
from store_servers import SERVERS, ServerProcess

from elasticd.errors import AddInDoubt, StoreConnectionError, StoreTimeout
from elasticd.store.c10d import connect
from elasticd.store.counter import StoreCounter
from elasticd.store.tcpserver import Refused, TCPStoreServer
from elasticd.store.tcpstore import StoreProtocolError, TCPStoreClient


@pytest.fixture(params=SERVERS)
def server(request):
    server = ServerProcess(kind=request.param)
    yield server
    server.close()


@pytest.fixture(params=SERVERS)
def store_host(request):
    """A TCPStore hosted by another process, to be SIGSTOPped: a partition as a client sees
    it (the connection is up, nothing answers)."""
    host = ServerProcess(kind=request.param)
    try:
        yield host, host.endpoint
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.close()


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped: the signal is
    delivered asynchronously, and the store's server thread, running on the other core,
    could still answer a request sent right after os.kill (a test that saw b'v' from a
    "silent" store)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(_thread_state(pid, tid) in ("T", "t") for tid in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def _thread_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "T"  # gone: it answers nothing either


def run(coro):
    threads = threading.active_count()
    result = asyncio.run(asyncio.wait_for(coro, 60))
    assert threading.active_count() == threads  # the client starts no thread
    return result


def connections_to(port: int) -> set[int]:
    """The local ports of this process's open connections to ``port``."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


def test_torch_clients_see_the_same_keys(server):
    torch_side = connect(server.endpoint)

    async def scenario():
        client = TCPStoreClient(server.endpoint)
        try:
            await client.set("ours", b"1")
            torch_side.set("theirs", b"2")
            torch_side.add("count", 5)
            return await client.get("theirs"), await client.add("count", 1), torch_side.get("ours")
        finally:
            await client.close()

    assert run(scenario()) == (b"2", 6, b"1")
    torch_side.close()


@pytest.fixture
def repaired_at_once():
    """Our server on a thread of this process, where the junk an add meets is replaced by a
    count (41) right after the add is refused, before its client can read the key again:
    another node's repair landing in between, without a timing to hope for."""
    server = TCPStoreServer("127.0.0.1", 0)
    refuse = server.keys.add

    def add(key: bytes, amount: int) -> int:
        try:
            return refuse(key, amount)
        except Refused:
            server.keys.set(key, b"41")
            raise

    server.keys.add = add  # type: ignore[method-assign]
    yield server
    server.close()


def test_an_add_over_junk_repaired_meanwhile_is_a_read_or_in_doubt(repaired_at_once):
    """An add over junk loses its connection (torch's server and ours drop it), and the key
    holds a count when the client reads it again: a lost connection, or junk that another node
    repaired meanwhile.  An add of 0 answers that count (a read); any other add is in doubt,
    never "the store is unreachable", and a StoreCounter takes the next number.  Before, each
    was a StoreConnectionError: a daemon's board follower said the store was unreachable."""
    endpoint = f"127.0.0.1:{repaired_at_once.port}"
    keys = repaired_at_once.keys
    refused: list[str] = []

    async def justify(seen: int) -> int:
        return seen + 1

    async def scenario():
        client = TCPStoreClient(endpoint)
        counter = StoreCounter(client, "n", justify, lambda key, why: refused.append(why))
        try:
            keys.set(b"/r", b"junk")
            read = await client.add("r", 0)
            keys.set(b"/d", b"junk")
            with pytest.raises(AddInDoubt):
                await client.add("d", 2)
            keys.set(b"/n", b"junk")
            return read, await counter.take()
        finally:
            await client.close()

    assert run(scenario()) == (41, 42)
    assert keys.values[b"/d"] == b"41"  # the add in doubt was not applied
    assert refused == []  # the junk was repaired by the other node, not this one
    # torch's client, in a child process (it may hold the GIL while it waits: elasticd.store.c10d)
    keys.set(b"/r", b"junk")
    keys.set(b"/d", b"junk")
    torch_side = subprocess.run(
        [sys.executable, "-c", _TORCH_SIDE, endpoint],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert torch_side.stdout.split() == ["41", "AddInDoubt"], torch_side.stderr


_TORCH_SIDE = """
import sys
from elasticd.errors import AddInDoubt
from elasticd.store.c10d import connect
store = connect(sys.argv[1])
print(store.add("r", 0))
try:
    store.add("d", 1)
except AddInDoubt as doubt:
    print(type(doubt).__name__)
store.close()
"""


def test_a_timed_out_wait_is_cancelled_on_the_wire_and_its_connection_kept(server):
    async def scenario():
        client = TCPStoreClient(server.endpoint, connections=1, waits=1)
        try:
            assert await client.wait_for("never", 0.05) is False
            first = connections_to(server.port) - others
            for _ in range(5):
                assert await client.wait_for("never", 0.05) is False
            asyncio.get_running_loop().call_later(0.1, server_side.set, "later", b"x")
            found = await client.wait_for("later", 5.0)
            return found, first, connections_to(server.port) - others
        finally:
            await client.close()

    server_side = connect(server.endpoint)
    server_side.get("warm")  # its connection is open before the count
    others = connections_to(server.port)
    found, first, last = run(scenario())
    server_side.close()
    assert found is True
    assert len(first) == 1 and last == first  # one connection, the same one throughout


def test_a_wait_whose_caller_gave_up_frees_its_place(server):
    """One wait at a time: the abandoned 60 s wait must not hold the second one behind it
    (the second would time out after its 5 s instead of seeing its key)."""

    async def scenario():
        store = TCPStoreClient(server.endpoint, waits=1)
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


def test_a_silent_store_times_out_and_the_next_call_reconnects(store_host):
    host, endpoint = store_host

    async def scenario():
        client = TCPStoreClient(endpoint, timeout=0.5)
        try:
            await client.set("k", b"before")
            freeze(host.pid)
            started = time.monotonic()
            with pytest.raises(StoreTimeout):
                await client.get("k")
            gave_up = time.monotonic() - started
            os.kill(host.pid, signal.SIGCONT)
            return gave_up, await client.get("k")
        finally:
            await client.close()

    gave_up, value = run(scenario())
    assert value == b"before"
    assert gave_up < 5  # the client's deadline (0.5 s), not TCPStore's 30 s or a hang


def test_close_ends_a_blocked_wait_at_once(store_host):
    host, endpoint = store_host

    async def scenario():
        client = TCPStoreClient(endpoint)
        await client.set("k", b"v")
        freeze(host.pid)  # nothing will ever answer the wait
        blocked = asyncio.create_task(client.wait_for("never", 60.0))
        await asyncio.sleep(0.1)
        await client.close()
        with pytest.raises(StoreConnectionError):
            await blocked
        with pytest.raises(StoreConnectionError):
            await client.get("k")

    run(scenario())


def test_a_dead_endpoint_is_named_after_the_connect_timeout():
    endpoint = f"127.0.0.1:{free_port()}"

    async def scenario():
        client = TCPStoreClient(endpoint)
        with pytest.raises(StoreConnectionError) as raised:
            await client.connect(1.0)
        return str(raised.value)

    message = run(scenario())
    assert endpoint in message and "did not answer within 1s" in message


def test_the_client_waits_for_a_store_that_comes_up_late():
    port = free_port()
    servers: list[ServerProcess] = []
    timer = threading.Timer(0.5, lambda: servers.append(ServerProcess("127.0.0.1", port)))
    timer.start()

    async def scenario():
        client = TCPStoreClient(f"127.0.0.1:{port}")
        try:
            await client.connect(20.0)
            await client.set("k", b"v")
            return await client.get("k")
        finally:
            await client.close()

    try:
        assert asyncio.run(scenario()) == b"v"
    finally:
        timer.join()
        for server in servers:
            server.close()


def test_a_restarted_store_fails_one_call_then_the_client_reconnects():
    server = ServerProcess("127.0.0.1", 0)
    port = server.port

    async def scenario():
        nonlocal server
        client = TCPStoreClient(server.endpoint, timeout=5.0)
        try:
            await client.set("k", b"v")
            server.close()
            with pytest.raises(StoreConnectionError) as raised:
                await client.get("k")
            assert server.endpoint in str(raised.value)
            server = ServerProcess("127.0.0.1", port)
            assert await client.get("k") is None  # the data went with the old server
            await client.set("k", b"again")
            return await client.get("k")
        finally:
            await client.close()

    try:
        assert asyncio.run(scenario()) == b"again"
    finally:
        server.close()


def test_a_peer_that_is_not_a_tcpstore_is_an_error_not_a_hang():
    """An HTTP-ish server that answers the handshake with text."""

    async def scenario():
        async def liar(reader, writer):
            await reader.read(64)
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()

        fake = await asyncio.start_server(liar, "127.0.0.1", 0)
        port = fake.sockets[0].getsockname()[1]
        client = TCPStoreClient(f"127.0.0.1:{port}", timeout=2.0)
        try:
            with pytest.raises(StoreConnectionError):
                await client.get("k")
        finally:
            await client.close()
            fake.close()

    run(scenario())


def test_calls_queued_behind_a_stuck_one_keep_their_own_deadlines(store_host):
    """One connection, stuck on a silent store: three calls queue for it, and each ends at
    its own 2 s deadline (all within about 2 s), not one after the other (6 s)."""
    host, endpoint = store_host

    async def scenario():
        client = TCPStoreClient(endpoint, timeout=2.0, connections=1)
        try:
            await client.set("k", b"v")
            freeze(host.pid)
            started = time.monotonic()
            results = await asyncio.gather(
                *(client.get("k") for _ in range(3)), return_exceptions=True
            )
            return time.monotonic() - started, results
        finally:
            await client.close()

    took, results = run(scenario())
    assert all(isinstance(r, StoreTimeout) for r in results), results
    assert took < 4.0  # 6 s one after the other; 2 s of slack for a loaded machine


def test_a_write_given_up_never_lands_later_over_a_newer_one(store_host):
    """A 7 MiB set times out on a silent store with most of it still in the client's buffer;
    once the store answers again, a newer set must stay (the given-up bytes are dropped, not
    flushed behind the caller's back)."""
    host, endpoint = store_host

    async def scenario():
        client = TCPStoreClient(endpoint, timeout=1.0)
        try:
            await client.set("k", b"0")
            freeze(host.pid)
            with pytest.raises(StoreTimeout):
                await client.set("k", b"A" * (7 << 20))
            os.kill(host.pid, signal.SIGCONT)
            await client.set("k", b"B")
            await asyncio.sleep(1.0)  # time for a late write to land, if one were coming
            return await client.get("k")
        finally:
            await client.close()

    assert run(scenario()) == b"B"


def test_close_ends_a_call_whose_write_is_still_buffered(store_host):
    host, endpoint = store_host

    async def scenario():
        client = TCPStoreClient(endpoint, timeout=30.0)
        await client.set("k", b"0")
        freeze(host.pid)
        writing = asyncio.create_task(client.set("k", b"A" * (7 << 20)))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await client.close()
        with pytest.raises(StoreConnectionError):
            await writing
        return time.monotonic() - started

    assert run(scenario()) < 5  # at once, not at the call's 30 s deadline


def test_a_call_racing_close_fails_and_leaves_no_connection(server):
    async def scenario():
        client = TCPStoreClient(server.endpoint)
        racing = asyncio.create_task(client.set("k", b"v"))  # inside its connect
        await asyncio.sleep(0)
        await client.close()
        with pytest.raises(StoreConnectionError):
            await racing
        with pytest.raises(StoreConnectionError):
            await client.get("k")
        return client._open

    assert run(scenario()) == set()


def test_connect_retries_a_peer_that_breaks_off_the_handshake():
    """A store host that accepts and drops connections while it starts: connect keeps trying
    until a TCPStore answers there."""

    async def scenario():
        dropped = []

        async def drop(reader, writer):
            dropped.append(1)
            writer.close()

        fake = await asyncio.start_server(drop, "127.0.0.1", 0)
        port = fake.sockets[0].getsockname()[1]
        client = TCPStoreClient(f"127.0.0.1:{port}")

        async def then_a_real_store():
            async with asyncio.timeout(20):
                while len(dropped) < 2:
                    await asyncio.sleep(0.05)
            fake.close()
            await fake.wait_closed()
            return await asyncio.to_thread(ServerProcess, "127.0.0.1", port)

        swap = asyncio.create_task(then_a_real_store())
        try:
            await client.connect(20.0)
            await client.set("k", b"v")
            return len(dropped) >= 2, await client.get("k")
        finally:
            await client.close()
            swap.cancel()
            if not swap.cancelled() and swap.done() and swap.exception() is None:
                swap.result().close()

    assert asyncio.run(scenario()) == (True, b"v")


def test_a_peer_announcing_a_huge_value_is_refused_before_buffering_it():
    """A peer that passes the handshake, then announces a 8 EiB value and streams zeros."""

    async def scenario():
        async def hostile(reader, writer):
            await reader.readexactly(1 + 4 + 1 + 4)  # VALIDATE and PING
            writer.write(struct.pack("<I", os.getpid() & 0xFFFFFFFF))
            await reader.read(1 << 16)  # the request
            writer.write(struct.pack("<Q", 2**63))
            try:
                while True:
                    writer.write(b"\0" * (1 << 20))
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass

        fake = await asyncio.start_server(hostile, "127.0.0.1", 0)
        client = TCPStoreClient(f"127.0.0.1:{fake.sockets[0].getsockname()[1]}", timeout=3.0)
        try:
            with pytest.raises(StoreProtocolError, match="announced a value"):
                await client.get("k")
        finally:
            await client.close()
            fake.close()

    run(scenario())


def test_a_wait_queued_for_a_slot_still_ends_false_at_its_timeout(server):
    """One wait slot, two 1 s waits for a key that never comes: both return False (the second
    one's time in the queue counts against its own timeout, not against the store's)."""

    async def scenario():
        client = TCPStoreClient(server.endpoint, timeout=1.0, waits=1)
        try:
            return await asyncio.gather(
                client.wait_for("never", 1.0), client.wait_for("never", 1.0)
            )
        finally:
            await client.close()

    assert run(scenario()) == [False, False]
