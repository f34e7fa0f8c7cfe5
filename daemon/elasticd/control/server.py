"""Request servers: the control socket (a Unix stream socket at
``<runtime dir>/control.sock``) and the ZeroMQ ROUTER of the peer channel.

Who is calling is known, not claimed: the control server reads the caller's uid, gid and
pid from the kernel (SO_PEERCRED) when it accepts the connection.  It owns ``accept()``, so
that no local user can exhaust the daemon's file descriptors or memory: connections are
limited per user and in all, a connection has a few requests open at a time (beyond that
its bytes stay unread in the kernel), a user has a few requests being worked on at a time,
and a reply waits for the client to read the previous one.  A bad frame gets an error reply,
a log line and a counter, and the server goes on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from elasticd.cluster.peers import router_socket
from elasticd.errors import ElasticdError, TooLarge
from elasticd.faults import LOG_INTERVAL, Throttle, held_back
from elasticd.wire import protocol
from elasticd.wire.protocol import ProtocolError, Request

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HARD_FRAME_LIMIT = 64 * 1024 * 1024  # beyond this libzmq drops the connection unread
PEER_HWM = 64  # messages queued per peer connection, each way (a stream's chunks are <= ~1 MB)
PEER_HANDSHAKE = 5.0  # seconds a peer connection may take to authenticate before it is dropped


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    pid: int


class PeerGone(Exception):
    """The client disconnected; a stream to it ends."""


class Responder:
    """Sends the replies of one request to the client that made it."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id

    async def result(self, value: Any) -> None:
        """One result; TooLarge (an error reply instead) for one the client would refuse."""
        frame = protocol.ok(self.id, value)
        if len(frame) > protocol.MAX_REPLY:
            raise TooLarge(
                f"the reply would be {len(frame)} bytes, over the control "
                f"protocol's {protocol.MAX_REPLY}"
            )
        await self._send(frame)

    async def end(self) -> None:
        await self._send(protocol.end(self.id))

    async def error(self, code: str, message: str) -> None:
        await self._send(protocol.error(self.id, code, message))

    async def _send(self, frame: bytes) -> None:
        raise NotImplementedError


class RouterReply(Responder):
    def __init__(self, socket: zmq.asyncio.Socket, identity: bytes, request_id: str) -> None:
        super().__init__(request_id)
        self._socket = socket
        self._identity = identity

    async def _send(self, frame: bytes) -> None:
        try:
            await self._socket.send_multipart([self._identity, frame])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGone() from None
            raise


Handler = Callable[[Any, Request, Responder], Awaitable[None]]
ZapPolicy = Callable[
    [bytes, bytes, list[bytes]], bytes | None
]  # (mechanism, address, credentials) -> user id


class Zap:
    """The context's ZAP handler (RFC 27), one policy per ZAP domain.

    Not ``zmq.auth``'s AsyncioAuthenticator: it serves from a task of its own that no task
    group owns (``ensure_future``), and a credentials callback that raises ends that task,
    after which every peer handshake hangs unanswered; here a failing policy refuses one
    connection, and ``serve`` runs in the daemon's task group.

    A refused handshake is counted (``on_refused``) and logged, but anyone who reaches the
    port can make thousands: after the first, one line per ``interval`` seconds says how
    many more there were."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        on_refused: Callable[[str], None] = lambda domain: None,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LOG_INTERVAL,
    ) -> None:
        self._socket = ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._policies: dict[bytes, ZapPolicy] = {}
        self._on_refused = on_refused
        self._clock = clock
        self._refusals = Throttle(interval)  # per domain
        self._summing: asyncio.TimerHandle | None = None

    def add(self, domain: bytes, policy: ZapPolicy) -> None:
        self._policies[domain] = policy

    async def serve(self) -> None:
        while True:
            (
                version,
                request_id,
                domain,
                address,
                _identity,
                mechanism,
                *credentials,
            ) = await self._socket.recv_multipart()
            user_id = self._admit(domain, mechanism, address, credentials)
            status, text = (b"200", b"OK") if user_id else (b"400", b"not admitted")
            if user_id is None:
                self._refused(domain.decode(errors="replace"), address.decode(errors="replace"))
            await self._socket.send_multipart(
                [version, request_id, status, text, user_id or b"", b""]
            )

    def _refused(self, domain: str, address: str) -> None:
        self._on_refused(domain)
        held = self._refusals.check(domain, self._clock(), address)
        if held is not None:
            log.warning(
                "refused a %s connection from %s (more are counted: "
                "elasticd_peer_refused_total; one line per %g s sums them up)%s",
                domain,
                address,
                self._refusals.interval,
                held_back(held),
            )
        elif self._summing is None:
            self._sum_up_later()

    def _sum_up(self) -> None:
        """The summary lines that are due; again later while some are not."""
        self._summing = None
        for domain, held, newest in self._refusals.flush(self._clock()):
            log.warning(
                "refused %d more %s connections in the last %g s (the newest from %s)",
                held,
                domain,
                self._refusals.interval,
                newest,
            )
        self._sum_up_later()

    def _sum_up_later(self) -> None:
        due = self._refusals.due()
        if due is not None:
            self._summing = asyncio.get_running_loop().call_later(
                max(0.0, due - self._clock()), self._sum_up
            )

    def _admit(
        self, domain: bytes, mechanism: bytes, address: bytes, credentials: list[bytes]
    ) -> bytes | None:
        policy = self._policies.get(domain)
        try:
            return policy(mechanism, address, credentials) if policy else None
        except Exception:  # a policy bug refuses one connection; it must not stop the daemon
            log.exception("ZAP policy for %s failed", domain.decode(errors="replace"))
            return None

    def close(self) -> None:
        if self._summing is not None:
            self._summing.cancel()
        self._socket.close(linger=0)


class RouterServer:
    """A ROUTER that runs ``handler(caller, request, reply)`` for each request in a task of
    its own, in the one task group of ``serve``: none outlives it.

    ``identify`` turns a message's ZAP User-Id into the caller the handler sees.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        handler: Handler,
        *,
        domain: bytes,
        identify: Callable[[str], Any],
        on_request: Callable[[str, str], None] | None = None,
        curve_secret: bytes | None = None,
        log_interval: float = LOG_INTERVAL,
    ) -> None:
        self.endpoint = endpoint
        self._handler = handler
        self._identify = identify
        self._outcomes = Outcomes(on_request or (lambda op, result: None), log_interval)
        self._router = router_socket(
            ctx,
            domain=domain,
            max_message=HARD_FRAME_LIMIT,
            hwm=PEER_HWM,
            handshake=PEER_HANDSHAKE,
            curve_secret=curve_secret,
        )

    def bind(self) -> str:
        self._router.bind(self.endpoint)
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    async def serve(self) -> None:
        """Serve until cancelled; the requests in flight are cancelled with it."""
        async with asyncio.TaskGroup() as requests:
            while True:
                frames = await self._router.recv_multipart(copy=False)
                if len(frames) != 2:
                    self._outcomes.count("invalid", protocol.E_BAD_REQUEST)
                    log.warning("control: dropped a message of %d frames", len(frames))
                    continue
                identity, frame = frames
                requests.create_task(self._dispatch(identity.bytes, frame))

    async def _dispatch(self, identity: bytes, frame: zmq.Frame) -> None:
        """Never raises (but for cancellation): one request must not end the others."""
        raw = frame.bytes
        reply = RouterReply(self._router, identity, protocol.request_id(raw))
        user_id = frame.get("User-Id")  # a string property (zmq types every property int | str)
        try:
            caller = self._identify(user_id if isinstance(user_id, str) else "")
        except ElasticdError as exc:
            await _refuse(reply, "invalid", exc.code, exc.message, self._outcomes)
            return
        except Exception:
            log.exception("control: cannot tell who sent a request")
            return
        await answer(self._handler, caller, raw, reply, self._outcomes)

    def close(self) -> None:
        self._router.close(linger=0)


class Outcomes:
    """What became of each request: counted (``count(op, result)``: every one), and, for a
    refusal, a client gone or an internal error, a log line per kind once per ``interval``
    with how many more there were: a local user can make thousands a second."""

    def __init__(
        self,
        count: Callable[[str, str], None],
        interval: float = LOG_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.count = count
        self._told = Throttle(interval)
        self._clock = clock

    def tell(self, kind: str) -> int | None:
        """None: not now; else log it, with this many held back (see Throttle.check)."""
        return self._told.check(kind, self._clock())


async def answer(
    handler: Handler, caller: Any, raw: bytes, reply: Responder, outcomes: Outcomes
) -> None:
    """Decode one request, run its handler, and turn every failure into an error reply.
    Never raises (but for cancellation): one bad request must not touch any other."""
    op = "invalid"
    try:
        request = protocol.decode_request(raw)
        op, reply.id = request.op, request.id
        await handler(caller, request, reply)
        outcomes.count(op, "ok")
    except ProtocolError as exc:
        await _refuse(reply, op, exc.code, str(exc), outcomes)
    except ElasticdError as exc:
        await _refuse(reply, op, exc.code, exc.message, outcomes)
    except PeerGone:
        outcomes.count(op, "peer_gone")
        if (held := outcomes.tell("peer_gone")) is not None:
            log.info("control: client went away during %s%s", _shortened(op, 40), held_back(held))
    except Exception:
        if (held := outcomes.tell("traceback")) is not None:
            log.exception("control: %s failed%s", _shortened(op, 40), held_back(held))
        await _refuse(
            reply, op, protocol.E_INTERNAL, "internal error (see the daemon log)", outcomes
        )


_LOGGED_MESSAGE = 300  # characters of a refusal's message in the daemon's log


def _shortened(text: str, limit: int = _LOGGED_MESSAGE) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


async def _refuse(reply: Responder, op: str, code: str, message: str, outcomes: Outcomes) -> None:
    outcomes.count(op, code)
    # the op and message may carry a client's text: a line, never a 4 MiB record per request
    if (held := outcomes.tell(code)) is not None:
        log.info(
            "control: %s refused: %s: %s%s",
            _shortened(str(op), 40),
            code,
            _shortened(message),
            held_back(held),
        )
    try:
        await reply.error(code, message)
    except PeerGone:
        pass
    except Exception:  # the reply itself cannot be sent (e.g. the connection broke)
        log.exception("control: could not send the error reply of %s", op)


def served(path: str) -> bool:
    """Whether a daemon answers on the control socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _refuse_if_served(path: str) -> None:
    """Another daemon answering on ``path`` is an error, not a stale file to replace."""
    if served(path):
        raise ElasticdError(f"another elasticd is already serving {path}")


def _remove_stale_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


# -- the control socket ----------------------------------------------------------------------

_BACKLOG = 512
_READ_LIMIT = 64 * 1024
_WRITE_HIGH = 256 * 1024
_ACCEPT_BACKOFF = 0.1  # seconds: out of fds or memory, try again soon (the listener stays)
_OVERSIZED_HEAD = 1024  # of a frame over the limit, this much is read to find its id


@dataclass(frozen=True)
class ConnectionLimits:
    connections: int = 1024  # open control connections, all users together
    connections_per_user: int = 32  # open control connections of one uid
    in_flight: int = 8  # requests one connection has open (reading waits beyond)
    work_per_user: int = 4  # requests of one uid being worked on before their first reply


def peer_credentials(sock: socket.socket) -> Caller:
    """The connecting process's credentials, from the kernel (taken at its connect())."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Caller(uid, gid, pid)


class Admission:
    """Open connections by uid, and whether one more may open (pure bookkeeping)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self.open: collections.Counter[int] = collections.Counter()

    def refusal(self, uid: int) -> str | None:
        if self.open[uid] >= self._limits.connections_per_user:
            return (
                f"too many connections from uid {uid} "
                f"(control.max_connections_per_user = {self._limits.connections_per_user})"
            )
        if self.open.total() >= self._limits.connections:
            return f"too many connections (control.max_connections = {self._limits.connections})"
        return None

    def opened(self, uid: int) -> None:
        self.open[uid] += 1

    def closed(self, uid: int) -> None:
        self.open[uid] -= 1
        if self.open[uid] <= 0:
            del self.open[uid]


class _Token:
    """A user's permit to work on one request; given back at the request's first reply."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self._semaphore: asyncio.Semaphore | None = semaphore

    def release(self) -> None:
        if self._semaphore is not None:
            self._semaphore.release()
            self._semaphore = None


class _Link:
    """One client connection: its writer, its open requests, its user's work permits."""

    def __init__(
        self, writer: asyncio.StreamWriter, caller: Caller, in_flight: int, work: asyncio.Semaphore
    ) -> None:
        self.writer = writer
        self.caller = caller
        self.slots = asyncio.Semaphore(in_flight)
        self.requests: set[asyncio.Task[None]] = set()
        self._work = work
        self._writing = asyncio.Lock()
        writer.transport.set_write_buffer_limits(high=_WRITE_HIGH)

    async def permit(self) -> _Token:
        await self._work.acquire()
        return _Token(self._work)

    async def send(self, payload: bytes) -> None:
        """One frame; returns once the client has taken most of what was sent before
        (a client that never reads holds only its own request, never the daemon's memory)."""
        async with self._writing:
            if self.writer.is_closing():
                raise PeerGone()
            self.writer.write(protocol.framed(payload))
            try:
                await self.writer.drain()
            except (ConnectionError, RuntimeError):
                raise PeerGone() from None


class StreamReply(Responder):
    def __init__(self, link: _Link, token: _Token, request_id: str) -> None:
        super().__init__(request_id)
        self._link = link
        self._token = token

    async def _send(self, frame: bytes) -> None:
        self._token.release()  # the work is done; a slow reader waits on its own
        await self._link.send(frame)


@dataclass(frozen=True)
class Oversized:
    """A request frame over the limit, skipped unread but for its id."""

    size: int
    id: str


class ControlServer:
    """The local control socket.  ``handler(caller, request, reply)`` answers each request."""

    def __init__(
        self,
        path: str,
        handler: Handler,
        *,
        limits: ConnectionLimits = ConnectionLimits(),
        on_request: Callable[[str, str], None] | None = None,
        on_connections: Callable[[int], None] | None = None,
        world_accessible: bool = False,
        log_interval: float = LOG_INTERVAL,
    ) -> None:
        self.path = path
        self._handler = handler
        self._limits = limits
        self._outcomes = Outcomes(on_request or (lambda op, result: None), log_interval)
        self._on_connections = on_connections or (lambda n: None)
        self._world = world_accessible
        self._admission = Admission(limits)
        self._work: dict[int, asyncio.Semaphore] = {}
        self._sock: socket.socket | None = None
        self._accept_failed_at = 0.0

    def bind(self) -> str:
        """Listen (replacing a stale socket file, refusing to steal a live one)."""
        _refuse_if_served(self.path)
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o666 if self._world else 0o600)
            sock.listen(_BACKLOG)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        return self.path

    async def serve(self) -> None:
        """Accept connections until cancelled; each is served by a task of this one group."""
        assert self._sock is not None, "bind() first"
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as connections:
            while True:
                try:
                    conn, _ = await loop.sock_accept(self._sock)
                except OSError as exc:  # out of fds or memory: never stop listening
                    self._accept_failed(exc)
                    await asyncio.sleep(_ACCEPT_BACKOFF)
                    continue
                self._admit(conn, connections)

    def _admit(self, conn: socket.socket, connections: asyncio.TaskGroup) -> None:
        try:
            caller = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        refusal = self._admission.refusal(caller.uid)
        if refusal is not None:
            self._outcomes.count("connect", protocol.E_TOO_MANY)
            _say_and_close(conn, protocol.error("", protocol.E_TOO_MANY, refusal))
            return
        self._admission.opened(caller.uid)
        self._on_connections(self._admission.open.total())
        connections.create_task(self._connection(conn, caller))

    def _accept_failed(self, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._accept_failed_at > 60:
            self._accept_failed_at = now
            log.error("control: cannot accept connections: %s (retrying)", exc)

    async def _connection(self, conn: socket.socket, caller: Caller) -> None:
        work = self._work.setdefault(caller.uid, asyncio.Semaphore(self._limits.work_per_user))
        writer = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=_READ_LIMIT)
            link = _Link(writer, caller, self._limits.in_flight, work)
            await self._read_requests(reader, link)
        except Exception:  # one connection must never take the server down
            log.exception("control: connection of uid %d failed", caller.uid)
        finally:
            if writer is not None:
                writer.close()
            else:
                conn.close()
            self._admission.closed(caller.uid)
            if caller.uid not in self._admission.open:
                self._work.pop(caller.uid, None)
            self._on_connections(self._admission.open.total())

    async def _read_requests(self, reader: asyncio.StreamReader, link: _Link) -> None:
        """Read frames while the connection has free request slots; at EOF (the client is
        gone) its requests are cancelled."""
        async with asyncio.TaskGroup() as group:
            try:
                while True:
                    await link.slots.acquire()
                    frame = await read_frame(reader)
                    task = group.create_task(self._request(link, frame))
                    link.requests.add(task)
                    task.add_done_callback(link.requests.discard)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                for task in list(link.requests):
                    task.cancel()

    async def _request(self, link: _Link, frame: bytes | Oversized) -> None:
        try:
            token = await link.permit()
            try:
                if isinstance(frame, Oversized):
                    reply = StreamReply(link, token, frame.id)
                    await _refuse(
                        reply,
                        "invalid",
                        protocol.E_TOO_LARGE,
                        f"frame of {frame.size} bytes exceeds {protocol.MAX_FRAME}",
                        self._outcomes,
                    )
                else:
                    reply = StreamReply(link, token, protocol.request_id(frame))
                    await answer(self._handler, link.caller, frame, reply, self._outcomes)
            finally:
                token.release()
        finally:
            link.slots.release()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            _remove_stale_socket(self.path)


async def read_frame(reader: asyncio.StreamReader) -> bytes | Oversized:
    """The next request frame; one over the limit is read past (its id kept), never held."""
    (size,) = protocol.HEADER.unpack(await reader.readexactly(protocol.HEADER.size))
    if size <= protocol.MAX_FRAME:
        return await reader.readexactly(size)
    head = await reader.readexactly(_OVERSIZED_HEAD)
    left = size - len(head)
    while left:
        chunk = await reader.read(min(left, _READ_LIMIT))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(chunk)
    return Oversized(size, protocol.id_near_start(head))


def _say_and_close(conn: socket.socket, payload: bytes) -> None:
    """Tell a refused client why (if its socket takes it now), then hang up."""
    try:
        conn.setblocking(False)
        conn.send(protocol.framed(payload))
    except OSError:
        pass
    finally:
        conn.close()
