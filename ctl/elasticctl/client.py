"""A client for elasticd's control socket (docs/security.md): a Unix stream socket carrying
length-prefixed JSON frames.

One request frame out, one reply frame back (or several, for a stream, until ``end``).
Nothing here ever waits without a bound it chose: connecting takes at most a second (so a
missing daemon is reported at once), the first reply must come within ``timeout`` seconds,
and a dropped connection is seen as the end of the byte stream.  A signal (Ctrl-C) wakes
the wait through Python's wakeup fd: one that lands just before ``select`` blocks would
otherwise wait for the next reply, perhaps forever.
"""

from __future__ import annotations

import select
import signal
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any

from elasticd.wire import paths, protocol

DEFAULT_TIMEOUT = 15.0
CONNECT_TIMEOUT = 1.0
_RECEIVE = 256 * 1024


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
        super().__init__(
            f"elasticd is not running (no control socket at {path}); " + paths.REACH_ELSEWHERE
        )


class NoReply(Unavailable):
    code = "timeout"


class RemoteError(ClientError):
    """The daemon answered with an error reply."""


class RequestTooLarge(ClientError):
    code = protocol.E_TOO_LARGE


class Client:
    """A connection to one daemon; use as a context manager."""

    def __init__(self, path: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout
        self._sock = _connect(path)
        self._frames = protocol.FrameReader(protocol.MAX_REPLY)
        self._ready: deque[bytes] = deque()
        self._wakeup = SignalWakeup()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._wakeup.close()
        self._sock.close()

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
        try:
            frame = protocol.encode_request(request)
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end].encode("utf-8", "surrogateescape")
            raise ClientError(
                f"the {op} request holds text that is not UTF-8 (bytes {bad!r}); "
                "the control protocol carries UTF-8 only",
                protocol.E_BAD_REQUEST,
            ) from None
        if len(frame) > protocol.MAX_FRAME:
            raise RequestTooLarge(
                f"the {op} request is {len(frame)} bytes, over the "
                f"{protocol.MAX_FRAME}-byte limit of the control protocol"
            )
        self._sock.settimeout(self.timeout)
        try:
            self._sock.sendall(protocol.framed(frame))
        except TimeoutError:
            raise NoReply(f"elasticd at {self.path} does not take requests") from None
        except OSError:
            raise self._lost() from None
        finally:
            self._sock.setblocking(False)
        return request.id

    def _receive(self, request_id: str, timeout: float | None) -> protocol.Reply:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self._ready:
                reply = _decode(self._ready.popleft())
                if not reply.ok and not reply.id:
                    raise RemoteError(reply.message, reply.code)  # about the connection itself
                if reply.id != request_id:
                    continue  # a late reply to some earlier request: not ours
                if not reply.ok:
                    raise RemoteError(reply.message, reply.code)
                return reply
            self._fill(deadline, timeout)

    def _fill(self, deadline: float | None, timeout: float | None) -> None:
        """Wait for bytes from the daemon and add the frames they complete."""
        waiting = [self._sock] + ([self._wakeup.fd] if self._wakeup.fd is not None else [])
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select(waiting, [], [], left)
        if self._wakeup.fd in readable:
            self._wakeup.drain()  # the signal's handler runs as this returns
            return
        if not readable:
            raise NoReply(
                f"elasticd did not answer within {timeout:g} s "
                f"(socket {self.path}; ELASTICCTL_TIMEOUT sets the limit)"
            )
        try:
            data = self._sock.recv(_RECEIVE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            raise self._lost()
        try:
            self._ready.extend(self._frames.feed(data))
        except protocol.ProtocolError as exc:
            raise ClientError(f"bad reply from elasticd: {exc}", exc.code) from None

    def _lost(self) -> Unavailable:
        return Unavailable(f"lost the connection to elasticd at {self.path}", "connection_lost")


def _connect(path: str) -> socket.socket:
    """A connected socket, or NotRunning/Unavailable at once.

    A blocking connect waits (up to SO_SNDTIMEO) while the daemon's accept queue is full,
    as it may be for a moment while somebody floods it; a non-blocking one would fail."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    seconds = int(CONNECT_TIMEOUT)
    sock.setsockopt(
        socket.SOL_SOCKET,
        socket.SO_SNDTIMEO,
        struct.pack("ll", seconds, int((CONNECT_TIMEOUT - seconds) * 1e6)),
    )
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        raise NotRunning(path) from None
    except (TimeoutError, BlockingIOError):
        sock.close()
        raise NoReply(f"elasticd does not accept connections at {path}") from None
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot connect to {path}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


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


def _decode(frame: bytes) -> protocol.Reply:
    try:
        return protocol.decode_reply(frame)
    except protocol.ProtocolError as exc:
        raise ClientError(f"bad reply from elasticd: {exc}", protocol.E_BAD_REQUEST) from None
