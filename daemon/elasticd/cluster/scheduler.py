"""The cluster's scheduler (docs/scheduler.md): the allocator that the observer runs, the schedule
it publishes, and every node's following of it.

Keys under ``elasticd/<cluster>/schedule``::

    body            signed Schedule, versioned (term << 32 | number: newer whatever the clocks)
    head            signed {"version"}: what a follower reads every duty (small)
    mark/<version>  a wake-up for followers waiting on the next version: its presence alone
                    changes nothing (anyone may write it: the follower then reads the signed
                    head, and a wake-up that brought no news makes it back off)

The allocator runs on the node that observes the heartbeats (its election, its term): a
new observer takes over within ``dead_after`` and starts from the last schedule.  It plans
again only when its input changed (a job's record, the nodes, a growth or a job's
``min_run_time`` falling due), and writes only a changed plan.  Nothing it computes runs on
the event loop: each plan runs in a worker thread, at the cost of what changed (the pure
``Planner`` keeps each job's demand; the fair share reads running sums that each changed
record updates, never the whole history), bounded by its look-ahead, which shrinks when a
plan overruns ``PLAN_DEADLINE`` (and grows back when plans are quick again).  The loop
only hands it the records that changed and the nodes, so heartbeats, the observer's
duties and the control socket never wait behind a plan.

A follower holds the newest valid schedule; one of an older term than the observer's is
dropped after ``dead_after``, and the node places jobs itself meanwhile (so placing never
stops).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elasticd.aio import race
from elasticd.cluster.registry import node_state
from elasticd.cluster.service import NodeService
from elasticd.config import DaemonConfig
from elasticd.core import events
from elasticd.core.allocation import Policy
from elasticd.core.allocator import LOOK_AHEAD
from elasticd.core.model import NodeState
from elasticd.core.records import JobRecord
from elasticd.core.schedule import NodeSize, Planner, Schedule, next_due
from elasticd.core.usage import UsageSums
from elasticd.errors import StoreError
from elasticd.faults import Throttle
from elasticd.jobs.accounts import account_of, group_name, group_namer
from elasticd.jobs.registry import JobRegistry
from elasticd.store.base import Store
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import Freshness, Refused, Signer, open_or_refuse

log = logging.getLogger(__name__)

MARKS_KEPT = 8
PLAN_DEADLINE = 0.25  # seconds: a plan that takes longer halves the allocator's look-ahead
LEAST_LOOK_AHEAD = 8
QUIET_PAUSE = 0.01  # seconds: the first pause after a wake-up that brought no news (doubles)


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
        records: Iterable[JobRecord],
        policy: Policy,
        *,
        account: Callable[[Any], str] = account_of,
        clock: Callable[[], float] = time.time,
        on_plan: Callable[[Schedule | None, Schedule, float], None] = lambda *plan: None,
        deadline: float = PLAN_DEADLINE,
        settle: float = 0.0,
    ) -> None:
        self._board = board
        self._settle = settle  # seconds after a store reset before the next plan
        self._nodes = nodes
        self.policy = policy
        self._clock = clock
        self._on_plan = on_plan
        self._deadline = deadline
        self._wake = asyncio.Event()
        self._changes = 0  # job records changed (JobRegistry.subscribe)
        self._changed: dict[str, JobRecord] = {r.id: r for r in records}  # since the last plan
        self._planned: tuple[Any, ...] | None = None  # the input of the last plan
        self._due: float | None = None  # when a plan may move something with no change
        self.schedule: Schedule | None = None  # the last one written (or read at takeover)
        self.look_ahead = LOOK_AHEAD
        self._slow = Throttle(60.0)
        # touched only by the planning thread, one plan at a time:
        self._planner = Planner(account)
        self._usage = UsageSums(policy.half_life, group_name)
        self._planning: asyncio.Future[Schedule] | None = None

    def jobs_changed(self, record: JobRecord | None = None) -> None:
        if record is not None:
            self._changed[record.id] = record
        self._changes += 1
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Plan after every change of the jobs, every heartbeat duty (the nodes), and when a
        growth or a job's minimum run time falls due."""
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
        """Plan once if this node observes and the input changed (or something falls due);
        publish a plan that moved something."""
        registry = self._nodes.registry
        if not registry.observing:
            self.schedule, self._planned = None, None
            return
        reset = self._nodes.reset_at
        if reset is not None and time.monotonic() - reset < self._settle:
            # a reset store holds only the nodes that republished since: a plan now would
            # take the others' shares from their running jobs (they republish within a
            # heartbeat's dead_after, while the nodes follow the schedule written back)
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
        schedule = await self._plan(node_sizes(self._nodes), term, now)
        took = time.perf_counter() - began
        self._pace(took)
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
        self._due = next_due(schedule, self.policy, now)

    async def _plan(self, nodes: Mapping[str, NodeSize], term: int, now: float) -> Schedule:
        """One plan in the worker thread, with the records changed since the last one.  A
        plan is never cancelled half way (its thread could not be): a caller cancelled
        meanwhile leaves it to finish, and the next plan waits for it."""
        if self._planning is not None and not self._planning.done():
            await asyncio.shield(self._planning)
        changed, self._changed = self._changed, {}
        previous, look_ahead = self.schedule, self.look_ahead
        self._planning = asyncio.ensure_future(
            asyncio.to_thread(self._plan_in_thread, changed, nodes, previous, term, now, look_ahead)
        )
        try:
            return await asyncio.shield(self._planning)
        except Exception:
            self._changed = {**changed, **self._changed}  # taken again by the next plan
            raise

    def _plan_in_thread(
        self,
        changed: Mapping[str, JobRecord],
        nodes: Mapping[str, NodeSize],
        previous: Schedule | None,
        term: int,
        now: float,
        look_ahead: int,
    ) -> Schedule:
        named = group_namer()  # one lookup per group per plan
        for record in changed.values():
            self._usage.update(record, now, named)
        self._planner.take(changed.values())
        return self._planner.plan(
            nodes,
            previous,
            self.policy,
            self._usage.at(now),
            term=term,
            now=now,
            look_ahead=look_ahead,
        )

    def _pace(self, took: float) -> None:
        """A plan over the deadline halves the look-ahead; one well within it doubles it
        back, up to the allocator's own."""
        if took > self._deadline and self.look_ahead > LEAST_LOOK_AHEAD:
            self.look_ahead = max(LEAST_LOOK_AHEAD, self.look_ahead // 2)
            held = self._slow.check("plan", time.monotonic())
            if held is not None:
                log.warning(
                    "a plan took %.2f s, over %.2f s: the allocator places at most %d waiting "
                    "jobs a plan now%s",
                    took,
                    self._deadline,
                    self.look_ahead,
                    f" ({held} more such plans since the last line)" if held else "",
                )
        elif took < self._deadline / 4 and self.look_ahead < LOOK_AHEAD:
            self.look_ahead = min(LOOK_AHEAD, self.look_ahead * 2)


def describe(schedule: Schedule) -> str:
    """Counts only: a line naming jobs would be theirs in the journal (`elasticctl queue`
    and `list` name them)."""
    nodes = sum(len(n) for n in schedule.nodes.values())
    return (
        f"{len(schedule.nodes)} jobs on {nodes} node shares, "
        f"{len(schedule.waiting) + schedule.later} waiting"
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
        self.quiet_wakes = 0  # wake-ups in a row that brought no newer schedule

    async def run(self, stop: asyncio.Event) -> None:
        """Follow at once when the allocator marks its next schedule, else every interval.
        A mark anyone may write: one that woke this node for nothing (the head did not
        move) makes it pause before it waits again, twice as long each time up to the
        interval, so a key written ahead of the allocator costs a read per interval, not
        a busy loop."""
        woke = False
        while not stop.is_set():
            try:
                before = self._version()
                await self.follow()
                if not woke or self._version() != before:
                    self.quiet_wakes = 0
                else:
                    self.quiet_wakes += 1
                    pause = min(self._nodes.interval, QUIET_PAUSE * 2 ** (self.quiet_wakes - 1))
                    await race(stop=stop.wait(), pause=asyncio.sleep(pause))
                    if stop.is_set():
                        return
                name, done = await race(
                    stop=stop.wait(),
                    mark=self._board.wait_next(self._version(), self._nodes.interval),
                )
                woke = name == "mark" and bool(done.result())
            except StoreError:  # the store is away: keep what is held, look again later
                woke = False
                await race(stop=stop.wait(), pause=asyncio.sleep(self._nodes.interval))

    def _version(self) -> int:
        return self.held.version if self.held is not None else 0

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
    """The allocator (it plans while this node observes, from the jobs' records as they
    change; ``on_plan(previous, schedule, seconds)`` after each plan) and this node's
    following of its schedule; None where the config turns the scheduler off."""
    if not config.scheduler.enabled:
        return None
    board = ScheduleBoard(store, signer, Keyspace(config.cluster.name), refused)
    allocator = Allocator(
        board,
        nodes,
        registry.jobs(),
        config.scheduler.policy(),
        on_plan=on_plan,
        settle=config.rendezvous.keep_alive.dead_after,
    )
    registry.subscribe(allocator.jobs_changed)
    return allocator, ScheduleFollower(
        board, nodes, post, dead_after=config.rendezvous.keep_alive.dead_after
    )
