"""The cluster's scheduler (docs/scheduler.md): the allocator that the observer runs, the schedule
it publishes, and every node's following of it.

Keys under ``elasticd/<cluster>/schedule``::

    body            signed Schedule, versioned (term << 32 | number: newer whatever the clocks)
    head            signed {"version"}: what a follower reads every duty (small)
    mark/<version>  a wake-up for followers waiting on the next version (not trusted: the
                    head and the body are)

The allocator runs on the node that observes the heartbeats (its election, its term): a
new observer takes over within ``dead_after`` and starts from the last schedule.  It plans
again only when its input changed (a job's record, the nodes, a growth falling due), and
writes only a changed plan: its cost is O(changes).  A follower holds the newest valid
schedule; one of an older term than the observer's is dropped after ``dead_after``, and
the node places jobs itself meanwhile (so placing never stops).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from elasticd.aio import race
from elasticd.cluster.registry import node_state
from elasticd.cluster.service import NodeService
from elasticd.config import DaemonConfig
from elasticd.core import events
from elasticd.core.allocation import Policy
from elasticd.core.model import NodeState
from elasticd.core.records import JobRecord
from elasticd.core.schedule import NodeSize, Schedule, next_growth, plan
from elasticd.core.usage import decayed, spans
from elasticd.errors import StoreError
from elasticd.jobs.accounts import account_of, group_namer
from elasticd.jobs.registry import JobRegistry
from elasticd.store.base import Store
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import Freshness, Refused, Signer, open_or_refuse

log = logging.getLogger(__name__)

MARKS_KEPT = 8


def _version(body: Any) -> int:
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError("a schedule head holds a version")
    return version


class ScheduleBoard:
    """The schedule's keys in the store: signed, versioned, refused when forged or older."""

    def __init__(
        self, store: Store, signer: Signer, keyspace: Keyspace, on_refused: Refused
    ) -> None:
        self._store = store
        self._signer = signer
        self._prefix = keyspace.schedule
        self._refused = on_refused
        self._fresh = Freshness()

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    async def publish(self, schedule: Schedule) -> bool:
        """Write ``schedule`` unless the store holds a newer one (an allocator that was
        paused past its term must not write over its successor's); True if written."""
        version = schedule.version
        newer = await self.head()
        if newer is not None and newer > version:
            return False
        body, head = self._key("body"), self._key("head")
        await self._store.set(body, self._signer.seal(body, schedule.to_json(), version=version))
        await self._store.set(head, self._signer.seal(head, {"version": version}, version=version))
        await self._store.set(self._key(f"mark/{version}"), b"1")
        if schedule.number > MARKS_KEPT:
            await self._store.delete(self._key(f"mark/{version - MARKS_KEPT}"))
        return True

    async def head(self) -> int | None:
        """The newest schedule's version (None: none, or refused)."""
        key = self._key("head")
        return open_or_refuse(
            self._signer, key, await self._store.get(key), _version, self._refused, self._fresh
        )

    async def read(self) -> Schedule | None:
        key = self._key("body")
        return open_or_refuse(
            self._signer,
            key,
            await self._store.get(key),
            Schedule.from_json,
            self._refused,
            self._fresh,
        )

    async def wait_next(self, version: int, timeout: float) -> bool:
        """Wait for the schedule after ``version`` of the same term, at most ``timeout``."""
        return await self._store.wait_for(self._key(f"mark/{version + 1}"), timeout)


def node_sizes(nodes: NodeService) -> dict[str, NodeSize]:
    """Every node the allocator may use, and whether it may take jobs now."""
    sizes = {}
    for name, sighting in nodes.sightings.items():
        info = sighting.record.info
        sizes[name] = NodeSize(
            info.slots,
            len(info.gpus),
            info.cpus,
            usable=node_state(sighting) is NodeState.UP and sighting.record.listed,
        )
    return sizes


class Allocator:
    """Plans the cluster's schedule while this node observes; idle otherwise."""

    def __init__(
        self,
        board: ScheduleBoard,
        nodes: NodeService,
        jobs: Callable[[], list[JobRecord]],
        policy: Policy,
        *,
        usage: Callable[[float], Mapping[str, float]] = lambda now: {},
        clock: Callable[[], float] = time.time,
        on_plan: Callable[[Schedule | None, Schedule, float], None] = lambda *plan: None,
    ) -> None:
        self._board = board
        self._nodes = nodes
        self._jobs = jobs
        self.policy = policy
        self._usage = usage
        self._clock = clock
        self._on_plan = on_plan
        self._wake = asyncio.Event()
        self._changes = 0  # job records changed (JobRegistry.subscribe)
        self._planned: tuple[Any, ...] | None = None  # the input of the last plan
        self._due: float | None = None  # when a job's growth falls due (a plan may then move it)
        self.schedule: Schedule | None = None  # the last one written (or read at takeover)

    def jobs_changed(self, record: JobRecord | None = None) -> None:
        self._changes += 1
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Plan after every change of the jobs, every heartbeat duty (the nodes), and when a
        growth falls due."""
        duties = 0
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.allocate()
            except StoreError as exc:
                log.warning("the allocator could not publish the schedule: %s", exc)
            wait = (
                self._nodes.interval
                if self._due is None
                else min(self._nodes.interval, max(self._due - self._clock(), 0.0))
            )
            try:
                async with asyncio.timeout(wait):
                    name, done = await race(
                        stop=stop.wait(), wake=self._wake.wait(), duty=self._nodes.next_duty(duties)
                    )
                    if name == "duty":
                        duties = done.result()
            except TimeoutError:
                pass

    async def allocate(self) -> None:
        """Plan once if this node observes and the input changed (or a growth is due);
        publish a plan that moved something."""
        registry = self._nodes.registry
        if not registry.observing:
            self.schedule, self._planned = None, None
            return
        term = registry.observer_term
        if self.schedule is None or self.schedule.term != term:
            try:
                self.schedule = await self._board.read()  # the last one, of any term
            except StoreError:
                return
            self._planned = None
        now = self._clock()
        planned = (term, self._changes, id(self._nodes.sightings))
        if planned == self._planned and (self._due is None or now < self._due):
            return
        began = time.perf_counter()
        schedule = plan(
            self._jobs(),
            node_sizes(self._nodes),
            self.schedule,
            self.policy,
            self._usage(now),
            term=term,
            now=now,
            account=account_of,
        )
        took = time.perf_counter() - began
        if schedule is not self.schedule:
            if not await self._board.publish(schedule):  # a later term wrote: this node's is over
                log.info(
                    "a newer schedule is in the store: node %s no longer allocates", registry.name
                )
                self.schedule, self._planned = None, None
                return
            if self.schedule is None or not schedule.same_plan(self.schedule):
                log.info("schedule %d.%d: %s", schedule.term, schedule.number, describe(schedule))
        self._on_plan(self.schedule, schedule, took)  # every plan (the previous one: nothing moved)
        self.schedule, self._planned = schedule, planned
        self._due = next_growth(schedule, self.policy, now)


def describe(schedule: Schedule) -> str:
    """Counts only: a line naming jobs would be theirs in the journal (`elasticctl queue`
    and `list` name them)."""
    nodes = sum(len(n) for n in schedule.nodes.values())
    return (
        f"{len(schedule.nodes)} jobs on {nodes} node shares, {len(schedule.waiting)} waiting"
        f"{f', {len(schedule.preempted)} preempted' if schedule.preempted else ''}"
    )


class ScheduleFollower:
    """Holds the newest valid schedule and tells the node core which one to follow."""

    def __init__(
        self,
        board: ScheduleBoard,
        nodes: NodeService,
        post: Callable[[Any], None],
        *,
        dead_after: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._board = board
        self._nodes = nodes
        self._post = post
        self._dead_after = dead_after
        self._clock = clock
        self.held: Schedule | None = None
        self._sent: Schedule | None = None  # what the core follows (it starts with none)
        self._stale_since: float | None = None  # when the held schedule's term was found behind
        self._told = False  # the core heard at least once (it places nothing before)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow at once when the allocator marks its next schedule, else every interval."""
        while not stop.is_set():
            try:
                await self.follow()
                version = self.held.version if self.held is not None else 0
                name, done = await race(
                    stop=stop.wait(), mark=self._board.wait_next(version, self._nodes.interval)
                )
                if name == "mark":
                    done.result()
            except StoreError:  # the store is away: keep what is held, look again later
                await race(stop=stop.wait(), pause=asyncio.sleep(self._nodes.interval))

    async def follow(self) -> None:
        version = await self._board.head()
        if version is not None and (self.held is None or version > self.held.version):
            schedule = await self._board.read()
            if schedule is not None and schedule.version >= version:
                self.held = schedule
        self._judge(self._nodes.registry.observer_term)

    @property
    def followed(self) -> Schedule | None:
        """The schedule this node follows now (None: it places jobs itself)."""
        return self._sent

    def _judge(self, term: int) -> None:
        current = self.held if self.held is not None and self.held.term >= term else None
        if current is not None:
            self._stale_since = None
            if current is not self._sent:
                self._send(current)
            return
        if not self._told:  # none in the store (a new cluster): first come until there is one
            self._send(None)
            return
        now = self._clock()
        if self._stale_since is None:
            self._stale_since = now
        if self._sent is not None and now - self._stale_since >= self._dead_after:
            log.warning(
                "no schedule from the allocator of term %d for %.0f s: nodes place jobs "
                "themselves until it publishes one",
                term,
                now - self._stale_since,
            )
            self._send(None)

    def _send(self, schedule: Schedule | None) -> None:
        self._sent, self._told = schedule, True
        self._post(events.ScheduleChanged(schedule))


def build_scheduler(
    config: DaemonConfig,
    store: Store,
    signer: Signer,
    nodes: NodeService,
    registry: JobRegistry,
    post: Callable[[Any], None],
    refused: Refused,
    *,
    on_plan: Callable[[Schedule | None, Schedule, float], None] = lambda *plan: None,
) -> tuple[Allocator, ScheduleFollower] | None:
    """The allocator (it plans while this node observes; fair share from the jobs' usage;
    ``on_plan(previous, schedule, seconds)`` after each plan) and this node's following of
    its schedule; None where the config turns the scheduler off."""
    if not config.scheduler.enabled:
        return None
    board = ScheduleBoard(store, signer, Keyspace(config.cluster.name), refused)
    policy = config.scheduler.policy()

    def usage(now: float) -> dict[str, float]:
        named = group_namer()  # one lookup per group per plan, not one per span
        return decayed(
            (span for record in registry.jobs() for span in spans(record, named)),
            now,
            policy.half_life,
        )

    allocator = Allocator(board, nodes, registry.jobs, policy, usage=usage, on_plan=on_plan)
    registry.subscribe(allocator.jobs_changed)
    return allocator, ScheduleFollower(
        board, nodes, post, dead_after=config.rendezvous.keep_alive.dead_after
    )
