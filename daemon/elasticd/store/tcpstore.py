"""TCPStoreClient: the c10d TCPStore's wire protocol, spoken from the event loop.

torch's TCPStore client blocks, cannot cancel a wait and cannot be interrupted, so calling it
from a daemon meant a thread per call in flight, two thread wake-ups per call (measured here:
120 us a call through a thread, 50 us on the loop), and a wait nobody awaits any more
holding its thread until its timeout.  This client needs neither threads nor torch: each
call is a write and a read on a connection of its own from a small pool; a call given up
(its deadline passed, its task cancelled) closes its connection, and a wait that timed out
is cancelled on the wire (CANCEL_WAIT) so that its connection is reused.

The protocol is torch's (``torch/csrc/distributed/c10d/TCPStore.cpp`` and
``TCPStoreBackend.hpp``, checked against torch 2.13's libuv server by the contract suite):
a request is a one-byte query type and its arguments; byte strings are a little-endian
uint64 length and the bytes, integers little-endian; every key carries the client prefix
``/`` that torch's client adds, so torch's own clients see the same keys.  A connection
opens with VALIDATE (a magic number) and a PING that the server echoes.  Writes that the
server does not answer (SET, APPEND) are followed by a PING in the same packet: a call
returns once the store applied it.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from elasticd.endpoint import split_endpoint
from elasticd.errors import StoreConnectionError, StoreTimeout
from elasticd.store.base import check_compare_value, lost_add
from elasticd.store.tcpwire import (
    MAGIC,
    NOT_READY,
    READY,
    STOP_WAITING,
    WAIT_CANCELED,
    Query,
    blob,
)

MISSING = b"\x00elasticd:missing\x00"  # compare_set(k, MISSING, MISSING) reads k without blocking
_MAX_VALUE = 16 << 20  # bytes: more than any record of ours; torch's server resets bigger values
_MAX_LISTED = 1 << 24  # keys a LIST_KEYS may announce
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 2.0


def _stored(key: str) -> bytes:
    """A key as TCPStore holds it: torch's clients put "/" before every key."""
    return ("/" + key).encode()


def _key(key: str) -> bytes:
    return blob(_stored(key))


def _query(query: Query, *args: bytes) -> bytes:
    return bytes([query]) + b"".join(args)


class StoreProtocolError(StoreConnectionError):
    """The peer answered something TCPStore never sends: not a TCPStore, or out of step."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._nonce = os.getpid() & 0xFFFFFFFF

    def send(self, *frames: bytes) -> None:
        self._writer.write(b"".join(frames))

    def ping(self) -> bytes:
        return _query(Query.PING, struct.pack("<I", self._nonce))

    async def pong(self) -> None:
        (nonce,) = struct.unpack("<I", await self._reader.readexactly(4))
        if nonce != self._nonce:
            raise StoreProtocolError(f"the store echoed {nonce:#x} to a ping of {self._nonce:#x}")

    async def byte(self) -> int:
        return (await self._reader.readexactly(1))[0]

    async def int64(self) -> int:
        return struct.unpack("<q", await self._reader.readexactly(8))[0]

    async def blob(self) -> bytes:
        (size,) = struct.unpack("<Q", await self._reader.readexactly(8))
        if size > _MAX_VALUE:  # a hostile peer would have us buffer whatever it sends
            raise StoreProtocolError(
                f"the store announced a value of {size} bytes (at most {_MAX_VALUE})"
            )
        return await self._reader.readexactly(size)

    @property
    def usable(self) -> bool:
        return not self._writer.is_closing() and not self._reader.at_eof()

    def close(self) -> None:
        """At once, unsent bytes dropped: a write whose caller gave up must not land later,
        over a newer one."""
        self._writer.transport.abort()


Exchange = Callable[[_Connection], Awaitable[Any]]


class TCPStoreClient:
    """The store operations as coroutines over a TCPStore server (see the module docstring).

    At most ``connections`` calls and ``waits`` waits are on the wire at once; each call has a
    deadline of ``timeout`` seconds (a wait: its own timeout plus that), past which it raises
    StoreTimeout.  A call fails at once with StoreConnectionError when the store refuses
    connections (its callers retry on their own schedule and report the store down
    meanwhile); only :meth:`connect` waits for a store to come up.
    """

    def __init__(
        self, endpoint: str, *, timeout: float = 30.0, connections: int = 4, waits: int = 64
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._host, self._port = split_endpoint(endpoint)
        self._calls = asyncio.Semaphore(connections)
        self._waits = asyncio.Semaphore(waits)
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._unreachable: BaseException | None = None  # why the last connect failed
        self._closed = False

    # -- the store operations -------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        value = await self._call(_cas(key, MISSING, MISSING), _Connection.blob)
        return None if value == MISSING else value

    async def set(self, key: str, value: bytes) -> None:
        await self._call(_query(Query.SET, _key(key), blob(value)), _Connection.pong, ping=True)

    async def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        check_compare_value(expected)
        if expected == desired:  # TCPStore's answer would be ambiguous; a no-op swap is a read
            current = await self.get(key)
            return current == desired, current
        value = await self._call(_cas(key, expected or b"", desired), _Connection.blob)
        if value == desired:
            return True, value
        if (
            expected is not None and value == expected
        ):  # TCPStore echoes `expected` on a missing key
            return False, None
        return False, value

    async def add(self, key: str, amount: int) -> int:
        """NotACounter when the key holds no count: torch's server answers an ADD over a value
        that ``std::stoll`` does not take (junk, a number past int64, nothing) by dropping
        the connection, which a lost connection does too; a read on a new one tells them
        apart where it can (``lost_add``: a count there makes an add of 0 a read, any other
        an AddInDoubt)."""
        try:
            return await self._call(
                _query(Query.ADD, _key(key), struct.pack("<q", amount)), _Connection.int64
            )
        except StoreConnectionError as lost:
            # a store that is gone fails this read too
            return lost_add(key, amount, await self.get(key), lost)

    async def append(self, key: str, value: bytes) -> None:
        await self._call(_query(Query.APPEND, _key(key), blob(value)), _Connection.pong, ping=True)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Every key's value in one round trip (the reads are pipelined)."""
        if not keys:
            return []

        async def answers(conn: _Connection) -> list[bytes | None]:
            values = [await conn.blob() for _ in keys]
            return [None if value == MISSING else value for value in values]

        return await self._call(b"".join(_cas(key, MISSING, MISSING) for key in keys), answers)

    async def delete(self, key: str) -> bool:
        return await self._call(_query(Query.DELETE_KEY, _key(key)), _Connection.int64) > 0

    async def delete_under(self, prefixes: list[str]) -> int:
        """TCPStore has no range: one LIST_KEYS (every key the store holds), then the
        deletes of those under ``prefixes`` in one round trip."""
        wanted = tuple(_stored(prefix) for prefix in prefixes)

        async def listed(conn: _Connection) -> list[bytes]:
            count = await conn.int64()
            if not 0 <= count <= _MAX_LISTED:
                raise StoreProtocolError(f"the store announced {count} keys")
            keys = []
            for _ in range(count):  # only those wanted are kept: the store may hold millions
                key = await conn.blob()
                if key.startswith(wanted):
                    keys.append(key)
            return keys

        doomed = await self._call(_query(Query.LIST_KEYS), listed) if wanted else []
        if not doomed:
            return 0

        async def deleted(conn: _Connection) -> int:
            return sum([await conn.int64() > 0 for _ in doomed])

        deletes = b"".join(_query(Query.DELETE_KEY, blob(key)) for key in doomed)
        return await self._call(deletes, deleted)

    async def wait_for(self, key: str, timeout: float) -> bool:
        """True once ``key`` exists, False after ``timeout`` seconds."""
        if timeout <= 0:
            check = _query(Query.CHECK, struct.pack("<Q", 1), _key(key))
            return await self._call(check, _check_answer)
        ends = asyncio.get_running_loop().time() + timeout  # a wait for a free slot counts

        async def answer(conn: _Connection) -> bool:
            try:
                async with asyncio.timeout_at(ends):
                    response = await conn.byte()
            except TimeoutError:
                conn.send(_query(Query.CANCEL_WAIT))
                response = await conn.byte()
                if response == STOP_WAITING:  # the key came as we cancelled
                    response = await conn.byte()
                if response != WAIT_CANCELED:
                    raise StoreProtocolError(
                        f"unexpected answer {response} to CANCEL_WAIT"
                    ) from None
                return False
            if response != STOP_WAITING:
                raise StoreProtocolError(f"unexpected answer {response} to WAIT")
            return True

        wait = _query(Query.WAIT, struct.pack("<Q", 1), _key(key))
        return await self._call(wait, answer, limit=self._waits, deadline=timeout + self.timeout)

    async def connect(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the store to answer (a daemon may start before
        its store host does)."""
        try:
            async with asyncio.timeout(timeout):
                self._idle.append(await self._connect(retry=True))
        except TimeoutError:
            raise StoreConnectionError(
                f"the store at {self.endpoint} did not answer within "
                f"{timeout:g}s: {self._unreachable or 'no answer'}"
            ) from None

    async def close(self) -> None:
        """Close every connection; calls in flight fail with StoreConnectionError."""
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()

    # -- connections ----------------------------------------------------------------------

    async def _call(
        self,
        request: bytes,
        exchange: Exchange,
        *,
        ping: bool = False,
        limit: asyncio.Semaphore | None = None,
        deadline: float | None = None,
    ) -> Any:
        """Send ``request`` on a free connection and read its answer with ``exchange``, all
        within ``deadline`` (the wait for a free connection too).  A connection whose
        exchange did not complete is closed: its state is unknown."""
        deadline = self.timeout if deadline is None else deadline
        conn = None
        try:
            async with asyncio.timeout(deadline), limit or self._calls:
                conn = await self._take()
                conn.send(request, conn.ping() if ping else b"")
                result = await exchange(conn)
        except TimeoutError:
            self._discard(conn)
            raise StoreTimeout(f"store {self.endpoint}: no answer within {deadline:g}s") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._discard(conn)
            raise StoreConnectionError(
                f"lost the store at {self.endpoint}: {exc or type(exc).__name__}"
            ) from exc
        except BaseException:
            self._discard(conn)
            raise
        if self._closed:  # closed while this call ran: its connection goes with the rest
            self._discard(conn)
        else:
            self._idle.append(conn)
        return result

    async def _take(self) -> _Connection:
        if self._closed:
            raise StoreConnectionError(f"the store client for {self.endpoint} is closed")
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn
            self._discard(conn)
        return await self._connect()

    async def _connect(self, retry: bool = False) -> _Connection:
        """A new validated connection; with ``retry``, tried again with back-off until the
        caller's deadline ends it."""
        backoff = _FIRST_BACKOFF
        while True:
            try:
                return await self._handshake()
            except StoreConnectionError as exc:
                self._unreachable = exc.__cause__ or exc
                if not retry or self._closed:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def _handshake(self) -> _Connection:
        if self._closed:
            raise StoreConnectionError(f"the store client for {self.endpoint} is closed")
        try:
            reader, writer = await asyncio.open_connection(self._host, self._port)
        except OSError as exc:
            raise StoreConnectionError(f"cannot reach the store at {self.endpoint}: {exc}") from exc
        conn = _Connection(reader, writer)
        self._open.add(conn)
        try:
            conn.send(_query(Query.VALIDATE, struct.pack("<I", MAGIC)), conn.ping())
            await conn.pong()
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._discard(conn)
            raise StoreConnectionError(
                f"the store at {self.endpoint} broke off the handshake: {exc or type(exc).__name__}"
            ) from exc
        except BaseException:
            self._discard(conn)
            raise
        if self._closed:  # closed during the handshake
            self._discard(conn)
            raise StoreConnectionError(f"the store client for {self.endpoint} is closed")
        self._unreachable = None
        return conn

    def _discard(self, conn: _Connection | None) -> None:
        if conn is not None:
            conn.close()
            self._open.discard(conn)


async def _check_answer(conn: _Connection) -> bool:
    response = await conn.byte()
    if response not in (READY, NOT_READY):
        raise StoreProtocolError(f"unexpected answer {response} to CHECK")
    return response == READY


def _cas(key: str, expected: bytes, desired: bytes) -> bytes:
    return _query(Query.COMPARE_SET, _key(key), blob(expected), blob(desired))
