"""JobService: this node's side of every job.

Submit, finish and cancel a job (through the board, the cluster's job table in the store);
place jobs on this node (``placement``, pure) and run one agent per job placed here, as
tasks of one group; take what the agents report (AgentPorts) into the registry and onto the
board.  Following the board is the BoardFollower's, building agents the AgentFactory's.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import pwd
import re
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from .agent import AgentFactory, JobAgent
from .blacklist import USERS_FOR_NODE, Blacklist, worker_failures
from .board import BoardFollower, JobBoard
from .discovery import Listing
from .errors import Conflict, StoreError
from .faults import Faults
from .jobs import JobRegistry
from .journal import about
from .records import JobRecord, Outcome, Part, started
from .model import JobSpec, JobState, PartState
from .placement import Offer, Resources, place, refusal
from .rendezvous import Reason

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^j-[0-9a-f]{6}$")
_SHUTDOWN_PUBLISH = 5.0  # seconds the last parts get to reach the board at shutdown
_REPUBLISH_PAUSE = 2.0  # seconds between tries to publish a part while the store is away


@dataclass
class _Running:
    agent: JobAgent
    offer: Offer
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Hold(enum.StrEnum):
    """Why this node takes no new job and leaves its jobs (any one of them is enough)."""

    DRAINED = "drained by an operator"
    UNLISTED = "not listed by the discovery script"
    BLACKLISTED = "blacklisted"


class JobService:
    def __init__(self, *, node: str, resources: Resources, board: JobBoard,
                 follower: BoardFollower, registry: JobRegistry, agents: AgentFactory,
                 standalone: bool = False, allow_root: bool = False,
                 blacklist: Blacklist | None = None,
                 on_blacklist: Callable[[bool], None] = lambda blacklisted: None,
                 faults: Faults | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.node = node
        self._faults = faults or Faults()
        self.resources = resources
        self._configured = resources  # what the config gives (discovery may say other slots)
        self._board = board
        self._follower = follower
        self._registry = registry
        self._agents = agents
        self._standalone = standalone
        self._running: dict[str, _Running] = {}
        self._unstartable: set[str] = set()  # jobs whose agent failed to start here
        self._refused: dict[str, str] = {}  # job id -> why this node's rules forbid it
        self._declined: dict[str, int] = {}  # job id -> its record's version when its agent declined
        self._allow_root = allow_root
        self._unpublished: dict[str, Part] = {}  # job id -> this node's newest part, for the board
        self._publish = asyncio.Event()
        self._placing = False
        self._stopping = False
        self._holds: set[Hold] = set()
        self.listed = True
        self._blacklist = blacklist
        self._on_blacklist = on_blacklist
        self._cooldown: asyncio.TimerHandle | None = None
        self._user_cooldowns: dict[int, asyncio.TimerHandle] = {}  # uid -> the end of its cooldown here
        self.blacklisted_until = 0.0  # wall clock, for display (0: not blacklisted)
        self._clock = clock
        self._wall = wall_clock
        self._tasks: asyncio.TaskGroup | None = None
        registry.subscribe(self._on_change)

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the board and run agents until ``stop`` is set; then stop every job here."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            await self._follower.resync()
            self._republish_parts()
            following = tasks.create_task(self._follower.run())
            publishing = tasks.create_task(self._publish_parts())
            self._schedule_placement()
            await stop.wait()
            if self._cooldown is not None:
                self._cooldown.cancel()
            for timer in self._user_cooldowns.values():
                timer.cancel()
            following.cancel()  # it may be waiting on a store that does not answer
            await self._shutdown()
            await self._flush_parts()
            publishing.cancel()
        self._tasks = None

    async def _shutdown(self) -> None:
        """Stop every local job: a one-node cluster cancels them, a node of a larger one leaves."""
        self._stopping = True
        for job_id, running in list(self._running.items()):
            if self._standalone:
                await self.finish(job_id, Outcome(JobState.CANCELLED, time.time(), None,
                                                  "cancelled: elasticd shut down", None, self.node))
            else:
                running.agent.leave(Reason.SHUTDOWN)
        await asyncio.gather(*(r.done.wait() for r in self._running.values()))

    # -- submit, finish, cancel -------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobRecord:
        """Publish a new job.  It is in this node's history first: a job that could not be
        recorded (a full disk) is refused before any node could take it."""
        seq = await self._board.next_seq()
        self._registry.reserve(spec, seq)
        try:
            await self._board.publish_spec(spec, seq)
        except BaseException:
            self._registry.unreserve(spec.id)
            raise
        return self._registry.add(spec, seq)

    async def finish(self, job_id: str, outcome: Outcome) -> Outcome:
        """Make ``outcome`` the job's outcome unless another was first; close its rendezvous."""
        record = self._registry.get(job_id)
        if record.outcome is not None:
            return record.outcome
        final = await self._board.publish_outcome(job_id, outcome)
        if final is outcome:  # this node's outcome won: its spec record says so too
            await self._board.publish_ended(record.spec, record.seq, final)
        self._registry.set_outcome(job_id, final)
        await self._agents.rendezvous(record.spec).set_closed()
        return final

    async def cancel(self, job_id: str, by: str) -> JobRecord:
        record = self._registry.get(job_id)
        if record.outcome is not None:
            raise Conflict(f"job {job_id} already ended ({record.state.value})")
        await self.finish(job_id, Outcome(JobState.CANCELLED, time.time(), None,
                                          f"cancelled by {by}", None, self.node))
        await self.settled(job_id)
        return self._registry.get(job_id)

    async def fetch(self, job_id: str) -> JobRecord | None:
        """One job read from the board now (ahead of the change log); None if it has none
        (or ``job_id`` is no job id: a prefix typed by a user is looked up locally only)."""
        if not _JOB_ID.match(job_id):
            return None
        await self._follower.fetch(job_id)
        return self._registry.find(job_id)

    async def settled(self, job_id: str) -> None:
        """Return once this node runs nothing of the job (its workers stopped, logs drained)."""
        running = self._running.get(job_id)
        if running is not None:
            await running.done.wait()

    # -- AgentPorts ---------------------------------------------------------------------------

    def report(self, job_id: str, part: Part) -> None:
        self._count_failures(job_id, part)
        record = self._registry.set_part(job_id, part, own=True)
        if record is not None:  # as recorded: with why this node holds the job, if it does
            self._unpublished[job_id] = record.parts.get(part.node, part)  # replaces one not published yet
            self._publish.set()

    def _republish_parts(self) -> None:
        """At start: this node's part of every job that has not ended, as this node knows it
        last (a part its restart ended is LEFT now), so that no node goes on showing a part
        of this one that no agent runs any more."""
        for record in self._registry.jobs():
            part = record.parts.get(self.node)
            if record.outcome is None and part is not None:
                self._unpublished[record.id] = part
                self._publish.set()

    def _publish_hold(self, job_id: str) -> None:
        """Every node shows a job that this node holds, and why: this node's part says so
        (a LEFT part when it has none: it never takes the job)."""
        record = self._registry.find(job_id)
        if record is None or record.outcome is not None or not record.held:
            return
        own = record.parts.get(self.node)
        if own is None or own.held != record.held:
            self.report(job_id, own or Part(self.node, PartState.LEFT, updated=self._wall()))

    async def _publish_parts(self) -> None:
        """This node's parts onto the board, in order, the newest of each job only."""
        while True:
            await self._publish.wait()
            self._publish.clear()
            if not await self._flush_parts():  # the store is away: try again after a pause
                await asyncio.sleep(_REPUBLISH_PAUSE)
                self._publish.set()

    async def _flush_parts(self) -> bool:
        """Publish every pending part once; False if some failed (they stay pending, unless
        a newer part of the same job came meanwhile): a store that was away and came back
        with its data (etcd, or a TCPStore whose host did not restart) must still learn them."""
        failed: dict[str, Part] = {}
        while self._unpublished:
            job_id = next(iter(self._unpublished))
            part = self._unpublished.pop(job_id)
            try:
                async with asyncio.timeout(_SHUTDOWN_PUBLISH):
                    await self._board.publish_part(job_id, part)
            except (StoreError, TimeoutError) as exc:
                log.warning("could not publish %s's part of %s: %s", part.node, job_id, exc or "timed out",
                            extra=about(job_id))
                failed[job_id] = part
            except Exception:  # this part is lost, the others and the loop go on
                self._faults.report("parts", f"job {job_id}")
        for job_id, part in failed.items():
            self._unpublished.setdefault(job_id, part)
        return not failed

    # -- placement ----------------------------------------------------------------------------

    def _on_change(self, record: JobRecord) -> None:
        running = self._running.get(record.id)
        if record.outcome is not None and running is not None:
            running.agent.job_ended(record.outcome)
        if record.held and record.outcome is None:  # after this change has reached everyone
            asyncio.get_running_loop().call_soon(self._publish_hold, record.id)
        self._schedule_placement()

    def _schedule_placement(self) -> None:
        if not self._placing and not self._stopping and self._tasks is not None:
            self._placing = True
            asyncio.get_running_loop().call_soon(self._place)

    def used(self) -> Resources:
        """What the jobs running here hold."""
        return Resources(sum(r.offer.nproc for r in self._running.values()),
                         tuple(g for r in self._running.values() for g in r.offer.gpus))

    def local_jobs(self) -> list[str]:
        return sorted(self._running)

    def _place(self) -> None:
        self._placing = False
        if self._stopping or self._tasks is None:
            return
        used = self.used()
        free = replace(self.resources, slots=self.resources.slots - used.slots,
                       gpus=tuple(g for g in self.resources.gpus if g not in used.gpus))
        jobs = self._registry.jobs()
        kept_off = self._blacklist.kept_off() if self._blacklist is not None else set()
        busy = set(self._running) | self._unstartable | self._refused_here(jobs) | {
            r.id for r in jobs if self._declined.get(r.id) == r.version or r.spec.uid in kept_off}
        for offer in place(jobs, self.node, free, has_gpus=bool(self.resources.gpus),
                           busy=busy, draining=self.draining):
            try:
                self._start_agent(self._registry.get(offer.job_id), offer)
            except Exception:  # one job that cannot start must not hold up the jobs behind it
                log.exception("job %s: cannot start its agent on %s", offer.job_id, self.node,
                              extra=about(offer.job_id))
                self._unstartable.add(offer.job_id)

    def _refused_here(self, jobs: list[JobRecord]) -> set[str]:
        """The open jobs that this node's own rules forbid (each judged once, and logged)."""
        for record in jobs:
            if record.outcome is None and record.id not in self._refused:
                why = self._refusal(record)
                if why:
                    log.warning("job %s: not run on %s: %s", record.id, self.node, why,
                                extra=about(record.id))
                self._refused[record.id] = why
        return {job_id for job_id, why in self._refused.items() if why}

    def _refusal(self, record: JobRecord) -> str:
        if os.getuid() != 0:  # a user's own daemon runs every job as that user
            return ""
        try:
            local_user: str | None = pwd.getpwuid(record.spec.uid).pw_name
        except KeyError:
            local_user = None
        return refusal(record.spec, allow_root=self._allow_root, local_user=local_user) or ""

    def _start_agent(self, record: JobRecord, offer: Offer) -> None:
        assert self._tasks is not None
        agent = self._agents.agent(record.spec, offer.gpus, self, started(record))
        running = self._running[record.id] = _Running(agent, offer)
        self._tasks.create_task(self._run_agent(running))
        log.info("job %s: joining with %d workers%s", record.id, offer.nproc,
                 f" on GPUs {','.join(offer.gpus)}" if offer.gpus else "", extra=about(record.id))

    async def _run_agent(self, running: _Running) -> None:
        try:
            await running.agent.run()
        except Exception:  # whatever one job's agent does, it never reaches the task group
            log.exception("job %s: its agent on %s ended with an error", running.agent.spec.id, self.node,
                          extra=about(running.agent.spec.id))
        finally:
            job_id = running.agent.spec.id
            del self._running[job_id]
            if running.agent.held:
                self._registry.hold(job_id, running.agent.held)  # never again here
            if running.agent.declined and (record := self._registry.find(job_id)) is not None:
                self._declined[job_id] = record.version  # not again until the job changes
            running.done.set()
            self._schedule_placement()

    # -- this node's usage, drain, a reset store ----------------------------------------------------

    def usage(self) -> dict[str, dict]:
        """The live usage of every job running here, by job id (jobs without a cgroup left out)."""
        return {job_id: usage for job_id in self._running
                if (usage := self.usage_of(job_id)) is not None}

    def usage_of(self, job_id: str) -> dict | None:
        """The live usage of one job here (None: not running here, or no cgroup)."""
        running = self._running.get(job_id)
        return running.agent.usage() if running is not None else None

    @property
    def draining(self) -> bool:
        """Whether this node takes no new job and leaves its jobs, for any reason."""
        return bool(self._holds)

    def set_draining(self, draining: bool) -> None:
        """An operator's drain, or undrain: undrain also lifts a blacklisting (not what the
        discovery script says)."""
        if not draining and self._blacklist is not None and self._blacklist.lift():
            log.info("node %s: blacklisting lifted by an operator", self.node)
            for timer in self._user_cooldowns.values():
                timer.cancel()
            self._user_cooldowns.clear()
            self._readmit()
            self._schedule_placement()
        self._hold(Hold.DRAINED, draining)

    def set_listed(self, listing: Listing) -> None:
        """What the discovery script says of this node: not listed, it is drained; listed
        with slots, it has that many."""
        self.listed = listing.listed
        slots = listing.slots if listing.listed and listing.slots else self._configured.slots
        if slots != self.resources.slots:
            log.info("node %s: %d slots (%s)", self.node, slots,
                     "from the discovery script" if slots != self._configured.slots else "configured")
            self.resources = replace(self._configured, slots=slots)
        self._hold(Hold.UNLISTED, not listing.listed)
        self._schedule_placement()

    def _hold(self, why: Hold, on: bool) -> None:
        """A draining node takes no new job and leaves its jobs through a clean new round."""
        if (why in self._holds) == on:
            return
        was = self.draining
        (self._holds.add if on else self._holds.discard)(why)
        if on:
            log.info("node %s: %s%s", self.node, why.value,
                     ": it takes no new job" + (" and leaves its jobs" if self._running else "")
                     if not was else "")
        elif not self.draining:
            log.info("node %s takes jobs again", self.node)
        if self.draining and not was:
            for running in self._running.values():
                running.agent.leave(Reason.DRAIN)
        self._schedule_placement()

    # -- the blacklist: failures of workers on this node, by user -------------------------------

    def _count_failures(self, job_id: str, part: Part) -> None:
        record = self._registry.find(job_id)
        if self._blacklist is None or part.node != self.node or record is None:
            return
        spec = record.spec
        for key in worker_failures(job_id, part):
            now = self._clock()
            verdict = self._blacklist.failed(key, spec.uid, now)
            if verdict.node_until is not None:
                self._blacklist_node(verdict.node_until, now)
            if verdict.user_until is not None:
                self._keep_off(spec.uid, spec.user, verdict.user_until, now)

    def _keep_off(self, uid: int, user: str, until: float, now: float) -> None:
        """One user's jobs failed here too often: they leave this node and are not placed here
        until the cooldown ends; other users' jobs stay."""
        assert self._blacklist is not None
        log.warning("node %s: jobs of %s kept off it for %.0f s: %d failures of their workers "
                    "within %g s (%d in a row)", self.node, user, until - now,
                    self._blacklist.policy.failures, self._blacklist.policy.window,
                    self._blacklist.user_strikes(uid))
        if not self.draining:  # a draining node told every job to leave already
            for running in self._running.values():
                if running.agent.spec.uid == uid:
                    running.agent.leave(Reason.DRAIN)
        self._user_cooldowns[uid] = asyncio.get_running_loop().call_later(
            until - now, self._user_cooldown_over, uid, user)
        self._schedule_placement()

    def _user_cooldown_over(self, uid: int, user: str) -> None:
        """The timer of a user's cooldown's end (it goes again if it fired a moment early)."""
        assert self._blacklist is not None
        now = self._clock()
        until = self._blacklist.user_until(uid)
        if until is not None and not self._blacklist.expire_user(uid, now):
            self._user_cooldowns[uid] = asyncio.get_running_loop().call_later(
                until - now, self._user_cooldown_over, uid, user)
            return
        self._user_cooldowns.pop(uid, None)
        log.info("node %s: jobs of %s may run here again", self.node, user)
        self._schedule_placement()

    def _blacklist_node(self, until: float, now: float) -> None:
        """The jobs of several users failed here: the node takes no job for the cooldown."""
        assert self._blacklist is not None
        self.blacklisted_until = self._wall() + (until - now)
        log.warning("node %s blacklisted for %.0f s: the workers of %d or more users' jobs failed "
                    "%d times each within %g s (%d in a row)", self.node, until - now,
                    USERS_FOR_NODE, self._blacklist.policy.failures, self._blacklist.policy.window,
                    self._blacklist.strikes)
        self._on_blacklist(True)
        self._hold(Hold.BLACKLISTED, True)
        self._cooldown = asyncio.get_running_loop().call_later(until - now, self._cooldown_over)

    def _cooldown_over(self) -> None:
        """The timer of the cooldown's end (it goes again if it fired a moment early)."""
        assert self._blacklist is not None and self._blacklist.until is not None
        now = self._clock()
        if not self._blacklist.expire(now):
            self._cooldown = asyncio.get_running_loop().call_later(
                self._blacklist.until - now, self._cooldown_over)
            return
        log.info("node %s: its blacklisting cooldown is over", self.node)
        self._readmit()

    def _readmit(self) -> None:
        if self._cooldown is not None:
            self._cooldown.cancel()
            self._cooldown = None
        self.blacklisted_until = 0.0
        self._on_blacklist(False)
        self._hold(Hold.BLACKLISTED, False)

    async def store_reset(self) -> None:
        """The store lost its data (its host restarted): publish again what this node knows
        (open jobs, and this node's parts), then read the board afresh."""
        self._board.forget_index()
        for record in self._registry.jobs():
            if record.outcome is not None:
                continue
            await self._board.publish_spec(record.spec, record.seq)
            part = record.parts.get(self.node)
            if part is not None:
                await self._board.publish_part(record.id, part)
        await self._follower.resync()
