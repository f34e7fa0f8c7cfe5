"""The failure detector's shell: its UDP socket, its timers, the wire's authentication, in a
thread of its own.  The rules are core/detector.py's.

**Where.** Each daemon listens on UDP at its node address and the number of its peer port
(``node.peer_port``: the same number, over UDP; the port travels in the node's signed
record).  The members of the rounds this node is in (``watch``, from the node shell) are
probed; every node of the cluster that the heartbeat loop knows up may be asked to help
(``learn``).  A node it finds lost is told to the node shell as ``NodesLost``, the same
word as the heartbeat's: the node's parts re-form without it at once, and every other
survivor follows their new round in one store round trip.

**Its own thread, its own event loop.**  A daemon whose event loop is busy (a large reply,
the observer's duty) must not look dead to its peers, nor find them dead: the detector
runs on a loop of its own, in a thread, and takes the interpreter's lock for a few
microseconds per message.  A frozen or cut-off host stops it like any thread.

**The wire.**  A datagram is ``EDD1``, an HMAC-SHA256 tag and a JSON body (``v``, from,
to, boot, seq, kind, nonce, target).  The tag's key is derived from the cluster key
(``signing.subkey``), so only a daemon of the cluster makes one; the body names the node it
is for (a copy sent to another is refused).  Replays are refused by a window per sender:
its ``boot`` (a number that grows from each start of the daemon to the next, kept in the
state directory) and ``seq`` (one up per message): a message older than the newest boot
seen, or already seen, or more than 1024 behind, is dropped.  An ALIVE or NACK is believed
only when it answers one of this node's own asks (its nonce), from the helper asked.
Replies go to the sender's address as its signed record says, never to a datagram's source
(no reflection).

**A flood** costs a bounded amount and blinds nobody.  The nodes near this one on its rings
(its neighbours, their helpers, those it helps: a few per round) each have a socket of
their own, bound to the same port (SO_REUSEPORT, same user only) and connected to that
node, so the kernel hands each one exactly that node's datagrams; everyone else's land in
the shared socket (the lobby).  Each socket reads at most its budget a second (the lobby
``max_rate``, the others a tenth of it, each a ``recvfrom`` and one HMAC before anything is
parsed); past that it is not read until its budget refills, and the kernel drops the rest.
A flood from anywhere but a near node's address therefore never delays that node's probes
and acks: it makes no false loss and keeps no dead node alive.  (An attacker that forges a
near node's source address fills that node's socket only; nothing is credited then either,
and the local health score rises.)  Every refusal is counted (``elasticd_detector_refused_total{why}``) and
logged once per ``log.summary_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from elasticd.core.detector import Detector, DetectorSettings, Kind, Lost, Send
from elasticd.endpoint import split_endpoint
from elasticd.faults import Throttle, held_back
from elasticd.wire import safejson

log = logging.getLogger(__name__)

MAGIC = b"EDD1"
TAG = 32
MAX_DATAGRAM = 1024
WINDOW = 1024  # seqs of one sender remembered behind its newest
_READ_BATCH = 64  # datagrams read per wake-up at most
_RCVBUF = 256 * 1024
_KINDS = {k.value: k for k in Kind}


class Refused(ValueError):
    """A datagram that is not a fresh message of this cluster for this node; ``why``: a
    short word for the counter (``format``, ``mac``, ``stranger``, ``replay``)."""

    def __init__(self, why: str, detail: str = "") -> None:
        super().__init__(detail or why)
        self.why = why


@dataclass(frozen=True)
class Message:
    sender: str
    kind: Kind
    nonce: int
    target: str


class ReplayWindow:
    """Per sender: its newest boot, its newest seq and which of the ``WINDOW`` before it
    were seen.  Pure."""

    def __init__(self, width: int = WINDOW) -> None:
        self._width = width
        self._seen: dict[str, tuple[int, int, int]] = {}  # sender -> (boot, top, mask)

    def fresh(self, sender: str, boot: int, seq: int) -> bool:
        """Whether (boot, seq) is new from ``sender``; it is remembered if so."""
        known = self._seen.get(sender)
        if known is None or boot > known[0]:
            self._seen[sender] = (boot, seq, 1)
            return True
        old_boot, top, mask = known
        if boot < old_boot:
            return False
        if seq > top:
            shift = seq - top
            mask = ((mask << shift) | 1) & ((1 << self._width) - 1) if shift < self._width else 1
            self._seen[sender] = (boot, seq, mask)
            return True
        behind = top - seq
        if behind >= self._width or mask >> behind & 1:
            return False
        self._seen[sender] = (boot, top, mask | 1 << behind)
        return True

    def forget(self, keep: set[str]) -> None:
        self._seen = {name: v for name, v in self._seen.items() if name in keep}


class Wire:
    """Seals messages from ``me`` and opens those for ``me``.  Pure but for the seq counter."""

    def __init__(self, key: bytes, me: str, boot: int) -> None:
        self._key = key
        self.me = me
        self.boot = boot
        self._seq = 0
        self.replays = ReplayWindow()

    def seal(self, to: str, kind: Kind, nonce: int, target: str = "") -> bytes:
        self._seq += 1
        body = json.dumps(
            {
                "v": 1,
                "f": self.me,
                "t": to,
                "b": self.boot,
                "s": self._seq,
                "k": kind.value,
                "n": nonce,
                "x": target,
            },
            separators=(",", ":"),
        ).encode()
        return MAGIC + hmac.digest(self._key, MAGIC + body, hashlib.sha256) + body

    def open(self, raw: bytes, senders: Mapping[str, Any]) -> Message:
        """The message in ``raw``, if it is one for this node from a node in ``senders``,
        sealed with this cluster's key and not seen before; else Refused."""
        if len(raw) > MAX_DATAGRAM or len(raw) < len(MAGIC) + TAG + 2 or raw[:4] != MAGIC:
            raise Refused("format", "not a detector datagram")
        tag, body = raw[4 : 4 + TAG], raw[4 + TAG :]
        if not hmac.compare_digest(tag, hmac.digest(self._key, MAGIC + body, hashlib.sha256)):
            raise Refused("mac", "its tag does not match (not sealed with this cluster's key)")
        try:
            doc = safejson.loads(body, max_bytes=MAX_DATAGRAM, max_depth=1)
            sender, to, boot, seq = doc["f"], doc["t"], doc["b"], doc["s"]
            kind, nonce, target = _KINDS[doc["k"]], doc["n"], doc["x"]
            ints = all(type(v) is int and v >= 0 for v in (boot, seq, nonce))
            if (
                doc["v"] != 1
                or not ints
                or not all(isinstance(v, str) for v in (sender, to, target))
            ):
                raise ValueError("wrong types")
        except (safejson.Undecodable, KeyError, TypeError, ValueError) as exc:
            raise Refused("format", f"a sealed body that is no message: {exc}") from None
        if to != self.me:
            raise Refused("stranger", f"meant for {to!r}, not this node")
        if sender == self.me or sender not in senders:
            raise Refused("stranger", f"from {sender!r}, no node this one knows")
        if not self.replays.fresh(sender, boot, seq):
            raise Refused("replay", f"from {sender}: boot {boot} seq {seq} seen already or older")
        return Message(sender, kind, nonce, target)


def next_boot(path: str, clock: Callable[[], float] = time.time) -> int:
    """This start's boot number: greater than the last one written at ``path`` and than the
    wall clock in microseconds (a clock that went back does not make it repeat); written
    back.  Without a writable state directory, the clock alone."""
    last = 0
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            last = int(f.read(32).strip() or 0)
    boot = max(int(clock() * 1_000_000), last + 1)
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(boot))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("detector: cannot keep its boot number in %s: %s", path, exc)
    return boot


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved.  Pure: ``now`` is passed in."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens, self._at = burst, now

    def take(self, now: float) -> bool:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def wait(self) -> float:
        """Seconds until a token is there."""
        return max(0.0, (1 - self._tokens) / self.rate)


@dataclass
class _Inlet:
    """A socket the detector reads, with its own budget: the lobby (``peer`` None) or one
    connected to a node near this one."""

    sock: socket.socket
    peer: tuple[str, int] | None
    rate: float
    since: float
    reading: bool = False
    node: str = ""  # the node it is connected to (the lobby: none)

    def __post_init__(self) -> None:
        self.bucket = TokenBucket(self.rate, max(1.0, self.rate / 10), self.since)


class DetectorMetrics(Protocol):
    """What the detector counts (metrics.Metrics has these; tests pass none)."""

    def detector_message(self, direction: str) -> None: ...
    def detector_refused(self, why: str) -> None: ...
    def detector_lost(self, silent: float) -> None: ...
    def detector_state(self, watched: int, health: int) -> None: ...


class _Uncounted:
    def detector_message(self, direction: str) -> None:
        pass

    def detector_refused(self, why: str) -> None:
        pass

    def detector_lost(self, silent: float) -> None:
        pass

    def detector_state(self, watched: int, health: int) -> None:
        pass


class DetectorService:
    """The detector of this node, in a thread of its own (see the module's docstring).
    ``watch``, ``unwatch`` and ``learn`` are called on the daemon's loop; ``on_lost`` is
    called there too."""

    def __init__(
        self,
        node: str,
        key: bytes,
        *,
        settings: DetectorSettings = DetectorSettings(),
        boot: int,
        on_lost: Callable[[str, float], None],
        max_rate: float = 2000.0,
        metrics: DetectorMetrics | None = None,
        log_interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.settings = settings
        self._wire = Wire(key, node, boot)
        self._on_lost = on_lost
        self._max_rate = max_rate
        self._metrics: DetectorMetrics = metrics or _Uncounted()
        self._clock = clock
        self._told = Throttle(log_interval)
        self._sock: socket.socket | None = None
        self.address: tuple[str, int] | None = None
        # the daemon loop's view, copied to the thread's at each change
        self._groups: dict[str, tuple[str, ...]] = {}
        self._endpoints: dict[str, tuple[str, int]] = {}
        self._main: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the detector thread's
        # the thread's own state
        self._detector = Detector(node, settings)
        self._t_groups: dict[str, tuple[str, ...]] = {}
        self._t_endpoints: dict[str, tuple[str, int]] = {}
        self._lobby: _Inlet | None = None  # the bound socket: whoever is not near
        self._inlets: dict[str, _Inlet] = {}  # node -> its own connected socket
        self._stopped: asyncio.Event | None = None

    # -- set-up ---------------------------------------------------------------------------

    def bind(self, host: str, port: int) -> None:
        """Listen on UDP ``host:port`` (OSError if it cannot: the daemon runs without)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # see _connect
            sock.bind((host, port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.address = sock.getsockname()[:2]

    @property
    def bound(self) -> bool:
        return self._sock is not None

    @property
    def answered(self) -> set[str]:
        """The watched nodes heard since they were first watched: those whose silence is
        judged (the detector thread's view, read from another thread)."""
        return self._detector.answered

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` (or cancellation); the thread ends before this returns."""
        if self._sock is None:
            await stop.wait()
            return
        self._main = asyncio.get_running_loop()
        started = threading.Event()
        thread = threading.Thread(
            target=self._thread_main, args=(started,), name="elasticd-detector", daemon=True
        )
        thread.start()
        await asyncio.to_thread(started.wait)
        self._push()
        try:
            await stop.wait()
        finally:
            loop, stopped = self._loop, self._stopped
            if loop is not None and stopped is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(stopped.set)
            await asyncio.shield(asyncio.to_thread(thread.join))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()

    # -- the daemon loop's side -----------------------------------------------------------------

    def watch(self, group: str, members: tuple[str, ...]) -> None:
        """This node is in ``group`` (a job's round) with ``members`` now."""
        self._groups[group] = tuple(members)
        self._push()

    def unwatch(self, group: str) -> None:
        if self._groups.pop(group, None) is not None:
            self._push()

    def learn(self, endpoints: Mapping[str, tuple[str, int]]) -> None:
        """Every node that is up, and its detector's address (from its signed record)."""
        endpoints = dict(endpoints)
        if endpoints != self._endpoints:
            self._endpoints = endpoints
            self._push()

    def _push(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop is closing
                loop.call_soon_threadsafe(self._apply, dict(self._groups), dict(self._endpoints))

    # -- the thread --------------------------------------------------------------------------

    def _thread_main(self, started: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(started))
        finally:
            loop.close()

    async def _serve(self, started: threading.Event) -> None:
        assert self._sock is not None
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        now = self._clock()
        self._lobby = _Inlet(self._sock, None, self._max_rate, now)
        self._open(self._lobby)
        ticking = self._loop.call_soon(self._tick, now)
        started.set()
        try:
            await self._stopped.wait()
        finally:
            ticking.cancel()
            if self._tick_handle is not None:
                self._tick_handle.cancel()
            for inlet in [self._lobby, *self._inlets.values()]:
                if inlet.reading:
                    self._loop.remove_reader(inlet.sock)
            for inlet in self._inlets.values():
                inlet.sock.close()
            self._inlets = {}
            self._loop = None

    _tick_handle: asyncio.TimerHandle | None = None

    def _apply(
        self, groups: dict[str, tuple[str, ...]], endpoints: dict[str, tuple[str, int]]
    ) -> None:
        self._t_groups, self._t_endpoints = groups, endpoints
        known = set(endpoints)
        self._detector.know(known)
        self._detector.watch(
            {g: tuple(m for m in members if m in known) for g, members in groups.items()},
            self._clock(),
        )
        self._wire.replays.forget(known)
        self._connect(self._detector.near(self.settings.helpers + 2))

    def _connect(self, near: set[str]) -> None:
        """A socket of its own for each node near this one on its rings (its neighbours,
        their helpers, those it helps): bound to the same port (SO_REUSEPORT) and connected
        to that node, so the kernel hands it exactly that node's datagrams, and a flood from
        anywhere else fills only the shared socket (the lobby), never theirs."""
        assert self._sock is not None and self._loop is not None
        wanted = {n: self._t_endpoints[n] for n in near if n in self._t_endpoints}
        for name, inlet in list(self._inlets.items()):
            if wanted.get(name) != inlet.peer:
                self._shut(inlet)
                del self._inlets[name]
        host, port = self.address or ("", 0)
        for name, peer in wanted.items():
            if name in self._inlets:
                continue
            sock = socket.socket(self._sock.family, socket.SOCK_DGRAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((host, port))
                sock.connect(peer)
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                log.debug("detector: no socket of its own for %s: %s", name, exc)
                continue
            inlet = _Inlet(sock, peer, max(100.0, self._max_rate / 10), self._clock(), node=name)
            self._inlets[name] = inlet
            self._open(inlet)

    def _open(self, inlet: _Inlet) -> None:
        assert self._loop is not None
        self._loop.add_reader(inlet.sock, self._readable, inlet)
        inlet.reading = True

    def _shut(self, inlet: _Inlet) -> None:
        if inlet.reading and self._loop is not None:
            self._loop.remove_reader(inlet.sock)
        inlet.reading = False
        inlet.sock.close()

    def _tick(self, due: float) -> None:
        now = self._clock()
        try:
            self._carry_out(self._detector.tick(now), now)
            self._metrics.detector_state(len(self._detector.watched), self._detector.health)
        except Exception:  # a bug must not stop the detector for good
            if self._told.check("tick", now) is not None:
                log.exception("detector: a tick failed")
        step = self.settings.tick
        following = due + step if now - due < step else now + step
        assert self._loop is not None
        self._tick_handle = self._loop.call_later(
            max(0.0, following - self._clock()), self._tick, following
        )

    def _readable(self, inlet: _Inlet) -> None:
        for _ in range(_READ_BATCH):
            now = self._clock()
            if not inlet.bucket.take(now):
                self._throttle(inlet, now)
                return
            try:
                raw = inlet.sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionRefusedError:  # an earlier send's ICMP port unreachable
                self._refused(inlet.node, now)
                continue
            except OSError:
                continue  # another ICMP error of an earlier send
            self._received(raw, now)

    def _throttle(self, inlet: _Inlet, now: float) -> None:
        """Too many datagrams on one socket: it is not read until its budget refills (the
        kernel drops the rest).  A flood comes from elsewhere than the nodes near this one
        (their datagrams have sockets of their own), so nobody's silence is credited: that
        would let a flood keep a dead node alive.  The local health score goes up."""
        assert self._loop is not None
        self._loop.remove_reader(inlet.sock)
        inlet.reading = False
        self._detector.pause(0.0, now)
        self._metrics.detector_refused("flood")
        held = self._told.check("flood", now)
        if held is not None:
            log.warning(
                "detector: more than %g datagrams a second reach UDP %s%s: reading paused "
                '(a flood? elasticd_detector_refused_total{why="flood"} counts the pauses)%s',
                inlet.bucket.rate,
                self.address,
                f" from {inlet.peer}" if inlet.peer else "",
                held_back(held),
            )
        self._loop.call_later(max(inlet.bucket.wait(), 0.001), self._resume, inlet)

    def _resume(self, inlet: _Inlet) -> None:
        if self._loop is None or inlet.sock.fileno() < 0 or inlet.reading:
            return
        self._open(inlet)

    def _received(self, raw: bytes, now: float) -> None:
        try:
            message = self._wire.open(raw, self._t_endpoints)
        except Refused as refused:
            self._metrics.detector_refused(refused.why)
            held = self._told.check(f"refused-{refused.why}", now)
            if held is not None:
                log.warning("detector: refused a datagram (%s)%s", refused, held_back(held))
            return
        self._metrics.detector_message("in")
        self._carry_out(
            self._detector.receive(
                message.sender, message.kind, message.nonce, message.target, now
            ),
            now,
        )

    def _refused(self, node: str, now: float) -> None:
        """The host of ``node`` said nothing listens at its port (ICMP, on the socket
        connected to it: the kernel matched it to that socket's own address and port)."""
        if node:
            self._carry_out(self._detector.refused(node, now), now)

    def _carry_out(self, out: list[Send | Lost], now: float) -> None:
        for item in out:
            if isinstance(item, Lost):
                self._lost(item)
                continue
            address = self._t_endpoints.get(item.to)
            if address is None or self._sock is None:
                continue
            sealed = self._wire.seal(item.to, item.kind, item.nonce, item.target)
            inlet = self._inlets.get(item.to)
            try:
                if inlet is not None:
                    inlet.sock.send(sealed)  # from the same port: the peer's own socket for us
                else:
                    self._sock.sendto(sealed, address)
                self._metrics.detector_message("out")
            except ConnectionRefusedError:  # an earlier send's ICMP, reported on this one
                if inlet is not None:
                    self._refused(inlet.node, now)
            except OSError as exc:  # unreachable for now: its silence is what counts
                held = self._told.check("send", now)
                if held is not None:
                    log.debug("detector: cannot send to %s at %s: %s", item.to, address, exc)

    def _lost(self, lost: Lost) -> None:
        self._metrics.detector_lost(lost.silent)
        log.warning(
            "detector: node %s is lost (silent %.2f s%s)",
            lost.node,
            lost.silent,
            (f"; confirmed by {', '.join(lost.confirmed_by)}" if lost.confirmed_by else "")
            + ("; nothing listens at its port" if lost.refused else ""),
        )
        if self._main is not None:
            with contextlib.suppress(RuntimeError):  # the daemon's loop is closing
                self._main.call_soon_threadsafe(self._on_lost, lost.node, lost.silent)

    # -- what status and tests read ---------------------------------------------------------

    @property
    def health(self) -> int:
        return self._detector.health


def udp_endpoint(peer_endpoint: str) -> tuple[str, int] | None:
    """The detector's address of a node whose peer endpoint (``tcp://host:port``) is this."""
    try:
        return split_endpoint(peer_endpoint)
    except ValueError:
        return None
