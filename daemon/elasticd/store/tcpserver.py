"""TCPStoreServer: the cluster's c10d TCPStore, served by the daemon that hosts it, without torch.

torch's own server (libuv, in ``torch.distributed.TCPStore``) made the hosting daemon import
torch: 1.9 s of CPU and 200 MB of memory before it could serve a key, on the one node every
other node waits for, and a Python with torch wherever a daemon might host.  This server
speaks the same protocol (``TCPStoreBackend.hpp``'s query types as torch 2.13 sends them;
:mod:`elasticd.store.tcpwire`), so torch's clients and ours see the same
store: the contract suite runs both clients against both servers, and compares their answers
to a random sequence of operations.

Where it differs from torch's server, on purpose:

- **Bounded.** torch's server keeps whatever anyone sends.  Here the keys and values held
  are capped (``max_bytes``: ``store.max_memory``), as are a connection's unread requests
  and unsent answers; a request past a cap closes that connection (logged once a minute),
  the store and every other connection go on.  A key is at most 8 KiB and a request's value
  8 MiB, as in torch; a value grown by appends, 16 MiB (what a client of ours reads).
- **A read wakes nobody.** torch's server wakes a key's waiters on a compare-and-set of a
  missing key (which is how a client reads a key without blocking), so a waiter could be
  told a key exists that does not; here a waiter is woken only by a write of its key.
- **A client that does not open with VALIDATE, or sends a query it does not know, is
  closed** (torch's server ignores the first and stalls that connection).
- No reverse DNS lookup of each new client.

It runs on a thread of its own with its own event loop, as torch's server does: the
daemon's loop stalling (a slow disk, a long callback) does not stall every other node's
heartbeat.  Everything is torn down by :meth:`TCPStoreServer.close`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

from elasticd.endpoint import join_endpoint
from elasticd.errors import StoreConnectionError
from elasticd.store import tcpwire as wire
from elasticd.store.tcpwire import MAGIC, Query, blob

log = logging.getLogger(__name__)

MAX_KEY = 8 << 10  # bytes, as torch's server
MAX_VALUE = 8 << 20  # in one request
MAX_HELD_VALUE = 16 << 20  # grown by appends: what TCPStoreClient reads at most
MAX_KEYS_PER_QUERY = 128 << 10
MAX_PENDING = 64 << 20  # a connection's unread requests, and its unsent answers
BACKLOG = 4096  # connections not yet accepted, as torch's server (a large world at once)
_WARN_EVERY = 60.0  # seconds between two warnings about refused connections


READY, NOT_READY = bytes([wire.READY]), bytes([wire.NOT_READY])
STOP_WAITING, WAIT_CANCELED = bytes([wire.STOP_WAITING]), bytes([wire.WAIT_CANCELED])

# what std::stoll takes: leading white space, a sign, decimal digits; the rest is ignored
_COUNT = re.compile(rb"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_INT64 = range(-(1 << 63), 1 << 63)


class Refused(Exception):
    """A request this server does not serve: its connection is closed."""


class _Incomplete(Exception):
    """The request is not all here yet."""


class _Request:
    """A cursor over a connection's unread bytes; a read past their end raises _Incomplete."""

    def __init__(self, data: bytearray) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise _Incomplete
        chunk = bytes(self.data[self.at : end])
        self.at = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def i64(self) -> int:
        return int(struct.unpack("<q", self.take(8))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def key(self) -> bytes:
        size = self.u64()
        if size > MAX_KEY:
            raise Refused(f"a key of {size} bytes (at most {MAX_KEY})")
        return self.take(size)

    def value(self) -> bytes:
        size = self.u64()
        if size > MAX_VALUE:
            raise Refused(f"a value of {size} bytes (at most {MAX_VALUE})")
        return self.take(size)

    def count(self) -> int:
        count = self.u64()
        if count > MAX_KEYS_PER_QUERY:
            raise Refused(f"{count} keys in one query (at most {MAX_KEYS_PER_QUERY})")
        return count


def _int64(value: int) -> bytes:
    return struct.pack("<q", value)


def parse_count(value: bytes) -> int:
    """A stored count as torch's server reads one (``std::stoll``); Refused where it would
    throw (no digits, out of int64's range)."""
    match = _COUNT.match(value)
    if match is not None:
        sign, digits = match.group(1), match.group(2).lstrip(b"0") or b"0"
        # counted before int(), which refuses more than 4300 digits with a ValueError
        if len(digits) <= 19 and (count := int(sign + digits)) in _INT64:
            return count
    raise Refused(f"an add over {value[:32]!r}, which holds no count")


class Keys:
    """The store's keys, values, queues and waiters: what the queries do, without sockets.

    ``send`` is how an answer reaches a waiting client (a connection's ``answer``).
    """

    def __init__(self, max_bytes: int = 0) -> None:
        self.values: dict[bytes, bytes] = {}
        self.queues: dict[bytes, collections.deque[bytes]] = {}
        self.max_bytes = max_bytes or float("inf")  # 0: no limit
        self.held = 0  # bytes of keys and values, queued ones and the keys waited for too
        self.waiters: dict[bytes, list[Waiter]] = {}

    # -- writes ---------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        self._hold(key, value)
        self.values[key] = value
        self._wake(key)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self.values.get(key)
        if current is None:
            if expected:
                return expected  # as torch: the expected value, nothing written, nobody woken
            self.set(key, desired)
            return desired
        if current == expected:
            self.set(key, desired)
            return desired
        return current

    def add(self, key: bytes, amount: int) -> int:
        current = self.values.get(key)
        total = amount + (parse_count(current) if current is not None else 0)
        if total not in _INT64:
            raise Refused(f"an add past int64 at {key[:64]!r}")
        self.set(key, str(total).encode())
        return total

    def append(self, key: bytes, value: bytes) -> None:
        current = self.values.get(key, b"")
        if len(current) + len(value) > MAX_HELD_VALUE:
            raise Refused(f"an append past {MAX_HELD_VALUE} bytes at {key[:64]!r}")
        self.set(key, current + value)

    def delete(self, key: bytes) -> int:
        value = self.values.pop(key, None)
        if value is None:
            return 0
        self.held -= len(key) + len(value)
        return 1

    def push(self, key: bytes, value: bytes) -> None:
        self._take(len(key) + len(value))
        self.queues.setdefault(key, collections.deque()).append(value)
        for waiter in self.waiters.get(key, ()):  # one popper is told, as torch's server does
            if waiter.awaited == {key}:
                self._arrived(key, waiter)
                break

    def pop(self, key: bytes) -> bytes:
        queue = self.queues.get(key)
        answer = _int64(len(queue) if queue else 0)
        if queue:
            value = queue.popleft()
            self.held -= len(key) + len(value)
            answer += blob(value)
            if not queue:
                del self.queues[key]
        return answer

    def barrier(self, key: bytes, world_size: int, waiter: Waiter) -> bool:
        """This client's arrival; True when it was the last (every earlier one is woken)."""
        current = self.values.get(key)
        count = parse_count(current) + 1 if current is not None else 1
        self._hold(key, str(count).encode())
        self.values[key] = str(count).encode()
        if count >= world_size:
            self._wake(key)
            return True
        self._await(waiter, {key})
        return False

    # -- reads ----------------------------------------------------------------------------

    def present(self, key: bytes) -> bool:
        return key in self.values or bool(self.queues.get(key))

    def wait(self, keys: list[bytes], waiter: Waiter) -> bool:
        """True when every key is there; else the waiter is told when they are."""
        missing = {key for key in keys if not self.present(key)}
        if not missing:
            return True
        self._await(waiter, missing)
        return False

    def cancel(self, waiter: Waiter) -> None:
        for key in waiter.awaited:
            waiting = self.waiters.get(key, [])
            if waiter in waiting:
                waiting.remove(waiter)
            if not waiting:
                self.waiters.pop(key, None)
        waiter.awaited = set()
        self._done_waiting(waiter)

    def answer_size(self, keys: list[bytes]) -> int:
        """Bytes of a MULTI_GET's answer (checked before it is made: one key named many
        times in one small request would have the daemon build gigabytes)."""
        return sum(8 + len(self.values.get(key, b"")) for key in keys)

    # -- bookkeeping ----------------------------------------------------------------------

    def _hold(self, key: bytes, value: bytes) -> None:
        current = self.values.get(key)
        self._take(len(value) - (len(current) if current is not None else -len(key)))

    def _take(self, grows: int) -> None:
        if grows > 0 and self.held + grows > self.max_bytes:
            raise Refused(f"the store holds {self.held} bytes (at most {self.max_bytes})")
        self.held += grows

    def _await(self, waiter: Waiter, keys: Iterable[bytes]) -> None:
        self.cancel(waiter)  # one wait per connection, as torch's clients send them
        awaited = set(keys)
        size = sum(map(len, awaited))  # counted while waited for: each connection may wait
        self._take(size)
        waiter.awaited, waiter.held = awaited, size
        for key in awaited:
            self.waiters.setdefault(key, []).append(waiter)

    def _done_waiting(self, waiter: Waiter) -> None:
        self.held -= waiter.held
        waiter.held = 0

    def _wake(self, key: bytes) -> None:
        for waiter in self.waiters.pop(key, ()):
            self._arrived(key, waiter, listed=False)

    def _arrived(self, key: bytes, waiter: Waiter, *, listed: bool = True) -> None:
        if listed:
            waiting = self.waiters[key]
            waiting.remove(waiter)
            if not waiting:
                del self.waiters[key]
        waiter.awaited.discard(key)
        if not waiter.awaited:
            self._done_waiting(waiter)
            waiter.send(STOP_WAITING)


class Waiter:
    """A connection's wait in progress: the keys it still waits for, and how to tell it."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self.send = send
        self.awaited: set[bytes] = set()
        self.held = 0  # bytes of its keys, counted in the store's


class _Connection(asyncio.Protocol):
    def __init__(self, server: TCPStoreServer) -> None:
        self.server = server
        self.keys = server.keys
        self.unread = bytearray()
        self.validated = False
        self.transport: asyncio.Transport | None = None
        self.waiter = Waiter(self.answer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.keys.cancel(self.waiter)
        self.server.connections.discard(self)
        self.unread = bytearray()

    def data_received(self, data: bytes) -> None:
        self.unread += data
        request = _Request(self.unread)
        done = 0  # bytes of the requests served
        try:
            while done < len(self.unread) and self.transport is not None:
                self.serve(request)
                done = request.at
        except _Incomplete:
            if len(self.unread) - done > MAX_PENDING:
                self.refuse(f"a request of more than {MAX_PENDING} bytes")
        except Refused as why:
            self.refuse(str(why))
        del self.unread[:done]

    def answer(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if transport.get_write_buffer_size() > MAX_PENDING:
            self.refuse(f"more than {MAX_PENDING} bytes of answers it does not read")

    def refuse(self, why: str) -> None:
        self.server.refused(self.transport, why)
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def serve(self, request: _Request) -> None:
        """Read one whole request, then act on it (a request cut short changes nothing:
        _Incomplete is raised before any change)."""
        query = request.u8()
        if not self.validated:
            if query != Query.VALIDATE or request.u32() != MAGIC:
                raise Refused("not a TCPStore client: it did not open with VALIDATE")
            self.validated = True
            return
        keys = self.keys
        if query == Query.PING:
            self.answer(request.take(4))
        elif query == Query.SET:
            key, value = request.key(), request.value()
            keys.set(key, value)
        elif query == Query.COMPARE_SET:
            key, expected, desired = request.key(), request.value(), request.value()
            self.answer(blob(keys.compare_set(key, expected, desired)))
        elif query == Query.GET:
            self.answer(blob(keys.values.get(request.key(), b"")))
        elif query == Query.ADD:
            key, amount = request.key(), request.i64()
            self.answer(_int64(keys.add(key, amount)))
        elif query == Query.CHECK:
            wanted = [request.key() for _ in range(request.count())]
            self.answer(READY if all(map(keys.present, wanted)) else NOT_READY)
        elif query == Query.WAIT:
            wanted = [request.key() for _ in range(request.count())]
            if keys.wait(wanted, self.waiter):
                self.answer(STOP_WAITING)
        elif query == Query.GETNUMKEYS:
            self.answer(_int64(len(keys.values)))
        elif query == Query.DELETE_KEY:
            self.answer(_int64(keys.delete(request.key())))
        elif query == Query.APPEND:
            key, value = request.key(), request.value()
            keys.append(key, value)
        elif query == Query.MULTI_GET:
            wanted = [request.key() for _ in range(request.count())]
            if keys.answer_size(wanted) > MAX_PENDING:
                raise Refused(f"a MULTI_GET whose answer is over {MAX_PENDING} bytes")
            self.answer(b"".join(blob(keys.values.get(key, b"")) for key in wanted))
        elif query == Query.MULTI_SET:
            pairs = [(request.key(), request.value()) for _ in range(request.count())]
            for key, value in pairs:
                keys.set(key, value)
        elif query == Query.CANCEL_WAIT:
            keys.cancel(self.waiter)
            self.answer(WAIT_CANCELED)
        elif query == Query.QUEUE_PUSH:
            key, value = request.key(), request.value()
            keys.push(key, value)
        elif query == Query.QUEUE_POP:
            self.answer(keys.pop(request.key()))
        elif query == Query.QUEUE_LEN:
            self.answer(_int64(len(keys.queues.get(request.key(), ()))))
        elif query == Query.LIST_KEYS:
            self.answer(_int64(len(keys.values)) + b"".join(map(blob, keys.values)))
        elif query == Query.BARRIER:
            key, world_size = request.key(), request.i64()
            if keys.barrier(key, world_size, self.waiter):
                self.answer(STOP_WAITING)
        else:
            raise Refused(f"query {query}, which TCPStore does not have")


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host`` only (TCPStore alone would listen on every address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise StoreConnectionError(f"cannot host the store on {host}:{port}: {err}") from err
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        raise StoreConnectionError(f"cannot host the store on {host}:{port}: {err}") from err
    return sock


class TCPStoreServer:
    """Serves the store at ``host:port`` (0: any free port) from a thread of its own, until
    :meth:`close`; ``max_bytes`` of keys and values at most (0: no limit)."""

    def __init__(self, host: str, port: int = 0, *, max_bytes: int = 0) -> None:
        self.host = host
        self.keys = Keys(max_bytes)
        self.connections: set[_Connection] = set()
        self._last_warning = -_WARN_EVERY
        self._quiet = 0  # refusals not logged since the last warning
        sock = listen(host, port)
        self.port: int = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(sock,), name=f"store-server-{self.port}", daemon=True
        )
        self._thread.start()
        self._started.wait()
        if self._failed is not None:
            self._thread.join()
            raise StoreConnectionError(
                f"cannot host the store on {host}:{port}: {self._failed}"
            ) from self._failed

    @property
    def endpoint(self) -> str:
        return join_endpoint(self.host, self.port)

    def close(self) -> None:
        """Stop serving: the listening socket and every connection are closed when this returns."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def refused(self, transport: asyncio.BaseTransport | None, why: str) -> None:
        now = time.monotonic()
        if now - self._last_warning < _WARN_EVERY:
            self._quiet += 1
            return
        peer = transport.get_extra_info("peername") if transport is not None else None
        more = f" ({self._quiet} more since the last warning)" if self._quiet else ""
        log.warning("the store closed the connection of %s: %s%s", peer, why, more)
        self._last_warning, self._quiet = now, 0

    def _run(self, sock: socket.socket) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                loop.create_server(lambda: _Connection(self), sock=sock, backlog=BACKLOG)
            )
        except BaseException as exc:
            self._failed = exc
            sock.close()
            loop.close()
            self._started.set()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for connection in list(self.connections):
                if connection.transport is not None:
                    connection.transport.abort()
            loop.run_until_complete(server.wait_closed())
            loop.run_until_complete(asyncio.sleep(0))  # the aborted transports' callbacks
            loop.close()
