"""The channel between the agent and an in-place job's workers, on real Unix sockets: the agent's
end (elasticd.shell.workerlink.WorkerLink) against the worker's end (elasticd.elastic.runtime.Channel)
and against workers that misbehave (the job's own code, or another local user)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from elasticd.elastic.runtime import Channel
from elasticd.shell.workerlink import _MAX_BUFFERED, Ready, WorkerLink

NOBODY = 65534
OTHER = 1  # "daemon": an unprivileged user who is not the job's
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root (other users)")


def run(coro: Any) -> Any:
    """One test's event loop, with a deadline so that a hang fails instead of blocking the suite."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, 8.0)

    return asyncio.run(bounded())


async def until(cond: Callable[[], bool], what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Linked:
    """A real WorkerLink listening in a short temporary directory, and what it reported."""

    def __init__(self, slots: int, uid: int, gid: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="wl-", dir="/tmp")
        os.chmod(self.dir, 0o755)  # other users may reach the socket; its own mode must stop them
        self.path = os.path.join(self.dir, "j.sock")
        self.readies: list[Ready] = []
        self.loop_errors: list[dict[str, Any]] = []
        self.link = WorkerLink(
            self.path, uid=uid, gid=gid, slots=slots, on_ready=self.readies.append
        )
        self.channels: list[Channel] = []
        self.aborts: list[int] = []
        self.raw: list[asyncio.StreamWriter] = []

    async def channel(self, slot: int, timeout: float = 3.0) -> Channel:
        """The real worker end, created off the loop (it connects and starts a reader thread)."""
        channel = await asyncio.to_thread(Channel, self.path, slot, self.aborts.append)
        self.channels.append(channel)
        await until(lambda: slot in self.link._writers, f"slot {slot} to say hello", timeout)
        return channel

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self.raw.append(writer)
        return reader, writer

    async def served(self, channel: Channel, slot: int, round: int) -> None:
        """``channel`` still works both ways: it gets a place and the agent hears its ask."""
        env = {"RANK": str(slot), "ROUND": str(round)}
        self.link.place(slot, round, env)
        assert await asyncio.to_thread(channel.place_after, round - 1, "interrupt") == (round, env)
        await until(
            lambda: Ready(slot, round - 1, "interrupt", "") in self.readies,
            f"the ask of slot {slot} after round {round - 1}",
        )
        assert self.link.asked(slot) == round - 1


@contextlib.asynccontextmanager
async def linked(
    slots: int = 2, uid: int | None = None, gid: int | None = None
) -> AsyncIterator[Linked]:
    h = Linked(slots, os.getuid() if uid is None else uid, os.getgid() if gid is None else gid)
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: h.loop_errors.append(ctx))
    assert len(h.path.encode()) < 100
    h.link.bind()
    serving = asyncio.create_task(h.link.serve())
    try:
        yield h
    finally:
        for writer in h.raw:
            writer.close()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await h.link.close()  # closes the workers' writers: a blocked place_after ends
        for channel in h.channels:
            with contextlib.suppress(OSError):
                channel._sock.shutdown(socket.SHUT_RDWR)
            channel._sock.close()
        shutil.rmtree(h.dir, ignore_errors=True)


async def closed_by_agent(reader: asyncio.StreamReader) -> bool:
    """Read until the agent closes the connection (EOF or reset); time out if it never does."""

    async def drain() -> None:
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(1 << 16):
                pass

    await asyncio.wait_for(drain(), 3.0)
    return True


def line(doc: Any) -> bytes:
    return json.dumps(doc).encode() + b"\n"


# -- the round trip with the worker's real end ------------------------------------------------


def test_round_trip_with_the_real_channel():
    async def main() -> None:
        async with linked(slots=2) as h:
            link = h.link
            assert link.asked(0) == -2
            env0 = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
            link.place(0, 3, env0)  # before the worker connected: delivered at its hello
            channel = await h.channel(0)
            assert await asyncio.to_thread(channel.place_after, -1, "start") == (3, env0)
            await until(lambda: h.readies == [Ready(0, -1, "start", "")], "the first ask")
            assert link.asked(0) == -1 and link.asked(1) == -2

            # place_after blocks until the agent has a place in a newer round
            asking = asyncio.ensure_future(
                asyncio.to_thread(channel.place_after, 3, "failure", "gloo: connection closed")
            )
            await until(lambda: link.asked(0) == 3, "the second ask")
            assert not asking.done()
            assert h.readies[-1] == Ready(0, 3, "failure", "gloo: connection closed")
            env5 = {"RANK": "1", "WORLD_SIZE": "3"}
            link.place(0, 5, env5)
            assert await asyncio.wait_for(asking, 3.0) == (5, env5)

            link.announce(6, added=True)
            await until(lambda: channel.announced == 6, "the announcement")
            assert channel.added is True
            link.announce(7, added=False)
            await until(lambda: channel.announced == 7, "the second announcement")
            assert channel.added is False
            assert channel.aborted == -1 and h.aborts == []

            link.abort(7)
            await until(lambda: h.aborts == [7], "on_abort")
            assert channel.aborted == 7

            await h.served(channel, 0, 8)

            # a new worker takes the slot: the old one's asks and its connection are void
            link.forget(0)
            assert link.asked(0) == -2 and 0 not in link._writers
            await until(lambda: channel.closed, "the forgotten worker to see its channel close")
            with pytest.raises(ConnectionError):
                await asyncio.to_thread(channel.place_after, 8, "interrupt")
            assert h.loop_errors == []

    run(main())


def test_a_worker_that_says_hello_after_a_round_without_its_slot_gets_no_stale_place():
    """A member placed none of its workers in round 4 (they were still warming up): a worker
    that connects then must not form round 3, whose peers are gone; it waits for a place."""

    async def main() -> None:
        async with linked(slots=2) as h:
            h.link.place_round(3, {0: {"RANK": "0"}, 1: {"RANK": "1"}})
            h.link.place_round(4, {1: {"RANK": "0"}})  # round 4 holds slot 1 only
            channel = await h.channel(0)
            asking = asyncio.ensure_future(asyncio.to_thread(channel.place_after, -1, "start"))
            await until(lambda: h.link.asked(0) == -1, "the ask")
            assert not asking.done() and h.link._places.keys() == {1}
            h.link.place(0, 5, {"RANK": "2"})
            assert await asyncio.wait_for(asking, 3.0) == (5, {"RANK": "2"})

    run(main())


def test_a_ready_error_is_cut_to_2000_characters():
    async def main() -> None:
        async with linked(slots=1) as h:
            _reader, writer = await h.connect()
            writer.write(
                line({"op": "hello", "slot": 0})
                + line({"op": "ready", "round": 4, "why": "failure", "error": "e" * 5000})
            )
            await until(lambda: h.readies, "the ask")
            assert h.readies == [Ready(0, 4, "failure", "e" * 2000)]

    run(main())


# -- who may connect ----------------------------------------------------------------------------

_CLIENT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("PermissionError")
    sys.exit(0)
s.settimeout(5)
data = b""
try:
    s.sendall(b'{"op": "hello", "slot": 0}\n')
except (BrokenPipeError, ConnectionResetError):  # the agent closed it at once
    print("EOF")
    sys.exit(0)
while not data.endswith(b"\n"):
    try:
        chunk = s.recv(65536)
    except ConnectionResetError:
        chunk = b""
    if not chunk:
        print("EOF")
        sys.exit(0)
    data += chunk
print(data.decode().strip())
"""


# a system interpreter: the venv's may live where other users cannot reach (/root)
_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
needs_python = pytest.mark.skipif(_PYTHON is None, reason="no python3 other users can run")


def client_as(uid: int, path: str) -> str:
    """Connect to ``path`` as ``uid``, say hello for slot 0, return what came back."""
    done = subprocess.run(
        [_PYTHON, "-c", _CLIENT, path],
        user=uid,
        group=uid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=7,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@as_root
def test_the_socket_is_0600_and_owned_by_the_jobs_user():
    async def main() -> None:
        async with linked(uid=NOBODY, gid=NOBODY) as h:
            info = os.stat(h.path)
            assert stat.S_ISSOCK(info.st_mode)
            assert stat.S_IMODE(info.st_mode) == 0o600
            assert (info.st_uid, info.st_gid) == (NOBODY, NOBODY)

    run(main())


@as_root
@needs_python
def test_the_jobs_user_may_connect_another_user_may_not():
    async def main() -> None:
        async with linked(uid=NOBODY, gid=NOBODY) as h:
            # the job's user reaches the socket through the same directory, says hello, gets a place
            job = asyncio.ensure_future(asyncio.to_thread(client_as, NOBODY, h.path))
            await until(lambda: 0 in h.link._writers, "the job's user to say hello", timeout=5)
            h.link.place(0, 2, {"RANK": "0"})
            assert json.loads(await asyncio.wait_for(job, 7)) == {
                "op": "place",
                "round": 2,
                "env": {"RANK": "0"},
            }

            assert await asyncio.to_thread(client_as, OTHER, h.path) == "PermissionError"
            assert h.link._connections == 0 and h.readies == []

    run(main())


@as_root
@needs_python
def test_another_user_is_refused_even_when_the_mode_lets_it_in():
    """The peer's credentials are checked too (belt and braces: the mode could be wrong)."""

    async def main() -> None:
        async with linked(uid=NOBODY, gid=NOBODY) as h:
            os.chmod(h.path, 0o666)
            assert await asyncio.to_thread(client_as, OTHER, h.path) == "EOF"
            assert 0 not in h.link._writers
            await until(lambda: h.link._connections == 0, "the stranger's connection to end")
            channel = await h.channel(0)  # the agent keeps serving
            await h.served(channel, 0, 1)

    run(main())


# -- what a misbehaving worker can do -------------------------------------------------------------

MALFORMED = {
    "bad json": b"{not json\n",
    "json array": b"[1, 2]\n",
    "json string": b'"hello"\n',
    "not utf-8": b"\xff\xfe\n",
    "too deeply nested": b"[" * 5000 + b"\n",
    "huge number": b'{"op": "hello", "slot": ' + b"9" * 5000 + b"}\n",
    "unknown op": line({"op": "shutdown"}),
    "no op": line({"slot": 1}),
    "hello slot out of range": line({"op": "hello", "slot": 2}),
    "hello slot negative": line({"op": "hello", "slot": -1}),
    "hello slot bool": line({"op": "hello", "slot": True}),
    "hello slot string": line({"op": "hello", "slot": "1"}),
    "hello slot float": line({"op": "hello", "slot": 1.0}),
    "hello without slot": line({"op": "hello"}),
    "hello twice": line({"op": "hello", "slot": 1}) * 2,
    "ready before hello": line({"op": "ready", "round": 1, "why": "start", "error": ""}),
    "ready round string": line({"op": "hello", "slot": 1})
    + line({"op": "ready", "round": "1", "why": "start"}),
    "ready round missing": line({"op": "hello", "slot": 1}) + line({"op": "ready", "why": "start"}),
    "ready round float": line({"op": "hello", "slot": 1})
    + line({"op": "ready", "round": 1.5, "why": "start"}),
    "ready why unknown": line({"op": "hello", "slot": 1})
    + line({"op": "ready", "round": 1, "why": "whatever"}),
    "ready why list": line({"op": "hello", "slot": 1})
    + line({"op": "ready", "round": 1, "why": ["start"]}),
    "ready error not text": line({"op": "hello", "slot": 1})
    + line({"op": "ready", "round": 1, "why": "failure", "error": 5}),
    "line over 64 KiB": b"a" * (65 * 1024),
    "hello then line over 64 KiB": line({"op": "hello", "slot": 1}) + b" " * (65 * 1024) + b"\n",
}


@pytest.mark.parametrize("payload", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_closes_only_that_connection(payload):
    async def main() -> None:
        async with linked(slots=2) as h:
            good = await h.channel(0)
            reader, writer = await h.connect()
            with contextlib.suppress(ConnectionError):
                writer.write(payload)
                await writer.drain()
            assert await closed_by_agent(reader)
            await until(lambda: h.link._connections == 1, "the bad connection to end")
            assert 1 not in h.link._writers
            assert h.link.asked(1) == -2 and h.readies == []
            assert h.loop_errors == []  # handled, not an exception escaping to the loop
            await h.served(good, 0, 1)  # the well-behaved worker is still served
            assert not good.closed

    run(main())


def test_connections_beyond_the_limit_are_refused():
    async def main() -> None:
        async with linked(slots=2) as h:  # at most 2 * 2 + 4 = 8 connections
            good = await h.channel(0)
            idle = [await h.connect() for _ in range(7)]
            await until(lambda: h.link._connections == 8, "8 connections")

            reader, writer = await h.connect()
            writer.write(line({"op": "hello", "slot": 1}))
            assert await closed_by_agent(reader)
            assert 1 not in h.link._writers
            await until(lambda: h.link._connections == 8, "the 9th connection to end")
            await h.served(good, 0, 1)

            idle[0][1].close()  # one gone: a newcomer fits again
            await until(lambda: h.link._connections == 7, "an idle connection to end")
            late = await h.channel(1)
            await h.served(late, 1, 1)

    run(main())


def test_a_worker_that_does_not_read_is_cut_off():
    async def main() -> None:
        async with linked(slots=2) as h:
            good = await h.channel(1)
            stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                stuck.connect(h.path)
                stuck.sendall(line({"op": "hello", "slot": 0}))  # ... and never reads
                await until(lambda: 0 in h.link._writers, "the stuck worker's hello")
                writer = h.link._writers[0]
                big = {"BLOB": "x" * 32768}
                message = len(line({"op": "place", "round": 10**6, "env": big}))
                started = time.monotonic()
                for round in range(1000):
                    h.link.place(0, round, big)
                    h.link.announce(round, added=True)
                    if 0 not in h.link._writers:
                        break
                    assert writer.transport.get_write_buffer_size() <= _MAX_BUFFERED + 2 * message
                    await asyncio.sleep(0)  # the loop keeps flushing to the good worker
                assert 0 not in h.link._writers, "never cut off"
                assert time.monotonic() - started < 2.0
                assert writer.is_closing()
                held = writer.transport.get_write_buffer_size()
                assert held <= _MAX_BUFFERED + 2 * message
                for later in range(round + 1, round + 50):  # nothing more is queued for it
                    h.link.place(0, later, big)
                    h.link.announce(later, added=False)
                assert writer.transport.get_write_buffer_size() <= held
                assert 0 not in h.link._writers

                # the others are still told everything
                await until(lambda: good.announced == later, "the good worker's notices")
                await h.served(good, 1, later + 1)

                # the stuck worker, once it reads, finds its channel closed
                def read_to_end() -> bool:
                    stuck.settimeout(3.0)
                    try:
                        while stuck.recv(1 << 16):
                            pass
                    except ConnectionResetError:
                        pass
                    return True

                assert await asyncio.to_thread(read_to_end)
                await until(lambda: h.link._connections == 1, "the stuck connection to end")
            finally:
                stuck.close()
            assert h.loop_errors == []

    run(main())


def test_a_second_hello_for_a_slot_replaces_the_first():
    async def main() -> None:
        async with linked(slots=2) as h:
            old = await h.channel(0)
            old_writer = h.link._writers[0]
            new = await asyncio.to_thread(Channel, h.path, 0, h.aborts.append)
            h.channels.append(new)
            await until(lambda: h.link._writers.get(0) not in (None, old_writer), "the new hello")
            await until(lambda: old.closed, "the old connection to close")
            await until(lambda: h.link._connections == 1, "the old connection to end")
            assert h.link._writers[0] is not old_writer  # the old one's end did not drop the new
            await h.served(new, 0, 1)
            h.link.abort(2)
            await until(lambda: new.aborted == 2, "the abort")
            assert old.aborted == -1 and h.aborts == [2]

    run(main())


# -- the socket file --------------------------------------------------------------------------


def test_close_removes_the_socket_and_open_replaces_a_stale_one():
    async def main() -> None:
        directory = tempfile.mkdtemp(prefix="wl-", dir="/tmp")
        path = os.path.join(directory, "j.sock")
        try:
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stale.bind(path)  # a previous daemon's socket, left behind
            stale.close()
            with pytest.raises(ConnectionRefusedError):
                socket.socket(socket.AF_UNIX).connect(path)

            readies: list[Ready] = []
            link = WorkerLink(
                path, uid=os.getuid(), gid=os.getgid(), slots=1, on_ready=readies.append
            )
            link.bind()
            serving = asyncio.create_task(link.serve())
            info = os.stat(path)
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
            channel = await asyncio.to_thread(Channel, path, 0, lambda r: None)
            try:
                link.place(0, 1, {"RANK": "0"})
                assert await asyncio.to_thread(channel.place_after, -1, "start") == (
                    1,
                    {"RANK": "0"},
                )
                await until(lambda: readies == [Ready(0, -1, "start", "")], "the ask")

                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)
                await link.close()
                assert not os.path.exists(path)
                await until(lambda: channel.closed, "the worker to see the agent go")
                with pytest.raises(FileNotFoundError):
                    socket.socket(socket.AF_UNIX).connect(path)
            finally:
                channel._sock.close()

            # a stale regular file (not a socket) is replaced as well
            with open(path, "w") as f:
                f.write("junk")
            again = WorkerLink(
                path, uid=os.getuid(), gid=os.getgid(), slots=1, on_ready=readies.append
            )
            serving = asyncio.create_task(again.serve())
            await until(lambda: stat.S_ISSOCK(os.stat(path).st_mode), "the socket")
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await again.close()
            assert not os.path.exists(path)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    run(main())


# -- a worker that writes as fast as it can ------------------------------------------------------


def test_the_bucket_allows_a_burst_then_the_rate():
    from elasticd.shell.workerlink import Bucket

    bucket = Bucket(rate=10.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.1)  # the 4th waits for a token
    assert bucket.take(0.0) == pytest.approx(0.2)  # and the one taken ahead counts
    assert bucket.take(0.3) == pytest.approx(0.0, abs=1e-9)  # paid back by waiting
    assert bucket.take(10.0) == 0.0  # refilled, to the burst at most
    assert [bucket.take(10.0) for _ in range(2)] == [0.0, 0.0] and bucket.take(10.0) > 0


def flood(path: str, slot: int, stop: float) -> tuple[int, str]:
    """A worker that says hello and then writes `ready` as fast as the socket takes it, until
    the agent closes the connection or ``stop`` seconds passed; (lines sent, how it ended)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(0.2)
    sock.sendall(line({"op": "hello", "slot": slot}))
    ready = line({"op": "ready", "round": -1, "why": "start", "error": ""})
    sent, ends = 0, time.monotonic() + stop
    try:
        while time.monotonic() < ends:
            try:
                sock.sendall(ready * 64)
                sent += 64
            except TimeoutError:  # the agent stopped reading: slowed
                continue
        return sent, "never closed"
    except (BrokenPipeError, ConnectionResetError):
        return sent, "closed"
    finally:
        sock.close()


def test_a_flooding_worker_is_slowed_then_cut_off_and_the_others_are_served(monkeypatch):
    """Four workers wrote `ready` lines as fast as they could (431,000 in 40 s, the daemon at
    72% CPU): the flooder's lines beyond the rate wait unread, then its connection is closed;
    a well-behaved worker of the same job is served throughout."""
    from elasticd.shell import workerlink

    monkeypatch.setattr(workerlink, "LINES_PER_SECOND", 50.0)
    monkeypatch.setattr(workerlink, "PATIENCE", 25)

    async def main() -> None:
        async with linked(slots=2) as h:
            good = await h.channel(0)
            started = time.monotonic()
            flooding = asyncio.ensure_future(asyncio.to_thread(flood, h.path, 1, 5.0))
            await h.served(good, 0, 1)  # while it floods
            sent, ended = await asyncio.wait_for(flooding, 7.0)
            took = time.monotonic() - started
            heard = [r for r in h.readies if r.slot == 1]
            assert ended == "closed" and h.link.cut_off == 1
            assert sent > 10 * len(heard)  # most of what it wrote was never read
            # at most the burst, the rate while it lasted, and the patience it used up
            assert len(heard) <= workerlink.LINE_BURST + 50.0 * took + 25 + 1
            await h.served(good, 0, 2)
            assert not good.closed and h.loop_errors == []

    run(main())


def test_connecting_in_a_loop_is_paced():
    """The job's user may connect and hang up in a loop: beyond a burst of 2 * slots + 4,
    the agent accepts one connection per slot a second; the rest wait in the backlog (so a
    user who churns delays its own job's workers, nobody else's)."""

    async def main() -> None:
        async with linked(slots=2) as h:  # a burst of 8, then 2 a second

            def churn(seconds: float) -> int:
                done, ends = 0, time.monotonic() + seconds
                while time.monotonic() < ends:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(0.2)
                    try:
                        sock.connect(h.path)
                        done += 1
                    except OSError:  # the backlog is full: connect waits, or fails
                        pass
                    finally:
                        sock.close()
                return done

            started = time.monotonic()
            connects = await asyncio.to_thread(churn, 1.5)
            took = time.monotonic() - started
            assert h.link.accepted <= 8 + 2 * took + 1, (h.link.accepted, connects)
            channel = await h.channel(0, timeout=20)  # once the backlog drained, it gets in
            await h.served(channel, 0, 1)

    async def bounded() -> None:
        await asyncio.wait_for(main(), 30.0)

    asyncio.run(bounded())
