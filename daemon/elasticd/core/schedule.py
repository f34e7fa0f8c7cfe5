"""The schedule (docs/scheduler.md), pure: what the cluster's allocator publishes and every node
follows, and how job records and nodes become the allocator's input.

``plan`` runs on the elected node (the observer) when the jobs or the nodes changed, or a
job's growth falls due; ``follows`` and ``leaves`` are a node's reading of it.  A node that
holds no valid schedule places jobs as before (core/placement.py), so placing never stops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from elasticd.core.allocation import JobDemand, NodeCapacity, Policy, Reason, Share, Waiting
from elasticd.core.allocator import allocate
from elasticd.core.model import JobSpec, PartState
from elasticd.core.placement import Resources, eligible, fit
from elasticd.core.records import JobRecord

_ENDED_HERE = frozenset({PartState.SUCCEEDED, PartState.FAILED, PartState.STOPPED})
MAX_JOBS = 1 << 16  # jobs in one schedule: far beyond a store's open jobs
Accounts = Callable[[JobSpec], str]  # the account a job is charged to (jobs/accounts.account_of)


def _named_account(spec: JobSpec) -> str:
    return spec.account or f"gid:{spec.gid}"


@dataclass(frozen=True)
class NodeSize:
    """A node as the allocator sees it: its whole size, and whether it may take jobs now
    (up, not drained, listed, not blacklisted)."""

    slots: int
    gpus: int = 0
    cpus: int = 0
    usable: bool = True


@dataclass(frozen=True)
class Schedule:
    """Each job's nodes, and the waiting jobs in the order they will start, with why.
    ``term``: the allocator's (the observer's term); ``number`` counts its schedules.
    ``grown``: each job's last growth (wall clock: the next allocator reads it).
    ``preempted``: jobs stopped below their min, requeued until they fit again."""

    term: int
    number: int
    nodes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    waiting: tuple[Waiting, ...] = ()
    grown: Mapping[str, float] = field(default_factory=dict)
    preempted: frozenset[str] = frozenset()
    made: float = 0.0

    @property
    def version(self) -> int:
        """The record's version: later terms and later schedules of a term are newer,
        whatever the writers' clocks say."""
        return (self.term << 32) | self.number

    @functools.cached_property
    def _reasons(self) -> dict[str, Reason]:
        return {w.job: w.reason for w in self.waiting}

    def knows(self, job: str) -> bool:
        return job in self.nodes or job in self._reasons

    def reason(self, job: str) -> Reason | None:
        """Why ``job`` waits (None: it does not), in O(1): `list` asks it of every row."""
        return self._reasons.get(job)

    def same_plan(self, other: Schedule | None) -> bool:
        return other is not None and (self.nodes, self.waiting, self.preempted) == (
            other.nodes,
            other.waiting,
            other.preempted,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "number": self.number,
            "made": self.made,
            "nodes": {job: sorted(nodes) for job, nodes in sorted(self.nodes.items())},
            "waiting": [[w.job, w.reason.value] for w in self.waiting],
            "grown": dict(sorted(self.grown.items())),
            "preempted": sorted(self.preempted),
        }

    @classmethod
    def from_json(cls, doc: Any) -> Schedule:
        """Raises ValueError for anything that is not a schedule (a signed record of another
        version, or a bug: it is refused like a forged one)."""
        if not isinstance(doc, dict):
            raise ValueError("a schedule is an object")
        term, number, made = doc.get("term"), doc.get("number"), doc.get("made", 0.0)
        if not (_count(term) and _count(number) and isinstance(made, (int, float))):
            raise ValueError("a schedule has a term, a number and a time")
        nodes, waiting = doc.get("nodes"), doc.get("waiting")
        grown, preempted = doc.get("grown", {}), doc.get("preempted", [])
        if (
            not (
                isinstance(nodes, dict)
                and isinstance(waiting, list)
                and isinstance(grown, dict)
                and isinstance(preempted, list)
            )
            or len(nodes) + len(waiting) > MAX_JOBS
        ):
            raise ValueError("a schedule has nodes, waiting jobs, growths and preempted jobs")
        if not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in nodes.values()
        ):
            raise ValueError("a schedule's nodes are lists of names")
        if not all(isinstance(w, list) and len(w) == 2 and isinstance(w[0], str) for w in waiting):
            raise ValueError("a schedule's waiting jobs are [job, reason]")
        if not all(isinstance(t, (int, float)) for t in grown.values()) or not all(
            isinstance(j, str) for j in preempted
        ):
            raise ValueError("a schedule's growths are times and its preempted jobs names")
        return cls(
            term,
            number,
            {j: frozenset(n) for j, n in nodes.items()},
            tuple(Waiting(j, Reason(r)) for j, r in waiting),
            {j: float(t) for j, t in grown.items()},
            frozenset(preempted),
            float(made),
        )


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


# -- the allocator's input, from records -------------------------------------------------------


def demand(
    record: JobRecord,
    nodes: Mapping[str, NodeSize],
    previous: Schedule | None,
    account: Accounts = _named_account,
) -> JobDemand:
    """A job as the allocator sees it.  Its current nodes are those the last schedule gave
    it (joined or not yet: a node it was told to leave is not its own while it leaves);
    a job the last schedule did not know holds where it runs.  A node where its part
    ended, or that holds the job and runs no part of it, gives it nothing (a held job
    runs on where it runs: it only takes no new node)."""
    spec = record.spec
    closed = {
        n
        for n, p in record.parts.items()
        if p.state in _ENDED_HERE or (p.held and not p.state.active)
    }  # a holding node runs on
    shares = {
        name: share
        for name, size in nodes.items()
        if name not in closed
        and eligible(spec, name)
        and (share := _share(record, size)) is not None
    }
    if previous is not None and previous.knows(spec.id):
        current = set(previous.nodes.get(spec.id, frozenset()))
    else:
        current = {n for n, p in record.parts.items() if p.state.active}
    return JobDemand(
        id=spec.id,
        user=spec.user,
        account=account(spec),
        shares=shares,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        step=spec.nnodes_step,
        priority=spec.priority,
        seq=record.seq,
        submitted=spec.created,
        preemptible=spec.preemptible,
        held=bool(record.held),
        current=frozenset(current - closed),
        last_grown=previous.grown.get(spec.id) if previous is not None else None,
    )


def _share(record: JobRecord, size: NodeSize) -> Share | None:
    gpus = tuple(str(i) for i in range(size.gpus))
    offer = fit(record.spec, Resources(size.slots, gpus, size.cpus), has_gpus=bool(gpus))
    return Share(offer.nproc, len(offer.gpus)) if offer is not None else None


def capacities(nodes: Mapping[str, NodeSize]) -> dict[str, NodeCapacity]:
    return {name: NodeCapacity(s.slots, s.gpus, s.usable) for name, s in nodes.items()}


def plan(
    records: Iterable[JobRecord],
    nodes: Mapping[str, NodeSize],
    previous: Schedule | None,
    policy: Policy,
    usage: Mapping[str, float],
    *,
    term: int,
    now: float,
    account: Accounts = _named_account,
) -> Schedule:
    """The next schedule: ``previous`` itself when nothing moved in this term (so that a
    caller publishes only changes), else a new number."""
    open_jobs = [r for r in records if r.outcome is None]
    jobs = [demand(r, nodes, previous, account) for r in open_jobs]
    allocation = allocate(capacities(nodes), jobs, policy, usage, now)
    grown = {
        j: t
        for j, t in (previous.grown.items() if previous is not None else ())
        if j in allocation.nodes
    }
    grown.update({j: now for j in allocation.grown})
    before = previous.preempted if previous is not None else frozenset()
    preempted = (allocation.preempted | before) & {r.id for r in open_jobs} - set(allocation.nodes)
    number = previous.number + 1 if previous is not None and previous.term == term else 1
    schedule = Schedule(
        term, number, dict(allocation.nodes), allocation.waiting, grown, frozenset(preempted), now
    )
    if previous is not None and previous.term == term and schedule.same_plan(previous):
        return previous
    return schedule


def next_growth(schedule: Schedule, policy: Policy, now: float) -> float | None:
    """When the soonest job growth after ``now`` falls due (a plan then may move
    something), or None."""
    times = [
        t + policy.resize_interval
        for t in schedule.grown.values()
        if t + policy.resize_interval > now
    ]
    return min(times) if times else None


# -- a node's reading of it ---------------------------------------------------------------------


def follows(schedule: Schedule, job: str, node: str) -> bool:
    """Whether ``node`` may take part in ``job``: the schedule gives it that node."""
    return node in schedule.nodes.get(job, ())


def leaves(schedule: Schedule, job: str, node: str) -> bool:
    """Whether ``node`` must leave ``job``: the schedule knows the job and gives it other
    nodes, or none (a job newer than the schedule is left alone until the next one)."""
    return schedule.knows(job) and not follows(schedule, job, node)


def waiting_jobs(
    records: Iterable[JobRecord], schedule: Schedule | None
) -> list[tuple[JobRecord, str | None]]:
    """The jobs that wait, in the order they will start, and why (`elasticctl queue`, the
    metrics): the schedule's waiting jobs with its reasons; without one, the open jobs no
    node runs, in submit order (no reason)."""
    open_jobs = {r.id: r for r in records if r.outcome is None}
    if schedule is not None:
        return [(open_jobs[w.job], w.reason.value) for w in schedule.waiting if w.job in open_jobs]
    return [
        (r, None)
        for r in sorted(open_jobs.values(), key=lambda r: r.seq)
        if not any(p.state.active for p in r.parts.values())
    ]
