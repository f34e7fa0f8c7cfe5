"""The checkpoint tier's data plane between daemons: bulk bytes, authenticated and sealed.

Each daemon serves a ROUTER on ``tcp://<node address>:<tier port>`` (its endpoint travels in
its signed node record, beside the peer channel's), with the peer channel's key pair and the
same admission: a client is admitted only if its CURVE key is a known node's, and its node
name comes from that key, so a node can neither claim another's name nor send as one.  A
message is two frames: a JSON header and, for a chunk, its raw bytes (no base64: a
checkpoint is gigabytes).  It is apart from the peer channel so that a checkpoint in flight
never queues in front of a probe or a log request.

CURVE (XSalsa20-Poly1305 in ZeroMQ's one I/O thread) moves about 600 MiB/s on a core, a
tenth of what a data-centre NIC carries, so the bytes themselves take a second socket, the
*bulk* port: a client opens a session over CURVE (``open``), which gives it a fresh random
AES-256-GCM key (over CURVE, so only that admitted node has it) and the bulk endpoint.  On
the bulk port every message is the session id and a counter in clear, then the header and
the data, each sealed with the session's key (AES-GCM, several GB/s with AES-NI; the nonce
is the direction, the frame and the counter, the clear part its associated data).  The
server takes only counters above the session's last, so a replayed or reordered message is
refused, and anything that does not open under a live session's key is refused unread.  A
session ends when idle for ``SESSION_IDLE`` seconds or when its node opens too many (the one
it used longest ago goes).  A ``drop`` carries no bytes: it goes over CURVE alone.  A
server without the bulk port (an older daemon) answers ``open`` with an unknown op: the
client then sends everything over CURVE, as before.

- ``put`` (job, ckpt, name, offset, seal): a chunk of the caller's own file, kept by the
  receiver as a copy of the caller's share; chunks come in order, the last one carries the
  whole file's size and SHA-256 (``seal``), which the receiver checks.
- ``get`` (job, owner, ckpt, name, offset, length): bytes of ``owner``'s file as the receiver
  holds it (its own, or its copy).  ``size``: its length, which the fetching node compares
  with the file's manifest before it asks for a byte (the job may have truncated the file).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import json
import logging
import os
import secrets
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, TypeVar

import zmq
import zmq.asyncio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from elasticd.cluster.peers import router_socket
from elasticd.core import checkpoints as cp
from elasticd.errors import CheckpointsFull, ElasticdError
from elasticd.shell.checkpoints import CheckpointTier
from elasticd.wire import safejson

log = logging.getLogger(__name__)
T = TypeVar("T")

TIER_DOMAIN = b"elasticd-tier"
CHUNK = 4 * 1024 * 1024  # bytes a put or a get carries
WINDOW = 4  # requests a transfer keeps in flight
MAX_HEADER = 4096
TIMEOUT = 30.0  # seconds without an answer before a transfer fails
HANDSHAKE = 5.0  # seconds a connection may take to authenticate
SESSION_ID = 16  # bytes of a bulk session's id
SESSION_IDLE = 2 * TIMEOUT  # seconds a bulk session lives unused
SESSIONS_PER_NODE = 32  # bulk sessions a node may hold open here; its least used goes first
_HEAD = SESSION_ID + 8  # a bulk message's clear part: the session id and the counter
_TO_SERVER, _TO_CLIENT = 0, 1


class TierError(ElasticdError):
    code = "tier_unreachable"


class TierFull(TierError, CheckpointsFull):
    """The node refused to keep what was sent: the job's checkpoint memory there is full
    (its cap).  Not a fault of the link: sending it again as it is does not help."""

    code = CheckpointsFull.code


_FULL = (errno.ENOSPC, errno.EDQUOT)


class NodeRecords(Protocol):
    """What the data plane needs of the other nodes (cluster.NodeService)."""

    async def record(self, name: str) -> Any: ...
    def alive(self, name: str) -> bool: ...
    def sighted(self, name: str) -> Any: ...  # its record as last seen (None: unknown)


# -- the server ---------------------------------------------------------------------------


class TierServer:
    """Serves other daemons' puts and gets from this node's tier, one message at a time (a
    file's chunks stay in order; each file read or write runs in a thread)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        tier: CheckpointTier,
        *,
        curve_secret: bytes,
        bulk_endpoint: str | None,
        on_fault: Callable[[str, str], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        # (loop, detail) while an unexpected exception is handled: the daemon counts and logs it
        self._on_fault = on_fault or _log_fault
        self.bulk_endpoint = bulk_endpoint
        self._tier = tier
        self._router = router_socket(
            ctx,
            domain=TIER_DOMAIN,
            max_message=CHUNK + MAX_HEADER + 1024,
            hwm=2 * WINDOW,
            handshake=HANDSHAKE,  # the peer channel's
            curve_secret=curve_secret,
        )
        # no CURVE and no ZAP: what comes in is read only if it opens under a session's key
        # (None: no bulk port, everything over CURVE, as a daemon from before it)
        self._bulk = None
        if bulk_endpoint is not None:
            self._bulk = router_socket(
                ctx,
                domain=None,
                max_message=CHUNK + MAX_HEADER + 1024,
                hwm=2 * WINDOW,
                handshake=HANDSHAKE,
                curve_secret=None,
            )
        self._sessions: OrderedDict[bytes, _BulkSession] = OrderedDict()

    def bind(self) -> str:
        self._router.bind(self.endpoint)
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def bind_bulk(self) -> str:
        assert self._bulk is not None and self.bulk_endpoint is not None
        self._bulk.bind(self.bulk_endpoint)
        self.bulk_endpoint = self._bulk.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bulk_endpoint

    @property
    def sessions(self) -> int:
        """Bulk sessions open here."""
        return len(self._sessions)

    async def serve(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._serve_curve())
            if self._bulk is not None:
                tasks.create_task(self._serve_bulk(self._bulk))

    async def _serve_curve(self) -> None:
        while True:
            frames = await self._router.recv_multipart(copy=False)
            if len(frames) not in (2, 3):
                continue
            identity, header = frames[0].bytes, frames[1]
            caller = str(header.get("User-Id") or "")
            data = frames[2].bytes if len(frames) == 3 else b""
            reply, payload = await self._answer(caller, header.bytes, data)
            try:
                await self._router.send_multipart(
                    [identity, reply, *([payload] if payload else [])]
                )
            except zmq.ZMQError:
                pass  # the asker went away

    async def _serve_bulk(self, bulk: zmq.asyncio.Socket) -> None:
        while True:
            frames = await bulk.recv_multipart(copy=False)
            if len(frames) not in (3, 4):
                continue
            identity, head = frames[0].bytes, frames[1].bytes
            try:
                reply = await self._answer_sealed(head, [f.buffer for f in frames[2:]])
            except _Refused as exc:  # before anything was read: said in clear
                reply = [b"", str(exc).encode()]
            try:
                await bulk.send_multipart([identity, head, *reply], copy=False)
            except zmq.ZMQError:
                pass  # the asker went away

    async def _answer_sealed(self, head: bytes, sealed: list[memoryview]) -> list[bytes]:
        """A bulk message opened with its session's key, answered as over CURVE, the answer
        sealed; _Refused if it does not open (no such session, a replay, a forgery)."""
        session = self._sessions.get(head[:SESSION_ID]) if len(head) == _HEAD else None
        if session is None:
            raise _Refused("no such session (expired?): open another")
        counter = int.from_bytes(head[SESSION_ID:], "big")
        if counter <= session.last:
            raise _Refused("a replayed or reordered message")
        try:
            opened = [
                session.aead.decrypt(_nonce(_TO_SERVER, i, counter), part, head)
                for i, part in enumerate(sealed)
            ]
        except InvalidTag:
            raise _Refused("not sealed with this session's key") from None
        session.last, session.used = counter, time.monotonic()
        self._sessions.move_to_end(head[:SESSION_ID])  # the last a node loses to a new one
        reply, payload = await self._answer(
            session.node, opened[0], opened[1] if len(opened) > 1 else b""
        )
        return [
            session.aead.encrypt(_nonce(_TO_CLIENT, i, counter), part, head)
            for i, part in enumerate([reply, payload] if payload else [reply])
        ]

    def _open(self, caller: str) -> dict[str, Any]:
        """A new bulk session for ``caller``: its id, key and the bulk endpoint."""
        now = time.monotonic()
        for ident in [i for i, s in self._sessions.items() if now - s.used > SESSION_IDLE]:
            del self._sessions[ident]
        theirs = [i for i, s in self._sessions.items() if s.node == caller]
        for ident in theirs[: max(0, len(theirs) - SESSIONS_PER_NODE + 1)]:
            del self._sessions[ident]  # the one it used longest ago
        ident, key = secrets.token_bytes(SESSION_ID), AESGCM.generate_key(bit_length=256)
        self._sessions[ident] = _BulkSession(caller, AESGCM(key), used=now)
        return {
            "session": ident.hex(),
            "key": base64.b64encode(key).decode(),
            "bulk": self.bulk_endpoint,
        }

    async def _answer(self, caller: str, raw: bytes, data: bytes) -> tuple[bytes, bytes]:
        ident, op = "", None
        try:
            doc = safejson.loads(raw, max_bytes=MAX_HEADER)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            ident = str(doc.get("id", ""))[:64]
            op = doc.get("op")
            if op == "open" and self.bulk_endpoint is not None:
                if not caller:
                    raise ValueError("no admitted caller")
                return _ok(ident, **self._open(caller)), b""
            job, ckpt, name = _text(doc, "job"), _text(doc, "ckpt"), _text(doc, "name")
            offset = _number(doc, "offset")
            if op == "put":
                seal = doc.get("seal")
                facts = None
                if seal is not None:
                    if not (
                        isinstance(seal, list)
                        and len(seal) == 2
                        and type(seal[0]) is int
                        and isinstance(seal[1], str)
                    ):
                        raise ValueError("seal")
                    facts = cp.FileFacts(seal[0], seal[1])
                await asyncio.to_thread(
                    self._tier.receive, caller, job, ckpt, name, offset, data, facts
                )
                return _ok(ident), b""
            if op == "drop":
                await asyncio.to_thread(self._tier.drop, caller, job, ckpt)
                return _ok(ident), b""
            owner = _text(doc, "owner")
            if op == "get":
                length = min(_number(doc, "length"), CHUNK)
                chunk = await asyncio.to_thread(
                    self._tier.read, job, owner, ckpt, name, offset, length
                )
                return _ok(ident), chunk
            if op == "size":
                size = await asyncio.to_thread(self._tier.size, job, owner, ckpt, name)
                return _ok(ident, size=size), b""
            raise ValueError(f"unknown op {op!r}")
        except (ValueError, OSError, safejson.Undecodable) as exc:
            full = isinstance(exc, OSError) and exc.errno in _FULL
            error = {"id": ident, "ok": False, "error": str(exc)[:300], "full": full}
            return json.dumps(error).encode(), b""
        except Exception:  # a bug, or input nothing above foresaw: answered, and the port serves on
            self._on_fault("tier", f"{op!r} from {caller or 'a bulk session'}")
            error = {"id": ident, "ok": False, "error": "this node failed (its log says why)"}
            return json.dumps({**error, "full": False}).encode(), b""

    def close(self) -> None:
        self._router.close(linger=0)
        if self._bulk is not None:
            self._bulk.close(linger=0)


def _log_fault(loop: str, detail: str) -> None:
    log.exception("the %s server: unexpected error (%s); it goes on", loop, detail)


@dataclass
class _BulkSession:
    node: str  # who opened it, admitted over CURVE
    aead: AESGCM
    used: float  # time.monotonic() of its last message
    last: int = 0  # the highest counter taken


class _Refused(Exception):
    """A bulk message that is not opened: no such session, a replay or a forgery."""


def _nonce(direction: int, frame: int, counter: int) -> bytes:
    return bytes((direction, frame, 0, 0)) + counter.to_bytes(8, "big")


def _ok(ident: str, **more: Any) -> bytes:
    return json.dumps({"id": ident, "ok": True, **more}).encode()


def _text(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or len(value) > 256:
        raise ValueError(f"{key} must be a short string")
    return value


def _number(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
        raise ValueError(f"{key} must be a count")
    return value


# -- the client --------------------------------------------------------------------------


class TierLinks:
    """This node's transfers to and from other nodes' tiers (the tier's ``TierPeers``)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        public: bytes,
        secret: bytes,
        nodes: NodeRecords,
        *,
        timeout: float = TIMEOUT,
    ) -> None:
        self._ctx = ctx
        self._public, self._secret = public, secret
        self._nodes = nodes
        self._timeout = timeout

    def alive(self, node: str) -> bool:
        return self._nodes.alive(node)

    def domain(self, node: str) -> str:
        """A node's failure domain: its ``domain`` label, else its address (its host)."""
        record = self._nodes.sighted(node)
        if record is None:
            return node
        return str(record.info.labels.get("domain") or record.info.address or node)

    async def send(
        self, node: str, job: str, ckpt: str, name: str, source: BinaryIO
    ) -> cp.FileFacts:
        digest, size = hashlib.sha256(), os.fstat(source.fileno()).st_size
        async with self._session(node) as session:
            sent = 0
            while True:
                chunk = await asyncio.to_thread(source.read, CHUNK)
                digest.update(chunk)
                last = sent + len(chunk) >= size or not chunk
                header = {"op": "put", "job": job, "ckpt": ckpt, "name": name, "offset": sent}
                if last:
                    header["seal"] = [sent + len(chunk), digest.hexdigest()]
                await session.request(header, chunk)
                sent += len(chunk)
                if last:
                    break
            await session.drain()
        return cp.FileFacts(sent, digest.hexdigest())

    async def drop(self, node: str, job: str, ckpt: str) -> None:
        """Tell ``node`` that this node's checkpoint ``ckpt`` is gone (deleted, or renamed
        away after its copy landed): its copy there goes too."""
        async with self._session(node, bulk=False) as session:
            await session.call({"op": "drop", "job": job, "ckpt": ckpt, "name": ckpt, "offset": 0})

    async def fetch(
        self,
        node: str,
        job: str,
        owner: str,
        ckpt: str,
        name: str,
        into: int,
        ranges: list[tuple[int, int]] | None = None,
        *,
        size: int | None = None,
    ) -> cp.FileFacts | None:
        """``ranges`` of the file, or the whole of it, which must be ``size`` bytes (its
        manifest's): a holder whose file is another size is refused before a byte is asked
        for, since the job's own processes there may have truncated it to any size."""
        base = {"job": job, "owner": owner, "ckpt": ckpt, "name": name}
        whole = ranges is None
        digest = hashlib.sha256()
        written = 0
        async with self._session(node) as session:
            if ranges is None:
                if size is None:
                    raise ValueError("a whole file is fetched only with its manifest's size")
                reply, _ = await session.call({"op": "size", **base, "offset": 0})
                held = reply.get("size")
                if type(held) is not int or held != size:
                    raise TierError(
                        f"{node} holds {str(held)[:40]} bytes of {ckpt}/{name}, "
                        f"its manifest says {size}"
                    )
                ranges = [(0, size)]

            def write(piece: tuple[int, int], reply: dict[str, Any], data: bytes) -> None:
                nonlocal written
                offset, expected = piece
                if len(data) != expected:
                    raise TierError(f"{node} sent {len(data)} bytes of {expected}")
                os.pwrite(into, data, offset)
                written += expected
                if whole:  # the pieces come in order: the file's digest as it is written
                    digest.update(data)

            await session.pipeline(
                (
                    (piece, {"op": "get", **base, "offset": piece[0], "length": piece[1]}, b"")
                    for piece in _pieces(ranges)
                ),
                write,
            )
        if not whole:
            return None
        return cp.FileFacts(written, digest.hexdigest())

    def _session(self, node: str, *, bulk: bool = True) -> _Session:
        return _Session(self, node, bulk)


class _Session:
    """One DEALER to one node's tier, with up to WINDOW requests in flight: over its bulk
    port, sealed with a session's key, where the node has one and ``bulk`` asks for it (a
    transfer of bytes); else over CURVE."""

    def __init__(self, links: TierLinks, node: str, bulk: bool) -> None:
        self._links, self._node, self._wants_bulk = links, node, bulk
        self._curve: zmq.asyncio.Socket | None = None
        self._bulk: zmq.asyncio.Socket | None = None
        self._session = b""
        self._aead: AESGCM | None = None
        self._counter = 0
        self._pending: list[str] = []

    async def __aenter__(self) -> _Session:
        record = await self._links._nodes.record(self._node)
        if record is None or not record.tier_endpoint or not record.peer_key:
            raise TierError(f"node {self._node} has no checkpoint tier to reach")
        sock = self._links._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey = self._links._secret
        sock.curve_publickey = self._links._public
        sock.curve_serverkey = record.peer_key.encode()
        sock.connect(record.tier_endpoint)
        self._curve = sock
        if not self._wants_bulk:
            return self
        try:
            await self._open_bulk()
        except BaseException:  # cancelled too: a socket left open holds the context's end
            self._close()
            raise
        return self

    async def _open_bulk(self) -> None:
        """A session on the node's bulk port, where it has one (else all goes over CURVE)."""
        try:
            # the fields an older node reads before it finds the op unknown
            hollow = {"job": "", "owner": "", "ckpt": "", "name": "", "offset": 0}
            opened, _ = await self.call({"op": "open", **hollow})
        except TierError as exc:
            if "unknown op" not in str(exc):
                raise
            return  # an older node: everything over CURVE
        try:
            session = bytes.fromhex(str(opened["session"]))
            key = base64.b64decode(str(opened["key"]), validate=True)
            bulk = str(opened["bulk"])
            if len(session) != SESSION_ID or len(key) != 32 or not bulk.startswith("tcp://"):
                raise ValueError(opened)
        except (KeyError, ValueError) as exc:
            raise TierError(f"{self._node} opened no usable session: {exc}") from exc
        self._session, self._aead = session, AESGCM(key)
        self._bulk = self._links._ctx.socket(zmq.DEALER)
        self._bulk.setsockopt(zmq.LINGER, 0)
        self._bulk.connect(bulk)

    async def __aexit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        for sock in (self._curve, self._bulk):
            if sock is not None:
                sock.close(linger=0)
        self._curve = self._bulk = None

    async def _send(self, header: dict[str, Any], data: bytes) -> str:
        ident = uuid.uuid4().hex
        frames = [json.dumps({**header, "id": ident}).encode()]
        if data:
            frames.append(data)
        if self._bulk is None:
            assert self._curve is not None
            await self._curve.send_multipart(frames)
            return ident
        assert self._aead is not None
        self._counter += 1
        head = self._session + self._counter.to_bytes(8, "big")
        sealed = [
            self._aead.encrypt(_nonce(_TO_SERVER, i, self._counter), frame, head)
            for i, frame in enumerate(frames)
        ]
        await self._bulk.send_multipart([head, *sealed], copy=False)
        return ident

    def _open(self, received: list[zmq.Frame]) -> list[bytes]:
        """A reply's frames, a bulk reply's opened (TierError if refused or not sealed by
        the node)."""
        if self._bulk is None:
            return [frame.bytes for frame in received]
        assert self._aead is not None
        head, frames = received[0].bytes, [frame.buffer for frame in received[1:]]
        if not frames or len(head) != _HEAD or head[:SESSION_ID] != self._session:
            raise TierError(f"{self._node}: a reply to no request of this session")
        if not frames[0]:
            refusal = bytes(frames[1]).decode(errors="replace") if len(frames) > 1 else ""
            raise TierError(f"{self._node} refused a message: {refusal[:300]}")
        counter = int.from_bytes(head[SESSION_ID:], "big")
        try:
            return [
                self._aead.decrypt(_nonce(_TO_CLIENT, i, counter), part, head)
                for i, part in enumerate(frames)
            ]
        except InvalidTag:
            raise TierError(f"{self._node}: a reply not sealed with this session's key") from None

    async def _receive(self, ident: str) -> tuple[dict[str, Any], bytes]:
        """The reply to ``ident``; TierError after the timeout without one, or as soon as
        the node is known lost (looked at every second)."""
        sock = self._bulk or self._curve
        assert sock is not None
        quiet_since = time.monotonic()
        while True:
            if not await sock.poll(int(min(self._links._timeout, 1.0) * 1000)):
                if not self._links.alive(self._node):
                    raise TierError(f"no answer from {self._node}'s checkpoint tier (lost)")
                if time.monotonic() - quiet_since >= self._links._timeout:
                    raise TierError(f"no answer from {self._node}'s checkpoint tier")
                continue
            frames = self._open(await sock.recv_multipart(copy=False))
            quiet_since = time.monotonic()
            reply = json.loads(frames[0])
            if reply.get("id") != ident:
                continue  # an answer to a request given up on
            if not reply.get("ok"):
                refused = TierFull if reply.get("full") is True else TierError
                raise refused(f"{self._node}: {reply.get('error')}")
            return reply, frames[1] if len(frames) > 1 else b""

    async def call(self, header: dict[str, Any], data: bytes = b"") -> tuple[dict[str, Any], bytes]:
        return await self._receive(await self._send(header, data))

    async def request(self, header: dict[str, Any], data: bytes) -> None:
        """Send, keeping at most WINDOW unanswered (the replies come back in order)."""
        if len(self._pending) >= WINDOW:
            await self._receive(self._pending.pop(0))
        self._pending.append(await self._send(header, data))

    async def drain(self) -> None:
        while self._pending:
            await self._receive(self._pending.pop(0))

    async def pipeline(
        self,
        requests: Iterable[tuple[T, dict[str, Any], bytes]],
        each: Callable[[T, dict[str, Any], bytes], None],
    ) -> None:
        """Send ``requests`` (each with a tag) WINDOW at a time, taken from the iterable only
        as they are sent; ``each(tag, reply, data)`` in order."""
        sent: deque[tuple[T, str]] = deque()
        for tag, header, data in requests:
            if len(sent) >= WINDOW:
                await self._answered(sent.popleft(), each)
            sent.append((tag, await self._send(header, data)))
        while sent:
            await self._answered(sent.popleft(), each)

    async def _answered(
        self, sent: tuple[T, str], each: Callable[[T, dict[str, Any], bytes], None]
    ) -> None:
        tag, ident = sent
        reply, payload = await self._receive(ident)
        each(tag, reply, payload)


def _pieces(ranges: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """``ranges`` (offset, length) cut into pieces of CHUNK bytes at most, one at a time: a
    list of them all would be as long as the ranges are large."""
    for start, length in ranges:
        for at in range(0, length, CHUNK):
            yield start + at, min(CHUNK, length - at)
