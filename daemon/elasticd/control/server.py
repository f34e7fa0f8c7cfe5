"""The control socket: a ZeroMQ ROUTER on ``ipc://<runtime dir>/control.sock`` (DESIGN §3).

Who is calling is known, not claimed: the daemon answers ZAP requests, in which libzmq puts
the peer's ``uid:gid:pid`` (SO_PEERCRED) for ipc connections, and sets that as the
connection's User-Id, which every message then carries.  Each request runs in its own task;
a bad frame gets an error reply, a log line and a counter, and the server goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import zmq
import zmq.asyncio

from ..errors import ElasticdError, PermissionDenied
from . import protocol
from .protocol import ProtocolError, Request

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"elasticd"
HARD_FRAME_LIMIT = 64 * 1024 * 1024  # beyond this libzmq drops the connection unread


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    pid: int


def parse_peer(user_id: str) -> Caller:
    """``"uid:gid:pid"`` (as our ZAP handler sets it) -> Caller."""
    try:
        uid, gid, pid = (int(part) for part in user_id.split(":"))
    except ValueError:
        raise PermissionDenied("the caller's credentials are unknown") from None
    return Caller(uid, gid, pid)


def zap_user_id(address: bytes) -> bytes | None:
    """The ZAP request's address for ipc is ``<host>:<uid>:<gid>:<pid>``; keep the last three."""
    parts = address.decode(errors="replace").rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return ":".join(parts[1:]).encode()


class PeerGone(Exception):
    """The client disconnected; a stream to it ends."""


class Reply:
    """Sends the replies of one request to the client that made it."""

    def __init__(self, socket: zmq.asyncio.Socket, identity: bytes, request_id: str) -> None:
        self._socket = socket
        self._identity = identity
        self.id = request_id

    async def result(self, value: Any) -> None:
        await self._send(protocol.ok(self.id, value))

    async def end(self) -> None:
        await self._send(protocol.end(self.id))

    async def error(self, code: str, message: str) -> None:
        await self._send(protocol.error(self.id, code, message))

    async def _send(self, frame: bytes) -> None:
        try:
            await self._socket.send_multipart([self._identity, frame])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGone() from None
            raise


Handler = Callable[[Any, Request, Reply], Awaitable[None]]
ZapPolicy = Callable[[bytes, bytes, list[bytes]], bytes | None]  # (mechanism, address, credentials) -> user id


def local_peer_policy(mechanism: bytes, address: bytes, credentials: list[bytes]) -> bytes | None:
    """ipc control socket: admit every local peer, labelled with its SO_PEERCRED credentials."""
    return zap_user_id(address)


class Zap:
    """The context's ZAP handler (RFC 27), one policy per ZAP domain."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._socket = ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._policies: dict[bytes, ZapPolicy] = {}

    def add(self, domain: bytes, policy: ZapPolicy) -> None:
        self._policies[domain] = policy

    async def serve(self) -> None:
        while True:
            version, request_id, domain, address, _identity, mechanism, *credentials = \
                await self._socket.recv_multipart()
            user_id = self._admit(domain, mechanism, address, credentials)
            status, text = (b"200", b"OK") if user_id else (b"400", b"not admitted")
            if user_id is None:
                log.warning("refused a %s connection from %s", domain.decode(errors="replace"),
                            address.decode(errors="replace"))
            await self._socket.send_multipart([version, request_id, status, text, user_id or b"", b""])

    def _admit(self, domain: bytes, mechanism: bytes, address: bytes,
               credentials: list[bytes]) -> bytes | None:
        policy = self._policies.get(domain)
        try:
            return policy(mechanism, address, credentials) if policy else None
        except Exception:  # a policy bug refuses one connection; it must not stop the daemon
            log.exception("ZAP policy for %s failed", domain.decode(errors="replace"))
            return None

    def close(self) -> None:
        self._socket.close(linger=0)


class RouterServer:
    """A ROUTER that runs ``handler(caller, request, reply)`` for each request in its own task.

    ``identify`` turns a message's ZAP User-Id into the caller the handler sees.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, handler: Handler, *,
                 domain: bytes, identify: Callable[[str], Any],
                 on_request: Callable[[str, str], None] | None = None,
                 curve_secret: bytes | None = None) -> None:
        self.endpoint = endpoint
        self._handler = handler
        self._identify = identify
        self._count = on_request or (lambda op, result: None)
        self._tasks: set[asyncio.Task[None]] = set()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ZAP_DOMAIN, domain)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        router.setsockopt(zmq.LINGER, 0)
        if curve_secret is not None:
            router.curve_server = True
            router.curve_secretkey = curve_secret
        self._router = router

    def bind(self) -> str:
        self._router.bind(self.endpoint)
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    async def serve(self) -> None:
        while True:
            frames = await self._router.recv_multipart(copy=False)
            if len(frames) != 2:
                self._count("invalid", protocol.E_BAD_REQUEST)
                log.warning("control: dropped a message of %d frames", len(frames))
                continue
            identity, frame = frames
            task = asyncio.create_task(self._dispatch(identity.bytes, frame))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, identity: bytes, frame: zmq.Frame) -> None:
        raw = frame.bytes
        reply = Reply(self._router, identity, protocol.request_id(raw))
        op = "invalid"
        try:
            caller = self._identify(frame.get("User-Id") or "")
            request = protocol.decode_request(raw)
            op, reply.id = request.op, request.id
            await self._handler(caller, request, reply)
            self._count(op, "ok")
        except ProtocolError as exc:
            await self._refuse(reply, op, exc.code, str(exc))
        except ElasticdError as exc:
            await self._refuse(reply, op, exc.code, exc.message)
        except PeerGone:
            self._count(op, "peer_gone")
            log.info("control: client went away during %s", op)
        except Exception:
            log.exception("control: %s failed", op)
            await self._refuse(reply, op, protocol.E_INTERNAL, "internal error (see the daemon log)")

    async def _refuse(self, reply: Reply, op: str, code: str, message: str) -> None:
        self._count(op, code)
        log.info("control: %s refused: %s: %s", op, code, message)
        try:
            await reply.error(code, message)
        except PeerGone:
            pass

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._router.close(linger=0)


class ControlServer(RouterServer):
    """The local control socket: ``ipc://<runtime dir>/control.sock``."""

    def __init__(self, ctx: zmq.asyncio.Context, zap: Zap, path: str, handler: Handler, *,
                 on_request: Callable[[str, str], None] | None = None,
                 world_accessible: bool = False) -> None:
        super().__init__(ctx, f"ipc://{path}", handler, domain=ZAP_DOMAIN, identify=parse_peer,
                         on_request=on_request)
        zap.add(ZAP_DOMAIN, local_peer_policy)
        self.path = path
        self._world = world_accessible

    def bind(self) -> str:
        """Bind (replacing a stale socket file, refusing to steal a live one)."""
        _refuse_if_served(self.path)
        _remove_stale_socket(self.path)
        endpoint = super().bind()
        os.chmod(self.path, 0o666 if self._world else 0o600)
        return endpoint

    def close(self) -> None:
        super().close()
        _remove_stale_socket(self.path)


def _refuse_if_served(path: str) -> None:
    """Another daemon answering on ``path`` is an error, not a stale file to replace."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return
    finally:
        probe.close()
    raise ElasticdError(f"another elasticd is already serving {path}")


def _remove_stale_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
