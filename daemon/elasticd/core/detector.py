"""The failure detector's rules: SWIM's probes with Lifeguard's local health, pure (``now``
is passed in; the sockets, timers and the wire's authentication are cluster/detector.py's).

Who is watched: the members of the rounds this node is in (``watch``: one group per job).
In each group the members stand on a ring in name order, and a node probes its two
neighbours (its predecessor and its successor) every ``interval``: every member is probed by
two others, whatever the group's size, so a node's cost is O(1) per interval (O(groups it is
in) at most).  Every authenticated message from a node (its ping, its ack, anything) is a
sign of its life: a node that stops reading (flooded) but still sends is not lost.

A node silent for ``suspect_after`` is *suspected*: ``helpers`` other nodes (members of the
group after it on the ring, then nodes outside it) are asked to probe it (SWIM's ping-req);
each answers that it reached it (its life, relayed) or, after ``relay_timeout``, that it did
not (a *nack*, Lifeguard's).  A node silent for ``lost_after`` is declared lost only when a
helper confirmed it (a nack); with helpers asked and none answering, this node is probably
the one cut off, and it declares nothing (the store's heartbeat, the slow path, still will).
With no helper at all (a two-node cluster) the silence alone decides.

Local health (Lifeguard): signs that this node itself is slow raise a score (a tick that
came a whole interval late: the process was paused or starved; helpers that all stayed
silent; its socket had to stop reading a flood), and ``suspect_after``/``lost_after`` are multiplied by
``1 + score``; the score falls by one per ``health_decay`` seconds without such a sign.
Time this node did not run (a late tick, a pause the shell reports) is not counted as
anyone's silence: it is credited to every watched node.

A node is judged only once it has been heard since it was first watched: one that has not
answered yet may not know this one yet (a node that joins a round probes the others at once,
and they refuse the datagrams of a node their registry has not shown them yet: two nodes
started a second apart took each other for lost, and the job's workers started twice), and
on a node that never answers the store's heartbeat decides.

A node whose host says nothing listens at its port (an ICMP port unreachable, which the
shell sees on its socket connected to that node: its daemon's process is gone, the host is
up) is *refused*: its helpers are asked at once, a helper asked about it nacks at once, and
it is judged at ``suspect_after`` of silence instead of ``lost_after``, still only once a
helper confirmed it.  Such a message can be forged (by root on the network): what it
cannot do is silence a live node, whose every message clears the refusal.

A node declared lost is still probed (so that two nodes that declared each other hear each
other again) but not declared again until it is heard again (then, if it is still in a
group, it is watched afresh).  Nonces are this detector's own counter: what makes a
message unforgeable and fresh is the wire's MAC and replay window, not the nonce.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MAX_RELAYS = 256  # probes this node makes for others at once (a helper's table is bounded)
MAX_ASKED = 64  # nonces one suspicion keeps (asks are repeated while it lasts)


class Kind(enum.StrEnum):
    PING = "ping"  # are you there?  (answered with an ACK)
    ACK = "ack"
    ASK = "ask"  # SWIM's ping-req: probe ``target`` for me
    ALIVE = "alive"  # a helper reached ``target`` (its ack, relayed)
    NACK = "nack"  # a helper did not reach ``target`` within its relay timeout


@dataclass(frozen=True)
class DetectorSettings:
    interval: float = 0.1  # seconds between two probes of a watched node
    suspect_after: float = 0.2  # silence after which helpers are asked
    lost_after: float = 0.4  # silence after which a confirmed node is lost
    helpers: int = 3  # nodes asked to probe a suspected one
    stall: float = 0.05  # a tick this much later than due: this node itself stalled
    max_health: int = 8  # the local health score's ceiling
    health_decay: float = 1.0  # seconds without a sign of slowness per point recovered

    def __post_init__(self) -> None:
        if not (0 < self.interval and 0 < self.suspect_after < self.lost_after):
            raise ValueError("need 0 < interval and 0 < suspect_after < lost_after")

    @property
    def tick(self) -> float:
        """How often the shell calls ``tick``."""
        return self.interval / 2

    @property
    def relay_timeout(self) -> float:
        """How long a helper waits for a suspected node before it says so: its nack must
        reach the asker before ``lost_after``."""
        return max(self.tick, 0.6 * (self.lost_after - self.suspect_after))


@dataclass(frozen=True)
class Send:
    """A message to ``to``: ``kind``, with ``nonce`` and, for ASK/ALIVE/NACK, ``target``."""

    to: str
    kind: Kind
    nonce: int
    target: str = ""


@dataclass(frozen=True)
class Lost:
    """``node`` is lost: silent for ``silent`` seconds of this node's awake time."""

    node: str
    silent: float
    confirmed_by: tuple[str, ...] = ()
    refused: bool = False  # its host said nothing listens at its port


Out = Send | Lost


@dataclass
class _Target:
    heard: float  # the last sign of its life (credited for this node's own stalls)
    answered: bool = False  # heard at all since it was first watched: it knows this node
    pinged: float = -math.inf
    asked_at: float | None = None  # when helpers were last asked (None: not suspected)
    suspected_at: float | None = None  # when they were first asked, this suspicion
    asked: dict[int, str] = field(default_factory=dict)  # nonce -> helper
    nacks: set[str] = field(default_factory=set)
    doubted: bool = False  # the silent helpers of this suspicion raised the health score
    declared: bool = False
    refused: bool = False  # its host said nothing listens at its port since it was heard


@dataclass
class _Relay:
    asker: str
    nonce: int  # the asker's
    target: str
    until: float


class Detector:
    """One node's failure detector.  Feed it ``watch``/``know`` (what the node is in and who
    exists), ``receive`` (each authenticated, fresh message) and ``tick`` (every
    ``settings.tick`` seconds); carry out what they return."""

    def __init__(self, me: str, settings: DetectorSettings = DetectorSettings()) -> None:
        self.me = me
        self.settings = settings
        self.health = 0
        self._health_at = 0.0
        self._groups: dict[str, tuple[str, ...]] = {}  # group -> its members, sorted
        self._targets: dict[str, _Target] = {}
        self._known: list[str] = []  # every node that may help or be probed, sorted
        self._relays: dict[int, _Relay] = {}
        self._nonce = 0
        self._last_tick: float | None = None

    # -- what this node is in, and who exists ------------------------------------------

    def watch(self, groups: Mapping[str, Iterable[str]], now: float) -> None:
        """The groups this node is in now (group -> its members, this node among them or
        not).  A node newly watched counts as heard now."""
        self._groups = {
            name: tuple(sorted(set(members) | {self.me}))
            for name, members in groups.items()
            if set(members) - {self.me}
        }
        wanted = self.neighbours()
        for name in list(self._targets):
            if name not in wanted:
                del self._targets[name]
        for name in sorted(wanted):
            self._targets.setdefault(name, _Target(heard=now))

    def know(self, nodes: Iterable[str]) -> None:
        """Every node this one may probe for others or ask for help (the cluster's)."""
        self._known = sorted(set(nodes) - {self.me})

    def neighbours(self) -> set[str]:
        """The nodes this one probes: its two neighbours on each group's ring."""
        found: set[str] = set()
        for ring in self._groups.values():
            at = bisect.bisect_left(ring, self.me)  # sorted: O(log N), not ring.index's O(N)
            found.add(ring[(at - 1) % len(ring)])
            found.add(ring[(at + 1) % len(ring)])
        found.discard(self.me)
        return found

    def near(self, reach: int) -> set[str]:
        """The nodes within ``reach`` places of this one on each group's ring, either way:
        its neighbours, their helpers and those it helps (who may send to it)."""
        found: set[str] = set()
        for ring in self._groups.values():
            at = bisect.bisect_left(ring, self.me)
            for k in range(1, min(reach, len(ring) - 1) + 1):
                found.add(ring[(at + k) % len(ring)])
                found.add(ring[(at - k) % len(ring)])
        found.discard(self.me)
        return found

    def helpers(self, target: str) -> list[str]:
        """Who is asked to probe ``target``: up to ``settings.helpers`` members of the
        groups that hold both, after it on their ring, then other known nodes after it."""
        chosen: list[str] = []
        want = self.settings.helpers
        for ring in self._groups.values():
            at = bisect.bisect_left(ring, target)
            if at == len(ring) or ring[at] != target:
                continue
            for k in range(1, len(ring)):
                if len(chosen) >= want:
                    break
                node = ring[(at + k) % len(ring)]
                if node not in (self.me, target) and node not in chosen:
                    chosen.append(node)
        known = self._known
        start = bisect.bisect_right(known, target)
        for k in range(len(known)):
            if len(chosen) >= want:
                break
            node = known[(start + k) % len(known)]
            if node not in (self.me, target) and node not in chosen:
                chosen.append(node)
        return chosen

    @property
    def watched(self) -> dict[str, float]:
        """Each watched node and when it was last heard."""
        return {name: t.heard for name, t in self._targets.items()}

    @property
    def answered(self) -> set[str]:
        """The watched nodes heard since they were first watched (only those are judged)."""
        return {name for name, t in self._targets.items() if t.answered}

    @property
    def multiplier(self) -> int:
        return 1 + self.health

    # -- time ----------------------------------------------------------------------------

    def tick(self, now: float) -> list[Out]:
        """Probe who is due, ask helpers about the suspected, judge the silent, answer for
        the relays that timed out.  A tick later than due by more than ``settings.stall``
        means this node did not run meanwhile: that time is nobody's silence."""
        s = self.settings
        if self._last_tick is not None:
            late = now - self._last_tick - s.tick
            if late > s.stall:  # credited; a stall of a whole interval also raises the score
                self.pause(late, now, slow=late > s.interval)
        self._last_tick = now
        if self.health and now - self._health_at >= s.health_decay:
            self.health -= 1
            self._health_at = now
        out: list[Out] = []
        for name, target in self._targets.items():
            # a declared one too: it may come back; half a tick early rather than a tick late
            if now - target.pinged >= s.interval - s.tick / 2:
                target.pinged = now
                out.append(Send(name, Kind.PING, self._next_nonce()))
            if target.declared or not target.answered:
                continue
            out += self._suspect(name, target, now)
            out += self._judge(name, target, now)
        for nonce, relay in list(self._relays.items()):
            if now >= relay.until:
                del self._relays[nonce]
                out.append(Send(relay.asker, Kind.NACK, relay.nonce, relay.target))
        return out

    def pause(self, seconds: float, now: float, slow: bool = True) -> None:
        """This node did not run (or could not read) for ``seconds``: nobody's silence grew
        meanwhile, and (``slow``) its health score goes up."""
        for target in self._targets.values():
            target.heard = min(target.heard + seconds, now)
            if target.asked_at is not None:
                target.asked_at = min(target.asked_at + seconds, now)
            if target.suspected_at is not None:
                target.suspected_at = min(target.suspected_at + seconds, now)
        for relay in self._relays.values():
            relay.until += seconds
        if slow:
            self._slow(now)

    def _slow(self, now: float) -> None:
        self.health = min(self.settings.max_health, self.health + 1)
        self._health_at = now

    # -- messages --------------------------------------------------------------------------

    def receive(self, sender: str, kind: Kind, nonce: int, target: str, now: float) -> list[Out]:
        """One authenticated, fresh message from ``sender``: a sign of its life, and what it
        says."""
        out: list[Out] = []
        self._heard(sender, now)
        if kind is Kind.PING:
            out.append(Send(sender, Kind.ACK, nonce))
        elif kind is Kind.ACK:
            relay = self._relays.get(nonce)
            if relay is not None and relay.target == sender:
                del self._relays[nonce]
                out.append(Send(relay.asker, Kind.ALIVE, relay.nonce, sender))
        elif kind is Kind.ASK:
            if (
                target != self.me
                and target != sender
                and target in self._known
                and len(self._relays) < MAX_RELAYS
            ):
                mine = self._next_nonce()
                self._relays[mine] = _Relay(
                    sender, nonce, target, now + self.settings.relay_timeout
                )
                out.append(Send(target, Kind.PING, mine))
        elif kind in (Kind.ALIVE, Kind.NACK):
            watched = self._targets.get(target)
            if watched is not None and watched.asked.get(nonce) == sender:
                if kind is Kind.ALIVE:
                    self._heard(target, now)
                else:
                    watched.nacks.add(sender)
                    out += self._judge(target, watched, now)
        return out

    def refused(self, name: str, now: float) -> list[Out]:
        """``name``'s host said nothing listens at its port (see the module's docstring):
        the relays about it nack now, and its suspicion and verdict come sooner."""
        out: list[Out] = []
        for nonce, relay in list(self._relays.items()):
            if relay.target == name:
                del self._relays[nonce]
                out.append(Send(relay.asker, Kind.NACK, relay.nonce, name))
        target = self._targets.get(name)
        if target is None or target.declared or not target.answered:
            return out
        target.refused = True
        return out + self._suspect(name, target, now) + self._judge(name, target, now)

    def _heard(self, name: str, now: float) -> None:
        target = self._targets.get(name)
        if target is None:
            return
        target.heard = max(target.heard, now)
        target.answered = True
        target.asked_at = target.suspected_at = None
        target.doubted = target.declared = target.refused = False
        target.asked.clear()
        target.nacks.clear()

    # -- suspicion and verdicts --------------------------------------------------------------

    def _suspect(self, name: str, target: _Target, now: float) -> list[Out]:
        s = self.settings
        if not target.refused and now - target.heard < s.suspect_after * self.multiplier:
            return []
        if target.asked_at is not None and now - target.asked_at < s.relay_timeout + s.interval:
            return []
        target.asked_at = now
        if target.suspected_at is None:
            target.suspected_at = now
        out: list[Out] = []
        for helper in self.helpers(name):
            nonce = self._next_nonce()
            if len(target.asked) >= MAX_ASKED:
                target.asked.pop(next(iter(target.asked)))
            target.asked[nonce] = helper
            out.append(Send(helper, Kind.ASK, nonce, name))
        return out

    def _judge(self, name: str, target: _Target, now: float) -> list[Out]:
        silent = now - target.heard
        s = self.settings
        verdict = s.suspect_after if target.refused else s.lost_after
        if target.declared or not target.answered or silent < verdict * self.multiplier:
            return []
        if target.asked and not target.nacks:
            # helpers were asked and none answered: this node may be the one cut off
            if (
                not target.doubted
                and target.suspected_at is not None
                and now - target.suspected_at >= 2 * self.settings.relay_timeout
            ):
                target.doubted = True
                self._slow(now)
            return []
        if not target.asked and self.helpers(name):
            return []  # helpers exist and were not asked yet (its suspicion came late)
        target.declared = True
        return [Lost(name, silent, tuple(sorted(target.nacks)), target.refused)]

    def _next_nonce(self) -> int:
        self._nonce += 1
        return self._nonce
