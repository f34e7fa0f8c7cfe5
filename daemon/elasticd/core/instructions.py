"""Instructions: what the node core wants done.  Frozen data; the shell carries them out.

An instruction with an ``op`` starts an operation whose completion comes back as an event
with the same number; ``Cancel`` drops one that is no longer wanted (its completion, if it
still comes, is stale).  The others are done at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticd.core.checkpoints import Holding
from elasticd.core.model import JobSpec, WorkerGroup
from elasticd.core.records import Outcome, Part
from elasticd.rendezvous import Reason, RendezvousInfo

# -- the rendezvous -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Join:
    """Join the job's current (or next) round with ``nproc`` workers; ``master_ports``: the
    ports to offer for its store, in order (model.master_ports; none: a port free here now);
    ``scheduled``: the nodes the cluster's schedule gives the job (the round need not wait
    for more once they are all in)."""

    job: str
    op: int
    nproc: int
    master_ports: tuple[int, ...]
    scheduled: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrepareRestore:
    """Before the workers of ``round`` start: put the job's newest complete checkpoint in
    place on this node (fetching what it lacks, from the round's ``members`` first: a node
    left out of the round may be the one that was lost) and delete the saves that were cut
    off.  ``checkpoint``: the newest one a member declared it holds, joining the round (the
    same on every member, whatever each has seen of the others' records since)."""

    job: str
    op: int
    round: int
    members: tuple[str, ...] = ()
    checkpoint: Holding | None = None


@dataclass(frozen=True)
class Watch:
    """Until ``round`` is superseded or closed (or, with ``waiting``, nodes wait to join)."""

    job: str
    op: int
    round: int
    waiting: bool


@dataclass(frozen=True)
class RequestRound:
    """Supersede ``round`` (None: whichever round is current, for a node outside it)."""

    job: str
    op: int
    round: int | None
    reason: Reason
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArriveAtBarrier:
    """Arrive at the exit barrier of ``info``'s round and wait (at most ``timeout``) for
    every member, telling the progress as it goes."""

    job: str
    op: int
    info: RendezvousInfo
    timeout: float


@dataclass(frozen=True)
class Leave:
    """Tell the rendezvous that this node leaves (a courtesy with a deadline)."""

    job: str
    op: int
    reason: Reason


@dataclass(frozen=True)
class Probe:
    """Which of ``nodes`` have a daemon that is gone (one round trip, at most ``timeout``)."""

    job: str
    op: int
    nodes: tuple[str, ...]
    timeout: float


@dataclass(frozen=True)
class Cancel:
    """The operation ``op`` is no longer wanted."""

    job: str
    op: int


# -- the workers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartWorkers:
    """A new group of workers (its ranks in ``group``), its output in the round's folder.
    In place (``pool``): the part's one pool starts them all, kept across rounds."""

    job: str
    group: WorkerGroup
    round: int
    pool: bool = False


@dataclass(frozen=True)
class NewPool:
    """In place: a pool of standby workers (every slot, none started), replacing any."""

    job: str
    group: WorkerGroup


@dataclass(frozen=True)
class WarmWorkers:
    """In place: start new workers in ``slots`` (their old ones are gone); they have no rank
    until placed.  ``round``: the folder their output goes to until then."""

    job: str
    slots: tuple[int, ...]
    round: int


@dataclass(frozen=True)
class PlaceWorkers:
    """In place: ``group`` is the workers' place in its round; each hears its environment."""

    job: str
    group: WorkerGroup
    envs: Mapping[int, Mapping[str, str]]


@dataclass(frozen=True)
class Notify:
    """In place: tell the workers that ``round`` is coming: ``abort`` their collectives (a
    member is gone), or that it ``added`` members (they need the state)."""

    job: str
    round: int
    abort: bool = False
    added: bool | None = None


@dataclass(frozen=True)
class FailSlots:
    """In place: stop the workers of ``slots`` as failed, saying ``why`` (warm-ups that did
    not ask for their place in time); their ends come back as WorkersChanged."""

    job: str
    slots: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class DumpStacks:
    """Write the stack of each worker in ``slots`` into its stderr log (the library's signal,
    py-spy where installed) and say where each is: RanksHung."""

    job: str
    op: int
    slots: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class ForgetSlots:
    """In place: new workers take ``slots``; what the old ones asked or were told is void."""

    job: str
    slots: tuple[int, ...]


@dataclass(frozen=True)
class ShedSpares:
    """In place: stop the workers in ``slots`` only (spares the node gives back); done once
    each is reaped (SparesShed, a node operation: its ``op`` is below zero)."""

    job: str
    op: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class StopWorkers:
    """SIGTERM, grace, SIGKILL to every worker of the part; done once all are reaped."""

    job: str
    op: int


# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publish:
    """This node's part of the job, for the job table and the board (the shell adds its
    live usage and the time)."""

    job: str
    part: Part


@dataclass(frozen=True)
class Finish:
    """Make ``outcome`` the job's outcome unless another was first; close its rendezvous."""

    job: str
    op: int
    outcome: Outcome
    spec: JobSpec | None = None  # for a job this node runs nothing of
    board: bool = True  # False: this node's record only (a one-node cluster's old job)


@dataclass(frozen=True)
class HoldJob:
    """This node never places the job again: a record it needs was refused or lost."""

    job: str
    why: str


# -- life cycle, time, what is said -------------------------------------------------------------


@dataclass(frozen=True)
class StartPart:
    """Make the part's effectors (its rendezvous and keeper, cgroup, in-place channel)."""

    job: str
    spec: JobSpec
    nproc: int  # its processes: the workers and the spares
    gpus: tuple[str, ...]
    started: float | None  # when the job first ran, on any node (None: it has not)


@dataclass(frozen=True)
class ClosePart:
    """Stop the keeper, close the channel, remove the cgroup; then PartClosed."""

    job: str


@dataclass(frozen=True)
class SetTimer:
    """A TimerFired(job, name) (or, without a job, NodeTimerFired) at monotonic ``at``."""

    name: str
    at: float
    job: str | None = None
    key: Any = None


@dataclass(frozen=True)
class ClearTimer:
    name: str
    job: str | None = None
    key: Any = None


@dataclass(frozen=True)
class Count:
    """A metric: ``what`` (round_joined, restarted, worker_exited, barrier_waited,
    blacklisted ...), with a label and a value where it has them."""

    what: str
    label: str = ""
    value: float = 1.0


@dataclass(frozen=True)
class Say:
    """A line for the daemon's log, about ``job`` (None: the node)."""

    level: str
    message: str
    job: str | None = None
    args: tuple[Any, ...] = field(default_factory=tuple)


Instruction = (
    Join
    | PrepareRestore
    | Watch
    | RequestRound
    | ArriveAtBarrier
    | Leave
    | Probe
    | Cancel
    | StartWorkers
    | NewPool
    | WarmWorkers
    | PlaceWorkers
    | Notify
    | ForgetSlots
    | FailSlots
    | DumpStacks
    | ShedSpares
    | StopWorkers
    | Publish
    | Finish
    | HoldJob
    | StartPart
    | ClosePart
    | SetTimer
    | ClearTimer
    | Count
    | Say
)
