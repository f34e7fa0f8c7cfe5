"""The allocator's ledger: the cluster as the allocator fills it, what each job
holds and what each usable node has left, and how to clear room on a node for a job.
Private to ``allocator.py``; mutable, but only ever inside one ``allocate`` call, and a
trial placement works on a copy (``plan``) that is adopted whole or dropped.

Who yields a node to a job, first to last (``Ledger.clearing``): a job borrowing over a quota
(any job: borrowed room is reclaimed first), then a job of no higher priority with nodes
lent above its min (the last in the order first: mins come before anyone's extra nodes,
whoever was first), and, last, a ``preemptible`` job later in the order below its min (it
is preempted).  Among nodes, the one cheapest to clear: free room
first, then the fewest nodes taken that a job held before this allocation (one given to it
in this very allocation moves no worker), the fewest and lowest-ordered jobs moved, then the
tightest fit (whole nodes
stay whole for larger shares), then the name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from elasticd.core.allocation import JobDemand, Policy, Share, Tally

BORROWED, LENT, PREEMPT = 1, 2, 3  # how a job yields a node (lower yields first)
# What clearing a node costs, cheapest first: the worst way a victim yields, the victims that
# held it before, how many victims, their negated ranks, the gpus and slots left over.
Cost = tuple[int, int, int, tuple[int, ...], int, int]


class Ledger:
    def __init__(self, capacity: dict[str, tuple[int, int]], ranked: Sequence[JobDemand]) -> None:
        self.capacity = capacity  # usable node -> (slots, gpus)
        self.jobs = {j.id: j for j in ranked}
        self.rank = {j.id: i for i, j in enumerate(ranked)}
        self.held: dict[str, set[str]] = {j.id: set() for j in ranked}
        self.on: dict[str, set[str]] = {n: set() for n in capacity}  # node -> jobs on it
        self.used: dict[str, list[int]] = {n: [0, 0] for n in capacity}
        self.reserved: dict[str, list[int]] = {}  # node -> room kept for waiting jobs
        self.preempted: set[str] = set()

    def copy(self) -> Ledger:
        other = Ledger.__new__(Ledger)
        other.capacity, other.jobs, other.rank = self.capacity, self.jobs, self.rank
        other.held = {j: set(h) for j, h in self.held.items()}
        other.on = {n: set(s) for n, s in self.on.items()}
        other.used = {n: list(u) for n, u in self.used.items()}
        other.reserved = {n: list(r) for n, r in self.reserved.items()}
        other.preempted = set(self.preempted)
        return other

    def adopt(self, other: Ledger) -> None:
        self.__dict__.update(other.__dict__)

    # -- room ------------------------------------------------------------------------------

    def nodes_for(self, job: JobDemand) -> list[str]:
        """The usable nodes ``job`` may run on, by name."""
        return sorted(n for n in job.shares if n in self.capacity)

    def room(self, node: str, reservations: bool = False) -> tuple[int, int]:
        slots, gpus = self.capacity[node]
        used = self.used[node]
        kept = self.reserved.get(node, (0, 0)) if reservations else (0, 0)
        return slots - used[0] - kept[0], gpus - used[1] - kept[1]

    def fits(self, job: JobDemand, node: str, reservations: bool = False) -> bool:
        if node not in self.capacity or node not in job.shares:
            return False
        return _covers(self.room(node, reservations), job.shares[node])

    def take(self, job: JobDemand, node: str) -> None:
        share = job.shares[node]
        self.held[job.id].add(node)
        self.on[node].add(job.id)
        self.used[node][0] += share.slots
        self.used[node][1] += share.gpus

    def give(self, job_id: str, node: str) -> None:
        share = self.jobs[job_id].shares[node]
        self.held[job_id].discard(node)
        self.on[node].discard(job_id)
        self.used[node][0] -= share.slots
        self.used[node][1] -= share.gpus

    def reserve(self, job: JobDemand, policy: Policy) -> None:
        """Keep for ``job`` (waiting, and it did not fit) every node it could use now."""
        for node in self.nodes_for(job):
            if self.clearing(job, node, policy, reservations=True, preempt=False) is not None:
                kept = self.reserved.setdefault(node, [0, 0])
                kept[0] += job.shares[node].slots
                kept[1] += job.shares[node].gpus

    def growth_rank(self, job: JobDemand, node: str) -> tuple[bool, int, int, str]:
        """Growth takes nodes no waiting job keeps first, then the tightest fit."""
        slots, gpus = self.room(node)
        share = job.shares[node]
        return (
            bool(self.reserved.get(node, [0, 0]) != [0, 0]),
            gpus - share.gpus,
            slots - share.slots,
            node,
        )

    # -- clearing room for a job -----------------------------------------------------------

    def plan(
        self, job: JobDemand, count: int, policy: Policy, *, reservations: bool, preempt: bool
    ) -> Ledger | None:
        """A copy of the ledger with ``count`` more nodes given to ``job``, each the cheapest
        to clear, or None if there are not that many."""
        trial = self.copy()
        touched: set[str] = set()
        for _ in range(count):
            best = trial._cheapest(job, policy, reservations, preempt)
            if best is None:
                return None
            node, victims = best
            for victim in victims:
                trial.give(victim, node)
            touched.update(victims)
            trial.take(job, node)
        for victim in sorted(touched):
            trial._settle(victim)
        return trial

    def _cheapest(
        self, job: JobDemand, policy: Policy, reservations: bool, preempt: bool
    ) -> tuple[str, tuple[str, ...]] | None:
        best: tuple[Cost, str, tuple[str, ...]] | None = None
        for node in self.nodes_for(job):
            if node in self.held[job.id]:
                continue
            found = self.clearing(job, node, policy, reservations, preempt)
            if found is not None and (best is None or (found[0], node) < (best[0], best[1])):
                best = (found[0], node, found[1])
        return None if best is None else (best[1], best[2])

    def clearing(
        self, job: JobDemand, node: str, policy: Policy, reservations: bool, preempt: bool
    ) -> tuple[Cost, tuple[str, ...]] | None:
        """What giving ``node`` to ``job`` costs and who must yield it, or None if it cannot
        be cleared."""
        if node not in self.capacity or node not in job.shares:
            return None
        share = job.shares[node]
        room = self.room(node, reservations)
        ways = sorted(
            (how, -self.rank[v], v)
            for v in self.on[node]
            if v != job.id and (how := self._yields(job, v, policy, preempt)) is not None
        )
        victims: list[tuple[int, int, str]] = []
        for way in ways:
            if _covers(room, share):
                break
            victims.append(way)
            room = _plus(room, self.jobs[way[2]].shares[node])
        if not _covers(room, share):
            return None
        victims = self._needed(victims, room, share, node)
        left = _plus(room, _minus(share))
        moved = sum(1 for _, _, v in victims if node in self.jobs[v].current)
        cost = (
            max((w for w, _, _ in victims), default=0),
            moved,
            len(victims),
            tuple(sorted(r for _, r, _ in victims)),
            left[1],
            left[0],
        )
        return cost, tuple(v for _, _, v in victims)

    def _needed(
        self, victims: list[tuple[int, int, str]], room: tuple[int, int], share: Share, node: str
    ) -> list[tuple[int, int, str]]:
        """Drop the victims (first yielders first) whose room is not needed after all."""
        kept = list(victims)
        for way in victims:
            without = _plus(room, _minus(self.jobs[way[2]].shares[node]))
            if _covers(without, share):
                kept.remove(way)
                room = without
        return kept

    def _yields(self, job: JobDemand, victim_id: str, policy: Policy, preempt: bool) -> int | None:
        """How ``victim`` may yield a node to ``job``, or None if it may not."""
        victim = self.jobs[victim_id]
        later = self.rank[victim_id] > self.rank[job.id]
        if len(self.held[victim_id]) > victim.need:
            if borrowing(self, victim, policy):
                return BORROWED
            if victim.priority <= job.priority:
                return LENT
        if preempt and later and victim.preemptible and len(self.held[victim_id]) <= victim.need:
            return PREEMPT
        return None

    def _settle(self, victim_id: str) -> None:
        """A job that yielded nodes: below its min it is preempted (it gives up all); else
        it gives up more, if it must, to hold a multiple of its step."""
        victim = self.jobs[victim_id]
        held = sorted(self.held[victim_id], reverse=True)
        if len(held) < victim.need:
            for node in held:
                self.give(victim_id, node)
            self.preempted.add(victim_id)
            return
        extra = len(held) % victim.step
        for node in held[:extra]:
            self.give(victim_id, node)


# -- quotas ----------------------------------------------------------------------------------


def charge(ledger: Ledger, job: JobDemand, count: int | None = None) -> Tally:
    """What ``job`` counts against its quotas: its guaranteed nodes (``count``, by default
    as many as it holds up to its min) at its smallest share."""
    if count is None:
        count = len(ledger.held[job.id])
    count = min(count, job.need)
    if not job.shares or count <= 0:
        return Tally()
    return Tally(
        count,
        count * min(s.slots for s in job.shares.values()),
        count * min(s.gpus for s in job.shares.values()),
    )


def in_use(ledger: Ledger, jobs: Iterable[JobDemand]) -> Tally:
    """What ``jobs`` hold, every node at its share."""
    total = Tally()
    for job in jobs:
        for node in ledger.held[job.id]:
            share = job.shares[node]
            total += Tally(1, share.slots, share.gpus)
    return total


def borrowing(ledger: Ledger, job: JobDemand, policy: Policy) -> bool:
    """Whether ``job`` holds nodes above its min while its user or account is over a
    limit: those nodes are borrowed."""
    if len(ledger.held[job.id]) <= job.need:
        return False
    for limits, _, kind in policy.limits(job):
        owner = getattr(job, kind)
        if limits.exceeded_by(
            in_use(ledger, (j for j in ledger.jobs.values() if getattr(j, kind) == owner))
        ):
            return True
    return False


def _covers(room: tuple[int, int], share: Share) -> bool:
    return room[0] >= share.slots and room[1] >= share.gpus


def _plus(room: tuple[int, int], share: Share) -> tuple[int, int]:
    return room[0] + share.slots, room[1] + share.gpus


def _minus(share: Share) -> Share:
    return Share(-share.slots, -share.gpus)
