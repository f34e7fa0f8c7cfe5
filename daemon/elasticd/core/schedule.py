"""The schedule (docs/scheduler.md), pure: what the cluster's allocator publishes and every node
follows, and how job records and nodes become the allocator's input.

``plan`` runs on the elected node (the observer) when the jobs or the nodes changed, or a
job's growth falls due; ``follows`` and ``leaves`` are a node's reading of it.  A node that
holds no valid schedule places jobs as before (core/placement.py), so placing never stops.

A schedule is bounded by the cluster, not by the queue: it names the running jobs and the
waiting jobs the allocator judged (its look-ahead); the waiting jobs behind them are only
counted (``later``), with the fair-share factors that order them, and every node lists
them from its own records in that order (``waiting_jobs``).  ``Planner`` plans again and
again at the cost of what changed: a job's demand is rebuilt only when its record, the
nodes' sizes or what the last schedule says of it changed, and jobs of one shape share the
shares they take on each node.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

from elasticd.core import fairshare
from elasticd.core.allocation import JobDemand, NodeCapacity, Policy, Share, Waiting, WaitReason
from elasticd.core.allocator import LOOK_AHEAD, allocate, factors
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
    ``moved``: each running job's last start, resize or preemption (it is not disturbed
    again within ``scheduler.min_run_time``).  ``preempted``: jobs stopped below their min,
    requeued until they fit again.  ``later``: how many waiting jobs follow those listed
    (not placed this time: they wait behind them), ordered as the allocator orders, by
    ``factors`` (each one's account's fair-share factor); ``last_seq``: the newest job it
    planned.  ``charged``: node-seconds each account was charged for the nodes its jobs
    took from running ones, decayed as of ``made`` (added to its usage for fair share)."""

    term: int
    number: int
    nodes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    waiting: tuple[Waiting, ...] = ()
    grown: Mapping[str, float] = field(default_factory=dict)
    preempted: frozenset[str] = frozenset()
    made: float = 0.0
    moved: Mapping[str, float] = field(default_factory=dict)
    charged: Mapping[str, float] = field(default_factory=dict)
    later: int = 0
    last_seq: int = 0
    factors: Mapping[str, float] = field(default_factory=dict)

    @property
    def version(self) -> int:
        """The record's version: later terms and later schedules of a term are newer,
        whatever the writers' clocks say."""
        return (self.term << 32) | self.number

    @functools.cached_property
    def _reasons(self) -> dict[str, WaitReason]:
        return {w.job: w.reason for w in self.waiting}

    def knows(self, job: str) -> bool:
        """Whether the schedule says where ``job`` runs: on its nodes, or nowhere (listed
        waiting, or preempted).  A job it only counts among ``later`` it does not know:
        no node runs it, and none takes it."""
        return job in self.nodes or job in self._reasons or job in self.preempted

    def reason(self, job: str) -> WaitReason | None:
        """Why ``job`` waits (None: it does not, or it is not listed), in O(1): `list` asks
        it of every row."""
        return self._reasons.get(job)

    def same_plan(self, other: Schedule | None) -> bool:
        return other is not None and (
            self.nodes,
            self.waiting,
            self.preempted,
            self.later,
            self.last_seq,
        ) == (other.nodes, other.waiting, other.preempted, other.later, other.last_seq)

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "number": self.number,
            "made": self.made,
            "nodes": {job: sorted(nodes) for job, nodes in sorted(self.nodes.items())},
            "waiting": [[w.job, w.reason.value] for w in self.waiting],
            "grown": dict(sorted(self.grown.items())),
            "preempted": sorted(self.preempted),
            "moved": dict(sorted(self.moved.items())),
            "charged": dict(sorted(self.charged.items())),
            "later": self.later,
            "last_seq": self.last_seq,
            "factors": dict(sorted(self.factors.items())),
        }

    @classmethod
    def from_json(cls, doc: Any) -> Schedule:
        """Raises ValueError for anything that is not a schedule (a signed record of another
        version, or a bug: it is refused like a forged one).  The keys a schedule of an
        older allocator lacks read as none."""
        if not isinstance(doc, dict):
            raise ValueError("a schedule is an object")
        term, number, made = doc.get("term"), doc.get("number"), doc.get("made", 0.0)
        if not (_count(term) and _count(number) and _time(made)):
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
        if not all(isinstance(j, str) for j in preempted):
            raise ValueError("a schedule's preempted jobs are names")
        later, last_seq = doc.get("later", 0), doc.get("last_seq", 0)
        if not (_count(later) and isinstance(last_seq, int) and not isinstance(last_seq, bool)):
            raise ValueError("a schedule counts the jobs it does not list")
        return cls(
            term,
            number,
            {j: frozenset(n) for j, n in nodes.items()},
            tuple(Waiting(j, WaitReason(r)) for j, r in waiting),
            _times(grown, "growths"),
            frozenset(preempted),
            float(made),
            _times(doc.get("moved", {}), "moves"),
            _times(doc.get("charged", {}), "charges"),
            later,
            last_seq,
            _times(doc.get("factors", {}), "fair-share factors"),
        )


def _time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _times(doc: Any, what: str) -> dict[str, float]:
    if not isinstance(doc, dict) or len(doc) > MAX_JOBS or not all(map(_time, doc.values())):
        raise ValueError(f"a schedule's {what} are numbers by name")
    return {key: float(value) for key, value in doc.items()}


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
    a job the last schedule did not know holds where it runs (placed first come: not
    ``scheduled``).  A node where its part ended, or that holds the job and runs no part of
    it, gives it nothing (a held job runs on where it runs: it only takes no new node)."""
    closed = _closed(record)
    return _current(
        _base(record, closed, _shares_of(record, nodes, closed), account), closed, previous
    )


def _closed(record: JobRecord) -> frozenset[str]:
    """The nodes where the job's part ended, or that hold it and run no part of it."""
    return frozenset(
        n
        for n, p in record.parts.items()
        if p.state in _ENDED_HERE or (p.held and not p.state.active)
    )  # a holding node runs on


def _shares_of(
    record: JobRecord, nodes: Mapping[str, NodeSize], closed: frozenset[str]
) -> dict[str, Share]:
    spec = record.spec
    return {
        name: share
        for name, size in nodes.items()
        if name not in closed
        and eligible(spec, name)
        and (share := _share(record, size)) is not None
    }


def _base(
    record: JobRecord, closed: frozenset[str], shares: Mapping[str, Share], account: Accounts
) -> JobDemand:
    """The job's demand as its record alone says it (current: where it runs, first come)."""
    spec = record.spec
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
        current=frozenset(n for n, p in record.parts.items() if p.state.active) - closed,
        scheduled=False,
    )


def _current(base: JobDemand, closed: frozenset[str], previous: Schedule | None) -> JobDemand:
    """``base`` with what the last schedule says of it: its nodes and its last moves."""
    if previous is None:
        return base
    job = base.id
    scheduled = previous.knows(job)
    current = previous.nodes.get(job, frozenset()) - closed if scheduled else base.current
    grown, moved = previous.grown.get(job), previous.moved.get(job)
    if current == base.current and grown is None and moved is None and not current:
        return base  # a waiting job: what a schedule says of it changes nothing
    return replace(base, current=current, scheduled=scheduled, last_grown=grown, last_moved=moved)


def _share(record: JobRecord, size: NodeSize) -> Share | None:
    gpus = tuple(str(i) for i in range(size.gpus))
    offer = fit(record.spec, Resources(size.slots, gpus, size.cpus), has_gpus=bool(gpus))
    return Share(offer.nproc, len(offer.gpus)) if offer is not None else None


def capacities(nodes: Mapping[str, NodeSize]) -> dict[str, NodeCapacity]:
    return {name: NodeCapacity(s.slots, s.gpus, s.usable) for name, s in nodes.items()}


class Planner:
    """Plans schedule after schedule at the cost of what changed (each plan is ``plan``'s:
    the same input gives the same schedule).  It holds the open jobs' records, as ``take``
    hands it those that changed (records are replaced, never changed, when a job changes),
    and each one's demand as its record says it, rebuilt only when its record or the
    nodes' sizes change; jobs of one shape (sizing, --nodes, --exclude, nodes closed to it)
    share one map of shares.  A plan then adds what the last schedule says of the jobs it
    runs (their nodes, their last moves), O(running), and allocates."""

    def __init__(self, account: Accounts = _named_account) -> None:
        self._account = account
        self._sizes: tuple[tuple[str, int, int, int], ...] = ()
        self._shares: dict[tuple[Any, ...], dict[str, Share]] = {}
        self._records: dict[str, JobRecord] = {}  # the open jobs
        self._bases: dict[str, JobDemand] = {}  # each one's demand as its record says it
        self._closed: dict[str, frozenset[str]] = {}  # its nodes closed to it, where any
        self._placed: set[str] = set()  # the jobs whose record shows them running somewhere
        self._nodes: dict[str, NodeSize] = {}
        self._last_seq = 0

    def take(self, records: Iterable[JobRecord]) -> None:
        """Records that changed: new jobs, jobs that moved, jobs that ended."""
        for record in records:
            job = record.spec.id
            if record.outcome is None:
                self._records[job] = record
                self._last_seq = max(self._last_seq, record.seq)
                if self._sizes:
                    self._build(record)
            elif self._records.pop(job, None) is not None:
                self._bases.pop(job, None)
                self._closed.pop(job, None)
                self._placed.discard(job)

    def knows(self, job: str) -> bool:
        """Whether ``job`` is open (its record taken and not ended)."""
        return job in self._records

    def _build(self, record: JobRecord) -> None:
        job, spec = record.spec.id, record.spec
        closed = _closed(record)
        shape = (spec.nproc_per_node, spec.nodes, spec.exclude, closed)
        shares = self._shares.get(shape)
        if shares is None:
            shares = self._shares[shape] = _shares_of(record, self._nodes, closed)
        base = self._bases[job] = _base(record, closed, shares, self._account)
        if closed:
            self._closed[job] = closed
        else:
            self._closed.pop(job, None)
        if base.current:
            self._placed.add(job)
        else:
            self._placed.discard(job)

    def demands(self, nodes: Mapping[str, NodeSize], previous: Schedule | None) -> list[JobDemand]:
        """Each open job's demand (``demand``'s)."""
        sizes = tuple(sorted((n, s.slots, s.gpus, s.cpus) for n, s in nodes.items()))
        if sizes != self._sizes:  # every share may differ: build every demand again
            self._sizes, self._nodes, self._shares = sizes, dict(nodes), {}
            for record in self._records.values():
                self._build(record)
        out = dict(self._bases)
        running = previous.nodes.keys() if previous is not None else ()
        for job in self._placed.union(running):
            if job in out:
                out[job] = _current(out[job], self._closed.get(job, frozenset()), previous)
        return list(out.values())

    def plan(
        self,
        nodes: Mapping[str, NodeSize],
        previous: Schedule | None,
        policy: Policy,
        usage: Mapping[str, float],
        *,
        term: int,
        now: float,
        look_ahead: int = LOOK_AHEAD,
    ) -> Schedule:
        """The next schedule for the jobs taken so far: ``previous`` itself when nothing
        moved in this term (so that a caller publishes only changes), else a new number.
        ``usage``: what each account's jobs used (decayed node-seconds); the nodes its jobs
        took from running jobs are added (``Schedule.charged``)."""
        jobs = self.demands(nodes, previous)
        charged = _charges(previous, policy, now)
        used = dict(usage)
        for account, seconds in charged.items():
            used[account] = used.get(account, 0.0) + seconds
        allocation = allocate(capacities(nodes), jobs, policy, used, now, look_ahead=look_ahead)
        running = allocation.nodes
        grown = {j: t for j, t in (previous.grown.items() if previous else ()) if j in running}
        grown.update(dict.fromkeys(allocation.grown, now))
        moved = {j: t for j, t in (previous.moved.items() if previous else ()) if j in running}
        moved.update((j, now) for j in allocation.moved if j in running)
        for job, nodes_taken in allocation.forced.items():
            account = self._bases[job].account
            charged[account] = charged.get(account, 0.0) + nodes_taken * policy.min_run_time
        before = previous.preempted if previous else frozenset()
        preempted = {j for j in allocation.preempted | before if self.knows(j)} - set(running)
        same_term = previous is not None and previous.term == term
        number = previous.number + 1 if previous is not None and same_term else 1
        schedule = Schedule(
            term,
            number,
            dict(running),
            allocation.waiting,
            grown,
            frozenset(preempted),
            now,
            moved,
            {a: s for a, s in sorted(charged.items()) if s >= _LEAST_CHARGE},
            len(allocation.later),
            self._last_seq,
            factors(jobs, policy, used) if allocation.later else {},
        )
        if previous is not None and same_term and schedule.same_plan(previous):
            return previous
        return schedule


_LEAST_CHARGE = 1e-3  # node-seconds: a charge decayed below this is forgotten


def _charges(previous: Schedule | None, policy: Policy, now: float) -> dict[str, float]:
    """The accounts' charges for nodes taken from running jobs, decayed until ``now``."""
    if previous is None:
        return {}
    return fairshare.decay(previous.charged, now - previous.made, policy.half_life)


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
    look_ahead: int = LOOK_AHEAD,
) -> Schedule:
    """The next schedule (a Planner's, that keeps nothing for next time)."""
    planner = Planner(account)
    planner.take(records)
    return planner.plan(nodes, previous, policy, usage, term=term, now=now, look_ahead=look_ahead)


def next_growth(schedule: Schedule, policy: Policy, now: float) -> float | None:
    """When the soonest job growth after ``now`` falls due (a plan then may move
    something), or None."""
    times = [
        t + policy.resize_interval
        for t in schedule.grown.values()
        if t + policy.resize_interval > now
    ]
    return min(times) if times else None


def next_due(schedule: Schedule, policy: Policy, now: float) -> float | None:
    """When a plan may next move something though nothing else changed: a job's growth
    falls due or, while jobs wait, a running job's ``min_run_time`` ends (it may yield
    again); None: never."""
    times = [t + policy.resize_interval for t in schedule.grown.values()]
    if schedule.waiting or schedule.later:
        times += [t + policy.min_run_time for t in schedule.moved.values()]
    due = [t for t in times if t > now]
    return min(due) if due else None


# -- a node's reading of it ---------------------------------------------------------------------


def follows(schedule: Schedule, job: str, node: str) -> bool:
    """Whether ``node`` may take part in ``job``: the schedule gives it that node."""
    return node in schedule.nodes.get(job, ())


def leaves(schedule: Schedule, job: str, node: str) -> bool:
    """Whether ``node`` must leave ``job``: the schedule knows the job and gives it other
    nodes, or none (a job newer than the schedule is left alone until the next one)."""
    return schedule.knows(job) and not follows(schedule, job, node)


def waiting_jobs(
    records: Iterable[JobRecord], schedule: Schedule | None, account: Accounts = _named_account
) -> list[tuple[JobRecord, str | None]]:
    """The jobs that wait, in the order they will start, and why (`elasticctl queue`, the
    metrics): the schedule's waiting jobs with its reasons, then those it only counted
    (``later``: open jobs it neither runs nor lists, not newer than it), in its order, by
    its fair-share factors (Held, or Priority: they wait behind the others); without one,
    the open jobs no node runs, in submit order (no reason)."""
    open_jobs = {r.id: r for r in records if r.outcome is None}
    if schedule is None:
        return [
            (r, None)
            for r in sorted(open_jobs.values(), key=lambda r: r.seq)
            if not any(p.state.active for p in r.parts.values())
        ]
    listed: list[tuple[JobRecord, str | None]] = [
        (open_jobs[w.job], w.reason.value) for w in schedule.waiting if w.job in open_jobs
    ]
    if schedule.later:
        fair = schedule.factors
        behind = sorted(
            (r for r in open_jobs.values() if counted(schedule, r)),
            key=lambda r: (-r.spec.priority, -fair.get(account(r.spec), 1.0), r.seq, r.id),
        )
        listed += [(r, (WaitReason.HELD if r.held else WaitReason.PRIORITY).value) for r in behind]
    return listed


def counted(schedule: Schedule, record: JobRecord) -> bool:
    """Whether ``record``'s job is one the schedule only counts (``later``): open, planned
    (not newer than the schedule), neither running nor listed."""
    return (
        bool(schedule.later)
        and record.outcome is None
        and record.seq <= schedule.last_seq
        and record.id not in schedule.nodes
        and schedule.reason(record.id) is None
    )


def reason_of(schedule: Schedule, record: JobRecord) -> WaitReason | None:
    """Why ``record``'s job waits, as the schedule says (None: it runs, or the schedule
    does not know it yet): its listed reason, or for a job it only counts, Held or
    Priority (it waits behind the listed ones)."""
    reason = schedule.reason(record.id)
    if reason is None and counted(schedule, record):
        return WaitReason.HELD if record.held else WaitReason.PRIORITY
    return reason


def waiting_since(record: JobRecord) -> float:
    """When the job last began to wait: its submit; for a job that ran before (preempted,
    requeued), when the last of its parts left (their last report)."""
    if not any(p.started is not None for p in record.parts.values()):
        return record.spec.created
    return max((p.updated for p in record.parts.values()), default=record.spec.created)
