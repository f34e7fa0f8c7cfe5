"""The cluster's allocator (docs/scheduler.md), pure: from the jobs, the nodes, the policy, the usage
and the time to each job's node set.  No clock, no store: the same input gives the same
allocation, whatever order its mappings come in.

One order rules everything (``order``): priority, then the account's fair-share factor,
then submit order.  Then, in three phases on a ledger of the cluster:

1. *Keep*: every running job keeps its current nodes that are still usable, eligible, and
   have room (in order, should the input overcommit a node), up to its max.  A job that
   nodes placed themselves, first come (not ``scheduled``), was never charged against its
   quotas: it is checked now, at its share on the nodes it holds, and a job that breaks a
   quota so is requeued (it waits, and starts again within its quotas).
2. *Admit* (in order, repeated until nothing more starts): a waiting job whose min (rounded
   up to its step) is within its quotas takes free nodes, then nodes reclaimed from others:
   nodes borrowed over a quota (from any job), then nodes lent above min by jobs of no
   higher priority (the last in the order first; a min comes before anyone's extra nodes,
   whoever came first), never below their min and leaving a multiple of their step (given
   up from their largest shares, so that their charge does not rise).  A job's nodes are
   cleared the cheapest first or, where that leaves one no lender can clear, the costliest
   first.  A waiting job may, last, preempt ``preemptible`` jobs later in the order (they wait
   again).  A job that started, was resized or preempted less than ``min_run_time`` ago
   yields nothing it runs on.  A running job that lost nodes below its min is topped up the
   same way (a failure is not delayed), or keeps what it has.  A waiting job that cannot
   start reserves the room it could use: later waiting jobs start only on what it cannot
   use (reason Priority when the reservation is all that stops them), so a large job is not
   starved by a stream of small ones, while growth (3) may still use that room (it is lent,
   so the reserving job reclaims it once it fits).
3. *Grow*: free room goes to running jobs below max, in order, a multiple of step at a
   time, at most once per ``resize_interval`` per job (a job admitted now may start above
   its min).

Admit and grow repeat until neither moves anything: growth may make a node that a job just
admitted took (and a waiting job needs) a lent one, which the next walk reclaims.  So the
allocation is a fixed point: given back as the jobs' current nodes, it moves nothing.

*Bounded*: each walk tries to place at most ``look_ahead`` waiting jobs that then do not
fit (Slurm's ``bf_max_job_test``); the waiting jobs after them are not placed, only
summed up (``later``: they wait behind those, reason Priority).  A job held, too large for
the cluster or over a quota costs next to nothing to judge and is not counted.  So a plan
costs the running jobs and the look-ahead, not the length of the queue.

Quotas count each admitted job's min: its guaranteed nodes at its share on the nodes it
holds (a job sized by the node, ``--nproc-per-node gpu``, is charged the GPUs of the node it
lands on, and lands only where that is within its quotas); nodes beyond it in use over a
quota are *borrowed*, and reclaimed first.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping

from elasticd.core import fairshare
from elasticd.core.allocation import (
    Allocation,
    JobDemand,
    NodeCapacity,
    Policy,
    Quota,
    Share,
    Tally,
    Waiting,
    WaitReason,
)
from elasticd.core.ledger import QUOTAS, Ledger

__all__ = [
    "LOOK_AHEAD",
    "Allocation",
    "JobDemand",
    "NodeCapacity",
    "Policy",
    "Quota",
    "Share",
    "Tally",
    "WaitReason",
    "Waiting",
    "allocate",
    "order",
]

LOOK_AHEAD = 128  # waiting jobs tried (and not fitting) per walk; the rest wait behind them
_LISTED = 4  # waiting jobs listed with their reason: at most this many times the look-ahead


def order(jobs: Iterable[JobDemand], policy: Policy, usage: Mapping[str, float]) -> list[JobDemand]:
    """Priority (higher first), then fair share (higher first), then age (seq, then id).
    Jobs are grouped by priority and account, the groups of one priority and factor merged,
    and each level sorted by age: thousands of jobs cost a pass and sorts by plain
    attributes, not a sort by a computed key (half the time)."""
    groups: dict[tuple[int, str], list[JobDemand]] = {}
    for job in jobs:
        groups.setdefault((job.priority, job.account), []).append(job)
    fair = fairshare.factor(usage, policy.account_shares, {a for _, a in groups})
    levels: dict[tuple[int, float], list[JobDemand]] = {}
    for (priority, account), members in groups.items():
        levels.setdefault((priority, fair[account]), []).extend(members)
    ranked: list[JobDemand] = []
    for level in sorted(levels, key=lambda k: (-k[0], -k[1])):
        ranked += sorted(levels[level], key=_age)
    return ranked


_age = operator.attrgetter("seq", "id")


def factors(
    jobs: Iterable[JobDemand], policy: Policy, usage: Mapping[str, float]
) -> dict[str, float]:
    """The fair-share factor of every account of ``jobs`` (and of ``usage``)."""
    return fairshare.factor(usage, policy.account_shares, {j.account for j in jobs})


def allocate(
    nodes: Mapping[str, NodeCapacity],
    jobs: Iterable[JobDemand],
    policy: Policy,
    usage: Mapping[str, float],
    now: float,
    *,
    look_ahead: int = LOOK_AHEAD,
) -> Allocation:
    """Each job's nodes (see the module's docstring).  ``usage``: decayed node-seconds per
    account; ``now``: the time ``last_grown`` and ``last_moved`` are measured against."""
    ranked = order(jobs, policy, usage)
    ledger = Ledger(
        {n: (c.slots, c.gpus) for n, c in nodes.items() if c.usable}, ranked, policy, now
    )
    dropped, requeued = _keep(ledger, ranked)
    kept = {j: frozenset(h) for j, h in ledger.held.items()}
    added: dict[str, set[str]] = {}
    eligible: dict[int, int] = {}
    waiting: tuple[Waiting, ...] = ()
    later: tuple[str, ...] = ()
    started: set[str] = set()
    for _ in range(2 * len(ranked) + 2):
        waiting, later, moved = _walk(ledger, ranked, nodes, eligible, max(look_ahead, 1))
        started = {j for j in ledger.held if j not in kept or j in ledger.preempted}
        grew = _grow(ledger, policy, now, started, added)
        if not (moved or grew):
            break
    held = {j: frozenset(ledger.held[j]) for j in sorted(ledger.held)}
    preempted = (ledger.preempted & kept.keys()) | requeued
    return Allocation(
        nodes=held,
        waiting=waiting,
        order=tuple(j.id for j in ranked),
        started=frozenset(started),
        preempted=frozenset(preempted),
        grown=_net(
            {j: held.get(j, frozenset()) & a - kept.get(j, frozenset()) for j, a in added.items()}
        ),
        reclaimed=_net(
            {j: k - held.get(j, frozenset()) for j, k in kept.items() if j not in ledger.preempted}
        ),
        dropped=dropped,
        borrowing=frozenset(j for j in ledger.held if ledger.borrowing(ledger.jobs[j])),
        later=later,
        moved=frozenset(j for j in held.keys() | kept.keys() if held.get(j) != kept.get(j)).union(
            preempted
        ),
        forced={j: n for j, n in sorted(ledger.forced.items()) if n > 0 and j in held},
    )


def _net(sets: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    return {j: s for j, s in sorted(sets.items()) if s}


# -- 1. keep ---------------------------------------------------------------------------------


def _keep(ledger: Ledger, ranked: list[JobDemand]) -> tuple[dict[str, frozenset[str]], set[str]]:
    """Every running job keeps what it may; returns what each lost, and the jobs requeued
    because, placed first come, they hold more than their quotas allow."""
    dropped: dict[str, frozenset[str]] = {}
    requeued: set[str] = set()
    for job in [j for j in ranked if j.current]:
        for node in sorted(job.current):
            if len(ledger.holding(job.id)) < job.max_nodes and ledger.fits(job, node):
                ledger.take(job, node)
        if not job.scheduled and ledger.holding(job.id) and ledger.over_quota(job, (0, 0, 0)):
            for node in sorted(ledger.holding(job.id)):
                ledger.give(job.id, node)
            requeued.add(job.id)
        lost = job.current - ledger.holding(job.id)
        if lost:
            dropped[job.id] = frozenset(lost)
    return dropped, requeued


# -- 2. admit --------------------------------------------------------------------------------


def _walk(
    ledger: Ledger,
    ranked: list[JobDemand],
    nodes: Mapping[str, NodeCapacity],
    eligible: dict[int, int],
    look_ahead: int,
) -> tuple[tuple[Waiting, ...], tuple[str, ...], bool]:
    """One walk of the order: the jobs left waiting (listed, and beyond the look-ahead),
    and whether any job took nodes."""
    ledger.reserved.clear()
    waiting: list[Waiting] = []
    later: list[str] = []
    moved = False
    tried = 0
    for at, job in enumerate(ranked):
        if tried >= look_ahead:  # the rest: running jobs are topped up, waiting ones wait
            held = ledger.held
            rest = ranked[at:]
            later = [j.id for j in rest if j.id not in held]
            for job in [j for j in rest if j.id in held]:
                moved = _admit_one(ledger, job, nodes, eligible) is True or moved
            break
        outcome = _admit_one(ledger, job, nodes, eligible)
        if isinstance(outcome, WaitReason):
            if outcome in (WaitReason.RESOURCES, WaitReason.PRIORITY):
                tried += 1
            if len(waiting) < _LISTED * look_ahead:
                waiting.append(Waiting(job.id, outcome))
            else:
                later.append(job.id)
        moved = moved or outcome is True
    return tuple(waiting), tuple(later), moved


def _admit_one(
    ledger: Ledger, job: JobDemand, nodes: Mapping[str, NodeCapacity], eligible: dict[int, int]
) -> WaitReason | bool | None:
    """A reason it waits; True if it took nodes; None if it runs on as it is."""
    have = ledger.holding(job.id)
    if len(have) >= job.need:
        return None
    if have:
        return None if job.held else _top_up(ledger, job)
    if job.held:
        return WaitReason.HELD
    if job.need > job.top or _eligible_anywhere(job, nodes, eligible) < job.need:
        return WaitReason.SIZE
    return _start(ledger, job)


def _eligible_anywhere(
    job: JobDemand, nodes: Mapping[str, NodeCapacity], known: dict[int, int]
) -> int:
    """How many of the cluster's nodes could hold a share of ``job`` were they idle (jobs
    of one shape share their ``shares``: counted once)."""
    count = known.get(id(job.shares))
    if count is None:
        count = known[id(job.shares)] = sum(
            1
            for n, c in nodes.items()
            if n in job.shares and job.shares[n].slots <= c.slots and job.shares[n].gpus <= c.gpus
        )
    return count


def _top_up(ledger: Ledger, job: JobDemand) -> bool:
    """A running job below its min (it lost nodes) gets back to it if it can, at once,
    within its quotas."""
    more = job.need - len(ledger.holding(job.id))
    if _least_charge_over(ledger, job, more) is not None:
        return False
    return ledger.plan(job, more, reservations=False, preempt=False, quotas=QUOTAS)


def _start(ledger: Ledger, job: JobDemand) -> WaitReason | bool:
    reason = _least_charge_over(ledger, job, job.need)
    if reason is not None:
        return reason
    budget = ledger.headroom(job)
    if ledger.plan(job, job.need, reservations=True, preempt=True, quotas=QUOTAS):
        return True
    if ledger.plan(job, job.need, reservations=False, preempt=True, quotas=QUOTAS, keep=False):
        ledger.reserve(job, budget)
        return WaitReason.PRIORITY
    if ledger.plan(job, job.need, reservations=False, preempt=True, keep=False):
        return _quota_it_breaks(ledger, job)  # it would fit, but only where quotas forbid
    ledger.reserve(job, budget)
    return WaitReason.RESOURCES


def _least_charge_over(ledger: Ledger, job: JobDemand, more: int) -> WaitReason | None:
    """The quota ``job`` would break with ``more`` nodes even at its smallest share (None:
    within every limit so; its real charge is its share where it lands)."""
    slots, gpus = ledger.smallest(job)
    return ledger.over_quota(job, (more, more * slots, more * gpus))


def _quota_it_breaks(ledger: Ledger, job: JobDemand) -> WaitReason:
    """The quota a job breaks wherever it could start now: its user's, unless it could
    start within those (then its account's)."""
    if ledger.plan(job, job.need, reservations=False, preempt=True, quotas=("user",), keep=False):
        return WaitReason.QUOTA_ACCOUNT
    return WaitReason.QUOTA_USER


# -- 3. grow ---------------------------------------------------------------------------------


def _grow(
    ledger: Ledger, policy: Policy, now: float, started: set[str], added: dict[str, set[str]]
) -> bool:
    """Give free room to the jobs due to grow, in order; whether any grew (into ``added``)."""
    grew = False
    for job_id in sorted(ledger.held, key=ledger.rank.__getitem__):
        job = ledger.jobs[job_id]
        have = ledger.holding(job_id)
        if len(have) < job.need or job.held or not (job_id in started or _due(job, policy, now)):
            continue  # below its min it is topped up (admission, within quotas) or not at all
        if len(have) >= job.top:
            continue
        room = [n for n in ledger.candidates(job) if ledger.fits(job, n)]
        target = min(job.top, (len(have) + len(room)) // job.step * job.step)
        if target <= len(have):
            continue
        picks = sorted(room, key=lambda n: ledger.growth_rank(job, n))[: target - len(have)]
        for node in picks:
            ledger.take(job, node)
        added.setdefault(job_id, set()).update(picks)
        grew = True
    return grew


def _due(job: JobDemand, policy: Policy, now: float) -> bool:
    return job.last_grown is None or now - job.last_grown >= policy.resize_interval
