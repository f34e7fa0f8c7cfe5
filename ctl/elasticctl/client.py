"""A ZeroMQ DEALER client for elasticd's control socket (DESIGN §3).

One request frame out, one reply frame back (or several, for a stream, until ``end``).
Nothing here ever waits without a bound it chose: the socket is probed with a plain
``connect()`` first (so a missing daemon is reported at once), the first reply must come
within ``timeout`` seconds, and a dropped connection is seen through a socket monitor.
A signal (Ctrl-C) wakes the poll through Python's wakeup fd: one that lands just before
``zmq_poll`` blocks would otherwise wait for the next reply, perhaps forever.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import zmq

from elasticd.control import protocol

DEFAULT_TIMEOUT = 15.0
PROBE_TIMEOUT = 1.0
LOST_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class ClientError(Exception):
    """Anything that stops a request; ``code`` is a wire error code or a local one."""

    code = "client_error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class Unavailable(ClientError):
    """The daemon cannot be reached: not running, not answering, or gone mid-request."""

    code = "unavailable"


class NotRunning(Unavailable):
    code = "not_running"

    def __init__(self, path: str) -> None:
        super().__init__(f"elasticd is not running (no control socket at {path})")


class NoReply(Unavailable):
    code = "timeout"


class RemoteError(ClientError):
    """The daemon answered with an error reply."""


class RequestTooLarge(ClientError):
    code = protocol.E_TOO_LARGE


def probe(path: str) -> None:
    """Raise NotRunning unless something listens on the unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise NotRunning(path) from None
        except TimeoutError:
            raise NoReply(f"elasticd does not accept connections at {path}") from None
        except OSError as exc:
            raise Unavailable(f"cannot connect to {path}: {exc.strerror or exc}") from None


class Client:
    """A connection to one daemon; use as a context manager."""

    def __init__(self, path: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        probe(path)
        self.path = path
        self.timeout = timeout
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.linger = 0
        self._monitor = self._socket.get_monitor_socket(LOST_EVENTS)
        self._monitor.linger = 0
        self._socket.connect(f"ipc://{path}")
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._wakeup = SignalWakeup()
        if self._wakeup.fd is not None:
            self._poller.register(self._wakeup.fd, zmq.POLLIN)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._wakeup.close()
        self._context.destroy(linger=0)

    def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        """One request, one reply: its result (RemoteError for an error reply)."""
        return self._receive(self._send(op, args), self.timeout).result

    def stream(self, op: str, args: dict[str, Any] | None = None) -> Iterator[Any]:
        """Send now; iterate over the results until the daemon ends the stream.

        Only the first reply is bounded by the timeout: after it, the daemon is known to
        be working on the request and may take as long as the job does.
        """
        return self._results(self._send(op, args))

    def _results(self, request_id: str) -> Iterator[Any]:
        timeout: float | None = self.timeout
        while not (reply := self._receive(request_id, timeout)).end:
            yield reply.result
            timeout = None

    def _send(self, op: str, args: dict[str, Any] | None) -> str:
        request = protocol.Request(uuid.uuid4().hex, op, args or {})
        frame = protocol.encode_request(request)
        if len(frame) > protocol.MAX_FRAME:
            raise RequestTooLarge(f"the {op} request is {len(frame)} bytes, over the "
                                  f"{protocol.MAX_FRAME}-byte limit of the control protocol")
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise NoReply(f"elasticd at {self.path} does not take requests") from None
        return request.id

    def _receive(self, request_id: str, timeout: float | None) -> protocol.Reply:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = None if deadline is None else max(0, (deadline - time.monotonic()) * 1000)
            ready = dict(self._poller.poll(wait_ms))
            if self._wakeup.fd in ready:
                self._wakeup.drain()  # the signal's handler runs as this returns
                continue
            if not ready:
                raise NoReply(f"elasticd did not answer within {timeout:g} s "
                              f"(socket {self.path}; ELASTICCTL_TIMEOUT sets the limit)")
            if self._socket not in ready:  # replies that came before a hang-up still count
                raise self._lost()
            reply = _decode(self._socket.recv_multipart()[-1])
            if reply.id != request_id:
                continue  # a late reply to some earlier request: not ours
            if not reply.ok:
                raise RemoteError(reply.message, reply.code)
            return reply

    def _lost(self) -> Unavailable:
        event = monitor_event(self._monitor.recv_multipart())
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return Unavailable(f"elasticd at {self.path} refused this client")
        return Unavailable(f"lost the connection to elasticd at {self.path}", "connection_lost")


class SignalWakeup:
    """A socket pair installed as Python's signal wakeup fd (main thread only; elsewhere
    ``fd`` is None and nothing changes)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        if threading.current_thread() is not threading.main_thread():
            return
        self._read, self._write = socket.socketpair()
        for end in (self._read, self._write):
            end.setblocking(False)
        self._previous = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self.fd = self._read.fileno()

    def drain(self) -> None:
        try:
            while self._read.recv(64):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            signal.set_wakeup_fd(self._previous)
            self._read.close()
            self._write.close()
            self.fd = None


def monitor_event(frames: list[bytes]) -> int:
    """The event number of a libzmq monitor message (uint16 event, uint32 value; endpoint)."""
    event, _value = struct.unpack("=HI", frames[0][:6])
    return event


def _decode(frame: bytes) -> protocol.Reply:
    try:
        return protocol.decode_reply(frame)
    except protocol.ProtocolError as exc:
        raise ClientError(f"bad reply from elasticd: {exc}", protocol.E_BAD_REQUEST) from None
