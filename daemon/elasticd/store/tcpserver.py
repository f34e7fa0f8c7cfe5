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
  and unsent answers, those of all its connections together, and the connections open to
  every store of the process; a request past a cap closes that connection (logged once a
  minute), the store and every other connection go on.  A request is read once however
  it is cut into pieces.  A key is at most 8 KiB and a request's value
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
import contextlib
import logging
import re
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

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
MAX_BUFFERED = 4 * MAX_PENDING  # the same of all of a server's connections together
# what a key or a value costs beyond its bytes (a bytes object, a dict's or a list's slot):
# counted, or a million 8-byte keys counted as 8 MiB took 101 MiB
ENTRY = 100
MAX_CONNECTIONS = 1 << 16  # of every store this process serves (see connection_budget)
CLOSE_WAIT = 5.0  # seconds close() waits for the connections' ends (they were aborted)
BACKLOG = 4096  # connections not yet accepted, as torch's server (a large world at once)
_WARN_EVERY = 60.0  # seconds between two warnings about refused connections


READY, NOT_READY = bytes([wire.READY]), bytes([wire.NOT_READY])
STOP_WAITING, WAIT_CANCELED = bytes([wire.STOP_WAITING]), bytes([wire.WAIT_CANCELED])

# what std::stoll takes: leading white space, a sign, decimal digits; the rest is ignored
_COUNT = re.compile(rb"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_INT64 = range(-(1 << 63), 1 << 63)


class Refused(Exception):
    """A request this server does not serve: its connection is closed."""


Reading = Generator[None, None, Any]  # a read that yields until enough bytes are there


class _Cursor:
    """A connection's unread bytes, read by resumable reads: a read past their end yields
    until more arrive, so a request that comes in many pieces is read once, not again from
    its start at each piece (a MULTI_SET of 128K keys sent 1 KiB at a time had the server
    walk its keys thousands of times: minutes of the thread every connection shares)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.at = 0  # read up to here
        self.start = 0  # where the request being read began
        self.parsed = 0  # what the fields read so far of that request hold (ENTRY each)

    def take(self, size: int) -> Reading:
        while self.at + size > len(self.data):  # (compact() moves at)
            yield
        chunk = bytes(self.data[self.at : self.at + size])
        self.at += size
        return chunk

    def u32(self) -> Reading:
        return struct.unpack("<I", (yield from self.take(4)))[0]

    def i64(self) -> Reading:
        return struct.unpack("<q", (yield from self.take(8)))[0]

    def u64(self) -> Reading:
        return struct.unpack("<Q", (yield from self.take(8)))[0]

    def key(self) -> Reading:
        size = yield from self.u64()
        if size > MAX_KEY:
            raise Refused(f"a key of {size} bytes (at most {MAX_KEY})")
        return (yield from self.field(size))

    def value(self) -> Reading:
        size = yield from self.u64()
        if size > MAX_VALUE:
            raise Refused(f"a value of {size} bytes (at most {MAX_VALUE})")
        return (yield from self.field(size))

    def field(self, size: int) -> Reading:
        """A key or a value, held until its request is all here: counted (``parsed``)."""
        chunk = yield from self.take(size)
        self.parsed += size + ENTRY
        return chunk

    @property
    def holding(self) -> int:
        """The bytes this cursor holds: those unread and those of the fields read."""
        return len(self.data) + self.parsed

    def count(self) -> Reading:
        count = yield from self.u64()
        if count > MAX_KEYS_PER_QUERY:
            raise Refused(f"{count} keys in one query (at most {MAX_KEYS_PER_QUERY})")
        return count

    def keys(self) -> Reading:
        keys = []
        for _ in range((yield from self.count())):
            keys.append((yield from self.key()))
        return keys

    def pairs(self) -> Reading:
        pairs = []
        for _ in range((yield from self.count())):
            key = yield from self.key()
            pairs.append((key, (yield from self.value())))
        return pairs

    def fields(self, layout: str) -> Reading:
        """The fields of a query laid out as ``layout`` (see ``_LAYOUTS``)."""
        fields = []
        for field in layout:
            fields.append((yield from _READERS[field](self)))
        return fields

    def compact(self) -> None:
        """Drop the bytes of the requests read (once per arrival: not per request)."""
        if self.start:
            del self.data[: self.start]
            self.at -= self.start
            self.start = 0


_READERS: dict[str, Callable[[_Cursor], Reading]] = {
    "4": lambda cursor: cursor.take(4),
    "k": lambda cursor: cursor.key(),
    "v": lambda cursor: cursor.value(),
    "q": lambda cursor: cursor.i64(),
    "K": lambda cursor: cursor.keys(),
    "P": lambda cursor: cursor.pairs(),
}

# each query's fields: k a key, v a value, q an int64, 4 four bytes, K keys, P key-value pairs
_LAYOUTS = {
    Query.PING: "4",
    Query.SET: "kv",
    Query.COMPARE_SET: "kvv",
    Query.GET: "k",
    Query.ADD: "kq",
    Query.CHECK: "K",
    Query.WAIT: "K",
    Query.GETNUMKEYS: "",
    Query.DELETE_KEY: "k",
    Query.APPEND: "kv",
    Query.MULTI_GET: "K",
    Query.MULTI_SET: "P",
    Query.CANCEL_WAIT: "",
    Query.QUEUE_PUSH: "kv",
    Query.QUEUE_POP: "k",
    Query.QUEUE_LEN: "k",
    Query.LIST_KEYS: "",
    Query.BARRIER: "kq",
}


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
        # in the order they came (a dict: one of thousands leaves at once)
        self.waiters: dict[bytes, dict[Waiter, None]] = {}

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
        self.held -= len(key) + len(value) + ENTRY
        return 1

    def push(self, key: bytes, value: bytes) -> None:
        self._take(len(key) + len(value) + ENTRY)
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
            self.held -= len(key) + len(value) + ENTRY
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
            waiting = self.waiters.get(key, {})
            waiting.pop(waiter, None)
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
        self._take(len(value) - (len(current) if current is not None else -len(key) - ENTRY))

    def _take(self, grows: int) -> None:
        if grows > 0 and self.held + grows > self.max_bytes:
            raise Refused(f"the store holds {self.held} bytes (at most {self.max_bytes})")
        self.held += grows

    def _await(self, waiter: Waiter, keys: Iterable[bytes]) -> None:
        self.cancel(waiter)  # one wait per connection, as torch's clients send them
        awaited = set(keys)
        # counted while waited for: each connection may wait
        size = sum(len(key) + ENTRY for key in awaited)
        self._take(size)
        waiter.awaited, waiter.held = awaited, size
        for key in awaited:
            self.waiters.setdefault(key, {})[waiter] = None

    def _done_waiting(self, waiter: Waiter) -> None:
        self.held -= waiter.held
        waiter.held = 0

    def _wake(self, key: bytes) -> None:
        for waiter in self.waiters.pop(key, ()):
            self._arrived(key, waiter, listed=False)

    def _arrived(self, key: bytes, waiter: Waiter, *, listed: bool = True) -> None:
        if listed:
            waiting = self.waiters[key]
            del waiting[waiter]
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
        self.cursor = _Cursor()
        self.reading: Reading | None = None  # the request being read
        self.validated = False
        self.transport: asyncio.Transport | None = None
        self.waiter = Waiter(self.answer)
        self.buffered = 0  # its unread bytes and unsent answers, as last counted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.server.closing:  # accepted in the loop's last turn: after the aborts
            transport.abort()
            self.transport = None
            return
        if not self.server.admit(self):
            self.refuse(f"more than {self.server.max_connections} store connections open")
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.keys.cancel(self.waiter)
        self.server.let_go(self)
        self.cursor, self.reading = _Cursor(), None

    def data_received(self, data: bytes) -> None:
        cursor = self.cursor
        cursor.data += data
        try:
            while self.transport is not None:
                if self.reading is None:
                    if cursor.at == len(cursor.data):
                        break
                    cursor.start, cursor.parsed = cursor.at, 0
                    self.reading = self._read()
                try:
                    next(self.reading)
                    break  # the request is not all here yet
                except StopIteration as read:
                    self.reading = None
                    self.serve(*read.value)
            else:
                return
            if cursor.holding - cursor.start > MAX_PENDING:
                raise Refused(f"a request of more than {MAX_PENDING} bytes")
        except Refused as why:
            self.refuse(str(why))
            return
        if self.reading is None:
            cursor.start, cursor.parsed = cursor.at, 0
        cursor.compact()
        self.count_buffered()

    def answer(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if transport.get_write_buffer_size() > MAX_PENDING:
            self.refuse(f"more than {MAX_PENDING} bytes of answers it does not read")
        else:
            self.count_buffered()

    def count_buffered(self) -> None:
        """Its share of the server's buffered bytes, counted again (see ``TCPStoreServer``)."""
        self.count_buffered_quietly()
        if self.server.buffered > self.server.max_buffered:
            self.server.over_budget()

    def count_buffered_quietly(self) -> None:
        transport = self.transport
        now = self.cursor.holding + (transport.get_write_buffer_size() if transport else 0)
        self.server.buffered += now - self.buffered
        self.buffered = now

    def refuse(self, why: str) -> None:
        self.server.refused(self.transport, why)
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def _read(self) -> Reading:
        """One whole request: its query and fields (nothing changes until it is all here)."""
        cursor = self.cursor
        query = (yield from cursor.take(1))[0]
        if not self.validated:
            if query != Query.VALIDATE or (yield from cursor.u32()) != MAGIC:
                raise Refused("not a TCPStore client: it did not open with VALIDATE")
            return Query.VALIDATE, []
        layout = _LAYOUTS.get(query)
        if layout is None:
            raise Refused(f"query {query}, which TCPStore does not have")
        return query, (yield from cursor.fields(layout))

    def serve(self, query: int, fields: list[Any]) -> None:
        keys = self.keys
        if query == Query.VALIDATE:
            self.validated = True
        elif query == Query.PING:
            self.answer(fields[0])
        elif query == Query.SET or query == Query.MULTI_SET:
            for key, value in [fields] if query == Query.SET else fields[0]:
                keys.set(key, value)
        elif query == Query.COMPARE_SET:
            self.answer(blob(keys.compare_set(*fields)))
        elif query == Query.GET:
            self.answer(blob(keys.values.get(fields[0], b"")))
        elif query == Query.ADD:
            self.answer(_int64(keys.add(*fields)))
        elif query == Query.CHECK:
            self.answer(READY if all(map(keys.present, fields[0])) else NOT_READY)
        elif query == Query.WAIT:
            if keys.wait(fields[0], self.waiter):
                self.answer(STOP_WAITING)
        elif query == Query.GETNUMKEYS:
            self.answer(_int64(len(keys.values)))
        elif query == Query.DELETE_KEY:
            self.answer(_int64(keys.delete(fields[0])))
        elif query == Query.APPEND:
            keys.append(*fields)
        elif query == Query.MULTI_GET:
            if keys.answer_size(fields[0]) > MAX_PENDING:
                raise Refused(f"a MULTI_GET whose answer is over {MAX_PENDING} bytes")
            self.answer(b"".join(blob(keys.values.get(key, b"")) for key in fields[0]))
        elif query == Query.CANCEL_WAIT:
            keys.cancel(self.waiter)
            self.answer(WAIT_CANCELED)
        elif query == Query.QUEUE_PUSH:
            keys.push(*fields)
        elif query == Query.QUEUE_POP:
            self.answer(keys.pop(fields[0]))
        elif query == Query.QUEUE_LEN:
            self.answer(_int64(len(keys.queues.get(fields[0], ()))))
        elif query == Query.LIST_KEYS:
            self.answer(_int64(len(keys.values)) + b"".join(map(blob, keys.values)))
        elif query == Query.BARRIER:
            key, world_size = fields
            if keys.barrier(key, world_size, self.waiter):
                self.answer(STOP_WAITING)


def connection_budget() -> int:
    """Store connections this process may hold open: a quarter of its open-file limit (the
    rest is for workers' pipes and logs, peers and control clients), ``MAX_CONNECTIONS``
    at most."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = MAX_CONNECTIONS * 4 if soft == resource.RLIM_INFINITY else soft
    return max(16, min(MAX_CONNECTIONS, limit // 4))


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
    :meth:`close`; ``max_bytes`` of keys and values at most (0: no limit).

    What its connections buffer (requests not all here, answers not read) is bounded in
    all, not only per connection: past ``max_buffered`` the connection that holds the most
    is closed.  And the connections of every store this process serves are
    ``max_connections`` at most (a quarter of the open-file limit, at most 65536): past it
    a new one is closed at once, so that a flood of connections takes neither the memory
    nor the file descriptors the daemon's other work needs.
    """

    _open = 0  # connections of every server of this process
    _open_lock = threading.Lock()

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        max_bytes: int = 0,
        max_buffered: int = MAX_BUFFERED,
        max_connections: int = 0,
    ) -> None:
        self.host = host
        self.keys = Keys(max_bytes)
        self.connections: set[_Connection] = set()
        self.max_buffered = max_buffered
        self.max_connections = max_connections or connection_budget()
        self.buffered = 0  # bytes its connections buffer, counted when each changes
        self.closing = False  # set on its thread: a connection made from then on is aborted
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

    @staticmethod
    def open_connections() -> int:
        """Connections open to every store this process serves."""
        return TCPStoreServer._open

    def admit(self, connection: _Connection) -> bool:
        """Count a new connection in, unless this process has ``max_connections`` open."""
        with TCPStoreServer._open_lock:
            if TCPStoreServer._open >= self.max_connections:
                return False
            TCPStoreServer._open += 1
        self.connections.add(connection)
        return True

    def let_go(self, connection: _Connection) -> None:
        if connection in self.connections:
            self.connections.discard(connection)
            with TCPStoreServer._open_lock:
                TCPStoreServer._open -= 1
        self.buffered -= connection.buffered
        connection.buffered = 0

    def over_budget(self) -> None:
        """The buffered bytes counted are over ``max_buffered``: count them again (answers
        sent since lower them), and while still over, close the connection holding most."""
        self.buffered = 0
        for connection in self.connections:
            connection.buffered = 0
            connection.count_buffered_quietly()
        while self.buffered > self.max_buffered and self.connections:
            biggest = max(self.connections, key=lambda c: c.buffered)
            self.let_go(biggest)
            biggest.refuse(
                f"the store's connections buffer more than {self.max_buffered} bytes, "
                "and it the most"
            )

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
            try:
                self._close_on_loop(server, sock)
            finally:
                loop.close()

    def _close_on_loop(self, server: asyncio.Server, sock: socket.socket) -> None:
        """Accept no more, end every connection, the ones accepted in the last turns too
        (their transports not made yet: made once the server is closed, asyncio's failed,
        and left their sockets open until a garbage collection), then close the server."""
        loop = self._loop
        self.closing = True  # a connection made from now on ends at once (connection_made)
        loop.remove_reader(sock.fileno())
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
        ends = time.monotonic() + CLOSE_WAIT
        while (accepting := asyncio.all_tasks(loop)) and time.monotonic() < ends:
            loop.run_until_complete(asyncio.wait(accepting, timeout=ends - time.monotonic()))
        server.close()
        with contextlib.suppress(TimeoutError):  # (3.12+ waits for every connection)
            loop.run_until_complete(asyncio.wait_for(server.wait_closed(), CLOSE_WAIT))
        for _ in range(2):  # the aborted transports' callbacks (connection_lost)
            loop.run_until_complete(asyncio.sleep(0))
        for connection in list(self.connections):  # counted out, whatever ran
            self.let_go(connection)
