"""The agent's end of the channel to an in-place job's workers (the worker's end is
``elasticd.elastic.runtime``): a Unix socket per job in the daemon's runtime directory,
owned by the job's user and no one else (0600), JSON lines.

Workers never reach the cluster store through it: all they learn is their own place in a
round and notices.  They tell it when they ask for a place, and their progress (a commit, a
step: at most once a second per worker is passed on), which a job with ``--hang-timeout``
watches; a worker's hello names the signal on which its library dumps its stacks
(faulthandler), which the agent sends only to a worker that named one.  A classic job with a
hang timeout has the channel too, for progress only. A line over 64 KiB, one that is not a message (:func:`decode`: bounded
JSON of the right shape, or :class:`Malformed`) or a peer that does not read closes that
connection, never the agent.

What a job writes here is rate-limited, as the control socket's users are: a worker needs a
line or two a round, and four workers that wrote ``ready`` as fast as they could (431,000
lines in 40 s) held the daemon at 72% CPU and another user's ``elasticctl list`` at 1.25 s.
A slot's lines beyond :data:`LINES_PER_SECOND` (after a burst of :data:`LINE_BURST`) wait
unread, so the worker's writes block in the kernel (slowed); :data:`PATIENCE` lines past
the rate in a row close its connection (the worker's next ask then fails: its own problem,
its job's other workers keep theirs).  Connections are accepted at a pace too (the job's
user may connect in a loop): beyond a burst, at most one per slot a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticd.faults import Throttle, held_back
from elasticd.wire import safejson

log = logging.getLogger(__name__)

_MAX_LINE = 64 * 1024
_MAX_BUFFERED = 256 * 1024  # unread notices a worker may hold before it is cut off
_MAX_DEPTH = 4  # {"op": ...} holds scalars only
_WHY = ("start", "interrupt", "failure")
PROGRESS_EVERY = 1.0  # seconds: a worker's progress is passed on at most this often
_SIGNALS = range(1, 65)  # a signal a library may name for its stack dumps (not 9, not 19)
LINES_PER_SECOND = 10.0  # a slot's lines after the burst: a worker needs one or two a round
LINE_BURST = 20
PATIENCE = 50  # lines past the rate in a row, each slowed, before the connection is closed


class Bucket:
    """A token bucket (pure: the caller gives the time): ``rate`` a second, ``burst`` at most."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self._rate, self._burst = rate, burst
        self._tokens, self._at = burst, now

    def take(self, now: float) -> float:
        """Take a token: 0.0 when one was there, else how long to wait for the one taken
        (each taken ahead of time makes the next one later)."""
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self._rate


class Malformed(ValueError):
    """A line from a worker that is no message of the channel (its connection is closed)."""


@dataclass(frozen=True)
class Hello:
    """A worker says which slot it is, and on which signal its library dumps its stacks (0:
    none)."""

    slot: int
    stacks: int = 0


@dataclass(frozen=True)
class Progress:
    """A worker made progress (a commit, a step)."""


@dataclass(frozen=True)
class Ready:
    """A worker asked for its place in a round after ``after``."""

    slot: int
    after: int
    why: str  # start | interrupt | failure
    error: str  # what broke, for "failure"


class WorkerLink:
    def __init__(
        self,
        path: str,
        *,
        uid: int,
        gid: int,
        slots: int,
        on_ready: Callable[[Ready], None],
        on_progress: Callable[[int], None] = lambda slot: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._uid, self._gid, self._slots = uid, gid, slots
        self._on_ready = on_ready
        self._on_progress = on_progress
        self._clock = clock
        self._progressed: dict[int, float] = {}  # slot -> when its progress was last passed on
        self.stack_signals: dict[int, int] = {}  # slot -> the signal its library dumps stacks on
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._places: dict[int, tuple[int, dict[str, str]]] = {}
        self._asked: dict[int, int] = {}  # slot -> the round it last asked to leave behind
        self._connections = 0
        self.accepted = 0  # connections accepted, all told
        self.cut_off = 0  # connections closed for sending too fast
        self._accepts = Bucket(slots, 2 * slots + 4, clock())
        self._lines: dict[int, Bucket] = {}  # by slot: a new connection of a slot finds its own
        self._over: dict[int, int] = {}  # by slot: lines past the rate, in a row
        self._told = Throttle()
        self._sock: socket.socket | None = None

    def bind(self) -> None:
        """Listen on the job's socket now (0600, the job's user's): a worker that connects
        before ``serve`` runs waits in the backlog."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
            if os.getuid() == 0:
                os.chown(self.path, self._uid, self._gid)
            self._sock.listen(2 * self._slots + 4)
        except OSError:
            self._sock.close()
            raise

    async def serve(self) -> None:
        """Serve the socket (bound first, if ``bind`` was not called) until cancelled; each
        connection is a task of this one group, cancelled with it."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        self._sock.setblocking(False)
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as connections:
            while True:
                pause = self._accepts.take(self._clock())
                if pause:  # connecting in a loop: the next connect waits in the backlog
                    await asyncio.sleep(pause)
                try:
                    conn, _ = await loop.sock_accept(self._sock)
                except OSError as exc:  # out of fds or memory: never stop listening
                    if (held := self._told.check("accept", self._clock())) is not None:
                        log.warning(
                            "worker channel %s: cannot accept: %s%s",
                            self.path,
                            exc,
                            held_back(held),
                        )
                    await asyncio.sleep(1.0)  # a back-off
                    continue
                self.accepted += 1
                connections.create_task(self._serve(conn))

    async def close(self) -> None:
        """Close the socket and every worker's connection (``serve`` was cancelled first)."""
        for writer in self._writers.values():
            writer.close()
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- what the agent tells its workers --------------------------------------------------

    def place(self, slot: int, round: int, env: dict[str, str]) -> None:
        """``slot``'s place in ``round``; sent now if it is connected, else when it says hello."""
        self._places[slot] = (round, env)
        self._send(slot, {"op": "place", "round": round, "env": env})

    def place_round(self, round: int, envs: Mapping[int, Mapping[str, str]]) -> None:
        """Each slot's place in ``round``.  Another slot's older place is void: a worker that
        says hello later must not take it (that round is gone, its peers too)."""
        for slot in set(self._places).difference(envs):
            del self._places[slot]
        for slot, env in envs.items():
            self.place(slot, round, dict(env))

    def announce(self, round: int, added: bool) -> None:
        self._broadcast({"op": "update", "round": round, "added": added})

    def abort(self, round: int) -> None:
        self._broadcast({"op": "abort", "round": round})

    def asked(self, slot: int) -> int:
        """The round that ``slot``'s worker last asked to leave behind (-1: it asked for its
        first place; -2: it never asked)."""
        return self._asked.get(slot, -2)

    def forget(self, slot: int) -> None:
        """A new worker takes ``slot``: what the old one asked or was told is void, and it
        starts with a full allowance of lines."""
        self._asked.pop(slot, None)
        self._places.pop(slot, None)
        self._lines.pop(slot, None)
        self._over.pop(slot, None)
        writer = self._writers.pop(slot, None)
        if writer is not None:
            writer.close()

    def _broadcast(self, doc: dict[str, Any]) -> None:
        for slot in list(self._writers):
            self._send(slot, doc)

    def _send(self, slot: int, doc: dict[str, Any]) -> None:
        writer = self._writers.get(slot)
        if writer is None:
            return
        if writer.transport.get_write_buffer_size() > _MAX_BUFFERED:
            if (held := self._told.check("unread", self._clock())) is not None:
                log.warning(
                    "worker in slot %d does not read its notices; closing its channel%s",
                    slot,
                    held_back(held),
                )
            self._writers.pop(slot, None)
            writer.transport.abort()  # close() would wait for the worker to read what is queued
            return
        writer.write(json.dumps(doc).encode() + b"\n")

    # -- what workers tell the agent ---------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        slot = None
        writer = None
        self._connections += 1
        try:
            if self._connections > 2 * self._slots + 4 or not self._trusted(conn):
                return
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=_MAX_LINE)
            while line := await reader.readline():
                message = decode(line)
                if isinstance(message, Hello) and slot is None:
                    slot = self._hello(message.slot, writer)
                    if slot is None:
                        return
                    if message.stacks:
                        self.stack_signals[slot] = message.stacks
                    else:
                        self.stack_signals.pop(slot, None)
                elif isinstance(message, Ready) and slot is not None:
                    if not await self._paced(slot):
                        return
                    self._ready(slot, message)
                elif isinstance(message, Progress) and slot is not None:
                    self._progress(slot)
                else:
                    return
        except (Malformed, ValueError, asyncio.LimitOverrunError, ConnectionError, OSError) as exc:
            log.debug("worker channel closed: %s", exc)
        finally:
            self._connections -= 1
            if slot is not None and self._writers.get(slot) is writer:
                del self._writers[slot]
            if writer is not None:
                writer.close()
            else:
                conn.close()

    async def _paced(self, slot: int) -> bool:
        """Wait for ``slot``'s next line to be due (its bucket); False when it has sent
        :data:`PATIENCE` lines past the rate in a row: its connection is closed."""
        now = self._clock()
        bucket = self._lines.setdefault(slot, Bucket(LINES_PER_SECOND, LINE_BURST, now))
        pause = bucket.take(now)
        if not pause:
            self._over[slot] = 0
            return True
        self._over[slot] = self._over.get(slot, 0) + 1
        if self._over[slot] > PATIENCE:
            self._over[slot] = 0
            self.cut_off += 1
            if (held := self._told.check("flood", now)) is not None:
                log.warning(
                    "the worker in slot %d of %s sent more than %g lines a second for %d "
                    "lines: closing its channel%s",
                    slot,
                    self.path,
                    LINES_PER_SECOND,
                    PATIENCE,
                    held_back(held),
                )
            return False
        await asyncio.sleep(pause)  # its further lines wait in the kernel: it is slowed
        return True

    def _trusted(self, sock: socket.socket) -> bool:
        """The job's user (or root); the socket's mode says so too, this is belt and braces."""
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        return uid in (self._uid, 0, os.getuid())

    def _hello(self, slot: int, writer: asyncio.StreamWriter) -> int | None:
        if not 0 <= slot < self._slots:
            return None
        old = self._writers.get(slot)
        if old is not None:
            old.close()
        self._writers[slot] = writer
        if slot in self._places:
            round, env = self._places[slot]
            self._send(slot, {"op": "place", "round": round, "env": env})
        return slot

    def _progress(self, slot: int) -> None:
        now = self._clock()
        if now - self._progressed.get(slot, -PROGRESS_EVERY) >= PROGRESS_EVERY:
            self._progressed[slot] = now
            self._on_progress(slot)

    def _ready(self, slot: int, asked: Ready) -> None:
        self._asked[slot] = max(self._asked.get(slot, -2), asked.after)
        self._on_ready(Ready(slot, asked.after, asked.why, asked.error))


def decode(line: bytes) -> Hello | Ready | Progress:
    """One line from a worker: ``{"op": "hello", "slot": N, "stacks": SIGNAL}`` (``stacks``
    optional), ``{"op": "ready", "round": N, "why": ..., "error": ...}`` (a Ready whose slot,
    -1, is the connection's to say) or ``{"op": "progress"}``; anything else, whatever its
    bytes, is Malformed."""
    try:
        doc = safejson.loads(line, max_bytes=_MAX_LINE, max_depth=_MAX_DEPTH)
    except safejson.Undecodable as exc:
        raise Malformed(f"not JSON: {exc}") from None
    op = doc.get("op") if isinstance(doc, dict) else None
    if op == "hello":
        stacks = doc.get("stacks", 0)
        if type(stacks) is not int or (stacks and stacks not in _SIGNALS) or stacks in (9, 19):
            raise Malformed("stacks is not a signal number")
        return Hello(_count(doc, "slot"), stacks)
    if op == "progress":
        return Progress()
    if op == "ready":
        why, error = doc.get("why"), doc.get("error", "")
        if why not in _WHY or not isinstance(error, str):
            raise Malformed("a ready needs why (start, interrupt, failure) and a text error")
        return Ready(-1, _count(doc, "round", low=-1), why, error[:2000])
    raise Malformed("not a message: no known op")


def _count(doc: dict[str, Any], name: str, low: int = 0) -> int:
    value = doc.get(name)
    if type(value) is not int or value < low:
        raise Malformed(f"{name} is not a whole number")
    return value
