"""The nodes of the cluster: this node's inventory (slots, GPUs) and, in the store, every
node's signed record and heartbeat."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from . import discovery
from .aio import race
from .config import AUTO, DaemonConfig
from .errors import NotFound, StoreError
from .keyspace import Keyspace
from .liveness import Beat, KeepAlive, observe, silent
from .model import NODE_STATES, IllegalTransition, NodeInfo, NodeState
from .store.base import Store
from .store.signing import Freshness, Refused, Signer, SignedLines, VersionClock, open_or_refuse, open_version

log = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT = 10.0


def parse_nvidia_smi(output: str) -> tuple[str, ...]:
    """GPU indices from ``nvidia-smi --query-gpu=index --format=csv,noheader``."""
    return tuple(line.strip() for line in output.splitlines() if line.strip().isdigit())


def discover_gpus(setting: int | str, path: str | None = None) -> tuple[str, ...]:
    """This node's GPUs as CUDA device indices.

    An integer setting is taken as is (devices 0..n-1).  ``auto`` asks ``nvidia-smi`` when
    it is on PATH, and finds none when it is not or when it fails.
    """
    if setting != AUTO:
        return tuple(str(i) for i in range(int(setting)))
    smi = shutil.which("nvidia-smi", path=path)
    if smi is None:
        return ()
    try:
        done = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s); assuming no GPUs", exc)
        return ()
    return parse_nvidia_smi(done.stdout)


def slot_count(config: DaemonConfig, gpus: tuple[str, ...]) -> int:
    """Workers this node runs at once: configured, else one per CPU (at least one per GPU)."""
    if config.node.slots:
        return config.node.slots
    return max(os.cpu_count() or 1, len(gpus))


# -- the node registry in the store -------------------------------------------------------------

def _registered_name(body: Any) -> str:
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"not a node name: {name!r}")
    return name


@dataclass(frozen=True)
class NodeRecord:
    """What a node publishes about itself (signed), rewritten when it changes.

    ``draining``: it takes no new job, for any reason (drained by an operator, not listed by
    the discovery script, blacklisted); ``blacklisted_until``: when its cooldown ends, by its
    own wall clock (0: not blacklisted; for display only, no other node acts on it);
    ``listed``: whether the discovery script lists it (True when there is none)."""

    info: NodeInfo
    draining: bool = False
    slots_used: int = 0
    gpus_used: int = 0
    jobs: tuple[str, ...] = ()
    peer_endpoint: str = ""
    peer_key: str = ""
    blacklisted_until: float = 0.0
    listed: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"info": self.info.to_json(), "draining": self.draining,
                "slots_used": self.slots_used, "gpus_used": self.gpus_used,
                "jobs": list(self.jobs), "peer_endpoint": self.peer_endpoint,
                "peer_key": self.peer_key, "blacklisted_until": self.blacklisted_until,
                "listed": self.listed}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> NodeRecord:
        return cls(NodeInfo.from_json(doc["info"]), bool(doc.get("draining")),
                   int(doc.get("slots_used", 0)), int(doc.get("gpus_used", 0)),
                   tuple(doc.get("jobs", ())), str(doc.get("peer_endpoint", "")),
                   str(doc.get("peer_key", "")), float(doc.get("blacklisted_until", 0.0)),
                   bool(doc.get("listed", True)))


@dataclass(frozen=True)
class Sighting:
    """What this node last saw of another: its record and its heartbeat counter."""

    record: NodeRecord
    beat: Beat
    moved_wall: float   # this node's wall clock when the counter last moved, for display only


def node_state(sighting: Sighting, now: float, keep_alive: KeepAlive) -> NodeState:
    """Lost by the same rule as in every rendezvous; else what the node's record says."""
    if silent(sighting.beat, keep_alive, now):
        return NodeState.LOST
    if sighting.record.blacklisted_until:
        return NodeState.BLACKLISTED
    if sighting.record.draining:
        return NodeState.DRAINING if sighting.record.jobs else NodeState.DRAINED
    return NodeState.UP


def sight(previous: Sighting | None, record: NodeRecord, count: int, now: float,
          wall: float) -> Sighting:
    beat = observe(previous.beat if previous else None, count, now)
    moved = previous is None or beat.since != previous.beat.since
    return Sighting(record, beat, wall if moved else previous.moved_wall)


def node_doc(sighting: Sighting, state: NodeState) -> dict[str, Any]:
    record = sighting.record
    return {"name": record.info.name, "address": record.info.address, "state": state.value,
            "slots_total": record.info.slots, "slots_free": record.info.slots - record.slots_used,
            "gpus_total": len(record.info.gpus), "gpus_free": len(record.info.gpus) - record.gpus_used,
            "jobs": list(record.jobs), "last_seen": sighting.moved_wall,
            "version": record.info.version, "labels": dict(record.info.labels),
            "blacklisted_until": record.blacklisted_until or None, "listed": record.listed}


@dataclass(frozen=True)
class Tick:
    """The result of one heartbeat duty."""

    sightings: dict[str, Sighting]
    drain: bool | None          # a drain request for this node, if any
    epoch: str                  # the store's epoch (changes when the store host restarts)
    drain_version: int = 0      # the drain request's version (each request has a new one)


class NodeRegistry:
    """This node's record and heartbeat in the store, and its view of every other node.

    Keys under ``elasticd/<cluster>/nodes/``: ``names`` (every name that ever registered:
    sealed lines, appended), ``<name>/record`` (signed NodeRecord), ``<name>/hb`` (signed
    heartbeat: its version goes up at every beat), ``<name>/drain`` (signed drain request,
    written by whoever asked).  Records are versioned: an older one written back is refused,
    like a forged one, and this node publishes its own again.  ``tick`` is the heartbeat
    duty.  Store I/O is awaited on the event loop.
    """

    def __init__(self, store: Store, signer: Signer, cluster: str, name: str, *,
                 keep_alive: KeepAlive, endpoint: str = "", on_refused: Refused | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
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
        self._names: list[str] = []
        self._index = SignedLines(signer, self._key("names"), _registered_name, self._on_refused)
        self._versions = VersionClock(wall_clock)
        self._fresh = Freshness()
        self._epoch = ""  # the store's epoch as last read valid
        self._sightings: dict[str, Sighting] = {}
        self._published: NodeRecord | None = None
        self._registered_epoch = ""

    def _key(self, suffix: str) -> str:
        return f"{self._prefix}/{suffix}"

    @property
    def epoch_key(self) -> str:
        return self._keyspace.epoch

    async def create_epoch(self) -> str:
        """The store host marks a fresh store, so that others can tell it was reset."""
        token = secrets.token_hex(8)
        sealed = self._signer.seal(self.epoch_key, {"epoch": token}, version=self._versions.next())
        _, current = await self._store.compare_set(self.epoch_key, None, sealed)
        return self._open_epoch(current) or token

    def _open_epoch(self, raw: bytes | None) -> str:
        """The store's epoch; "" if there is none; the last valid one if it was refused."""
        if raw is None:
            return ""
        epoch = open_or_refuse(self._signer, self.epoch_key, raw, lambda body: str(body["epoch"]),
                               self._on_refused, self._fresh)
        self._epoch = epoch if epoch is not None else self._epoch
        return self._epoch

    async def tick(self, record: NodeRecord) -> Tick:
        epoch = self._open_epoch(await self._store.get(self.epoch_key))
        if epoch != self._registered_epoch or record != self._published:
            await self._publish(record, register=epoch != self._registered_epoch)
            self._registered_epoch = epoch
        beat = self._key(f"{self.name}/hb")
        await self._store.set(beat, self._signer.seal(beat, {}, version=self._versions.next()))
        self._learn_names(await self._store.get(self._key("names")))
        self._sightings = {n: s for n, s in self._sightings.items() if n in self._names}
        keys = [self._key(f"{n}/{part}") for n in self._names for part in ("record", "hb")]
        values = await self._store.get_many(keys + [self._key(f"{self.name}/drain")])
        now, wall = self._clock(), self._wall()
        for i, name in enumerate(self._names):
            record_raw, beat_raw = values[2 * i], values[2 * i + 1]
            parsed = self._open_record(name, record_raw)
            if name == self.name and parsed != self._published:
                self._published = None  # lost or tampered with: publish it again next time
            count = self._beat_count(name, beat_raw)
            if parsed is not None and count is not None:
                self._sightings[name] = sight(self._sightings.get(name), parsed, count, now, wall)
        drain, drain_version = self._open_drain(values[-1])
        return Tick(dict(self._sightings), drain, epoch, drain_version)

    async def _publish(self, record: NodeRecord, *, register: bool) -> None:
        key = self._key(f"{self.name}/record")
        await self._store.set(key, self._signer.seal(key, record.to_json(), version=self._versions.next()))
        if register:
            index = self._key("names")
            await self._store.append(index, self._signer.seal(index, {"name": self.name}) + b"\n")
        self._published = record

    def _learn_names(self, raw: bytes | None) -> None:
        """Every registered name, in order (the index is parsed from where it was last read)."""
        self._names = list(dict.fromkeys(n for n in self._index.fold(raw) if n))

    def _beat_count(self, name: str, raw: bytes | None) -> int | None:
        """A node's heartbeat as a count that moves; a refused one has not moved."""
        opened = open_version(self._signer, self._key(f"{name}/hb"), raw, self._on_refused, self._fresh)
        if opened is not None:
            return opened.version
        previous = self._sightings.get(name)
        return previous.beat.count if previous is not None and raw is not None else None

    def _open_record(self, name: str, raw: bytes | None) -> NodeRecord | None:
        key = self._key(f"{name}/record")
        record = open_or_refuse(self._signer, key, raw, NodeRecord.from_json, self._on_refused, self._fresh)
        if record is not None and record.info.name != name:
            self._on_refused(key, f"names another node ({record.info.name})")
            return None
        return record

    def _open_drain(self, raw: bytes | None) -> tuple[bool | None, int]:
        """The drain request for this node and its version; (None, 0) if there is none."""
        key = self._key(f"{self.name}/drain")
        opened = open_version(self._signer, key, raw, self._on_refused, self._fresh)
        if opened is None:
            return None, 0
        try:
            return bool(opened.body["drain"]), opened.version
        except (KeyError, TypeError) as exc:
            self._on_refused(key, f"unreadable: {exc}")
        return None, 0

    async def read_record(self, name: str) -> NodeRecord | None:
        """One node's record straight from the store (for a node not seen by a tick yet)."""
        return self._open_record(name, await self._store.get(self._key(f"{name}/record")))

    async def request_drain(self, name: str, drain: bool, by: str) -> None:
        if await self.read_record(name) is None:
            raise NotFound(f"no node {name!r}")
        key = self._key(f"{name}/drain")
        current = open_version(self._signer, key, await self._store.get(key), self._on_refused)
        version = max(self._versions.next(), current.version + 1 if current else 0)  # past it, whatever our clock says
        await self._store.set(key, self._signer.seal(key, {"drain": drain, "by": by, "at": self._wall()},
                                                     version=version))

    def states(self, sightings: Mapping[str, Sighting]) -> dict[str, NodeState]:
        now = self._clock()
        return {name: node_state(s, now, self.keep_alive) for name, s in sightings.items()}


@dataclass(frozen=True)
class NodeDuties:
    """What the heartbeat loop reads from its daemon and tells it, every duty."""

    local_record: Callable[[], NodeRecord]            # this node's record as of now
    on_drain: Callable[[bool], None]                  # a drain (or undrain) was requested (each request once)
    on_reset: Callable[[], Awaitable[None]]           # the store lost its data: publish again
    on_store: Callable[[bool, str], None] = lambda ok, problem: None  # the store (un)reachable
    on_tick: Callable[[], None] = lambda: None        # a duty ended


class NodeService:
    """The heartbeat loop: one tick per keep-alive interval (a timer, not a poll).  It
    publishes this node's record, watches the others, notices a reset store and drain
    requests, and reports the store's health."""

    def __init__(self, registry: NodeRegistry, *, interval: float) -> None:
        self.registry = registry
        self._interval = interval
        self._duties: NodeDuties | None = None  # given to run()
        self._sightings: dict[str, Sighting] = {}
        self._states: dict[str, NodeState] = {}
        self._epoch: str | None = None
        self._drain: tuple[bool, int] | None = None  # the last drain request: (drain, version)
        self._store_up = True
        self._ticked = asyncio.Condition()  # notified when a duty ends
        self._begun = 0      # duties begun
        self._ended = 0      # duties ended, successful or not
        self._wake = asyncio.Event()  # someone wants a duty now (see fresh())
        self.registered = asyncio.Event()  # this node's record is in the store

    async def run(self, stop: asyncio.Event, duties: NodeDuties) -> None:
        self._duties = duties
        while not stop.is_set():
            self._wake.clear()
            self._begun += 1
            try:
                tick = await self.registry.tick(duties.local_record())
                await self._apply(tick)
            except StoreError as exc:
                self._store_up = False
                duties.on_store(False, str(exc))
            else:
                self._store_up = True
                duties.on_store(True, "")
                self.registered.set()
            async with self._ticked:
                self._ended += 1
                self._ticked.notify_all()
            await self._pause(stop)

    async def _pause(self, stop: asyncio.Event) -> None:
        """Until the next duty: one heartbeat interval, or less if ``fresh()`` asks for one."""
        try:
            async with asyncio.timeout(self._interval):
                await race(stop=stop.wait(), wake=self._wake.wait())
        except TimeoutError:
            pass

    async def _apply(self, tick: Tick) -> None:
        assert self._duties is not None
        self._sightings = tick.sightings
        self._follow_states()
        self._duties.on_tick()
        # every new request counts, the same twice too: an undrain also lifts a blacklisting
        # that began after the previous undrain
        if tick.drain is not None and (tick.drain, tick.drain_version) != self._drain:
            self._drain = (tick.drain, tick.drain_version)
            self._duties.on_drain(tick.drain)
        if self._epoch is not None and tick.epoch != self._epoch:
            log.warning("the store was reset (its host restarted): publishing this node's jobs again")
            await self._duties.on_reset()  # a StoreError leaves the old epoch: the next duty tries again
        self._epoch = tick.epoch

    def states(self) -> dict[str, NodeState]:
        return dict(self._states)

    def _follow_states(self) -> None:
        """Every node's state as of this duty, each change checked by NODE_STATES (a change
        the table refuses is logged and the node keeps its state)."""
        states = {}
        for name, state in self.registry.states(self._sightings).items():
            try:
                states[name] = NODE_STATES.check(self._states.get(name), state)
            except IllegalTransition as exc:
                log.warning("node %s: %s", name, exc)
                states[name] = self._states[name]
        self._states = states

    def store_health(self) -> dict[str, Any]:
        return {"store": self.registry.endpoint, "store_up": self._store_up}

    def nodes(self) -> list[dict[str, Any]]:
        """Every node as last seen; this node with its usage as of now."""
        states = self.states()
        sightings = dict(self._sightings)
        me = self.registry.name
        if me in sightings and self._duties is not None:
            sightings[me] = replace(sightings[me], record=self._duties.local_record())
            states[me] = node_state(sightings[me], sightings[me].beat.since, self.registry.keep_alive)
        return [node_doc(s, states[name]) for name, s in sorted(sightings.items())]

    async def fresh(self) -> list[dict[str, Any]]:
        """The node list after a heartbeat duty done now, so that a node that just registered
        shows; the list as last seen if that duty does not end within one interval."""
        wanted = self._begun + 1  # a duty that begins after this request
        self._wake.set()
        async with self._ticked:
            try:
                async with asyncio.timeout(self._interval):
                    await self._ticked.wait_for(lambda: self._ended >= wanted)
            except TimeoutError:
                pass
        return self.nodes()

    async def watch(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The node list now, then again after every heartbeat duty that changed it (a failed
        duty too: with the store gone, nodes turn lost as time passes)."""
        last: list[dict[str, Any]] | None = None
        seen = -1
        while True:
            async with self._ticked:
                await self._ticked.wait_for(lambda: self._ended != seen)
                seen = self._ended
            nodes = self.nodes()
            if _without_times(nodes) != _without_times(last):
                last = nodes
                yield nodes

    async def record(self, name: str) -> NodeRecord | None:
        """A node's record: as last seen, else read from the store now."""
        sighting = self._sightings.get(name)
        if sighting is not None:
            return sighting.record
        return await self.registry.read_record(name)

    def heard_since(self, name: str, moment: float) -> bool:
        """Whether ``name`` beat after ``moment`` (this node's monotonic clock).  Counters are
        read once per interval, so a move seen within one interval of ``moment`` may be a
        beat from before it: only a later one counts."""
        sighting = self._sightings.get(name)
        return sighting is not None and sighting.beat.since > moment + self._interval

    def alive(self, name: str) -> bool:
        return self.states().get(name, NodeState.LOST) is not NodeState.LOST

    def peer_keys(self) -> dict[bytes, str]:
        return {s.record.peer_key.encode(): name for name, s in self._sightings.items() if s.record.peer_key}

    async def request_drain(self, name: str, drain: bool, by: str) -> None:
        await self.registry.request_drain(name, drain, by)


def _without_times(nodes: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Node docs minus their ever-changing 'last seen' (for change detection)."""
    return None if nodes is None else [{k: v for k, v in n.items() if k != "last_seen"} for n in nodes]


# -- host discovery: the script that says which nodes may take work ------------------------------

class DiscoveryFailed(Exception):
    """A run of the discovery script failed (the message says why)."""


_STDERR_TAIL = 512  # bytes of a failed script's stderr that its error message quotes


async def run_discovery_script(script: str, timeout: float, limit: int = discovery.MAX_OUTPUT) -> str:
    """What ``script`` printed (no shell, no arguments, stdin closed, in its own session);
    DiscoveryFailed if it cannot be run, exits non-zero, takes longer than ``timeout`` or
    prints more than ``limit`` bytes (its process group is killed then) or no UTF-8."""
    try:
        proc = await asyncio.create_subprocess_exec(
            script, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
    except OSError as exc:
        raise DiscoveryFailed(f"cannot run {script}: {exc.strerror or exc}") from None
    assert proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(timeout):
            out, err, _ = await asyncio.gather(_read_capped(proc, proc.stdout, limit),
                                               _read_capped(proc, proc.stderr, None), proc.wait())
    except TimeoutError:
        raise DiscoveryFailed(f"{script} did not finish within {timeout:g} s") from None
    finally:
        _kill_group(proc)
        await proc.wait()
    if out is None:
        raise DiscoveryFailed(f"{script} printed more than {limit} bytes")
    if proc.returncode != 0:
        why = f"exit status {proc.returncode}" if proc.returncode > 0 else \
            f"killed by signal {-proc.returncode}"
        last = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
        raise DiscoveryFailed(f"{script} failed ({why})" + (f": {last[0]!r}" if last else ""))
    try:
        return out.decode()
    except UnicodeDecodeError:
        raise DiscoveryFailed(f"{script} printed something that is not UTF-8") from None


async def _read_capped(proc: asyncio.subprocess.Process, stream: asyncio.StreamReader,
                       limit: int | None) -> bytes | None:
    """Everything until EOF.  More than ``limit`` bytes: None, and the script's process group
    is killed (the rest is read and dropped).  ``limit`` None: only the last _STDERR_TAIL
    bytes are kept (for an error message)."""
    data: bytes | None = b""
    while chunk := await stream.read(65536):
        if data is None:
            continue
        data += chunk
        if limit is None:
            data = data[-_STDERR_TAIL:]
        elif len(data) > limit:
            data = None
            _kill_group(proc)
    return data


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL to the script's process group, while its leader is not reaped (so that the
    group id cannot belong to anybody else)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class HostDiscovery:
    """Runs the discovery script once per interval (a timer after each run ends) and tells
    this node whether it is listed, each time that changes.  A failed run is reported to
    ``on_failure`` and changes nothing: the last good list stays in force.  The first run is
    the caller's (``first``), at start-up, where a failure stops the daemon."""

    def __init__(self, script: str, *, interval: float, timeout: float, names: tuple[str, ...],
                 on_failure: Callable[[str], None] = lambda why: None) -> None:
        self.script = script
        self._interval = interval
        self._timeout = timeout
        self._names = names
        self._on_failure = on_failure
        self._listing: discovery.Listing | None = None
        self._failing = ""  # why the runs fail, while they do (logged when it changes)

    async def discover(self) -> discovery.Listing:
        """One run: this node's listing; DiscoveryFailed if the run failed."""
        output = await run_discovery_script(self.script, self._timeout)
        try:
            hosts = discovery.parse_hosts(output)
        except ValueError as exc:
            raise DiscoveryFailed(f"{self.script} printed {exc}") from None
        return discovery.listing(hosts, self._names)

    async def first(self) -> discovery.Listing:
        """The run at start-up (DiscoveryFailed passes to the caller)."""
        self._listing = await self.discover()
        return self._listing

    async def run(self, stop: asyncio.Event, on_listing: Callable[[discovery.Listing], None]) -> None:
        """Until ``stop``: a run per interval; ``on_listing`` when this node's listing changed."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(self._interval):
                    await stop.wait()
                return
            except TimeoutError:
                pass
            try:
                listing = await self.discover()
            except DiscoveryFailed as exc:
                if str(exc) != self._failing:
                    log.warning("host discovery failed, the last list stays in force: %s", exc)
                self._failing = str(exc)
                self._on_failure(str(exc))
                continue
            if self._failing:
                log.info("host discovery works again")
                self._failing = ""
            if listing != self._listing:
                self._listing = listing
                on_listing(listing)
