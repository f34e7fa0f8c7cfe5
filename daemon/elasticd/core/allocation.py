"""What the cluster's allocator reads and says: nodes, jobs' demands, the
policy, and the allocation with each waiting job's reason.  Plain frozen values: the caller
maps its job records and node list onto them."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from elasticd.core import fairshare


@dataclass(frozen=True)
class Share:
    """What a job takes on one node."""

    slots: int
    gpus: int = 0


@dataclass(frozen=True)
class Tally:
    """What a user or an account holds: nodes, slots, GPUs."""

    nodes: int = 0
    slots: int = 0
    gpus: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.nodes + other.nodes, self.slots + other.slots, self.gpus + other.gpus)


class WaitReason(str, enum.Enum):
    """Why a job waits (Slurm's words)."""

    PRIORITY = "Priority"  # a job ahead of it waits for the room it would take
    RESOURCES = "Resources"  # not enough room, even reclaiming what may be
    QUOTA_USER = "QuotaUser"  # its min would take its user over a limit
    QUOTA_ACCOUNT = "QuotaAccount"  # its min would take its account over a limit
    HELD = "Held"  # held: it does not start until released
    SIZE = "Size"  # its min can never fit this cluster, even idle


@dataclass(frozen=True)
class NodeCapacity:
    slots: int
    gpus: int = 0
    usable: bool = True  # False: lost, drained or held; it gives nothing


@dataclass(frozen=True)
class JobDemand:
    """A job as the allocator sees it.  ``shares``: what it takes on each node it may run
    on (a node absent is not eligible).  ``current``: the nodes it holds now (empty:
    waiting)."""

    id: str
    user: str
    account: str
    shares: Mapping[str, Share]
    min_nodes: int = 1
    max_nodes: int = 1
    step: int = 1
    priority: int = 0
    seq: int = 0
    submitted: float = 0.0  # for the caller's estimates; the order's age is ``seq``
    preemptible: bool = False
    held: bool = False
    current: frozenset[str] = frozenset()
    last_grown: float | None = None
    last_moved: float | None = None  # its last start, resize or preemption (None: none known)
    scheduled: bool = True  # False: it runs where nodes placed it first come, not the allocator

    @property
    def need(self) -> int:
        """Its guaranteed count: min rounded up to its step."""
        return -(-max(self.min_nodes, 1) // self.step) * self.step

    @property
    def top(self) -> int:
        """The largest count it may have: max rounded down to its step."""
        return self.max_nodes // self.step * self.step


@dataclass(frozen=True)
class Quota:
    """One user's or account's limits on what its jobs hold (None: unlimited)."""

    nodes: int | None = None
    gpus: int | None = None
    slots: int | None = None

    def exceeded_by(self, t: Tally) -> bool:
        return any(
            limit is not None and used > limit
            for limit, used in ((self.nodes, t.nodes), (self.gpus, t.gpus), (self.slots, t.slots))
        )


@dataclass(frozen=True)
class Policy:
    users: Mapping[str, Quota] = field(default_factory=dict)
    accounts: Mapping[str, Quota] = field(default_factory=dict)
    user_default: Quota = Quota()
    account_default: Quota = Quota()
    account_shares: Mapping[str, float] = field(default_factory=dict)  # absent: 1.0
    resize_interval: float = 60.0
    half_life: float = fairshare.HALF_LIFE  # for the caller's fairshare.decay
    min_run_time: float = 0.0  # a job started, resized or preempted is not disturbed again sooner

    def limits(self, job: JobDemand) -> tuple[tuple[Quota, WaitReason, str], ...]:
        """The user's and the account's limits on ``job``, and how to say each."""
        return (
            (self.users.get(job.user, self.user_default), WaitReason.QUOTA_USER, "user"),
            (
                self.accounts.get(job.account, self.account_default),
                WaitReason.QUOTA_ACCOUNT,
                "account",
            ),
        )


class Waiting(NamedTuple):
    """A waiting job and why (a tuple: a queue of thousands is compared and built often)."""

    job: str
    reason: WaitReason


@dataclass(frozen=True)
class Allocation:
    """``nodes``: every job that runs, and its nodes.  ``waiting``: the others, in the
    order they will start.  ``preempted``: running jobs stopped below their min (requeued:
    in ``waiting``, or started again elsewhere in ``nodes``).  ``started``: admitted now.
    ``grown`` / ``reclaimed``: nodes given to / taken from a running job (the caller
    records ``now`` as the last growth of each job in ``grown``).  ``dropped``: current
    nodes a job could not keep (lost, no longer eligible, overcommitted, over its max).
    ``borrowing``: jobs holding nodes over a quota (reclaimed first).  ``later``: waiting
    jobs beyond the look-ahead, in order: not placed this time (they wait behind those in
    ``waiting``: reason Priority).  ``moved``: jobs started, resized or preempted now (the
    caller records ``now`` as their last move).  ``forced``: for each job, how many nodes
    it took from running jobs (reclaimed or preempted), which its account is charged for."""

    nodes: Mapping[str, frozenset[str]]
    waiting: tuple[Waiting, ...]
    order: tuple[str, ...]
    started: frozenset[str] = frozenset()
    preempted: frozenset[str] = frozenset()
    grown: Mapping[str, frozenset[str]] = field(default_factory=dict)
    reclaimed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    dropped: Mapping[str, frozenset[str]] = field(default_factory=dict)
    borrowing: frozenset[str] = frozenset()
    later: tuple[str, ...] = ()
    moved: frozenset[str] = frozenset()
    forced: Mapping[str, int] = field(default_factory=dict)
