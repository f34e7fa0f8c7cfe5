"""JobService: submit, place, run, finish and cancel jobs on this node.

Placement (DESIGN §5) is the pure function ``place``: walk the open jobs in submit order
and offer this node to each one it fits (constraints met, room for its workers, GPUs
partitioned so that jobs on one node hold disjoint devices).  Every node walks the same
order, so two jobs cannot each hold half of the nodes forever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import psutil

from .agent import DeadNodeProbe, JobAgent
from .aio import Lane, wait_or_timeout
from .board import BoardReset, Change, JobBoard
from .cgroups import JobCgroups
from .config import DaemonConfig
from .errors import Conflict, StoreError
from .jobs import JobRecord, JobRegistry, Outcome, Part, PartState, started
from .keyspace import Keyspace
from .logs import LogBus
from .metrics import Metrics
from .model import GPU, IllegalTransition, JobSpec, JobState
from .rendezvous import Reason, RendezvousHandler, RendezvousSettings
from .store import StoreBackend
from .store.signing import Signer

log = logging.getLogger(__name__)

_FOLLOW_TIMEOUT = 1.0
_JOB_ID = re.compile(r"^j-[0-9a-f]{6}$")


_DONE_HERE = frozenset({PartState.SUCCEEDED, PartState.FAILED, PartState.STOPPED})


@dataclass(frozen=True)
class Resources:
    slots: int
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Offer:
    job_id: str
    nproc: int
    gpus: tuple[str, ...]


def fit(spec: JobSpec, free: Resources, has_gpus: bool) -> Offer | None:
    """The share of this node a job would take, or None if it does not fit now."""
    if spec.nproc_per_node == GPU:
        if not free.gpus or len(free.gpus) > free.slots:
            return None
        return Offer(spec.id, len(free.gpus), free.gpus)
    nproc = int(spec.nproc_per_node)
    if nproc > free.slots or (has_gpus and nproc > len(free.gpus)):
        return None
    return Offer(spec.id, nproc, free.gpus[:nproc] if has_gpus else ())


def eligible(spec: JobSpec, node: str) -> bool:
    return node not in spec.exclude and (not spec.nodes or node in spec.nodes)


def never_fits(spec: JobSpec, nodes: Iterable[dict[str, Any]]) -> str | None:
    """Why no node of the cluster could ever run a share of ``spec``, even idle; None if
    one could.  (Too few such nodes is for the join timeout: nodes may still come.)"""
    nodes = list(nodes)
    if not nodes:
        return None  # nothing seen yet: no grounds to refuse
    unknown = sorted(set(spec.nodes) - {n["name"] for n in nodes})
    if unknown:
        return f"no node named {', '.join(unknown)}"
    candidates = [n for n in nodes if eligible(spec, n["name"])]
    if not candidates:
        return "every node is excluded"
    for node in candidates:
        whole = Resources(node["slots_total"], tuple(str(i) for i in range(node["gpus_total"])))
        if fit(spec, whole, has_gpus=bool(whole.gpus)) is not None:
            return None
    wanted = "one worker per GPU" if spec.nproc_per_node == GPU else f"{spec.nproc_per_node} workers"
    sizes = ", ".join(f"{n['name']} has {n['slots_total']} slots and {n['gpus_total']} GPUs"
                      for n in candidates[:5])
    return f"no node can run {wanted} on its own: {sizes}"


def place(jobs: Iterable[JobRecord], node: str, free: Resources, *, has_gpus: bool,
          busy: set[str], draining: bool = False) -> list[Offer]:
    """Offers this node makes, oldest job first: open jobs it fits and is not already in."""
    if draining:
        return []
    offers = []
    for record in sorted(jobs, key=lambda r: r.seq):
        if record.outcome is not None or record.id in busy or not eligible(record.spec, node):
            continue
        if node in record.parts and record.parts[node].state in _DONE_HERE:
            continue  # this node's share ended; the job's end is on its way
        members = [p for p in record.parts.values() if p.state.active]
        if len(members) >= record.spec.max_nodes:
            continue
        offer = fit(record.spec, free, has_gpus)
        if offer is None:
            continue
        offers.append(offer)
        free = Resources(free.slots - offer.nproc, tuple(g for g in free.gpus if g not in offer.gpus))
    return offers


@dataclass
class _Running:
    agent: JobAgent
    offer: Offer
    task: asyncio.Task[None] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class JobService:
    def __init__(self, config: DaemonConfig, *, node: str, address: str, resources: Resources,
                 store: StoreBackend, signer: Signer, board: JobBoard, registry: JobRegistry,
                 metrics: Metrics, logs: LogBus, peers: DeadNodeProbe,
                 cgroups: JobCgroups | None = None) -> None:
        self.config = config
        self.node = node
        self.address = address
        self.resources = resources
        self._store = store
        self._signer = signer
        self._board = board
        self._registry = registry
        self._metrics = metrics
        self._logs = logs
        self._running: dict[str, _Running] = {}
        self._unstartable: set[str] = set()  # jobs whose agent failed to start here
        self._peers = peers
        self._cgroups = cgroups
        # one long-lived thread (and store connection) each for writing and following the board
        self._writes = Lane("board-write")
        self._follow_lane = Lane("board-follow")
        self._placing = False
        self._stopping = False
        self.draining = False
        self._tasks: asyncio.TaskGroup | None = None
        registry.subscribe(self._on_change)

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the board and run agents until ``stop`` is set; then stop every job here."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            await self._resync()
            following = tasks.create_task(self._follow(stop))
            self._schedule_placement()
            await stop.wait()
            following.cancel()  # it may be waiting on a store that does not answer
            await self.shutdown()
        self._tasks = None

    async def shutdown(self) -> None:
        """Stop every local job: a one-node cluster cancels them, a node of a larger one leaves."""
        self._stopping = True
        for job_id, running in list(self._running.items()):
            if self.config.standalone:
                await self.finish(job_id, Outcome(JobState.CANCELLED, time.time(), None,
                                                  "cancelled: elasticd shut down", None, self.node))
            else:
                running.agent.leave(Reason.SHUTDOWN)
        await asyncio.gather(*(r.done.wait() for r in self._running.values()))
        self._writes.close()
        self._follow_lane.close()

    # -- submit, finish, cancel -------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobRecord:
        """Publish a new job.  It is in this node's history first: a job that could not be
        recorded (a full disk) is refused before any node could take it."""
        seq = await self._write(self._board.next_seq)
        self._registry.reserve(spec, seq)
        try:
            await self._write(self._board.publish_spec, spec, seq)
        except BaseException:
            self._registry.unreserve(spec.id)
            raise
        return self._registry.add(spec, seq)

    async def finish(self, job_id: str, outcome: Outcome) -> Outcome:
        """Make ``outcome`` the job's outcome unless another was first; close its rendezvous."""
        record = self._registry.get(job_id)
        if record.outcome is not None:
            return record.outcome
        final = await self._write(self._board.publish_outcome, job_id, outcome)
        self._registry.set_outcome(job_id, final)
        await self._write(self._close_rendezvous, record.spec)
        return final

    async def cancel(self, job_id: str, by: str) -> JobRecord:
        record = self._registry.get(job_id)
        if record.outcome is not None:
            raise Conflict(f"job {job_id} already ended ({record.state.value})")
        await self.finish(job_id, Outcome(JobState.CANCELLED, time.time(), None,
                                          f"cancelled by {by}", None, self.node))
        running = self._running.get(job_id)
        if running is not None:
            await running.done.wait()
        return self._registry.get(job_id)

    def _close_rendezvous(self, spec: JobSpec) -> None:
        handler = self._rendezvous(spec)
        try:
            handler.set_closed()
        finally:
            handler.shutdown()

    # -- AgentPorts ---------------------------------------------------------------------------

    def report(self, job_id: str, part: Part) -> None:
        record = self._registry.set_part(job_id, part, own=True)
        if record is not None:
            self._writes.post(self._publish_part, job_id, part)

    async def unreachable(self, nodes: list[str]) -> list[str]:
        return await self._peers.unreachable(nodes, self.config.rendezvous.keep_alive.dead_after)

    def output(self, job_id: str) -> None:
        self._logs.publish(job_id)

    def output_dropped(self, job_id: str, nbytes: int, why: str) -> None:
        self._metrics.output_dropped(nbytes, why)

    def _publish_part(self, job_id: str, part: Part) -> None:
        try:
            self._board.publish_part(job_id, part)
        except StoreError as exc:
            log.warning("could not publish %s's part of %s: %s", part.node, job_id, exc)

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._writes.call(fn, *args, timeout=self.config.store.timeout)

    # -- placement ----------------------------------------------------------------------------

    def _on_change(self, record: JobRecord) -> None:
        self._metrics.count_jobs(self._registry.jobs(), self.node)
        running = self._running.get(record.id)
        if record.outcome is not None and running is not None:
            running.agent.job_ended(record.outcome)
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
        free = Resources(self.resources.slots - used.slots,
                         tuple(g for g in self.resources.gpus if g not in used.gpus))
        for offer in place(self._registry.jobs(), self.node, free, has_gpus=bool(self.resources.gpus),
                           busy=set(self._running) | self._unstartable, draining=self.draining):
            try:
                self._start_agent(self._registry.get(offer.job_id).spec, offer)
            except Exception:  # one job that cannot start must not hold up the jobs behind it
                log.exception("job %s: cannot start its agent on %s", offer.job_id, self.node)
                self._unstartable.add(offer.job_id)

    def _start_agent(self, spec: JobSpec, offer: Offer) -> None:
        assert self._tasks is not None
        agent = JobAgent(spec, node=self.node, address=self.address,
                         started=started(self._registry.get(spec.id)),
                         rdzv=self._rendezvous(spec), ports=self, metrics=self._metrics,
                         log_root=self.log_root, gpus=offer.gpus,
                         stop_grace=self.config.jobs.stop_grace,
                         store_timeout=self.config.store.timeout, cgroups=self._cgroups)
        running = _Running(agent, offer)
        self._running[spec.id] = running
        running.task = self._tasks.create_task(self._run_agent(running))
        log.info("job %s: joining with %d workers%s", spec.id, offer.nproc,
                 f" on GPUs {','.join(offer.gpus)}" if offer.gpus else "")

    async def _run_agent(self, running: _Running) -> None:
        try:
            await running.agent.run()
        except Exception:  # whatever one job's agent does, it never reaches the task group
            log.exception("job %s: its agent on %s ended with an error", running.agent.spec.id, self.node)
        finally:
            del self._running[running.agent.spec.id]
            running.done.set()
            self._schedule_placement()

    def _rendezvous(self, spec: JobSpec) -> RendezvousHandler:
        settings = RendezvousSettings(
            run_id=spec.id, min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
            max_restarts=spec.max_restarts, join_timeout=spec.join_timeout,
            last_call_timeout=spec.last_call_timeout,
            keep_alive_interval=self.config.rendezvous.keep_alive_interval,
            keep_alive_max_attempt=self.config.rendezvous.keep_alive_max_attempt)
        return RendezvousHandler(self._store, self._signer, settings, self.node, self.address,
                                 prefix=Keyspace(self.config.cluster.name).rendezvous(spec.id),
                                 on_refused=self._board.refused)

    @property
    def log_root(self) -> str:
        return os.path.join(self.config.paths.state_dir, "logs")

    def usage(self) -> dict[str, dict[str, Any]]:
        """The live usage of every job running here, by job id (jobs without a cgroup left out)."""
        return {job_id: usage for job_id in self._running
                if (usage := self.usage_of(job_id)) is not None}

    def usage_of(self, job_id: str) -> dict[str, Any] | None:
        """The live usage of one job here (None: not running here, or no cgroup)."""
        running = self._running.get(job_id)
        return running.agent.usage() if running is not None else None

    async def settled(self, job_id: str) -> None:
        """Return once this node runs nothing of the job (its workers stopped, logs drained)."""
        running = self._running.get(job_id)
        if running is not None:
            await running.done.wait()

    def set_draining(self, draining: bool) -> None:
        """A draining node takes no new job and leaves its jobs through a clean new round."""
        if draining == self.draining:
            return
        self.draining = draining
        log.info("node %s %s", self.node, "draining" if draining else "takes jobs again")
        if draining:
            for running in self._running.values():
                running.agent.leave(Reason.DRAIN)
        self._schedule_placement()

    async def store_reset(self) -> None:
        """The store lost its data (its host restarted): publish again what this node knows
        (open jobs, and this node's parts), then read the board afresh."""
        await self._write(self._board.forget_index)
        for record in self._registry.jobs():
            if record.outcome is not None:
                continue
            await self._write(self._board.publish_spec, record.spec, record.seq)
            part = record.parts.get(self.node)
            if part is not None:
                await self._write(self._publish_part, record.id, part)
        await self._resync()

    async def fetch(self, job_id: str) -> JobRecord | None:
        """Read one job from the board now (ahead of the change log); None if it has none."""
        if not _JOB_ID.match(job_id):
            return None
        self._apply(await self._write(self._board.read_job, job_id))
        return self._registry.find(job_id)

    # -- following the board ------------------------------------------------------------------

    async def _resync(self) -> None:
        position, changes = await self._write(self._board.snapshot)
        self._position = position
        self._apply(changes)

    async def _follow(self, stop: asyncio.Event) -> None:
        """One loop: wait for the next board changes (in a thread) and apply them."""
        while not stop.is_set():
            try:
                self._position, changes = await self._follow_lane.call(
                    self._board.follow, self._position, _FOLLOW_TIMEOUT,
                    timeout=_FOLLOW_TIMEOUT + self.config.store.timeout)
            except BoardReset as exc:
                log.warning("%s; resynchronising", exc)
                await self._resync()
                continue
            except StoreError as exc:
                log.warning("store unreachable while following the board: %s", exc)
                self._metrics.store_up.set(0)
                await wait_or_timeout(stop, _FOLLOW_TIMEOUT)  # back-off before retrying
                continue
            self._metrics.store_up.set(1)
            self._apply(changes)

    def _apply(self, changes: Iterable[Change]) -> None:
        for change in changes:
            try:
                self._apply_one(change)
            except IllegalTransition as exc:  # the record stays as it was
                log.warning("job %s: ignored a change from the board: %s", change.job_id, exc)

    def _apply_one(self, change: Change) -> None:
        if change.kind == "spec":
            seq, spec = change.value
            self._registry.add(spec, seq)
        elif change.kind == "part":
            if change.value.node != self.node:  # our own parts are ours to write
                self._registry.set_part(change.job_id, change.value)
        elif change.kind == "outcome":
            self._registry.set_outcome(change.job_id, change.value)


def reap_leftovers(records: Iterable[JobRecord], node: str) -> int:
    """Kill what is left of workers recorded by a previous daemon on this node.

    Workers die with their daemon (PDEATHSIG); this catches descendants that stayed in a
    worker's process group.  A process is ours only if its group id is a recorded worker
    pid and it started after that job's workers did.
    """
    groups: dict[int, float] = {}
    for record in records:
        part = record.parts.get(node)
        if part is None or part.started is None:
            continue
        for worker in part.workers:
            if worker.get("pid"):
                groups[int(worker["pid"])] = part.started
    killed = 0
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            pgid = os.getpgid(proc.info["pid"])
        except OSError:
            continue
        if pgid in groups and proc.info["create_time"] >= groups[pgid] - 1:
            try:
                os.kill(proc.info["pid"], signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed
