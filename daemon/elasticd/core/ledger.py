"""The allocator's ledger: the cluster as the allocator fills it, what each job
holds and what each usable node has left, and how to clear room on a node for a job.
Private to ``allocator.py``; mutable, but only ever inside one ``allocate`` call.  A trial
placement (``plan``) works on the ledger itself and is either kept or rolled back from its
undo log: no copy of the cluster per waiting job.

Who yields a node to a job, first to last (``Ledger.clearing``): a job borrowing over a quota
(any job: borrowed room is reclaimed first), then a job of no higher priority with nodes
lent above its min (the last in the order first: mins come before anyone's extra nodes,
whoever was first), and, last, a ``preemptible`` job later in the order below its min (it
is preempted).  A job that started, was resized or was preempted less than the policy's
``min_run_time`` ago yields none of the nodes it runs on (a node given to it in this very
allocation moves no worker: that one it may give back).  Among nodes, the one cheapest to
clear: free room first, then the fewest nodes taken that a job held before this allocation,
the fewest and lowest-ordered jobs moved, then the tightest fit (whole nodes stay whole for
larger shares), then the name.

What the ledger keeps as it goes, so that no question costs a walk over every job: the
nodes with a free slot, the jobs that could yield a node (above their min, or
preemptible) and the nodes they hold, and each user's and account's tallies (what their
admitted mins are charged, and what they hold).

Quotas count what a job holds on the nodes it holds: its min (its guaranteed nodes, the
smallest of its shares on the nodes it holds) at its share *there*, so that a job sized by
the node (``--nproc-per-node gpu``) is charged the GPUs of the node it lands on.  So a job
that yields its cheapest node is charged more after: a placement counts its victims' rises
against their owners' limits, together, and against the placed job's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from elasticd.core.allocation import JobDemand, Policy, Share, Tally, WaitReason

QUOTAS = ("user", "account")  # the kinds of owner whose limits a placement keeps
BORROWED, LENT, PREEMPT = 1, 2, 3  # how a job yields a node (lower yields first)
UNLIMITED = 1 << 62
_NONE: frozenset[str] = frozenset()
_ZERO = (0, 0, 0)
# What clearing a node costs, cheapest first: the worst way a victim yields, the victims that
# held it before, how many victims, their negated ranks, the gpus and slots left over.
Cost = tuple[int, int, int, tuple[int, ...], int, int]


class Ledger:
    def __init__(
        self,
        capacity: dict[str, tuple[int, int]],
        ranked: Sequence[JobDemand],
        policy: Policy,
        now: float,
    ) -> None:
        self.capacity = capacity  # usable node -> (slots, gpus)
        self.policy = policy
        self.now = now
        self.jobs = {j.id: j for j in ranked}
        self.rank = {j.id: i for i, j in enumerate(ranked)}
        self.held: dict[str, set[str]] = {}  # only jobs that hold a node
        self.on: dict[str, set[str]] = {n: set() for n in capacity}  # node -> jobs on it
        self.used: dict[str, list[int]] = {n: [0, 0] for n in capacity}
        self.reserved: dict[str, list[int]] = {}  # node -> room kept for waiting jobs
        self.preempted: set[str] = set()
        self.forced: dict[str, int] = {}  # job -> nodes it took from running jobs
        self.open = {n for n, (slots, _) in capacity.items() if slots > 0}  # a slot free
        self.yielders: set[str] = set()  # jobs above their min, or preemptible ones holding
        self.yielding_on: dict[str, int] = {}  # node -> yielders on it
        self.charged: dict[tuple[str, str], list[int]] = {}  # (kind, owner) -> its jobs' mins
        self.in_use: dict[tuple[str, str], list[int]] = {}  # (kind, owner) -> all they hold
        self.charges: dict[str, tuple[int, int, int]] = {}  # job -> its min's charge
        self._undo: list[Callable[[], None]] | None = None
        self._eligible: dict[int, list[str]] = {}  # id(shares) -> usable eligible nodes
        self._smallest: dict[int, tuple[int, int]] = {}  # id(shares) -> least (slots, gpus)

    # -- what a job may use ----------------------------------------------------------------

    def holding(self, job_id: str) -> set[str] | frozenset[str]:
        return self.held.get(job_id, _NONE)

    def nodes_for(self, job: JobDemand) -> list[str]:
        """The usable nodes ``job`` may run on, by name."""
        key = id(job.shares)
        found = self._eligible.get(key)
        if found is None:
            found = self._eligible[key] = sorted(n for n in job.shares if n in self.capacity)
        return found

    def smallest(self, job: JobDemand) -> tuple[int, int]:
        """The least slots and the least GPUs of ``job``'s shares on usable nodes."""
        key = id(job.shares)
        found = self._smallest.get(key)
        if found is None:
            shares = [job.shares[n] for n in self.nodes_for(job)]
            found = self._smallest[key] = (
                min((s.slots for s in shares), default=0),
                min((s.gpus for s in shares), default=0),
            )
        return found

    def candidates(self, job: JobDemand) -> list[str]:
        """The usable nodes ``job`` may run on and does not hold, that have a free slot or
        hold a job that might yield: no other node can be cleared for it."""
        have, shares = self.holding(job.id), job.shares
        found = [n for n in self.open if n in shares and n not in have]
        found += [
            n for n in self.yielding_on if n in shares and n not in have and n not in self.open
        ]
        return found

    def room(self, node: str, reservations: bool = False) -> tuple[int, int]:
        slots, gpus = self.capacity[node]
        used = self.used[node]
        kept = self.reserved.get(node, (0, 0)) if reservations else (0, 0)
        return slots - used[0] - kept[0], gpus - used[1] - kept[1]

    def fits(self, job: JobDemand, node: str, reservations: bool = False) -> bool:
        if node not in self.capacity or node not in job.shares:
            return False
        return _covers(self.room(node, reservations), job.shares[node])

    # -- moves (each undone in a trial that fails) ------------------------------------------

    def take(self, job: JobDemand, node: str) -> None:
        share = job.shares[node]
        held = self.held.get(job.id)
        if held is None:
            held = self.held[job.id] = set()
        held.add(node)
        self.on[node].add(job.id)
        used = self.used[node]
        used[0] += share.slots
        used[1] += share.gpus
        if used[0] >= self.capacity[node][0]:
            self.open.discard(node)
        self._count(job, share, 1)
        if job.id in self.yielders:
            self.yielding_on[node] = self.yielding_on.get(node, 0) + 1
        self._restate(job)
        if self._undo is not None:
            self._undo.append(lambda: self.give(job.id, node))

    def give(self, job_id: str, node: str) -> None:
        job = self.jobs[job_id]
        share = job.shares[node]
        held = self.held[job_id]
        held.discard(node)
        if not held:
            del self.held[job_id]
        self.on[node].discard(job_id)
        used = self.used[node]
        used[0] -= share.slots
        used[1] -= share.gpus
        if used[0] < self.capacity[node][0]:
            self.open.add(node)
        self._count(job, share, -1)
        if job_id in self.yielders:
            self._unyield(node)
        self._restate(job)
        if self._undo is not None:
            self._undo.append(lambda: self.take(job, node))

    def preempt(self, job_id: str) -> None:
        if job_id in self.preempted:  # preempted before (and since started again): stays so
            return
        self.preempted.add(job_id)
        if self._undo is not None:
            self._undo.append(lambda: self.preempted.discard(job_id))

    def _force(self, job_id: str, nodes: int) -> None:
        if not nodes:
            return
        self.forced[job_id] = self.forced.get(job_id, 0) + nodes
        if self._undo is not None:
            self._undo.append(lambda: self._force(job_id, -nodes))

    def _count(self, job: JobDemand, share: Share, sign: int) -> None:
        for key in (("user", job.user), ("account", job.account)):
            tally = self.in_use.setdefault(key, [0, 0, 0])
            tally[0] += sign
            tally[1] += sign * share.slots
            tally[2] += sign * share.gpus

    def _restate(self, job: JobDemand) -> None:
        """``job``'s charge and whether it may yield, after its nodes changed."""
        held = self.held.get(job.id, _NONE)
        charge = self.charge(job, held)
        before = self.charges.get(job.id, _ZERO)
        if charge != before:
            self.charges[job.id] = charge
            for key in (("user", job.user), ("account", job.account)):
                tally = self.charged.setdefault(key, [0, 0, 0])
                for i in range(3):
                    tally[i] += charge[i] - before[i]
        yields = len(held) > job.need or (job.preemptible and bool(held))
        if yields and job.id not in self.yielders:
            self.yielders.add(job.id)
            for node in held:
                self.yielding_on[node] = self.yielding_on.get(node, 0) + 1
        elif not yields and job.id in self.yielders:
            self.yielders.discard(job.id)
            for node in held:
                self._unyield(node)

    def _unyield(self, node: str) -> None:
        left = self.yielding_on[node] - 1
        if left:
            self.yielding_on[node] = left
        else:
            del self.yielding_on[node]

    # -- quotas ------------------------------------------------------------------------------

    def charge(self, job: JobDemand, held: Iterable[str]) -> tuple[int, int, int]:
        """What ``job`` holding ``held`` counts against its quotas: its guaranteed nodes (as
        many as it holds, up to its min), each kind at the smallest of its shares there:
        (nodes, slots, GPUs).  Each kind on its own, so that a node more never raises the
        charge (a job admitted within its quotas stays within them as it grows; the order of
        two kinds would not: a node of fewer GPUs but more slots would)."""
        shares = [job.shares[n] for n in held]
        slots = sorted(share.slots for share in shares)[: job.need]
        gpus = sorted(share.gpus for share in shares)[: job.need]
        return len(slots), sum(slots), sum(gpus)

    def headroom(
        self,
        job: JobDemand,
        kinds: Iterable[str] = QUOTAS,
        rises: dict[tuple[str, str], list[int]] | None = None,
    ) -> list[int]:
        """What ``job``'s user and account (``kinds``) may still be charged: [nodes, slots,
        GPUs]; after their charges rise by ``rises``, if given."""
        left = [UNLIMITED] * 3
        for limits, _, kind in self.policy.limits(job):
            if kind not in kinds:
                continue
            key = (kind, getattr(job, kind))
            used = self.charged.get(key, _ZERO)
            more = rises.get(key, _ZERO) if rises else _ZERO
            for i, limit in enumerate((limits.nodes, limits.slots, limits.gpus)):
                if limit is not None:
                    left[i] = min(left[i], limit - used[i] - more[i])
        return left

    def over_quota(self, job: JobDemand, more: tuple[int, int, int]) -> WaitReason | None:
        """The quota ``job``'s user or account would break if charged ``more`` (None: none)."""
        for limits, reason, kind in self.policy.limits(job):
            used = self.charged.get((kind, getattr(job, kind)), _ZERO)
            if limits.exceeded_by(Tally(*(u + m for u, m in zip(used, more, strict=True)))):
                return reason
        return None

    def borrowing(self, job: JobDemand) -> bool:
        """Whether ``job`` holds nodes above its min while its user or account holds more
        than a limit allows: those nodes are borrowed."""
        if len(self.holding(job.id)) <= job.need:
            return False
        for limits, _, kind in self.policy.limits(job):
            if limits.exceeded_by(Tally(*self.in_use.get((kind, getattr(job, kind)), _ZERO))):
                return True
        return False

    # -- clearing room for a job -------------------------------------------------------------

    def plan(
        self,
        job: JobDemand,
        count: int,
        *,
        reservations: bool,
        preempt: bool,
        quotas: tuple[str, ...] = (),
        keep: bool = True,
    ) -> bool:
        """Give ``job`` ``count`` more nodes, each the cheapest to clear, within the limits
        of the ``quotas`` kinds ("user", "account") of its owners; False (and nothing
        changed) if there are not that many.  ``keep=False``: only say whether it could.
        Whatever ``quotas`` says, no job that yields a node is left over its own.

        Cheapest first may fail where the nodes could be cleared in another order: a victim
        that yielded a cheap node is at its min, and a later node only it could clear cannot
        be.  Then the ``count`` nodes cheapest to clear at the start are tried again, the
        costliest first (so the allocation is a fixed point: given its own output, whose
        extra nodes are then the victims' current ones, it would start the job)."""
        self._undo = []
        try:
            done, yielded = self._fill(job, count, reservations, preempt, quotas)
            if not done and yielded:
                self._roll_back()
                ranked = sorted(self._ways(job, reservations, preempt, quotas, count))
                if len(ranked) >= count:
                    hardest = {node for _, node, _ in ranked[:count]}
                    done, _ = self._fill(job, count, reservations, preempt, quotas, hardest)
        finally:
            log, self._undo = self._undo, None
        if not (done and keep):
            for undo in reversed(log):
                undo()
        return done

    def _roll_back(self) -> None:
        """Undo the trial's moves so far; it goes on, from an empty log."""
        log, self._undo = self._undo or [], None
        for undo in reversed(log):
            undo()
        self._undo = []

    def _fill(
        self,
        job: JobDemand,
        count: int,
        reservations: bool,
        preempt: bool,
        quotas: tuple[str, ...],
        hardest: set[str] | None = None,
    ) -> tuple[bool, bool]:
        """Take ``count`` nodes, each the cheapest to clear at its turn (of ``hardest``, if
        given: each the costliest); whether it did, and whether any job yielded a node."""
        if len(self.candidates(job)) < count:
            return False, False
        touched: set[str] = set()
        forced = 0
        for picked in range(count):
            ways = self._ways(job, reservations, preempt, quotas, count - picked, hardest)
            best = max(ways, default=None) if hardest else min(ways, default=None)
            if best is None:
                return False, bool(touched)
            _, node, victims = best
            for victim in victims:
                forced += node in self.jobs[victim].current
                self.give(victim, node)
            touched.update(victims)
            self.take(job, node)
        for victim in sorted(touched):
            settled = self._settle(victim)
            if settled is None:
                return False, True
            forced += settled
        self._force(job.id, forced)
        return True, bool(touched)

    def _ways(
        self,
        job: JobDemand,
        reservations: bool,
        preempt: bool,
        quotas: tuple[str, ...],
        picks: int,
        among: set[str] | None = None,
    ) -> Iterator[tuple[Cost, str, tuple[str, ...]]]:
        """Each node ``job`` could be given now (of ``among``, if given) whose share, and
        ``picks - 1`` more of its smallest, fit its ``quotas`` (after what its victims'
        charges rise by): what clearing it costs, and who yields it."""
        least = self.smallest(job)
        left = self.headroom(job, quotas) if quotas else None
        for node in self.candidates(job):
            if among is not None and node not in among:
                continue
            if left is not None and not _within(job.shares[node], left, picks, least):
                continue
            found = self.clearing(job, node, reservations, preempt)
            if found is None:
                continue
            cost, victims = found
            if victims:
                rises = self._rises(victims, node)
                if not self._victims_within(victims, rises):
                    continue
                after = self.headroom(job, quotas, rises) if quotas else None
                if after is not None and not _within(job.shares[node], after, picks, least):
                    continue
            yield cost, node, victims

    def clearing(
        self, job: JobDemand, node: str, reservations: bool, preempt: bool
    ) -> tuple[Cost, tuple[str, ...]] | None:
        """What giving ``node`` to ``job`` costs and who must yield it, or None if it cannot
        be cleared."""
        if node not in self.capacity or node not in job.shares:
            return None
        share = job.shares[node]
        room = self.room(node, reservations)
        if _covers(room, share):
            left = _plus(room, _minus(share))
            return (0, 0, 0, (), left[1], left[0]), ()
        ways = sorted(
            (how, -self.rank[v], v)
            for v in self.on[node]
            if v != job.id and (how := self._yields(job, v, preempt, node)) is not None
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

    def _yields(self, job: JobDemand, victim_id: str, preempt: bool, node: str) -> int | None:
        """How ``victim`` may yield ``node`` to ``job``, or None if it may not."""
        victim = self.jobs[victim_id]
        held = len(self.held[victim_id])
        settled = self.settled(victim)
        if (
            held > victim.need
            and (settled or node not in victim.current)
            and self._charge_holds(victim, node)
        ):
            if self.borrowing(victim):
                return BORROWED
            if victim.priority <= job.priority:
                return LENT
        if (
            preempt
            and victim.preemptible
            and held <= victim.need
            and self.rank[victim_id] > self.rank[job.id]
            and (settled or not victim.current & self.held[victim_id])
        ):
            return PREEMPT
        return None

    def _rises(self, victims: Iterable[str], node: str) -> dict[tuple[str, str], list[int]]:
        """How much the charges of the victims' users and accounts rise (or fall) when they
        give up ``node``."""
        rises: dict[tuple[str, str], list[int]] = {}
        for victim_id in victims:
            victim = self.jobs[victim_id]
            before = self.charges.get(victim_id, _ZERO)
            after = self.charge(victim, self.held[victim_id] - {node})
            for key in (("user", victim.user), ("account", victim.account)):
                tally = rises.setdefault(key, [0, 0, 0])
                for i in range(3):
                    tally[i] += after[i] - before[i]
        return rises

    def _victims_within(
        self, victims: Sequence[str], rises: dict[tuple[str, str], list[int]]
    ) -> bool:
        """Whether the victims stay within their own quotas after their charges rise by
        ``rises`` (each alone was checked as it was chosen; two of one user may not be)."""
        if len(victims) < 2:
            return True
        for victim_id in victims:
            victim = self.jobs[victim_id]
            for limits, _, kind in self.policy.limits(victim):
                key = (kind, getattr(victim, kind))
                more = rises[key]
                used = self.charged.get(key, _ZERO)
                if any(m > 0 for m in more) and limits.exceeded_by(
                    Tally(*(u + m for u, m in zip(used, more, strict=True)))
                ):
                    return False
        return True

    def _charge_holds(self, victim: JobDemand, *nodes: str) -> bool:
        """Whether ``victim`` stays within its quotas without ``nodes``: its charge is at its
        smallest shares, so giving back a node of small shares may raise it (a job admitted
        on a small node and grown onto a big one would be left on the big one, over them)."""
        before = self.charges.get(victim.id, _ZERO)
        after = self.charge(victim, self.held[victim.id].difference(nodes))
        more = (after[0] - before[0], after[1] - before[1], after[2] - before[2])
        return all(m <= 0 for m in more) or self.over_quota(victim, more) is None

    def settled(self, job: JobDemand) -> bool:
        """Whether ``job`` has run ``min_run_time`` since its last start, resize or
        preemption (it may be disturbed again)."""
        return job.last_moved is None or self.now - job.last_moved >= self.policy.min_run_time

    def _settle(self, victim_id: str) -> int | None:
        """A job that yielded nodes: below its min it is preempted (it gives up all); else
        it gives up more, if it must, to hold a multiple of its step: those of its largest
        shares, so that its charge (its smallest) rises the least.  Returns how many of the
        nodes it gave up here it ran on before this allocation; None if its charge would
        rise over a quota so (nothing given up then)."""
        victim = self.jobs[victim_id]
        shares = victim.shares
        held = sorted(
            self.holding(victim_id),
            key=lambda n: (shares[n].gpus, shares[n].slots, n),
            reverse=True,
        )
        if len(held) < victim.need:
            gone = held
            self.preempt(victim_id)
        else:
            gone = held[: len(held) % victim.step]
            if gone and not self._charge_holds(victim, *gone):
                return None
        for node in gone:
            self.give(victim_id, node)
        return sum(1 for node in gone if node in victim.current)

    def reserve(self, job: JobDemand, budget: Sequence[int] | None = None) -> None:
        """Keep for ``job`` (waiting, and it did not fit) every node it could use now (and,
        with a ``budget``, within its quotas)."""
        least = self.smallest(job)
        for node in self.candidates(job):
            if budget is not None and not _within(job.shares[node], budget, job.need, least):
                continue
            if self.clearing(job, node, reservations=True, preempt=False) is not None:
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


def _within(share: Share, left: Sequence[int], picks: int, least: tuple[int, int]) -> bool:
    """Whether ``share`` and ``picks - 1`` more of the smallest shares fit ``left``."""
    rest = picks - 1
    return (
        picks <= left[0]
        and share.slots + rest * least[0] <= left[1]
        and share.gpus + rest * least[1] <= left[2]
    )


def _covers(room: tuple[int, int], share: Share) -> bool:
    return room[0] >= share.slots and room[1] >= share.gpus


def _plus(room: tuple[int, int], share: Share) -> tuple[int, int]:
    return room[0] + share.slots, room[1] + share.gpus


def _minus(share: Share) -> Share:
    return Share(-share.slots, -share.gpus)
