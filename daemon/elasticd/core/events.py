"""Stimuli: what happened, as the node core hears it.  Frozen data, nothing else.

Each event names the job it is about (``job``), or none for a node-wide one.  The
completion of an operation the core asked for carries that operation's number (``op``): a
completion whose number is not the one the part waits for is stale (an abandoned join, a
watch of an old round) and is dropped, never acted on.

Every event carries a ``stimulus_id`` (dask's): the shell names each stimulus as it takes
it in, and the stories (core/story.py) tie each instruction to the stimulus that caused it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from elasticd.core.gpuhealth import GpuReading
from elasticd.core.model import Failure, JobSpec, WorkerGroup
from elasticd.core.records import JobRecord, Outcome
from elasticd.core.schedule import Schedule
from elasticd.rendezvous import NextRound, Reason, RendezvousInfo, RoundEvent


@dataclass(frozen=True)
class Stimulus:
    """What every event has: its name in the stories ("" until the shell names it)."""

    stimulus_id: str = field(default="", kw_only=True)


def stimulus_kind(event: Stimulus) -> str:
    """An event's kind as a stimulus id starts: ``RoundJoined`` -> ``round-joined``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "-", type(event).__name__).lower()


class Now(NamedTuple):
    """The time an event is handled: monotonic seconds for deadlines and durations, the
    wall clock for what is shown and stored."""

    mono: float
    wall: float


# -- one job on this node (a part) --------------------------------------------------------------


@dataclass(frozen=True)
class RoundJoined(Stimulus):
    job: str
    op: int
    info: RendezvousInfo


class JoinFailure:
    """Why a join ended without a round (JoinFailed.kind)."""

    CLOSED = "closed"  # the job ended: its rendezvous is closed
    GONE = "gone"  # its state is gone or refused and this node may not start it afresh
    TIMEOUT = "timeout"  # the join timeout passed
    STORE = "store"  # this node cannot serve the round's store at its master port


@dataclass(frozen=True)
class JoinFailed(Stimulus):
    job: str
    op: int
    kind: str
    message: str = ""


@dataclass(frozen=True)
class RoundChanged(Stimulus):
    """The watched round was superseded or closed, or nodes wait to join it."""

    job: str
    op: int
    event: RoundEvent


@dataclass(frozen=True)
class WorkersChanged(Stimulus):
    """A worker of the part changed state (started, exited, placed); ``failures``: why each
    failed worker of ``group`` failed."""

    job: str
    group: WorkerGroup
    failures: tuple[Failure, ...] = ()


@dataclass(frozen=True)
class WorkersStopped(Stimulus):
    job: str
    op: int


@dataclass(frozen=True)
class PeersProbed(Stimulus):
    """The members whose daemons were found gone when the workers failed."""

    job: str
    op: int
    lost: tuple[str, ...]


@dataclass(frozen=True)
class RoundRequested(Stimulus):
    job: str
    op: int
    result: NextRound


@dataclass(frozen=True)
class BarrierProgress(Stimulus):
    job: str
    op: int
    done: int
    total: int


@dataclass(frozen=True)
class BarrierDone(Stimulus):
    """The exit barrier's wait ended: everyone arrived, or its timeout passed."""

    job: str
    op: int
    arrived: int
    total: int


@dataclass(frozen=True)
class Finished(Stimulus):
    """The outcome that won (this node's, or one another node wrote first)."""

    job: str
    op: int
    outcome: Outcome


@dataclass(frozen=True)
class Left(Stimulus):
    """The rendezvous was told that this node leaves (or the telling gave up)."""

    job: str
    op: int


@dataclass(frozen=True)
class WorkerAsked(Stimulus):
    """In place: the worker in ``slot`` asked for its place in a round after ``after``
    (``why``: start, interrupt or failure; ``error``: what broke, for a failure)."""

    job: str
    slot: int
    after: int
    why: str
    error: str = ""


@dataclass(frozen=True)
class Progressed(Stimulus):
    """The worker in ``slot`` reported progress (a commit, a step: the worker library's)."""

    job: str
    slot: int


@dataclass(frozen=True)
class RanksHung(Stimulus):
    """The DumpStacks ``op`` is done: each hung local rank's stack is in the job's logs, and
    ``ranks`` says where each one is (core/hang.py)."""

    job: str
    op: int
    ranks: tuple[Any, ...]  # hang.HungRank


@dataclass(frozen=True)
class TimerFired(Stimulus):
    job: str
    name: str


@dataclass(frozen=True)
class OpFailed(Stimulus):
    """An operation of the part failed: the store did not answer (``store``), or something
    no rule foresaw (a bug: ``store`` False)."""

    job: str
    op: int | None  # None: an effect that has no operation of its own
    store: bool
    message: str


@dataclass(frozen=True)
class RestorePrepared(Stimulus):
    """The checkpoint the workers will read is in place here (``failure`` "": it is, or
    there is none to read; else why the job cannot go on from any)."""

    job: str
    op: int
    failure: str = ""


@dataclass(frozen=True)
class CheckpointsChanged(Stimulus):
    """This node's share of the job's newest checkpoints changed (its manifests)."""

    job: str
    manifests: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class JobEnded(Stimulus):
    """The job's outcome reached this node (from the board, or from its own finish)."""

    job: str
    outcome: Outcome


@dataclass(frozen=True)
class Leaving(Stimulus):
    """This node leaves the job (a drain, a shutdown, a reclaim, its user kept off it)."""

    job: str
    reason: Reason


@dataclass(frozen=True)
class PartClosed(Stimulus):
    """Everything of the part is gone: workers, channel, keeper, cgroup."""

    job: str


# -- this node --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobsChanged(Stimulus):
    """The node's job table after a change: every job it knows (``users``: the local name
    of each uid of an open job, None where there is none, for the node's own rules)."""

    jobs: tuple[JobRecord, ...]
    users: Mapping[int, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class ScheduleChanged(Stimulus):
    """The cluster's schedule as this node follows it now (None: there is no valid one, so
    the node places jobs itself, first come first served)."""

    schedule: Schedule | None


@dataclass(frozen=True)
class Restored(Stimulus):
    """At start: the jobs that a previous run of this daemon left unfinished."""

    jobs: tuple[JobRecord, ...]


@dataclass(frozen=True)
class HoldChanged(Stimulus):
    """An operator drained or undrained this node, or the discovery script (un)listed it."""

    hold: str  # core.node.Hold's value
    on: bool


@dataclass(frozen=True)
class GpusRead(Stimulus):
    """This node's GPUs as NVML read them (every ``gpu.health_interval``)."""

    readings: tuple[GpuReading, ...]


@dataclass(frozen=True)
class GpuReadmitted(Stimulus):
    """An operator put GPU ``index`` back in this node's offer (``undrain NODE --gpu``)."""

    index: int
    by: str = ""


@dataclass(frozen=True)
class Listed(Stimulus):
    """What the discovery script says of this node: listed or not, and its slots (0: the
    configured number)."""

    listed: bool
    slots: int = 0


@dataclass(frozen=True)
class NodesLost(Stimulus):
    """The one word that nodes are gone, whoever found out: the cluster's observer, a
    rendezvous keeper that dropped silent members, or a probe of the peers' daemons."""

    nodes: tuple[str, ...]


@dataclass(frozen=True)
class CancelAsked(Stimulus):
    job: str
    by: str
    spec: JobSpec | None = None  # the job, for one this node runs nothing of


@dataclass(frozen=True)
class ShutdownAsked(Stimulus):
    """The daemon stops: a one-node cluster cancels its jobs, a node of a larger one leaves."""

    standalone: bool


@dataclass(frozen=True)
class NodeTimerFired(Stimulus):
    name: str
    key: object = None


@dataclass(frozen=True)
class PartStartFailed(Stimulus):
    """The part's effectors could not be made (its cgroup, its channel)."""

    job: str
    message: str


@dataclass(frozen=True)
class LeaveAsked(Stimulus):
    """This node leaves the job (or, without one, every job here)."""

    reason: Reason
    job: str | None = None


@dataclass(frozen=True)
class SparesShed(Stimulus):
    """The node's ShedSpares ``op`` is done: the workers of ``slots`` are reaped (none: it
    failed, and the slots stay the part's)."""

    job: str
    op: int
    slots: tuple[int, ...]


PART_ONLY = (
    RestorePrepared,
    CheckpointsChanged,
    RoundJoined,
    JoinFailed,
    RoundChanged,
    WorkersChanged,
    WorkersStopped,
    PeersProbed,
    RoundRequested,
    BarrierProgress,
    BarrierDone,
    Left,
    WorkerAsked,
    TimerFired,
    Progressed,
    RanksHung,
)
PartEvent = (
    RoundJoined
    | JoinFailed
    | RoundChanged
    | WorkersChanged
    | WorkersStopped
    | PeersProbed
    | RoundRequested
    | BarrierProgress
    | BarrierDone
    | Finished
    | Left
    | WorkerAsked
    | TimerFired
    | Progressed
    | RanksHung
    | OpFailed
    | JobEnded
    | Leaving
    | NodesLost
    | RestorePrepared
    | CheckpointsChanged
)
NodeEvent = (
    JobsChanged
    | ScheduleChanged
    | Restored
    | HoldChanged
    | Listed
    | NodesLost
    | CancelAsked
    | ShutdownAsked
    | NodeTimerFired
    | PartClosed
    | PartStartFailed
    | LeaveAsked
    | GpusRead
    | GpuReadmitted
    | SparesShed
)
Event = PartEvent | NodeEvent
