"""The checkpoint tier's bulk port (docs/security.md, "Between daemons"): the real TierServer
and TierLinks on loopback, with the daemon's own ZAP handler admitting one known node.

- a transfer goes over the bulk port, sealed: the bytes arrive whole, and what crosses the
  wire is not them;
- what does not open under a live session's key is refused unread and the server keeps
  serving: no session, a forged or flipped byte, a replayed or reordered message, a session
  that its node opened too many after;
- a node without the bulk port (an older daemon) is still reached, over CURVE.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import json
import os
import sys
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
import zmq.asyncio
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from tier_nodes import OneNode, Record

from elasticd.cluster import tierlink
from elasticd.cluster.peers import curve_policy
from elasticd.control.server import Zap
from elasticd.errors import CheckpointsFull

DATA = os.urandom(3 * tierlink.CHUNK + 12345)  # four chunks, the last one short


class FileTier:
    """The server's side of the tier for one owner's file: what it read and was given."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str, int, bytes]] = []

    def read(self, job: str, owner: str, ckpt: str, name: str, offset: int, length: int) -> bytes:
        return DATA[offset : offset + length]

    def size(self, job: str, owner: str, ckpt: str, name: str) -> int:
        return len(DATA)

    def receive(self, peer: str, job: str, ckpt: str, name: str, offset: int, data: bytes,
                facts: Any) -> None:  # fmt: skip
        self.received.append((peer, name, offset, bytes(data)))

    def drop(self, peer: str, job: str, ckpt: str) -> None:
        self.received.append((peer, "drop", 0, b""))


@dataclass
class Rig:
    ctx: zmq.asyncio.Context
    server: tierlink.TierServer
    tier: FileTier
    links: tierlink.TierLinks
    public: bytes  # the known node's CURVE key pair
    secret: bytes
    server_key: bytes


@asynccontextmanager
async def rig(
    *, bulk: bool = True, on_fault: Callable[[str, str], None] | None = None
) -> AsyncIterator[Rig]:
    ctx = zmq.asyncio.Context()
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    zap = Zap(ctx)
    zap.add(tierlink.TIER_DOMAIN, curve_policy(lambda: {public: "node-a"}))
    tier = FileTier()
    server = tierlink.TierServer(
        ctx,
        "tcp://127.0.0.1:*",
        tier,  # type: ignore[arg-type]
        curve_secret=server_secret,
        bulk_endpoint="tcp://127.0.0.1:*" if bulk else None,  # None: as before the bulk port
        on_fault=on_fault,
    )
    server.bind()
    if bulk:
        server.bind_bulk()
    links = tierlink.TierLinks(
        ctx, public, secret, OneNode(Record(server.endpoint, server_public.decode())), timeout=5.0
    )
    try:
        async with asyncio.TaskGroup() as tasks:
            serving = [tasks.create_task(zap.serve()), tasks.create_task(server.serve())]
            try:
                yield Rig(ctx, server, tier, links, public, secret, server_public)
            finally:
                for task in serving:
                    task.cancel()
    finally:
        server.close()
        zap.close()
        ctx.destroy(linger=0)


async def _open_session(r: Rig) -> tuple[bytes, AESGCM, str]:
    """A session opened as the known node would, over CURVE: its id, key and bulk port."""
    sock = r.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = (
        r.secret,
        r.public,
        r.server_key,
    )
    sock.connect(r.server.endpoint)
    try:
        await sock.send_multipart([json.dumps({"op": "open", "id": "o"}).encode()])
        assert await sock.poll(10_000)
        reply = json.loads((await sock.recv_multipart())[0])
    finally:
        sock.close(linger=0)
    assert reply["ok"], reply
    return (
        bytes.fromhex(reply["session"]),
        AESGCM(base64.b64decode(reply["key"])),
        reply["bulk"],
    )


def _sealed(session: bytes, aead: AESGCM, counter: int, header: dict[str, Any], data: bytes) -> list[bytes]:  # fmt: skip
    head = session + counter.to_bytes(8, "big")
    frames = [json.dumps({**header, "id": str(counter)}).encode(), *([data] if data else [])]
    return [head, *(aead.encrypt(_nonce(0, i, counter), f, head) for i, f in enumerate(frames))]


def _nonce(direction: int, frame: int, counter: int) -> bytes:
    return bytes((direction, frame, 0, 0)) + counter.to_bytes(8, "big")


async def _ask(sock: zmq.asyncio.Socket, frames: list[bytes]) -> list[bytes]:
    await sock.send_multipart(frames)
    assert await sock.poll(10_000), "no answer: the server stopped serving"
    return await sock.recv_multipart()


def _bulk_socket(r: Rig, endpoint: str) -> zmq.asyncio.Socket:
    sock = r.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


PUT = {"op": "put", "job": "j-000001", "ckpt": "step-1", "name": "f", "offset": 0}


def test_a_fetch_and_a_send_go_over_the_bulk_port_whole(tmp_path: Any) -> None:
    async def main() -> None:
        async with rig() as r:
            into = os.open(tmp_path / "fetched", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                facts = await r.links.fetch(
                    "node-s", "j-000001", "node-s", "step-1", "f", into, size=len(DATA)
                )
                ranged = await r.links.fetch(
                    "node-s", "j-000001", "node-s", "step-1", "g", into, [(5, 100), (9000, 7)]
                )
            finally:
                os.close(into)
            assert facts is not None and ranged is None
            assert facts.size == len(DATA)
            assert facts.sha256 == hashlib.sha256(DATA).hexdigest()
            assert (tmp_path / "fetched").read_bytes() == DATA
            source = tmp_path / "share"
            source.write_bytes(DATA[:5_000_000])
            with open(source, "rb") as f:
                sent = await r.links.send("node-s", "j-000001", "step-1", "f", f)
            assert sent.sha256 == hashlib.sha256(DATA[:5_000_000]).hexdigest()
            assert b"".join(d for _, _, _, d in r.tier.received) == DATA[:5_000_000]
            assert {peer for peer, *_ in r.tier.received} == {"node-a"}  # named by its key
            assert r.server.sessions == 3  # one a transfer: it went over the bulk port
            await r.links.drop("node-s", "j-000001", "step-1")
            assert r.tier.received[-1] == ("node-a", "drop", 0, b"")
            assert r.server.sessions == 3  # no bytes: over CURVE, no session opened for it

    asyncio.run(main())


def test_a_whole_file_its_holder_holds_at_another_size_is_refused_before_a_byte(
    tmp_path: Any,
) -> None:
    """The job's own processes on the holder may truncate a file described already to any
    size, sparse (it costs them nothing): the fetching node compares the size the holder
    answers with the manifest's before it asks for a byte, and builds nothing as large as
    that size meanwhile."""
    held = tmp_path / "held"
    held.write_bytes(DATA)
    os.truncate(held, 1 << 40)  # a terabyte, in no block

    async def main() -> None:
        async with rig() as r:
            asked: list[tuple[Any, ...]] = []
            r.tier.size = lambda *args: os.stat(held).st_size  # type: ignore[method-assign]
            r.tier.read = lambda *args: asked.append(args) or b""  # type: ignore[method-assign]
            into = os.open(tmp_path / "fetched", os.O_RDWR | os.O_CREAT, 0o600)
            tracemalloc.start()
            try:
                with pytest.raises(tierlink.TierError) as refused:
                    await asyncio.wait_for(
                        r.links.fetch(
                            "node-s", "j-000001", "node-s", "step-1", "f", into, size=len(DATA)
                        ),
                        10.0,
                    )
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
                os.close(into)
            assert f"holds {1 << 40} bytes of step-1/f, its manifest says {len(DATA)}" in str(
                refused.value
            )
            assert asked == [] and os.path.getsize(tmp_path / "fetched") == 0
            assert peak < 1 << 20  # one (offset, length) per 4 MiB of a terabyte: 20 MB

    asyncio.run(main())


def test_what_crosses_the_bulk_port_is_sealed() -> None:
    async def main() -> None:
        async with rig() as r:
            session, aead, bulk = await _open_session(r)
            sock = _bulk_socket(r, bulk)
            get = {**PUT, "op": "get", "owner": "node-s", "length": 4096}
            reply = await _ask(sock, _sealed(session, aead, 1, get, b""))
            assert DATA[:4096] not in b"".join(reply)  # not in clear
            head = reply[0]
            opened = [aead.decrypt(_nonce(1, i, 1), f, head) for i, f in enumerate(reply[1:])]
            assert json.loads(opened[0])["ok"] and opened[1] == DATA[:4096]
            sock.close(linger=0)

    asyncio.run(main())


def test_what_does_not_open_under_a_live_session_is_refused_unread() -> None:
    async def main() -> None:
        async with rig() as r:
            session, aead, bulk = await _open_session(r)
            sock = _bulk_socket(r, bulk)
            chunk = b"c" * 1000

            async def refused(frames: list[bytes]) -> str:
                reply = await _ask(sock, frames)
                assert reply[1] == b"", reply  # said in clear: nothing was opened
                return reply[2].decode()

            # no such session (a stranger who never opened one)
            stranger = _sealed(os.urandom(16), AESGCM(AESGCM.generate_key(256)), 1, PUT, chunk)
            assert "no such session" in await refused(stranger)
            # a session's id with another key (the id crosses the wire in clear)
            forged = _sealed(session, AESGCM(AESGCM.generate_key(256)), 1, PUT, chunk)
            assert "not sealed" in await refused(forged)
            # one bit of the sealed data flipped, and a data frame from another message
            good = _sealed(session, aead, 1, PUT, chunk)
            flipped = [*good[:2], bytes([good[2][0] ^ 1]) + good[2][1:]]
            assert "not sealed" in await refused(flipped)
            swapped = [*good[:2], _sealed(session, aead, 2, PUT, chunk)[2]]
            assert "not sealed" in await refused(swapped)
            assert r.tier.received == []
            # the good one is taken once; replayed, and one with a lower counter, refused
            reply = await _ask(sock, good)
            assert reply[1] != b"" and r.tier.received == [("node-a", "f", 0, chunk)]
            assert "replayed" in await refused(good)
            higher = _sealed(session, aead, 7, PUT, chunk)
            assert (await _ask(sock, higher))[1] != b""
            assert "replayed" in await refused(_sealed(session, aead, 5, PUT, chunk))
            assert len(r.tier.received) == 2
            # garbage of every shape: refused or ignored, and the server goes on
            for frames in ([b"x"], [b"", b"", b"", b"", b""]):  # not a message: no answer
                await sock.send_multipart(frames)
            assert "no such session" in await refused([b"short", b"x"])
            assert "no such session" in await refused([session, b"x"])  # with no counter
            assert (await _ask(sock, _sealed(session, aead, 8, PUT, chunk)))[1] != b""
            sock.close(linger=0)

    asyncio.run(main())


def test_a_node_that_opens_too_many_sessions_loses_the_one_it_used_longest_ago() -> None:
    """Not the oldest: a long transfer keeps the session it opened first in use."""

    async def main() -> None:
        async with rig() as r:
            first, first_aead, bulk = await _open_session(r)
            second, second_aead, _ = await _open_session(r)
            sock = _bulk_socket(r, bulk)
            assert (await _ask(sock, _sealed(first, first_aead, 1, PUT, b"x")))[1] != b""
            for _ in range(tierlink.SESSIONS_PER_NODE - 1):
                latest, latest_aead, _ = await _open_session(r)
            assert r.server.sessions == tierlink.SESSIONS_PER_NODE
            reply = await _ask(sock, _sealed(second, second_aead, 1, PUT, b"x"))
            assert reply[1] == b"" and b"no such session" in reply[2]
            assert (await _ask(sock, _sealed(first, first_aead, 2, PUT, b"x")))[1] != b""
            assert (await _ask(sock, _sealed(latest, latest_aead, 1, PUT, b"x")))[1] != b""
            sock.close(linger=0)

    asyncio.run(main())


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "ranges"])
def test_a_node_without_the_bulk_port_is_reached_over_curve(tmp_path: Any, whole: bool) -> None:
    async def main() -> None:
        async with rig(bulk=False) as r:
            into = os.open(tmp_path / "fetched", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                ranges = None if whole else [(0, len(DATA))]
                await r.links.fetch(
                    "node-s", "j-000001", "node-s", "step-1", "f", into, ranges, size=len(DATA)
                )
            finally:
                os.close(into)
            assert (tmp_path / "fetched").read_bytes() == DATA
            assert r.server.sessions == 0

    asyncio.run(main())


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "curve"])
def test_a_send_refused_for_space_says_so_apart_from_other_refusals(
    tmp_path: Any, bulk: bool
) -> None:
    """A node whose tier for the job is full refuses a copy with TierFull (a CheckpointsFull:
    sending it again as it is does not help); any other refusal stays a plain TierError."""

    async def main() -> None:
        async with rig(bulk=bulk) as r:
            source = tmp_path / "share"
            source.write_bytes(DATA[:1000])
            for error, refused in (
                (OSError(errno.ENOSPC, "No space left on device"), tierlink.TierFull),
                (OSError(errno.EDQUOT, "Disk quota exceeded"), tierlink.TierFull),
                (OSError(errno.EACCES, "Permission denied"), tierlink.TierError),
            ):

                def receive(*args: Any, error: OSError = error) -> None:
                    raise error

                r.tier.receive = receive  # type: ignore[method-assign]
                with open(source, "rb") as f, pytest.raises(tierlink.TierError) as caught:
                    await r.links.send("node-s", "j-000001", "step-1", "f", f)
                assert type(caught.value) is refused, caught.value
                assert isinstance(caught.value, CheckpointsFull) == (refused is tierlink.TierFull)
                assert error.strerror in str(caught.value)

    asyncio.run(main())


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "curve"])
def test_a_request_the_server_fails_on_is_answered_and_the_port_serves_on(
    tmp_path: Any, bulk: bool
) -> None:
    """A bug in the tier, or a header no check foresaw (a seal's size that is no number): the
    asker is told at once, not left to its timeout; the fault is reported with its exception;
    the next request is served (the server used to end, and serve again a second later)."""
    faults: list[tuple[str, str, type[BaseException] | None]] = []

    async def main() -> None:
        async with rig(
            bulk=bulk,
            on_fault=lambda loop, detail: faults.append((loop, detail, sys.exc_info()[0])),
        ) as r:
            source = tmp_path / "share"
            source.write_bytes(DATA[:1000])

            def receive(*args: Any) -> None:
                raise KeyError("a bug")

            good, r.tier.receive = r.tier.receive, receive  # type: ignore[method-assign]
            with open(source, "rb") as f, pytest.raises(tierlink.TierError, match="its log"):
                await r.links.send("node-s", "j-000001", "step-1", "f", f)
            assert faults == [("tier", "'put' from node-a", KeyError)]
            r.tier.receive = good  # type: ignore[method-assign]
            async with r.links._session("node-s", bulk=bulk) as session:
                with pytest.raises(tierlink.TierError, match="seal"):
                    await session.call({**PUT, "seal": [{"a": 1}, "x"]}, b"x")
            assert len(faults) == 1 and r.tier.received == []  # checked, not a fault
            with open(source, "rb") as f:
                await r.links.send("node-s", "j-000001", "step-1", "f", f)
            assert b"".join(d for _, _, _, d in r.tier.received) == DATA[:1000]

    asyncio.run(main())


def test_a_transfer_cancelled_while_it_opens_its_session_leaves_no_socket_open(
    tmp_path: Any,
) -> None:
    """A node that never answers (lost, frozen): the transfer, cancelled while it waits for
    its session, closes its socket, or the context's term (the daemon's stop) would wait
    for it without end."""

    async def main() -> tuple[zmq.asyncio.Context, Any]:
        ctx = zmq.asyncio.Context()
        silent = ctx.socket(zmq.ROUTER)  # takes the connection, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        public, secret = zmq.curve_keypair()
        server_public, _ = zmq.curve_keypair()
        record = Record(f"tcp://127.0.0.1:{port}", server_public.decode())
        links = tierlink.TierLinks(ctx, public, secret, OneNode(record), timeout=30.0)
        into = os.open(tmp_path / "fetched", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fetch = asyncio.create_task(
                links.fetch("node-s", "j-000001", "node-s", "step-1", "f", into, size=1)
            )
            await asyncio.sleep(0.5)
            fetch.cancel()
            with pytest.raises(asyncio.CancelledError) as cancelled:
                await fetch
        finally:
            os.close(into)
            silent.close(linger=0)
        # kept, as a daemon may keep an error: its traceback holds the transfer's frames
        return ctx, cancelled.value

    ctx, kept = asyncio.run(main())
    ended = threading.Thread(target=ctx.term, daemon=True)
    ended.start()
    ended.join(10)
    if ended.is_alive():
        ctx.destroy(linger=0)  # closes the leaked socket: the thread's term returns
        ended.join(10)
        pytest.fail("a socket of the cancelled transfer was left open")
    del kept
