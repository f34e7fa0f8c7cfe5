"""The heartbeat loop (``NodeService``): one duty per keep-alive interval publishes this
node's record through the registry, follows the others and reports the store's health."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from elasticd.aio import race
from elasticd.cluster.registry import NodeRecord, NodeRegistry, Sighting, Tick, node_doc, node_state
from elasticd.core import events
from elasticd.core.model import NODE_STATES, IllegalTransition, NodeState
from elasticd.core.node import Hold
from elasticd.errors import StoreError
from elasticd.faults import Faults, Throttle, held_back
from elasticd.shell.publisher import StoreReset

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Watcher:
    """What is only observed of the heartbeat loop (metrics, the STATUS= line): nothing here
    changes what happens to jobs."""

    store: Callable[[bool, str], None] = lambda ok, problem: None  # the store (un)reachable
    tick: Callable[[], None] = lambda: None  # a duty ended


@dataclass(frozen=True)
class NodeDuties:
    """What the heartbeat loop reads from its daemon and tells it, every duty.  What changes
    what happens to jobs is an event into the node shell's queue (``post``): a drain (or
    undrain) request is HoldChanged (each request once), nodes the observer judged lost
    NodesLost, a store that lost its data StoreReset (awaited: a republish that failed is
    tried again at the next duty).  What is only observed goes to ``watcher``."""

    local_record: Callable[[], NodeRecord]  # this node's record as of now
    post: Callable[[Any], None]  # the node shell's queue (NodeShell.post)
    watcher: Watcher = Watcher()


def store_was_reset(before: str | None, now: str) -> bool:
    """Whether the store's epoch moved from one this node read to another ("" or a new one).
    From none ("": this node came before the store host marked its fresh store) to the
    first one is a store being born, not a reset: a cluster whose nodes start together
    reads that on every node but the host."""
    return bool(before) and now != before


class NodeService:
    """The heartbeat loop: one tick per keep-alive interval (a timer, not a poll).  It
    publishes this node's record, watches the others, notices a reset store and drain
    requests, and reports the store's health."""

    def __init__(
        self, registry: NodeRegistry, *, interval: float, faults: Faults | None = None
    ) -> None:
        self.registry = registry
        self._interval = interval
        self._faults = faults or Faults()
        self._duties: NodeDuties | None = None  # given to run()
        self._sightings: dict[str, Sighting] = {}
        self._seen = 0.0  # wall clock of the last duty that read the store
        self._states: dict[str, NodeState] = {}
        self._tally: Counter[NodeState] = Counter()
        self._epoch: str | None = None
        self.reset_at: float | None = None  # time.monotonic() when a store reset was last seen
        self._drain: tuple[bool, int] | None = None  # the last drain request: (drain, version)
        self._store_up = True
        self._ticked = asyncio.Condition()  # notified when a duty ends
        self._begun = 0  # duties begun
        self._ended = 0  # duties ended, successful or not
        self._wake = asyncio.Event()  # someone wants a duty now (see fresh())
        self._census = (
            False  # the next duty also reads the nodes that registered since the feed said
        )
        self.registered = asyncio.Event()  # this node's record is in the store
        self._told = Throttle()  # a store reset, told once per interval (its key can be deleted)

    async def run(self, stop: asyncio.Event, duties: NodeDuties) -> None:
        self._duties = duties
        while not stop.is_set():
            self._wake.clear()
            self._begun += 1
            began = time.monotonic()
            async with self._faults.contained("heartbeat"):  # then the next duty, as usual
                await self._duty(duties)
            async with self._ticked:
                self._ended += 1
                self._ticked.notify_all()
            await self._pause(stop, began + self._interval - time.monotonic())

    async def _duty(self, duties: NodeDuties) -> None:
        try:
            census, self._census = self._census, False
            tick = await self.registry.tick(duties.local_record(), census=census)
            await self._apply(tick)
        except StoreError as exc:
            self._store_up = False
            duties.watcher.store(False, str(exc))
        else:
            self._store_up = True
            duties.watcher.store(True, "")
            self.registered.set()

    async def _pause(self, stop: asyncio.Event, left: float) -> None:
        """Until the next duty: one heartbeat interval after this one began (so that the
        observer's O(N) duty does not stretch it), or less if ``fresh()`` asks for one or
        the observer published a change (a wait on the feed's next entry, not a poll)."""
        try:
            async with asyncio.timeout(max(left, 0.0)):
                await race(stop=stop.wait(), wake=self._wake.wait(), change=self._change())
        except TimeoutError:
            pass

    async def _change(self) -> None:
        """Returns when the feed moved; never when the store is away (the pause ends it)."""
        try:
            if (
                self._store_up
                and not self.registry.observing
                and await self.registry.wait_for_change(self._interval)
            ):
                return
        except StoreError:
            pass
        await asyncio.Event().wait()

    async def _apply(self, tick: Tick) -> None:
        assert self._duties is not None
        reset = store_was_reset(self._epoch, tick.epoch)
        if reset:  # before the sightings it brings: the nodes not yet republished are missing
            self.reset_at = time.monotonic()
        if tick.sightings is not self._sightings:
            self._sightings = tick.sightings
            before = self._states
            self._follow_states()
            lost = tuple(
                name
                for name, state in self._states.items()
                if state is NodeState.LOST
                and before.get(name, NodeState.LOST) is not NodeState.LOST
            )
            if lost:
                self._duties.post(events.NodesLost(lost))
        self._seen = time.time()
        self._duties.watcher.tick()
        # every new request counts, the same twice too: an undrain also lifts a blacklisting
        # that began after the previous undrain
        if tick.drain is not None and (tick.drain, tick.drain_version) != self._drain:
            self._drain = (tick.drain, tick.drain_version)
            self._duties.post(
                events.HoldChanged(Hold.DRAINED.value, tick.drain)
                if tick.drain_gpu is None
                else events.GpuReadmitted(tick.drain_gpu, tick.drain_by)
            )
        if reset:
            if (held := self._told.check("reset", time.monotonic())) is not None:
                log.warning(
                    "the store was reset (its host restarted): publishing this node's jobs again%s",
                    held_back(held),
                )
            republished = asyncio.get_running_loop().create_future()
            self._duties.post(StoreReset(republished))
            await republished  # a StoreError leaves the old epoch: the next duty tries again
        self._epoch = tick.epoch

    def states(self) -> dict[str, NodeState]:
        return dict(self._states)

    @property
    def sightings(self) -> dict[str, Sighting]:
        """Every node as of the last duty: the same object until a duty changed something."""
        return self._sightings

    async def next_duty(self, seen: int) -> int:
        """Wait until a heartbeat duty after the ``seen``-th ended; the number of duties
        ended by then."""
        async with self._ticked:
            await self._ticked.wait_for(lambda: self._ended > seen)
            return self._ended

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
        self._tally = Counter(states.values())

    def tally(self) -> Counter[NodeState]:
        """How many nodes are in each state (kept with the states: O(1) to read)."""
        return self._tally

    def store_health(self) -> dict[str, Any]:
        return {"store": self.registry.endpoint, "store_up": self._store_up}

    def nodes(self) -> list[dict[str, Any]]:
        """Every node as last seen; this node with its usage as of now."""
        states = self.states()
        sightings = dict(self._sightings)
        me = self.registry.name
        if me in sightings and self._duties is not None:
            sightings[me] = replace(sightings[me], record=self._duties.local_record())
            states[me] = node_state(sightings[me])
        return [node_doc(s, states[name], self._seen) for name, s in sorted(sightings.items())]

    async def fresh(self) -> list[dict[str, Any]]:
        """The node list after a heartbeat duty done now, so that a node that just registered
        shows; the list as last seen if that duty does not end within one interval."""
        wanted = self._begun + 1  # a duty that begins after this request
        self._census = True
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
                await self._ticked.wait_for(lambda: self._ended != seen)  # noqa: B023 (awaited here)
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

    async def beats(self, names: list[str]) -> dict[str, int | None]:
        """Each node's heartbeat version, read now (for a probe's verdict)."""
        return await self.registry.beats(names)

    @property
    def interval(self) -> float:
        return self._interval

    def sighted(self, name: str) -> NodeRecord | None:
        """A node's record as last seen (None: not seen)."""
        sighting = self._sightings.get(name)
        return sighting.record if sighting is not None else None

    def alive(self, name: str) -> bool:
        return self.states().get(name, NodeState.LOST) is not NodeState.LOST

    def peer_keys(self) -> dict[bytes, str]:
        return {
            s.record.peer_key.encode(): name
            for name, s in self._sightings.items()
            if s.record.peer_key
        }

    async def request_drain(self, name: str, drain: bool, by: str, gpu: int | None = None) -> None:
        await self.registry.request_drain(name, drain, by, gpu)


def _without_times(nodes: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Node docs minus their ever-changing 'last seen' (for change detection)."""
    return (
        None if nodes is None else [{k: v for k, v in n.items() if k != "last_seen"} for n in nodes]
    )
