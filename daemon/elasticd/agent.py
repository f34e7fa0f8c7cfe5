"""JobAgent: one node's share of one job, torchelastic's SimpleElasticAgent with three fixes.

rendezvous -> assign ranks -> start workers -> watch -> (restart | rejoin | scale | exit barrier)

1. A worker failure anywhere opens a new round of the job's rendezvous, so every node
   stops its workers and re-forms at once; nobody hangs in a collective.
2. The restart budget is job-wide: it lives in the rendezvous state, and two nodes that
   fail in the same round consume one restart.
3. A dead node is seen by heartbeat in the rendezvous; the survivors re-form within seconds.

What to do next is decided by ``decide``, a pure function of the event and the round.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from .aio import race
from .cgroups import JobCgroup, JobCgroups
from .containment import Containment
from .errors import RendezvousClosedError, RendezvousGone, RendezvousTimeoutError, StoreError
from .fileaccess import FileAccess
from .records import Outcome, Part
from .keyspace import Keyspace
from .journal import about, excerpt
from .liveness import KeepAlive
from .logs import LogBus, OutputLimit
from .cluster import cpu_count
from .model import (PART_STATES, Failure, JobSpec, PartState, JobState, RunResult, WorkerGroup,
                    WorkerState, assign_workers, local_nproc, placement_env)
from .rendezvous import (CHARGED, EventKind, NextRound, Reason, RendezvousHandler, RendezvousInfo,
                         RendezvousSettings, RoundEvent, may_restart)
from .store.base import Store
from .store.signing import Refused, Signer
from .workers import SOCKET_ENV, LocalWorkers
from .worker_library import python_path
from .workerlink import Ready, WorkerLink
from . import inplace

log = logging.getLogger(__name__)

_LEAVE_TIMEOUT = 5.0  # telling the rendezvous we leave is a courtesy: heartbeats tell it anyway


class Action(enum.Enum):
    BARRIER = "barrier"      # local workers succeeded: wait for the other nodes
    RESTART = "restart"      # a worker failed and restarts remain: open a new round ("failure")
    NODE_LOST = "node_lost"  # workers failed because a member node died: re-form without it
    FAIL = "fail"            # a worker failed and no restarts remain
    REJOIN = "rejoin"        # the round was superseded: stop and join the next one
    SCALE_UP = "scale_up"    # nodes are waiting and the job is below max: open a new round
    WATCH = "watch"          # nothing to do: keep watching
    STOP = "stop"            # the job ended: stop
    LEAVE = "leave"          # this node leaves the job (drain, shutdown)
    STALL = "stall"          # in place: a survivor did not rejoin in time; restart every worker


@dataclass(frozen=True)
class WorkersExited:
    result: RunResult
    lost: tuple[str, ...] = ()   # members whose daemon was found dead when the workers failed


@dataclass(frozen=True)
class WorkersReady:
    """In place: this node's new workers warmed up and asked for a place."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class RejoinStalled:
    """In place: survivors that did not ask for their place in time."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class RoundChanged:
    event: RoundEvent


@dataclass(frozen=True)
class JobEnded:
    outcome: Outcome


@dataclass(frozen=True)
class Leaving:
    reason: Reason


Event = WorkersExited | RoundChanged | JobEnded | Leaving | WorkersReady | RejoinStalled


def describe(event: Event) -> str:
    """One line for the daemon log."""
    if isinstance(event, WorkersExited):
        cause = event.result.root_cause
        lost = f" (node {', '.join(event.lost)} is gone)" if event.lost else ""
        return f"rank {cause.rank} failed: {excerpt(cause.message)}{lost}" if cause else "workers succeeded"
    if isinstance(event, RoundChanged):
        detail = event.event.reason or (f"{event.event.waiting} waiting" if event.event.waiting else "")
        return f"rendezvous: {event.event.kind}" + (f" ({detail})" if detail else "")
    if isinstance(event, JobEnded):
        return f"job ended: {event.outcome.state.value}"
    if isinstance(event, WorkersReady):
        return f"workers in slots {list(event.slots)} are ready"
    if isinstance(event, RejoinStalled):
        return f"workers in slots {list(event.slots)} did not rejoin"
    return f"leaving: {event.reason}"


def decide(event: Event, info: RendezvousInfo, spec: JobSpec) -> Action:
    """The agent's policy: what to do about ``event`` in the round ``info``."""
    if isinstance(event, JobEnded):
        return Action.STOP
    if isinstance(event, Leaving):
        return Action.LEAVE
    if isinstance(event, WorkersReady):
        return Action.SCALE_UP
    if isinstance(event, RejoinStalled):
        return Action.STALL
    if isinstance(event, WorkersExited):
        if event.result.state == WorkerState.SUCCEEDED:
            return Action.BARRIER
        if event.lost:
            return Action.NODE_LOST  # a membership change: no restart is charged
        return Action.RESTART if may_restart(info.restart_count, spec.max_restarts) else Action.FAIL
    round_event = event.event
    if round_event.kind is EventKind.CLOSED:
        return Action.STOP
    if round_event.kind is EventKind.NEXT_ROUND:
        return Action.REJOIN
    if round_event.kind is EventKind.WAITING and info.group_world_size < spec.max_nodes:
        return Action.SCALE_UP
    return Action.WATCH


class AgentPorts(Protocol):
    """What an agent tells its daemon's job service: how its part goes, and how the job ended."""

    def report(self, job_id: str, part: Part) -> None: ...
    async def finish(self, job_id: str, outcome: Outcome) -> Outcome: ...


class DeadNodeProbe(Protocol):
    """Which of some nodes' daemons are gone (peers.PeerLinks)."""

    async def unreachable(self, nodes: list[str], timeout: float) -> list[str]: ...


class AgentMetrics(Protocol):
    def round_joined(self, reason: str, seconds: float) -> None: ...
    def output_dropped(self, nbytes: int, why: str) -> None: ...
    def worker_exited(self, exit_code: int) -> None: ...
    def restarted(self) -> None: ...
    def barrier_waited(self, seconds: float) -> None: ...


_ROUND_FOR = {Action.RESTART: Reason.FAILURE, Action.NODE_LOST: Reason.NODE_LOST,
              Action.SCALE_UP: Reason.SCALE_UP, Action.STALL: Reason.STALLED}


def free_port(address: str) -> int:
    """A port that is free on ``address`` now (the master port this node offers if it is rank 0)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def failure_outcome(result: RunResult, spec: JobSpec, now: float, node: str) -> Outcome:
    cause = result.root_cause
    budget = f"(max restarts {spec.max_restarts} exhausted)" if spec.max_restarts else ""
    message = f"rank {cause.rank} on {cause.node}: {cause.message} {budget}".strip() if cause else "failed"
    return Outcome(JobState.FAILED, now, cause.exit_code if cause else 1, message, cause, node)


@dataclass(frozen=True)
class AgentFactory:
    """What every agent of this node shares; makes the agent (and its rendezvous handler) of
    each job placed here."""

    node: str
    address: str
    store: Store
    signer: Signer
    keyspace: Keyspace
    keep_alive: KeepAlive
    log_root: str
    metrics: AgentMetrics
    logs: LogBus
    probe: DeadNodeProbe
    refused: Refused
    stop_grace: float = 10.0
    cgroups: JobCgroups | None = None
    containment: Containment = Containment()  # what bounds a job here (its limits)
    runtime_dir: str = ""     # where in-place jobs' worker channels live
    worker_library: str = ""  # the directory holding elasticd.elastic for workers
    output_limit: OutputLimit = OutputLimit()  # when workers' output files are rotated
    access: FileAccess = field(default_factory=FileAccess)  # who reads jobs' files on disk

    def rendezvous(self, spec: JobSpec, *, may_create: bool = True) -> RendezvousHandler:
        """The job's rendezvous; ``may_create`` False for a job that already ran (its state
        is joined or restored, never started afresh)."""
        settings = RendezvousSettings(
            run_id=spec.id, min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
            max_restarts=spec.max_restarts, join_timeout=spec.join_timeout,
            last_call_timeout=spec.last_call_timeout,
            keep_alive_interval=self.keep_alive.interval,
            keep_alive_max_attempt=self.keep_alive.attempts)
        return RendezvousHandler(self.store, self.signer, settings, self.node, self.address,
                                 prefix=self.keyspace.rendezvous(spec.id), on_refused=self.refused,
                                 may_create=may_create)

    def agent(self, spec: JobSpec, gpus: tuple[str, ...], ports: AgentPorts,
              started: float | None) -> JobAgent:
        link = self._link_path(spec)
        return JobAgent(spec, node=self.node, address=self.address,
                        rdzv=self.rendezvous(spec, may_create=started is None),
                        ports=ports, metrics=self.metrics, logs=self.logs, probe=self.probe,
                        dead_after=self.keep_alive.dead_after, log_root=self.log_root, gpus=gpus,
                        stop_grace=self.stop_grace, cgroups=self.cgroups, started=started,
                        link_path=link, worker_env=self._worker_env(spec, link),
                        output_limit=self.output_limit, containment=self.containment,
                        access=self.access)

    def _link_path(self, spec: JobSpec) -> str:
        if not spec.in_place or not self.runtime_dir:
            return ""
        directory = os.path.join(self.runtime_dir, "agents")
        os.makedirs(directory, mode=0o755, exist_ok=True)
        return os.path.join(directory, f"{spec.id}.sock")

    def _worker_env(self, spec: JobSpec, link: str) -> dict[str, str]:
        """On top of worker_env: the library on PYTHONPATH, and an in-place job's channel."""
        env = {"PYTHONPATH": python_path(self.worker_library, spec.env)} if self.worker_library else {}
        return {**env, SOCKET_ENV: link} if link else env


class JobAgent:
    def __init__(self, spec: JobSpec, *, node: str, address: str, rdzv: RendezvousHandler,
                 ports: AgentPorts, metrics: AgentMetrics, logs: LogBus, probe: DeadNodeProbe,
                 dead_after: float, log_root: str, gpus: tuple[str, ...] = (),
                 stop_grace: float = 10.0, cgroups: JobCgroups | None = None,
                 started: float | None = None, link_path: str = "",
                 worker_env: dict[str, str] | None = None,
                 output_limit: OutputLimit = OutputLimit(),
                 containment: Containment = Containment(), access: FileAccess | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.node = node
        self.address = address
        self.gpus = gpus
        self.nproc = local_nproc(spec.nproc_per_node, gpus=len(gpus), cpus=cpu_count())
        self._rdzv = rdzv
        self._ports = ports
        self._metrics = metrics
        self._logs = logs
        self._probe = probe
        self._dead_after = dead_after
        self._log_root = log_root
        self._output_limit = output_limit
        self._access = access
        self._stop_grace = stop_grace
        self._now = wall_clock
        self._ended: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._leaving: asyncio.Future[Reason] = asyncio.get_running_loop().create_future()
        self._started = started  # when the job first ran, on any node (None: not yet)
        self._phase = PartState.RENDEZVOUS  # the state the next report is in
        self._reported: PartState | None = None  # as last reported (PART_STATES)
        self._workers: LocalWorkers | None = None
        self._cgroups = cgroups
        self._cgroup: JobCgroup | None = None  # made with the first round, gone with the agent
        self._limits = containment.job_limits(self.nproc)  # for its cgroup
        self._nproc_limit = containment.rlimit_nproc(self.nproc)  # for each worker, without one
        self.declined = ""  # why this node left the job on its own (not placed again until it changes)
        self.held = ""  # why this node can never run the job (a record it needs was refused or lost)
        self._link_path = link_path
        self._worker_env = worker_env or {}
        self._link: WorkerLink | None = None
        self._news: asyncio.Queue[Ready] = asyncio.Queue()
        self._aborted = -1  # the newest round whose coming the in-place workers were told to abort for
        self._rejoin: tuple[float, dict[int, int]] | None = None  # deadline; survivor slot -> its old round
        self._placed: dict[int, int] = {}  # in place: slot -> the round its worker was last placed in
        self._info: RendezvousInfo | None = None  # the round the in-place workers are in
        self._suspect: tuple[float, Failure] | None = None  # a collective failed: act if nothing else does by then

    # -- signals from the daemon ----------------------------------------------------------

    def job_ended(self, outcome: Outcome) -> None:
        if not self._ended.done():
            self._ended.set_result(outcome)

    def leave(self, reason: Reason) -> None:
        if not self._leaving.done():
            self._leaving.set_result(reason)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        keeper = asyncio.create_task(self._rdzv.keep(), name=f"keeper-{self.spec.id}")
        try:
            if self._cgroups is not None:
                self._cgroup = self._cgroups.create(self.spec.id, self._limits)
            if self._link_path:
                await self._run_in_place()
            else:
                await self._run()
        except StoreError as exc:
            # This node lost the store: its share ends here (the others re-form without it,
            # and it can join again once the store answers); the job's fate is not ours to write.
            log.warning("job %s: leaving, the store does not answer: %s", self.spec.id, exc,
                        extra=about(self.spec.id))
            self.declined = str(exc)
            self._report(PartState.LEFT)
        except Exception:
            log.exception("agent for job %s failed", self.spec.id, extra=about(self.spec.id))
            try:
                await self._finish(Outcome(JobState.FAILED, self._now(), None,
                                           f"elasticd agent on {self.node} failed", None, self.node))
            except StoreError as exc:  # the job's end is then for the other nodes to record
                log.warning("job %s: could not record that its agent failed: %s", self.spec.id, exc,
                            extra=about(self.spec.id))
            self._report(PartState.FAILED)
        finally:
            self._rdzv.shutdown()
            keeper.cancel()
            await asyncio.wait([keeper])
            await self._remove_cgroup()

    async def _remove_cgroup(self) -> None:
        """Every round stopped its workers and waited for the cgroup to empty; this catches
        a round that never started (and a process that got away from its round's stop)."""
        if self._cgroup is None:
            return
        if self._cgroup.populated():
            self._cgroup.kill()
            await self._cgroup.wait_empty(10.0)
        self._cgroup.remove()

    def usage(self) -> dict[str, Any] | None:
        """CPU time, memory peak and OOM kills of the job's processes here, from its cgroup."""
        return self._cgroup.usage().to_json() if self._cgroup is not None else None

    async def _run(self) -> None:
        state, info = PartState.RENDEZVOUS, None
        while True:
            self._report(state, info)
            info = await self._join()
            if info is None:
                return
            action = await self._run_round(info)
            if action is None:
                return
            state = PartState.RESTARTING

    # -- in place (elasticd.inplace) ----------------------------------------------------------

    async def _run_in_place(self) -> None:
        """Rounds whose survivors keep their processes: only missing workers are started, and
        they warm up before their node offers them to a round."""
        self._link = WorkerLink(self._link_path, uid=self.spec.uid, gid=self.spec.gid,
                                slots=self.nproc, on_ready=self._news.put_nowait)
        await self._link.open()
        self._workers = self._new_pool()
        info: RendezvousInfo | None = None
        state = PartState.RENDEZVOUS
        try:
            while True:
                self._report(state, info, self._workers.group)
                joined = await self._join_in_place(info)
                if joined is None:
                    return
                info = joined
                if await self._watch(info, self._workers) is None:
                    return
                state = PartState.RESTARTING
        finally:
            await self._workers.stop()
            await self._link.close()

    def _new_pool(self) -> LocalWorkers:
        return LocalWorkers(
            self.spec, inplace.standby(self.spec.id, self.node, self.nproc, self.gpus),
            self._attempt_dir(0), cgroup=self._cgroup,
            on_output=lambda: self._logs.publish(self.spec.id), on_dropped=self._metrics.output_dropped,
            on_change=lambda g: self._report(self._phase, self._info, g) if self._reported else None,
            stop_grace=self._stop_grace, extra_env=self._worker_env, output_limit=self._output_limit,
            nproc_limit=self._nproc_limit, access=self._access)

    def _attempt_dir(self, round: int) -> str:
        return os.path.join(self._log_root, self.spec.id, f"attempt_{round}")

    async def _join_in_place(self, previous: RendezvousInfo | None) -> RendezvousInfo | None:
        pool, link = self._workers, self._link
        assert pool is not None and link is not None
        if previous is None and self._started is None:  # the job's first round: start after it
            info = await self._join()
            if info is not None:
                pool.log_dir = self._attempt_dir(info.round)
                self._place(info, previous, range(self.nproc))
                await pool.start()
            return info
        missing = [slot for slot in range(self.nproc) if slot not in pool.alive()]
        if missing:
            for slot in missing:
                link.forget(slot)
                self._placed.pop(slot, None)
            pool.log_dir = self._attempt_dir(previous.round + 1 if previous else 0)
            await pool.warm(missing)
        ready = [slot for slot in pool.alive() if link.asked(slot) >= -1]
        if not ready:
            if previous is not None:
                await self._rdzv.step_aside()  # the survivors re-form without waiting for us
            ready = await self._warm_up(pool)
            if ready is None:
                return None
        info = await self._join(len(ready))
        if info is not None:
            self._place(info, previous, ready)
        return info

    async def _warm_up(self, pool: LocalWorkers) -> list[int] | None:
        """Wait until every worker asked for a place; None when one failed (this node then
        leaves the job: it goes on elsewhere), the job ended or this node leaves."""
        name, done = await race(ready=self._all_asked(pool), exited=pool.wait(),
                                ended=self._ended, leaving=self._leaving)
        if name == "ready":
            return done.result()
        if name == "leaving":
            return await self._leave(None, pool.group)
        if name == "ended":
            self._report(PartState.STOPPED)
            return None
        cause = done.result().root_cause
        self.declined = f"a worker failed while warming up: {cause.message if cause else 'no cause'}"
        log.warning("job %s: %s leaves the job: %s", self.spec.id, self.node, excerpt(self.declined),
                    extra=about(self.spec.id))
        self._report(PartState.LEFT, None, pool.group)
        return None

    async def _all_asked(self, pool: LocalWorkers) -> list[int]:
        link = self._link
        assert link is not None
        while not all(link.asked(slot) >= -1 for slot in pool.alive()):
            await self._news.get()
        return pool.alive()

    def _place(self, info: RendezvousInfo, previous: RendezvousInfo | None, slots: Iterable[int]) -> None:
        """Tell each kept worker its place in ``info``; survivors hear of the change."""
        pool, link = self._workers, self._link
        assert pool is not None and link is not None
        group = inplace.place(info, self.node, self.spec.id, slots, self.gpus)
        pool.place(group, self._attempt_dir(info.round))
        for worker in group.workers:
            link.place(worker.local_rank, info.round,
                       {**placement_env(group, worker), "ELASTICD_ROUND": str(info.round)})
        change = inplace.notice(previous, info)
        if change.abort and self._aborted < info.round:
            self._abort_workers(info.round)
        link.announce(info.round, change.added)
        survivors = {w.local_rank: self._placed[w.local_rank] for w in group.workers
                      if w.local_rank in self._placed}
        self._rejoin = (time.monotonic() + self.spec.rejoin_timeout, survivors) \
            if self._aborted >= info.round and survivors else None
        self._placed.update((w.local_rank, info.round) for w in group.workers)
        self._info, self._suspect = info, None
        self._started = self._started or self._now()
        self._report(PartState.RUNNING, info, pool.group)

    def _abort_workers(self, round: int) -> None:
        assert self._link is not None
        self._link.abort(round)
        self._aborted = round

    async def _rejoin_stalled(self, info: RendezvousInfo) -> RejoinStalled:
        """A timer: survivors told to abort must ask for their new place within the rejoin
        timeout; those who did not are reported (never resolves when all did)."""
        if self._rejoin is not None and self._workers is not None and self._link is not None:
            deadline, survivors = self._rejoin
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            late = tuple(slot for slot, old in survivors.items()
                         if slot in self._workers.alive() and self._link.asked(slot) < old)
            if late:
                return RejoinStalled(late)
        await asyncio.Future()  # nothing to report, ever
        raise AssertionError("unreachable")

    async def _worker_news(self, info: RendezvousInfo, pool: LocalWorkers) -> Event:
        """What workers say over the channel that needs the agent: a collective of this round
        failed (and nothing re-forms yet), or new workers are ready to be added."""
        link = self._link
        assert link is not None
        placed = {w.local_rank for w in pool.group.workers if w.rank >= 0}
        while True:
            try:
                async with asyncio.timeout_at(self._suspect[0] if self._suspect else None):
                    ready = await self._news.get()
            except TimeoutError:
                assert self._suspect is not None
                return WorkersExited(RunResult(WorkerState.FAILED, (self._suspect[1],)))
            if ready.why == "failure" and ready.after >= info.round and ready.slot in placed:
                event = await self._collective_failed(info, pool, ready)
                if event is not None:
                    return event
                continue
            warming = [slot for slot in pool.alive() if slot not in placed]
            if warming and all(link.asked(slot) >= -1 for slot in warming):
                return WorkersReady(tuple(warming))

    async def _collective_failed(self, info: RendezvousInfo, pool: LocalWorkers,
                                 ready: Ready) -> WorkersExited | None:
        """A worker's collective of this round failed. A dead member node re-forms the job at
        once (one probe); a dead worker shows itself (its exit here, its node's new round
        elsewhere). Only when nothing does within ``dead_after`` is it a failure of its own."""
        worker = pool.group.workers[ready.slot]
        failure = Failure(rank=worker.rank, local_rank=ready.slot, node=self.node, exit_code=1,
                          message=f"a collective failed: {ready.error}", timestamp=self._now())
        event = await self._workers_exited(info, RunResult(WorkerState.FAILED, (failure,)))
        if event.lost:
            return event
        if self._suspect is None:
            loop = asyncio.get_running_loop()
            self._suspect = (loop.time() + self._dead_after, failure)
        return None

    async def _act_in_place(self, action: Action, event: Event, info: RendezvousInfo,
                            workers: LocalWorkers) -> Action | None:
        """Membership changes keep the workers (they are told); the rest is as in ``_act``."""
        if action is Action.REJOIN:
            assert isinstance(event, RoundChanged) and event.event.reason is not None
            reason: Reason | None = event.event.reason
        else:
            reason = _ROUND_FOR.get(action)
        if reason is None:
            return await self._act(action, event, info, workers)
        self._report(PartState.RESTARTING, info, workers.group)
        if not inplace.keeps_workers(reason):
            await workers.stop()
            self._workers = self._new_pool()
        elif inplace.aborts(reason):
            self._abort_workers(info.round + 1)
        if action is Action.REJOIN:
            return Action.REJOIN
        lost = event.lost if isinstance(event, WorkersExited) else ()
        return await self._open_next_round(info, reason, event, lost=lost)

    async def _join(self, nproc: int | None = None) -> RendezvousInfo | None:
        """Join the next round; None when the job ended or this node left meanwhile."""
        started = time.monotonic()
        name, joining = await race(
            joined=self._rdzv.next_rendezvous(nproc or self.nproc, self._master_port()),
            ended=self._ended, leaving=self._leaving)
        if name == "leaving":
            return await self._leave(None, None)
        if name == "ended":
            self._report(PartState.STOPPED)
            return None
        try:
            info = joining.result()
        except RendezvousGone as exc:
            log.warning("job %s: not starting it on %s: %s", self.spec.id, self.node, exc,
                        extra=about(self.spec.id))
            self.declined = self.held = "its rendezvous state is gone or was refused, and no member restored it"
            self._report(PartState.LEFT)
            return None
        except RendezvousClosedError:
            self._report(PartState.STOPPED)
            return None
        except RendezvousTimeoutError as exc:
            await self._finish(Outcome(JobState.FAILED, self._now(), None, str(exc), None, self.node))
            self._report(PartState.FAILED)
            return None
        self._metrics.round_joined(info.reason, time.monotonic() - started)
        return info

    def _master_port(self) -> int:
        """The MASTER_PORT this node offers for the round (used if it gets group rank 0):
        the job's fixed one, else a port free here now."""
        return self.spec.master_port or free_port(self.address)

    async def _run_round(self, info: RendezvousInfo) -> Action | None:
        """Run this node's workers for one round; returns REJOIN to go on, None when done."""
        group = assign_workers(
            self.spec.id, self.node, round=info.round, restart_count=info.restart_count,
            group_rank=info.group_rank, group_world_size=info.group_world_size,
            rank_base=info.rank_base, world_size=info.world_size, nproc=info.nproc,
            master_addr=info.master_addr, master_port=info.master_port, gpus=self.gpus)
        self._workers = workers = LocalWorkers(
            self.spec, group, os.path.join(self._log_root, self.spec.id, f"attempt_{info.round}"),
            cgroup=self._cgroup, on_output=lambda: self._logs.publish(self.spec.id),
            on_dropped=self._metrics.output_dropped,
            on_change=lambda g: self._report(self._phase, info, g),
            stop_grace=self._stop_grace, extra_env=self._worker_env, output_limit=self._output_limit,
            nproc_limit=self._nproc_limit, access=self._access)
        self._started = self._started or self._now()
        self._report(PartState.RUNNING, info, workers.group)
        await workers.start()
        try:
            return await self._watch(info, workers)
        finally:
            await workers.stop()

    async def _watch(self, info: RendezvousInfo, workers: LocalWorkers) -> Action | None:
        notice_waiting = True
        while True:
            event = await self._next_event(info, workers, notice_waiting)
            action = decide(event, info, self.spec)
            log.info("job %s round %d: %s -> %s", self.spec.id, info.round, describe(event), action.value,
                     extra=about(self.spec.id))
            if action is Action.WATCH:
                notice_waiting = False  # the job is at its max: waiting nodes stay waiting
                continue
            if isinstance(event, WorkersExited):
                self._count_exits(workers.group)
            if self._link is not None:
                return await self._act_in_place(action, event, info, workers)
            return await self._act(action, event, info, workers)

    async def _next_event(self, info: RendezvousInfo, workers: LocalWorkers,
                          notice_waiting: bool) -> Event:
        watching = self._rdzv.watch(info.round, waiting=notice_waiting)
        in_place = {"news": self._worker_news(info, workers),
                    "stalled": self._rejoin_stalled(info)} if self._link is not None else {}
        try:
            name, done = await race(exited=workers.wait(), round=watching, ended=self._ended,
                                    leaving=self._leaving, **in_place)
        finally:
            watching.cancel()
        if name in in_place:
            return done.result()
        if name == "exited":
            return await self._workers_exited(info, done.result())
        if name == "ended":
            return JobEnded(done.result())
        if name == "leaving":
            return Leaving(done.result())
        return RoundChanged(done.result())

    async def _workers_exited(self, info: RendezvousInfo, result: RunResult) -> WorkersExited:
        """A failure caused by a member node's death is a membership change, not a worker
        failure: ask the other members' daemons (one round trip) before charging a restart."""
        if result.state == WorkerState.SUCCEEDED:
            return WorkersExited(result)
        others = [m.node for m in info.members if m.node != self.node]
        lost = await self._probe.unreachable(others, self._dead_after) if others else []
        return WorkersExited(result, tuple(lost))

    async def _act(self, action: Action, event: Event, info: RendezvousInfo,
                   workers: LocalWorkers) -> Action | None:
        if action in (Action.RESTART, Action.NODE_LOST, Action.SCALE_UP, Action.REJOIN):
            self._report(PartState.RESTARTING, info, workers.group)
        await workers.stop()
        group = workers.group
        if action is Action.RESTART:
            return await self._open_next_round(info, Reason.FAILURE, event)
        if action is Action.SCALE_UP:
            return await self._open_next_round(info, Reason.SCALE_UP, event)
        if action is Action.NODE_LOST:
            assert isinstance(event, WorkersExited)
            return await self._open_next_round(info, Reason.NODE_LOST, event, lost=event.lost)
        if action is Action.REJOIN:
            return Action.REJOIN
        if action is Action.FAIL:
            assert isinstance(event, WorkersExited)
            await self._finish(failure_outcome(event.result, self.spec, self._now(), self.node))
            self._report(PartState.FAILED, info, group)
            return None
        if action is Action.BARRIER:
            return await self._exit_barrier(info, group)
        if action is Action.LEAVE:
            return await self._leave(info, group)
        self._report(PartState.STOPPED, info, group)
        return None

    async def _leave(self, info: RendezvousInfo | None, group: WorkerGroup | None) -> None:
        """Tell the rendezvous (a courtesy, with a deadline: heartbeats tell it anyway)."""
        try:
            async with asyncio.timeout(_LEAVE_TIMEOUT):
                await self._rdzv.leave(self._leaving.result())
        except (TimeoutError, StoreError) as exc:
            log.warning("job %s: could not tell the rendezvous that %s leaves: %s",
                        self.spec.id, self.node, exc or "no answer", extra=about(self.spec.id))
        self._report(PartState.LEFT, info, group)

    async def _open_next_round(self, info: RendezvousInfo, reason: Reason, event: Event,
                               lost: tuple[str, ...] = ()) -> Action | None:
        result = await self._rdzv.request_next_round(info.round, reason, lost)
        if result is NextRound.EXHAUSTED:
            await self._finish(self._exhausted(event))
            self._report(PartState.FAILED, info)
            return None
        if result is NextRound.CLOSED:
            self._report(PartState.STOPPED, info)
            return None
        if reason in CHARGED:
            self._metrics.restarted()
        return Action.REJOIN

    def _exhausted(self, event: Event) -> Outcome:
        if isinstance(event, WorkersExited):
            return failure_outcome(event.result, self.spec, self._now(), self.node)
        slots = event.slots if isinstance(event, RejoinStalled) else ()
        return Outcome(JobState.FAILED, self._now(), 1,
                       f"workers in slots {list(slots)} on {self.node} did not rejoin within "
                       f"{self.spec.rejoin_timeout:g} s (max restarts {self.spec.max_restarts} exhausted)",
                       None, self.node)

    async def _exit_barrier(self, info: RendezvousInfo, group: WorkerGroup) -> Action | None:
        """Wait for every member of the final round; the job succeeds only if all did.

        Each arrival updates the progress (``done/total``) that ``status`` shows; a new round
        (a failure elsewhere) sends this node back to work.
        """
        started = time.monotonic()
        deadline = self._now() + self.spec.exit_barrier_timeout
        await self._rdzv.exit_barrier_arrive(info)

        def progress(done: int, total: int) -> None:
            self._report(PartState.BARRIER, info, group,
                         barrier={"done": done, "total": total, "deadline": deadline})

        watching = self._rdzv.watch(info.round, waiting=False)
        try:
            name, done = await race(
                arrived=self._rdzv.exit_barrier_wait(info, self.spec.exit_barrier_timeout, progress),
                round=watching, ended=self._ended, leaving=self._leaving)
        finally:
            watching.cancel()
        if name == "round" and done.result().kind is EventKind.NEXT_ROUND:
            return Action.REJOIN
        if name == "leaving":
            return await self._leave(info, group)
        self._metrics.barrier_waited(time.monotonic() - started)
        arrived, total = await self._rdzv.exit_barrier_progress(info)
        if arrived >= total:
            await self._finish(Outcome(JobState.SUCCEEDED, self._now(), 0, "", None, self.node))
            self._report(PartState.SUCCEEDED, info, group)
            return None
        if name != "arrived":  # the rendezvous closed or the job's outcome came
            self._report(PartState.STOPPED, info, group)
            return None
        await self._finish(Outcome(
            JobState.FAILED, self._now(), None,
            f"exit barrier timed out after {self.spec.exit_barrier_timeout:g} s: "
            f"{arrived}/{total} nodes finished", None, self.node))
        self._report(PartState.FAILED, info, group)
        return None

    async def _finish(self, outcome: Outcome) -> None:
        final = await self._ports.finish(self.spec.id, outcome)
        self.job_ended(final)

    def _count_exits(self, group: WorkerGroup) -> None:
        for worker in group.workers:
            if worker.exit_code is not None:
                self._metrics.worker_exited(worker.exit_code)

    def _report(self, state: PartState, info: RendezvousInfo | None = None,
                group: WorkerGroup | None = None, barrier: dict[str, Any] | None = None) -> None:
        self._phase = PART_STATES.check(self._reported, state)
        self._reported = state
        part = Part(
            node=self.node, state=state,
            round=info.round if info else None,
            group_rank=info.group_rank if info else None,
            restarts=info.restart_count if info else 0,
            world_size=info.world_size if info else None,
            group_world_size=info.group_world_size if info else None,
            workers=tuple(w.to_json() for w in group.workers) if group else (),
            started=self._started, barrier=barrier, updated=self._now(), usage=self.usage())
        self._ports.report(self.spec.id, part)
