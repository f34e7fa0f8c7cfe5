"""The cluster's allocator (docs/scheduler.md), pure: from the jobs, the nodes, the policy, the usage
and the time to each job's node set.  No clock, no store: the same input gives the same
allocation, whatever order its mappings come in.

One order rules everything (``order``): priority, then the account's fair-share factor,
then submit order.  Then, in three phases on a ledger of the cluster:

1. *Keep*: every running job keeps its current nodes that are still usable, eligible, and
   have room (in order, should the input overcommit a node), up to its max.
2. *Admit* (in order, repeated until nothing more starts): a waiting job whose min (rounded
   up to its step) is within its quotas takes free nodes, then nodes reclaimed from others:
   nodes borrowed over a quota (from any job), then nodes lent above min by jobs of no
   higher priority (the last in the order first; a min comes before anyone's extra nodes,
   whoever came first), never below their min and leaving a multiple of their step;
   a waiting job may, last, preempt ``preemptible`` jobs later in the order (they wait
   again).  A running job that lost nodes below its min is topped up the same way (a
   failure is not delayed), or keeps what it has.  A waiting job that cannot start reserves
   the room it could use: later waiting jobs start only on what it cannot use (reason
   Priority when the reservation is all that stops them), so a large job is not starved by
   a stream of small ones, while growth (3) may still use that room (it is lent, so the
   reserving job reclaims it once it fits).
3. *Grow*: free room goes to running jobs below max, in order, a multiple of step at a
   time, at most once per ``resize_interval`` per job (a job admitted now may start above
   its min).

Admit and grow repeat until neither moves anything: growth may make a node that a job just
admitted took (and a waiting job needs) a lent one, which the next walk reclaims.  So the
allocation is a fixed point: given back as the jobs' current nodes, it moves nothing.

Quotas count each admitted job's min (its min nodes at its smallest share); nodes beyond
it in use over a quota are *borrowed*, and reclaimed first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from elasticd.core import fairshare
from elasticd.core.allocation import (
    Allocation,
    JobDemand,
    NodeCapacity,
    Policy,
    Quota,
    Reason,
    Share,
    Tally,
    Waiting,
)
from elasticd.core.ledger import Ledger, borrowing, charge

__all__ = [
    "Allocation",
    "JobDemand",
    "NodeCapacity",
    "Policy",
    "Quota",
    "Reason",
    "Share",
    "Tally",
    "Waiting",
    "allocate",
    "order",
]


def order(jobs: Iterable[JobDemand], policy: Policy, usage: Mapping[str, float]) -> list[JobDemand]:
    """Priority (higher first), then fair share (higher first), then age (seq, then id)."""
    jobs = list(jobs)
    fair = fairshare.factor(usage, policy.account_shares, (j.account for j in jobs))
    return sorted(jobs, key=lambda j: (-j.priority, -fair[j.account], j.seq, j.id))


def allocate(
    nodes: Mapping[str, NodeCapacity],
    jobs: Iterable[JobDemand],
    policy: Policy,
    usage: Mapping[str, float],
    now: float,
) -> Allocation:
    """Each job's nodes (see the module's docstring).  ``usage``: decayed node-seconds per
    account; ``now``: the time ``last_grown`` is measured against."""
    ranked = order(jobs, policy, usage)
    ledger = Ledger({n: (c.slots, c.gpus) for n, c in nodes.items() if c.usable}, ranked)
    dropped = _keep(ledger, ranked)
    kept = {j: frozenset(h) for j, h in ledger.held.items() if h}
    added: dict[str, set[str]] = {}
    waiting: tuple[Waiting, ...] = ()
    for _ in range(2 * len(ranked) + 2):
        waiting, moved = _walk(ledger, ranked, policy, nodes)
        started = {
            j for j, h in ledger.held.items() if h and (j not in kept or j in ledger.preempted)
        }
        grew = _grow(ledger, ranked, policy, now, started, added)
        if not (moved or grew):
            break
    held = {j: frozenset(h) for j, h in sorted(ledger.held.items()) if h}
    return Allocation(
        nodes=held,
        waiting=waiting,
        order=tuple(j.id for j in ranked),
        started=frozenset(started),
        preempted=frozenset(ledger.preempted & kept.keys()),
        grown=_net(
            {j: held.get(j, frozenset()) & a - kept.get(j, frozenset()) for j, a in added.items()}
        ),
        reclaimed=_net(
            {j: k - held.get(j, frozenset()) for j, k in kept.items() if j not in ledger.preempted}
        ),
        dropped=dropped,
        borrowing=frozenset(j.id for j in ranked if borrowing(ledger, j, policy)),
    )


def _net(sets: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    return {j: s for j, s in sorted(sets.items()) if s}


# -- 1. keep ---------------------------------------------------------------------------------


def _keep(ledger: Ledger, ranked: list[JobDemand]) -> dict[str, frozenset[str]]:
    dropped: dict[str, frozenset[str]] = {}
    for job in ranked:
        for node in sorted(job.current):
            if len(ledger.held[job.id]) < job.max_nodes and ledger.fits(job, node):
                ledger.take(job, node)
        lost = job.current - ledger.held[job.id]
        if lost:
            dropped[job.id] = frozenset(lost)
    return dropped


# -- 2. admit --------------------------------------------------------------------------------


def _walk(
    ledger: Ledger, ranked: list[JobDemand], policy: Policy, nodes: Mapping[str, NodeCapacity]
) -> tuple[tuple[Waiting, ...], bool]:
    """One walk of the order: the jobs left waiting, and whether any job took nodes."""
    ledger.reserved.clear()
    waiting: list[Waiting] = []
    moved = False
    for job in ranked:
        outcome = _admit_one(ledger, job, policy, nodes)
        if isinstance(outcome, Reason):
            waiting.append(Waiting(job.id, outcome))
        moved = moved or outcome is True
    return tuple(waiting), moved


def _admit_one(
    ledger: Ledger, job: JobDemand, policy: Policy, nodes: Mapping[str, NodeCapacity]
) -> Reason | bool | None:
    """A reason it waits; True if it took nodes; None if it runs on as it is."""
    have = ledger.held[job.id]
    if len(have) >= job.need:
        return None
    if have:
        return None if job.held else _top_up(ledger, job, policy)
    if job.held:
        return Reason.HELD
    if job.need > job.top or _eligible_anywhere(job, nodes) < job.need:
        return Reason.SIZE
    return _start(ledger, job, policy)


def _eligible_anywhere(job: JobDemand, nodes: Mapping[str, NodeCapacity]) -> int:
    """How many of the cluster's nodes could hold a share of ``job`` were they idle."""
    return sum(
        1
        for n, c in nodes.items()
        if n in job.shares and job.shares[n].slots <= c.slots and job.shares[n].gpus <= c.gpus
    )


def _top_up(ledger: Ledger, job: JobDemand, policy: Policy) -> bool:
    """A running job below its min (it lost nodes) gets back to it if it can, at once."""
    more = job.need - len(ledger.held[job.id])
    if _quota(ledger, job, more, policy) is not None:
        return False
    plan = ledger.plan(job, more, policy, reservations=False, preempt=False)
    if plan is None:
        return False
    ledger.adopt(plan)
    return True


def _start(ledger: Ledger, job: JobDemand, policy: Policy) -> Reason | bool:
    reason = _quota(ledger, job, job.need, policy)
    if reason is not None:
        return reason
    plan = ledger.plan(job, job.need, policy, reservations=True, preempt=True)
    if plan is not None:
        ledger.adopt(plan)
        return True
    free = ledger.plan(job, job.need, policy, reservations=False, preempt=True)
    ledger.reserve(job, policy)
    return Reason.PRIORITY if free is not None else Reason.RESOURCES


def _quota(ledger: Ledger, job: JobDemand, more: int, policy: Policy) -> Reason | None:
    """The quota ``job`` would break with ``more`` guaranteed nodes on top of what it holds
    (None: within every limit).  Each job counts its min at its smallest share (``charge``):
    it does not depend on which nodes it gets, nor on what others lend or borrow."""
    for limits, reason, kind in policy.limits(job):
        owner = getattr(job, kind)
        others = (j for j in ledger.jobs.values() if j.id != job.id and getattr(j, kind) == owner)
        total = sum((charge(ledger, j) for j in others), Tally())
        if limits.exceeded_by(total + charge(ledger, job, len(ledger.held[job.id]) + more)):
            return reason
    return None


# -- 3. grow ---------------------------------------------------------------------------------


def _grow(
    ledger: Ledger,
    ranked: list[JobDemand],
    policy: Policy,
    now: float,
    started: set[str],
    added: dict[str, set[str]],
) -> bool:
    """Give free room to the jobs due to grow, in order; whether any grew (into ``added``)."""
    grew = False
    for job in ranked:
        have = ledger.held[job.id]
        if len(have) < job.need or job.held or not (job.id in started or _due(job, policy, now)):
            continue  # below its min it is topped up (admission, within quotas) or not at all
        room = [n for n in ledger.nodes_for(job) if n not in have and ledger.fits(job, n)]
        target = min(job.top, (len(have) + len(room)) // job.step * job.step)
        if target <= len(have):
            continue
        picks = sorted(room, key=lambda n: ledger.growth_rank(job, n))[: target - len(have)]
        for node in picks:
            ledger.take(job, node)
        added.setdefault(job.id, set()).update(picks)
        grew = True
    return grew


def _due(job: JobDemand, policy: Policy, now: float) -> bool:
    return job.last_grown is None or now - job.last_grown >= policy.resize_interval
