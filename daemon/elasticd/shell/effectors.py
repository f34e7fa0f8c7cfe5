"""What carries out a part's instructions on this node: its rendezvous (and the keeper that
beats for it), its cgroup, its workers, and an in-place job's channel to them.

``Effectors`` holds what every part of this node shares and makes each part's
``PartEffectors``; NodeShell (shell/node.py) drives them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from elasticd.core.containment import Containment
from elasticd.core.liveness import KeepAlive
from elasticd.core.model import JobSpec, WorkerGroup
from elasticd.faults import Faults
from elasticd.journal import about
from elasticd.rendezvous import RendezvousSettings
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.shell.cgroups import JobCgroup, JobCgroups
from elasticd.shell.checkpoints import CHECKPOINT_ENV, CheckpointTier
from elasticd.shell.fileaccess import FileAccess
from elasticd.shell.logs import LogBus, OutputLimit
from elasticd.shell.roundstore import RoundStores
from elasticd.shell.worker_library import python_path
from elasticd.shell.workerlink import Ready, WorkerLink
from elasticd.shell.workers import PROGRESS_ENV, REJOIN_ENV, SOCKET_ENV, LocalWorkers, Standbys
from elasticd.store.base import Store
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import Refused, Signer

log = logging.getLogger(__name__)

_EMPTY_WAIT = 10.0  # seconds a job's cgroup gets to empty when the part closes


class DeadNodeProbe(Protocol):
    """Which of some nodes' daemons are gone (peers.PeerLinks)."""

    async def unreachable(self, nodes: list[str], timeout: float) -> list[str]: ...


class RoundGuard(Protocol):
    """Who the failure detector watches: the members of each round this node is in
    (cluster/detector.py's DetectorService)."""

    def watch(self, group: str, members: tuple[str, ...]) -> None: ...
    def unwatch(self, group: str) -> None: ...


class OutputMetrics(Protocol):
    def output_dropped(self, nbytes: int, why: str) -> None: ...


class JobLens(Protocol):
    """What this node runs of a job it takes, where that is not the job's record as it is (a
    private daemon runs its own elasticrun's command line: private.py)."""

    def spec(self, spec: JobSpec) -> JobSpec:
        """The job as this node runs it; raises when this node runs no such job."""

    def worker_env(self, spec: JobSpec) -> Mapping[str, str]:
        """Variables on top of a worker's environment."""


class MasterPorts:
    """The master ports this node offers (its rank 0's TCPStore listens there), each kept
    bound for ``hold`` seconds after it is picked: with SO_REUSEADDR, never listening.

    A port picked by binding port 0 and let go at once is the kernel's to hand out again
    before the store listens on it, to another bind to port 0 (a gloo pair's) or to an
    outgoing connection: in a fresh CI run an in-place round failed so (EADDRINUSE) and
    spent a restart.  Held, the kernel gives it to neither, and the TCPStore, which binds
    with SO_REUSEADDR too, still binds and listens there.

    The port is picked and held on the wildcard address, as the TCPStore binds it: one
    free on the node's address alone may be another address's (a daemon's peer port on
    127.0.0.2, in a CI run).  SO_REUSEADDR is set after the bind: set before, the kernel
    picks from half its range only."""

    def __init__(self, hold: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._hold, self._clock = hold, clock
        self._held: collections.deque[tuple[float, socket.socket]] = collections.deque()

    def pick(self, address: str) -> int:
        now = self._clock()
        while self._held and self._held[0][0] <= now:
            self._held.popleft()[1].close()
        family, anywhere = (socket.AF_INET6, "::") if ":" in address else (socket.AF_INET, "")
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((anywhere, 0))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            sock.close()
            raise
        self._held.append((now + self._hold, sock))
        return int(sock.getsockname()[1])

    @property
    def held(self) -> list[int]:
        return [int(sock.getsockname()[1]) for _, sock in self._held]

    def close(self) -> None:
        while self._held:
            self._held.popleft()[1].close()


@dataclass(frozen=True)
class Effectors:
    """What every part of this node shares."""

    node: str
    address: str
    store: Store
    signer: Signer
    keyspace: Keyspace
    keep_alive: KeepAlive
    log_root: str
    metrics: OutputMetrics
    logs: LogBus
    probe: DeadNodeProbe
    refused: Refused
    stop_grace: float = 10.0
    cgroups: JobCgroups | None = None
    containment: Containment = Containment()  # what bounds a job here (its limits)
    master_ports: MasterPorts = field(default_factory=MasterPorts)
    runtime_dir: str = ""  # where in-place jobs' worker channels live
    worker_library: str = ""  # the directory holding elasticd.elastic for workers
    output_limit: OutputLimit = OutputLimit()  # when workers' output files are rotated
    access: FileAccess = field(default_factory=FileAccess)  # who reads jobs' files on disk
    faults: Faults | None = None  # where the rendezvous keepers' unexpected errors are counted
    tier: CheckpointTier | None = None  # each job's checkpoint directory in memory
    guard: RoundGuard | None = None  # the failure detector (None: heartbeats only)
    lens: JobLens | None = None  # what this node runs of a job (None: its record, as it is)

    def rendezvous(
        self,
        spec: JobSpec,
        *,
        may_create: bool = True,
        on_lost: Callable[[tuple[str, ...]], None] = lambda nodes: None,
    ) -> RendezvousHandler:
        """The job's rendezvous; ``may_create`` False for a job that already ran (its state
        is joined or restored, never started afresh)."""
        settings = RendezvousSettings(
            run_id=spec.id,
            min_nodes=spec.min_nodes,
            max_nodes=spec.max_nodes,
            max_restarts=spec.max_restarts,
            join_timeout=spec.join_timeout,
            last_call_timeout=spec.last_call_timeout,
            keep_alive_interval=self.keep_alive.interval,
            keep_alive_max_attempt=self.keep_alive.attempts,
        )
        return RendezvousHandler(
            self.store,
            self.signer,
            settings,
            self.node,
            self.address,
            prefix=self.keyspace.rendezvous(spec.id),
            on_refused=self.refused,
            may_create=may_create,
            on_lost=on_lost,
            faults=self.faults,
        )

    def part(
        self,
        spec: JobSpec,
        nproc: int,
        started: float | None,
        on_ready: Callable[[Ready], None],
        on_lost: Callable[[tuple[str, ...]], None],
        on_progress: Callable[[int], None] = lambda slot: None,
    ) -> PartEffectors:
        """A part's effectors: its cgroup made and its channel listening now (a failure
        raises: the part cannot start here)."""
        if self.lens is not None:
            spec = self.lens.spec(spec)
        cgroup = None
        if self.cgroups is not None:
            cgroup = self.cgroups.create(spec.id, self.containment.job_limits(nproc))
        link = None
        try:
            if (spec.in_place or spec.hang_timeout) and self.runtime_dir:
                directory = os.path.join(self.runtime_dir, "agents")
                os.makedirs(directory, mode=0o755, exist_ok=True)
                link = WorkerLink(
                    os.path.join(directory, f"{spec.id}.sock"),
                    uid=spec.uid,
                    gid=spec.gid,
                    slots=nproc,
                    on_ready=on_ready,
                    on_progress=on_progress,
                )
                link.bind()
        except Exception:
            if cgroup is not None:
                cgroup.remove()
            raise
        rdzv = self.rendezvous(spec, may_create=started is None, on_lost=on_lost)
        checkpoints = self.tier.open(spec) if self.tier is not None else ""
        standbys = self.standbys(spec, nproc)
        stores = RoundStores(self.address)
        return PartEffectors(
            self, spec, nproc, rdzv, cgroup, link, stores, checkpoints, standbys=standbys
        )

    def standbys(self, spec: JobSpec, nproc: int) -> Standbys | None:
        """A --warm-restart job's standbys here, in a cgroup of their own with the job's
        limits (None: no standbys; one that cannot have its cgroup has none, with a
        warning)."""
        if not spec.warm_restart or not self.worker_library:
            return None
        script = os.path.join(self.worker_library, "elasticd", "elastic", "standby.py")
        cgroup = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.create(
                    f"{spec.id}-standby", self.containment.job_limits(nproc)
                )
            except (OSError, ValueError) as exc:
                log.warning(
                    "job %s: no standbys (--warm-restart): no cgroup for them: %s",
                    spec.id,
                    exc,
                    extra=about(spec.id),
                )
                return None
        return Standbys(script, cgroup)

    def worker_env(
        self, spec: JobSpec, link: WorkerLink | None, checkpoints: str = ""
    ) -> dict[str, str]:
        """On top of worker_env: what this node runs of the job (elasticrun's lens), the
        library on PYTHONPATH, an in-place job's channel, the job's checkpoint directory."""
        env = dict(self.lens.worker_env(spec)) if self.lens is not None else {}
        if self.worker_library:
            env["PYTHONPATH"] = python_path(self.worker_library, spec.env)
        if checkpoints:
            env[CHECKPOINT_ENV] = checkpoints
        if link is None:
            return env
        if not spec.in_place:
            return {**env, PROGRESS_ENV: link.path}
        return {**env, SOCKET_ENV: link.path, REJOIN_ENV: f"{spec.rejoin_timeout:g}"}


@dataclass
class PartEffectors:
    """One part's effectors; ``workers`` is the round's group (classic) or the pool
    (in place)."""

    shared: Effectors
    spec: JobSpec
    nproc: int
    rdzv: RendezvousHandler
    cgroup: JobCgroup | None
    link: WorkerLink | None
    stores: RoundStores  # the stores its rounds form their groups in, served here
    checkpoints: str = ""  # the job's checkpoint directory here ("": no tier)
    workers: LocalWorkers | None = None
    standbys: Standbys | None = None  # --warm-restart: the next round's workers, waiting
    keeper: asyncio.Task[None] | None = None
    ops: dict[int, asyncio.Task[Any]] = field(default_factory=dict)
    watches: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)

    def attempt_dir(self, round: int) -> str:
        return os.path.join(self.shared.log_root, self.spec.id, f"attempt_{round}")

    def new_workers(
        self, group: WorkerGroup, round: int, on_change: Callable[[WorkerGroup], None]
    ) -> LocalWorkers:
        """A group of workers (not started yet): this round's, or an in-place pool."""
        shared = self.shared
        self.workers = LocalWorkers(
            self.spec,
            group,
            self.attempt_dir(round),
            cgroup=self.cgroup,
            on_output=lambda: shared.logs.publish(self.spec.id),
            on_dropped=shared.metrics.output_dropped,
            on_change=on_change,
            stop_grace=shared.stop_grace,
            extra_env=shared.worker_env(self.spec, self.link, self.checkpoints),
            output_limit=shared.output_limit,
            nproc_limit=shared.containment.rlimit_nproc(self.nproc),
            access=shared.access,
            standbys=self.standbys,
        )
        return self.workers

    def usage(self) -> dict[str, Any] | None:
        """CPU time, memory peak and OOM kills of the job's processes here, from its cgroup;
        with --warm-restart, how many standbys wait (None: neither)."""
        usage = self.cgroup.usage().to_json() if self.cgroup is not None else None
        if self.standbys is not None:
            usage = {**(usage or {}), "standbys": self.standbys.waiting()}
        return usage

    async def close(self) -> None:
        """Stop everything the part has here: its operations and timers, its workers, its
        channel, its keeper; then its cgroup (killing what escaped a round's stop)."""
        for task in self.ops.values():
            task.cancel()
        for timer in self.timers.values():
            timer.cancel()
        try:
            if self.ops:
                await asyncio.wait(list(self.ops.values()))
            self.ops.clear()
            if self.workers is not None:
                await self.workers.stop()
            if self.standbys is not None:
                await self.standbys.close()
            if self.link is not None:
                await self.link.close()
        finally:  # a port kept listening would outlive the job (a fixed --master-port too)
            self.stores.close()
        self.rdzv.shutdown()
        if self.keeper is not None:
            self.keeper.cancel()
            await asyncio.wait([self.keeper])
        if self.shared.tier is not None:
            await self.shared.tier.close(self.spec.id)
        await self._remove_cgroup()

    async def _remove_cgroup(self) -> None:
        if self.cgroup is None:
            return
        try:
            if self.cgroup.populated():
                self.cgroup.kill()
                await self.cgroup.wait_empty(_EMPTY_WAIT)
            self.cgroup.remove()
        except OSError as exc:
            log.warning(
                "job %s: could not remove its cgroup: %s",
                self.spec.id,
                exc,
                extra=about(self.spec.id),
            )
