"""The node registry in the store: every node's signed record and heartbeat, drain requests,
the observer's duty (who is lost) and the feed it publishes, and a follower's catching up."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticd.aio import BackOff
from elasticd.core.containment import Containment
from elasticd.core.liveness import Beat, KeepAlive, observe
from elasticd.core.membership import (
    Catch,
    Head,
    Membership,
    catch_up,
    judge,
    members_json,
    parse_members,
    takes_over,
)
from elasticd.core.model import NodeInfo, NodeState
from elasticd.errors import NotFound
from elasticd.store.base import Store
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import (
    Freshness,
    Refused,
    SignedLines,
    Signer,
    VersionClock,
    open_or_refuse,
    open_version,
)
from elasticd.wire.numbers import json_int, json_number, whole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself (signed), rewritten when it changes.

    ``draining``: it takes no new job, for any reason (drained by an operator, not listed by
    the discovery script, blacklisted); ``blacklisted_until``: when its cooldown ends, by its
    own wall clock (0: not blacklisted; for display only, no other node acts on it);
    ``listed``: whether the discovery script lists it (True when there is none);
    ``containment``: what bounds a job there (None: not published, an older daemon);
    ``gpus_out``: its GPUs that its health checks took out of its offer, by index, and why
    (``info.gpus`` holds only those offered)."""

    info: NodeInfo
    draining: bool = False
    slots_used: int = 0
    gpus_used: int = 0
    jobs: tuple[str, ...] = ()
    peer_endpoint: str = ""
    peer_key: str = ""
    blacklisted_until: float = 0.0
    listed: bool = True
    containment: Containment | None = None
    gpus_out: Mapping[int, str] = field(default_factory=dict)
    tier_endpoint: str = ""  # the checkpoint tier's data plane (its CURVE key is peer_key)

    def to_json(self) -> dict[str, Any]:
        return {
            "info": self.info.to_json(),
            "draining": self.draining,
            "slots_used": self.slots_used,
            "gpus_used": self.gpus_used,
            "jobs": list(self.jobs),
            "peer_endpoint": self.peer_endpoint,
            "peer_key": self.peer_key,
            "blacklisted_until": self.blacklisted_until,
            "listed": self.listed,
            "containment": self.containment.to_json() if self.containment else None,
            "gpus_out": {str(index): why for index, why in self.gpus_out.items()},
            "tier_endpoint": self.tier_endpoint,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> NodeRecord:
        return cls(
            NodeInfo.from_json(doc["info"]),
            bool(doc.get("draining")),
            json_int(doc.get("slots_used", 0), "slots_used"),
            json_int(doc.get("gpus_used", 0), "gpus_used"),
            tuple(doc.get("jobs", ())),
            str(doc.get("peer_endpoint", "")),
            str(doc.get("peer_key", "")),
            json_number(doc.get("blacklisted_until", 0.0), "blacklisted_until"),
            bool(doc.get("listed", True)),
            containment=Containment.from_json(doc.get("containment")),
            gpus_out={whole(index): str(why) for index, why in (doc.get("gpus_out") or {}).items()},
            tier_endpoint=str(doc.get("tier_endpoint", "")),
        )


@dataclass(frozen=True)
class Sighting:
    """What this node knows of another: its record and its membership."""

    record: NodeRecord
    member: Membership


def node_state(sighting: Sighting) -> NodeState:
    """Lost as the observer judged it; else what the node's record says."""
    if sighting.member.lost:
        return NodeState.LOST
    if sighting.record.blacklisted_until:
        return NodeState.BLACKLISTED
    if sighting.record.draining:
        return NodeState.DRAINING if sighting.record.jobs else NodeState.DRAINED
    return NodeState.UP


def node_doc(sighting: Sighting, state: NodeState, seen: float) -> dict[str, Any]:
    """A node as `elasticctl nodes` shows it; ``seen``: this node's wall clock when it last
    knew it alive (when it was judged lost, for a lost one)."""
    record = sighting.record
    return {
        "name": record.info.name,
        "address": record.info.address,
        "state": state.value,
        "slots_total": record.info.slots,
        "slots_free": record.info.slots - record.slots_used,
        "gpus_total": len(record.info.gpus),
        "gpus_free": len(record.info.gpus) - record.gpus_used,
        "cpus_total": record.info.cpus,
        "jobs": list(record.jobs),
        "last_seen": sighting.member.since if sighting.member.lost else seen,
        "version": record.info.version,
        "labels": dict(record.info.labels),
        "blacklisted_until": record.blacklisted_until or None,
        "listed": record.listed,
        "containment": record.containment.to_json() if record.containment else None,
        "gpus_out": {str(index): why for index, why in sorted(record.gpus_out.items())},
        "tier_endpoint": record.tier_endpoint or None,
    }


@dataclass(frozen=True)
class Tick:
    """The result of one heartbeat duty."""

    sightings: dict[str, Sighting]
    drain: bool | None  # a drain request for this node, if any
    epoch: str  # the store's epoch (changes when the store host restarts)
    drain_version: int = 0  # the drain request's version (each request has a new one)
    drain_gpu: int | None = None  # the request readmits only this GPU (undrain --gpu)
    drain_by: str = ""  # who asked


FEED_KEEP = (
    64  # feed entries kept behind the newest one (a follower further behind reads the snapshot)
)


class NodeRegistry:
    """This node's record and heartbeat in the store, and its view of every other node.

    Keys under ``elasticd/<cluster>/nodes/``::

        names               every name that ever registered: sealed lines, appended
        <name>/record       signed NodeRecord, versioned
        <name>/hb           signed heartbeat {"record": version}: its version goes up every beat
        <name>/drain        signed drain request, written by whoever asked
        observer            signed {"name"}: the elected observer; its version is the term
        feed/head           signed Head, rewritten by the observer every duty
        feed/<n>            signed entry n: {"term", "changes": {name: Membership}}
        feed/snapshot       signed {"term", "number", "members"}: every member as of entry n

    ``tick`` is the heartbeat duty: beat, read one batch of small keys (epoch, drain,
    observer, head, this node's own record), follow the feed, read the records that
    changed; the observer also judges every heartbeat (membership.py says why).  An older
    record written back is refused, like a forged one, and its node publishes its own
    again.  Store I/O is awaited on the event loop.
    """

    def __init__(
        self,
        store: Store,
        signer: Signer,
        cluster: str,
        name: str,
        *,
        keep_alive: KeepAlive,
        endpoint: str = "",
        on_refused: Refused | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._signer = signer
        self._keyspace = Keyspace(cluster)
        self._prefix = self._keyspace.nodes
        self.name = name
        self.endpoint = endpoint
        self.keep_alive = keep_alive
        self._on_refused = on_refused or (lambda key, why: None)
        self._clock = clock
        self._wall = wall_clock
        self._versions = VersionClock(wall_clock)
        self._fresh = Freshness()
        self._epoch = ""  # the store's epoch as last read valid
        self._replaced = False  # the last read of the epoch replaced a refused one
        self._published: NodeRecord | None = None
        self._published_version = 0
        self._registered_epoch: str | None = (
            None  # the epoch this node registered in (None: not yet)
        )
        self._members: dict[str, Membership] = {}  # the feed as followed
        self._records: dict[str, tuple[int, NodeRecord]] = {}  # (version, record) as read
        self._term, self._number = 0, 0  # where this node is in the feed
        self._observer: tuple[str, int] | None = None  # (name, term) as last read
        self._head_beat: Beat | None = None  # the observer's head, as a heartbeat
        self._head_version: int | None = None  # the head's version as last read valid
        self._observing: Observing | None = None
        self._index = SignedLines(signer, self._key("names"), _registered_name, self._on_refused)
        self._newcomers: dict[str, float] = {}  # census: name -> when first read (monotonic)
        self._sightings: dict[str, Sighting] | None = None  # as of the last change (None: changed)
        self._woken: tuple[int, int] | None = None  # where in the feed the last wake found us
        self.quiet = BackOff(longest=8 * keep_alive.interval)  # feed waits that woke for naught

    def _key(self, suffix: str) -> str:
        return f"{self._prefix}/{suffix}"

    @property
    def epoch_key(self) -> str:
        return self._keyspace.epoch

    @property
    def observing(self) -> bool:
        """Whether this node is the cluster's observer now."""
        return self._observing is not None

    @property
    def observer_term(self) -> int:
        """The observer's term as this node last read it (0: none read yet); this node's own
        while it observes."""
        if self._observing is not None:
            return self._observing.term
        return self._observer[1] if self._observer is not None else 0

    async def create_epoch(self) -> str:
        """Mark a fresh store, so that others can tell it was reset (the first writer wins).
        An epoch that is there but refused (garbage, or not sealed for it) is replaced."""
        token = secrets.token_hex(8)
        won, current = await self._store.compare_set(self.epoch_key, None, self._seal_epoch(token))
        if won:
            self._epoch = token
            return token
        epoch = await self._read_epoch(current)
        if self._replaced:
            log.warning("the store's epoch was refused (see above): this node wrote a new one")
        return epoch

    def _seal_epoch(self, token: str) -> bytes:
        return self._signer.seal(self.epoch_key, {"epoch": token}, version=self._versions.next())

    async def _read_epoch(self, raw: bytes | None) -> str:
        """The store's epoch; "" if there is none.  A refused one (reported) is replaced by
        the last valid epoch this node read, so that no node takes it for a reset store, or
        by a new one when it read none (a store whose epoch nobody can read counts as
        reset): one compare-and-set, whose loser reads the winner's.  While it stays
        refused, the last valid epoch."""
        self._replaced = False
        if raw is None:
            return ""
        epoch = self._open_epoch(raw)
        if epoch is None:
            token = self._epoch or secrets.token_hex(8)
            self._replaced, current = await self._store.compare_set(
                self.epoch_key, raw, self._seal_epoch(token)
            )
            epoch = (
                token
                if self._replaced
                else self._open_epoch(current)
                if current is not None
                else None
            )
        self._epoch = epoch if epoch is not None else self._epoch
        return self._epoch

    def _open_epoch(self, raw: bytes) -> str | None:
        return open_or_refuse(
            self._signer, self.epoch_key, raw, _epoch_token, self._on_refused, self._fresh
        )

    async def tick(self, record: NodeRecord, *, census: bool = False) -> Tick:
        """The heartbeat duty.  ``census``: also read the records of nodes that registered
        but are not members yet (O(N): for a request that must see a node that just came,
        never for the duty itself)."""
        small = [
            self.epoch_key,
            self._key(f"{self.name}/drain"),
            self._key("observer"),
            self._key("feed/head"),
            self._key(f"{self.name}/record"),
        ]
        epoch_raw, drain_raw, observer_raw, head_raw, own_raw = await self._store.get_many(small)
        epoch = await self._read_epoch(epoch_raw)
        if self._open_record(self.name, own_raw) != self._published:
            self._published = None  # lost or tampered with: publish it again
        if epoch != self._registered_epoch or record != self._published:
            await self._publish(record, register=epoch != self._registered_epoch)
            self._registered_epoch = epoch
        beat = self._key(f"{self.name}/hb")
        await self._store.set(
            beat,
            self._signer.seal(
                beat, {"record": self._published_version}, version=self._versions.next()
            ),
        )
        head = self._open_head(head_raw)
        await self._elect(observer_raw)
        await self._follow(head)
        if self._observing is not None:
            await self._observe(self._observing)
        if census:
            await self._census()
        if self._newcomers:
            now = self._clock()
            self._newcomers = {
                n: since
                for n, since in self._newcomers.items()
                if n not in self._members and now - since < self.keep_alive.dead_after
            }
            self._sightings = None
        drain, drain_version, gpu, by = self._open_drain(drain_raw)
        return Tick(self.sightings(), drain, epoch, drain_version, gpu, by)

    async def _census(self) -> None:
        """Newcomers: registered nodes that the observer has not admitted yet, counted as up
        for ``keep_alive.dead_after`` (then the observer's word decides)."""
        names = self._index.fold(await self._store.get(self._key("names")))
        now = self._clock()
        unknown = [
            n for n in dict.fromkeys(names) if n and n not in self._members and n != self.name
        ]
        if not unknown:
            return
        for name, raw in zip(
            unknown, await self._store.get_many([self._key(f"{n}/record") for n in unknown])
        ):
            opened = self._open_record_version(name, raw)
            if opened is not None:
                self._records[name] = opened
                self._newcomers.setdefault(name, now)
                self._sightings = None

    async def _publish(self, record: NodeRecord, *, register: bool) -> None:
        key = self._key(f"{self.name}/record")
        version = self._versions.next()
        await self._store.set(key, self._signer.seal(key, record.to_json(), version=version))
        if register:
            index = self._key("names")
            await self._store.append(index, self._signer.seal(index, {"name": self.name}) + b"\n")
        self._published, self._published_version = record, version
        self._records[self.name] = (version, record)
        self._sightings = None

    def sightings(self) -> dict[str, Sighting]:
        """Every member whose record this node holds; this node itself as soon as it published.
        The same object until something changed (a duty that changed nothing costs O(1))."""
        if self._sightings is None:
            self._sightings = self._sight()
        return self._sightings

    def _sight(self) -> dict[str, Sighting]:
        members = {
            n: Membership(self._records[n][0]) for n in self._newcomers if n in self._records
        }
        members.update(self._members)
        if self.name not in members and self._published is not None:
            members[self.name] = Membership(self._published_version)
        return {
            name: Sighting(self._records[name][1], member)
            for name, member in members.items()
            if name in self._records
        }

    # -- the observer's election ------------------------------------------------------------

    async def _elect(self, observer_raw: bytes | None) -> None:
        """Follow who observes; take over when there is none (or a refused record) or its
        head stood still.  The observer that finds none (or a refused one) writes its own
        again: else a node that took over meanwhile, whose record this one never read
        valid, would observe beside it for good."""
        key = self._key("observer")
        opened = open_or_refuse(
            self._signer, key, observer_raw, _registered_name, self._on_refused, self._fresh
        )
        term = self._fresh.newest(key)
        if opened is not None:
            if self._observer != (opened, term):
                self._head_beat = None  # a new observer: watch its head afresh
            self._observer = (opened, term)
        self._head_beat = observe(self._head_beat, self._head_version, self._clock())
        if opened == self.name:
            self._start_observing(term)
        elif opened is not None:
            self._observing = None
        if self._observing is None and takes_over(
            opened is not None, self._head_beat, self.keep_alive, self._clock()
        ):
            await self._take_over(observer_raw)
        elif self._observing is not None and opened is None:
            sealed = self._signer.seal(key, {"name": self.name}, version=self._observing.term)
            await self._store.compare_set(
                key, observer_raw, sealed
            )  # a lost race: the next duty reads the winner

    async def _take_over(self, observer_raw: bytes | None) -> None:
        term = max(self._observer[1] if self._observer else 0, self._term) + 1
        key = self._key("observer")
        sealed = self._signer.seal(key, {"name": self.name}, version=term)
        won, _ = await self._store.compare_set(key, observer_raw, sealed)
        if won:
            log.info("node %s observes the cluster's heartbeats now (term %d)", self.name, term)
            self._observer = (self.name, term)
            self._start_observing(term)

    def _start_observing(self, term: int) -> None:
        if self._observing is None or self._observing.term != term:
            self._observing = Observing(term, self._head_version or 0)

    # -- the observer's duty -------------------------------------------------------------------

    async def _observe(self, duty: Observing) -> None:
        """Read every registered node's heartbeat (one batch), judge them (membership.judge),
        publish the changes as the feed's next entry, then the snapshot, then the head
        (every duty: the head is the observer's own heartbeat)."""
        names = list(
            dict.fromkeys(
                n for n in self._index.fold(await self._store.get(self._key("names"))) if n
            )
        )
        values = await self._store.get_many([self._key(f"{n}/hb") for n in names])
        now, records = self._clock(), {}
        for name, raw in zip(names, values):
            count, records[name] = self._read_beat(duty, name, raw)
            duty.beats[name] = observe(duty.beats.get(name), count, now)
        duty.beats.pop(self.name, None)  # the observer never judges itself lost...
        changes = judge(self._members, duty.beats, records, self.keep_alive, now, self._wall())
        old = self._members.get(self.name)
        if self._published is not None and (
            old is None or old.lost or old.record != self._published_version
        ):
            changes[self.name] = Membership(
                self._published_version, False, self._wall()
            )  # ...its record
        if changes or not duty.started:
            await self._publish_entry(duty.term, changes)
            duty.started = True
        duty.head_version = max(duty.head_version + 1, self._versions.next())
        await self._write("feed/head", Head(duty.term, self._number).to_json(), duty.head_version)
        await self._read_records()

    async def _publish_entry(self, term: int, changes: dict[str, Membership]) -> None:
        self._term, self._number = term, self._number + 1
        self._members.update(changes)
        self._sightings = None
        number = self._number
        await self._write(
            f"feed/{number}", {"term": term, "changes": members_json(changes)}, number
        )
        await self._write(
            "feed/snapshot",
            {"term": term, "number": number, "members": members_json(self._members)},
            number,
        )
        if number > FEED_KEEP:
            await self._store.delete(self._key(f"feed/{number - FEED_KEEP}"))

    def _read_beat(
        self, duty: Observing, name: str, raw: bytes | None
    ) -> tuple[int | None, int | None]:
        """(its heartbeat count, the record version it names); a refused beat has not moved."""
        opened = open_version(
            self._signer, self._key(f"{name}/hb"), raw, self._on_refused, duty.fresh
        )
        if opened is None:
            return (duty.counts.get(name) if raw is not None else None), None
        duty.counts[name] = opened.version
        record = opened.body.get("record") if isinstance(opened.body, dict) else None
        return opened.version, record if isinstance(record, int) else None

    async def _write(self, suffix: str, body: Any, version: int) -> None:
        key = self._key(suffix)
        await self._store.set(key, self._signer.seal(key, body, version=version))

    # -- following the feed -------------------------------------------------------------------

    def _open_head(self, raw: bytes | None) -> Head | None:
        """The feed's head; a refused one (forged, or an old one written back) has not moved."""
        opened = open_version(
            self._signer, self._key("feed/head"), raw, self._on_refused, self._fresh
        )
        if opened is None:
            self._head_version = self._head_version if raw is not None else None
            return None
        self._head_version = opened.version
        try:
            return Head.from_json(opened.body)
        except (KeyError, TypeError, ValueError) as exc:
            self._on_refused(self._key("feed/head"), f"unreadable: {exc}")
        return None

    async def _follow(self, head: Head | None) -> None:
        """Read what changed up to ``head``; then the records whose version moved."""
        catch = catch_up(self._term, self._number, head, FEED_KEEP)
        if catch.entries and head is not None:  # (entries come with a head only)
            keys = [self._key(f"feed/{n}") for n in catch.entries]
            entries = [
                self._open_entry(n, raw)
                for n, raw in zip(catch.entries, await self._store.get_many(keys))
            ]
            of_term = [e for e in entries if e is not None and e[0] == head.term]
            if len(of_term) == len(entries):
                for _, changes in of_term:
                    self._members.update(changes)
                self._number = head.number
                self._sightings = None
            else:
                catch = Catch(snapshot=True)  # an entry missing, refused or of another term
        if catch.snapshot:
            await self._read_snapshot()
        await self._read_records()

    async def _read_snapshot(self) -> None:
        key = self._key("feed/snapshot")
        snapshot = open_or_refuse(
            self._signer, key, await self._store.get(key), _parse_snapshot, self._on_refused
        )
        if snapshot is not None:
            self._term, self._number, self._members = snapshot
            self._sightings = None

    def _open_entry(
        self, number: int, raw: bytes | None
    ) -> tuple[int, dict[str, Membership]] | None:
        return open_or_refuse(
            self._signer, self._key(f"feed/{number}"), raw, _parse_entry, self._on_refused
        )

    async def _read_records(self) -> None:
        """The record of every member whose announced version is past the one held."""
        stale = [
            name
            for name, member in self._members.items()
            if member.record > self._records.get(name, (0, None))[0] and name != self.name
        ]
        if not stale:
            return
        values = await self._store.get_many([self._key(f"{name}/record") for name in stale])
        for name, raw in zip(stale, values):
            opened = self._open_record_version(name, raw)
            if opened is not None:
                self._records[name] = opened
                self._sightings = None

    def _open_record_version(self, name: str, raw: bytes | None) -> tuple[int, NodeRecord] | None:
        key = self._key(f"{name}/record")
        opened = open_version(self._signer, key, raw, self._on_refused, self._fresh)
        if opened is None:
            return None
        try:
            record = NodeRecord.from_json(opened.body)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._on_refused(key, f"unreadable: {exc}")
            return None
        if record.info.name != name:
            self._on_refused(key, f"names another node ({record.info.name})")
            return None
        return opened.version, record

    def _open_record(self, name: str, raw: bytes | None) -> NodeRecord | None:
        opened = self._open_record_version(name, raw)
        return None if opened is None else opened[1]

    def _open_drain(self, raw: bytes | None) -> tuple[bool | None, int, int | None, str]:
        """The drain request for this node: drain or not, its version, the one GPU it
        readmits (None: the whole node) and who asked; (None, 0, None, "") if there is none."""
        key = self._key(f"{self.name}/drain")
        opened = open_version(self._signer, key, raw, self._on_refused, self._fresh)
        if opened is None:
            return None, 0, None, ""
        try:
            gpu = opened.body.get("gpu")
            if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0):
                raise TypeError(f"not a GPU index: {gpu!r}")
            return bool(opened.body["drain"]), opened.version, gpu, str(opened.body.get("by", ""))
        except (KeyError, TypeError, AttributeError) as exc:
            self._on_refused(key, f"unreadable: {exc}")
        return None, 0, None, ""

    async def wait_for_change(self, timeout: float) -> bool:
        """Block until the observer publishes the feed's next entry (True) or ``timeout``.

        Anyone can end the wait (write the key, or on TCPStore read it while it is missing).
        When the duty after the last wake did not move this node along the feed, that wake
        was no news: this one pauses first (``quiet``, doubling, reset once the feed moved;
        the duty's timer, which cuts the pause, reads the feed meanwhile)."""
        here = (self._term, self._number)
        if self._woken == here:
            await self.quiet.pause()
        else:
            self.quiet.reset()
        woke = await self._store.wait_for(self._key(f"feed/{self._number + 1}"), timeout)
        self._woken = here if woke else None
        return woke

    async def read_record(self, name: str) -> NodeRecord | None:
        """One node's record straight from the store (for a node not seen by a tick yet)."""
        return self._open_record(name, await self._store.get(self._key(f"{name}/record")))

    async def beats(self, names: list[str]) -> dict[str, int | None]:
        """Each node's heartbeat version as of now (None: none, or refused)."""
        keys = [self._key(f"{name}/hb") for name in names]
        values = await self._store.get_many(keys)
        opened = [
            open_version(self._signer, key, raw, self._on_refused) for key, raw in zip(keys, values)
        ]
        return {name: o.version if o is not None else None for name, o in zip(names, opened)}

    async def request_drain(self, name: str, drain: bool, by: str, gpu: int | None = None) -> None:
        if await self.read_record(name) is None:
            raise NotFound(f"no node {name!r}")
        key = self._key(f"{name}/drain")
        current = open_version(self._signer, key, await self._store.get(key), self._on_refused)
        version = max(
            self._versions.next(), current.version + 1 if current else 0
        )  # past it, whatever our clock says
        request = {
            "drain": drain,
            "by": by,
            "at": self._wall(),
            **({"gpu": gpu} if gpu is not None else {}),
        }
        await self._store.set(key, self._signer.seal(key, request, version=version))

    def states(self, sightings: Mapping[str, Sighting]) -> dict[str, NodeState]:
        return {name: node_state(s) for name, s in sightings.items()}


def _parse_entry(body: Any) -> tuple[int, dict[str, Membership]]:
    return json_int(body["term"], "term"), parse_members(body["changes"])


def _parse_snapshot(body: Any) -> tuple[int, int, dict[str, Membership]]:
    return (
        json_int(body["term"], "term"),
        json_int(body["number"], "number"),
        parse_members(body["members"]),
    )


def _epoch_token(body: Any) -> str:
    token = body.get("epoch") if isinstance(body, dict) else None
    if not isinstance(token, str) or not token:
        raise ValueError(f"not an epoch: {token!r}")
    return token


def _registered_name(body: Any) -> str:
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"not a node name: {name!r}")
    return name


@dataclass
class Observing:
    """The observer's memory, for its term: every heartbeat as it saw it."""

    term: int
    head_version: int  # past every head written before (whoever wrote it)
    beats: dict[str, Beat] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # the last valid beat version of each
    fresh: Freshness = field(default_factory=Freshness)  # an older beat written back is no beat
    started: bool = False  # a term starts with a snapshot
