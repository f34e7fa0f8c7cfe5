"""An in-place part's pool of worker slots, as pure data and pure functions.

A slot is a local rank.  In an ``--in-place`` job its worker process outlives rounds: it is
started (WARMING), asks for its place in a round (READY), is placed in one (PLACED), and its
process's end makes the slot EMPTY again.  Every move goes through SLOT_STATES.  A worker's
*place* is its rank in a round; nothing else in the part is called a place.

The functions below build the worker groups the shell carries out: the standby pool (every
slot, none placed), the group of a round (``round_group``), the pool once a round placed it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from elasticd.core.model import Failure, StateTable, Worker, WorkerGroup, WorkerState
from elasticd.rendezvous import Reason, RendezvousInfo

# Rounds after which spares fill the world size back to what it was before.
LOSSES = frozenset({Reason.FAILURE, Reason.NODE_LOST, Reason.LATE_EXIT})
# Rounds whose previous group lost a member: its survivors must abort their collectives.
ABORTING = frozenset(
    {
        Reason.FAILURE,
        Reason.LATE_EXIT,
        Reason.NODE_LOST,
        Reason.DRAIN,
        Reason.SHUTDOWN,
        Reason.RECLAIM,
        Reason.STALLED,
    }
)
ROUND_ENV = "ELASTICD_ROUND"


class SlotState(enum.StrEnum):
    EMPTY = "empty"  # no process
    WARMING = "warming"  # started, has not asked for a place
    READY = "ready"  # asked for a place
    PLACED = "placed"  # in a round


SLOT_STATES = StateTable(
    "an in-place slot",
    {
        SlotState.EMPTY: (SlotState.WARMING, SlotState.PLACED),  # PLACED: a first round's worker
        SlotState.WARMING: (SlotState.READY, SlotState.EMPTY),
        SlotState.READY: (SlotState.PLACED, SlotState.EMPTY),
        # READY: a spare that filled in steps back
        SlotState.PLACED: (SlotState.EMPTY, SlotState.READY),
    },
)


def keeps_workers(reason: Reason) -> bool:
    """Whether an in-place job's workers live on into a round opened for ``reason``."""
    return reason is not Reason.STALLED


def aborts(reason: Reason) -> bool:
    """Whether the survivors' group must be aborted at once: someone in it is gone."""
    return reason in ABORTING


@dataclass(frozen=True)
class Notice:
    abort: bool  # a member of the previous round is missing or has fewer workers
    added: bool  # a node is new or has more workers (the newcomers need the state)


def notice(previous: RendezvousInfo | None, current: RendezvousInfo) -> Notice:
    """What the survivors of ``previous`` hear when ``current`` is formed."""
    if previous is None:
        return Notice(False, False)
    before = {m.node: m.nproc for m in previous.members}
    after = {m.node: m.nproc for m in current.members}
    removed = any(after.get(node, 0) < n for node, n in before.items())
    added = any(before.get(node, 0) < n for node, n in after.items())
    return Notice(removed, added)


def round_group(
    info: RendezvousInfo, node: str, job_id: str, slots: Iterable[int], gpus: tuple[str, ...] = ()
) -> WorkerGroup:
    """This node's workers in ``info``: the given slots (kept first, in slot order) take the
    ranks ``rank_base + i``; LOCAL_RANK stays the slot (it names the worker's device)."""
    workers = tuple(
        Worker(local_rank=slot, rank=info.rank_base + i, world_size=info.world_size, node=node)
        for i, slot in enumerate(sorted(slots))
    )
    return WorkerGroup(
        job_id,
        info.round,
        info.restart_count,
        info.group_rank,
        info.group_world_size,
        info.rank_base,
        info.world_size,
        info.master_addr,
        info.master_port,
        workers,
        gpus,
    )


def standby(job_id: str, node: str, width: int, gpus: tuple[str, ...] = ()) -> WorkerGroup:
    """Every slot, none placed yet (round -1: workers get no rank in their environment)."""
    workers = tuple(Worker(local_rank=i, rank=-1, world_size=0, node=node) for i in range(width))
    return WorkerGroup(job_id, -1, 0, -1, 0, -1, 0, "", 0, workers, gpus)


def placed_group(pool: WorkerGroup, group: WorkerGroup) -> WorkerGroup:
    """The pool once ``group`` placed it: the round's ranks, each worker's pid and state kept
    (one with no place in it has no rank)."""
    by_slot = {w.local_rank: w for w in group.workers}
    workers = tuple(
        replace(
            old, rank=by_slot[old.local_rank].rank, world_size=by_slot[old.local_rank].world_size
        )
        if old.local_rank in by_slot
        else replace(old, rank=-1, world_size=0)
        for old in pool.workers
    )
    return replace(group, workers=workers)


def renewed(pool: WorkerGroup, slots: Iterable[int]) -> WorkerGroup:
    """The pool with new (INIT, unplaced) workers in ``slots``, as a warm-up makes them."""
    fresh = set(slots)
    workers = tuple(
        Worker(w.local_rank, -1, 0, w.node) if w.local_rank in fresh else w for w in pool.workers
    )
    return replace(pool, workers=workers)


def ended(group: WorkerGroup) -> set[int]:
    """Slots whose worker's process ended."""
    return {
        w.local_rank
        for w in group.workers
        if w.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)
    }


@dataclass
class Pool:
    """An in-place part's slots: what each asked for, where each was placed, and what the
    part's in-place policy remembers between stimuli."""

    slots: dict[int, SlotState] = field(default_factory=dict)
    # slot -> the round it last asked to leave behind (-1: its first)
    asked: dict[int, int] = field(default_factory=dict)
    placed: dict[int, int] = field(default_factory=dict)  # slot -> the round it was last placed in
    aborted: int = -1  # the newest round the workers were told to abort for
    survivors: dict[int, int] = field(default_factory=dict)  # slot -> its old round, to rejoin
    suspect: Failure | None = None  # a collective failed: the job fails with it, unless...
    suspected: Failure | None = None  # a collective failure whose peers are being probed
    joining: tuple[int, ...] = ()  # the slots offered to the round being joined
    first: bool = False  # the job's first round: its workers start once formed
    timers: dict[str, str] = field(default_factory=dict)  # role -> the name of its timer now
    warm_failures: int = 0  # warm-ups that failed since a worker last asked
    keep: int = 0  # the world size to keep: before the last losses
    extra: int = 0  # spares placed beyond nproc, filling in for a lost node
    fresh: bool = False  # every worker was stopped (a stall): all start anew
    given: set[int] = field(default_factory=set)  # slots given back: no worker runs there again
    # slot -> when its warm-up must have asked for a place (monotonic), while it warms up
    warm_until: dict[int, float] = field(default_factory=dict)

    def move(self, slot: int, state: SlotState) -> None:
        self.slots[slot] = SLOT_STATES.check(self.slots.get(slot, SlotState.EMPTY), state)

    def ask(self, slot: int, after: int) -> None:
        """The worker in ``slot`` asked for a place (one whose end was heard first is gone)."""
        self.asked[slot] = max(self.asked.get(slot, -2), after)
        self.warm_failures = 0  # it reached elastic.run: the script is able to
        self.warm_until.pop(slot, None)
        if self.slots.get(slot, SlotState.EMPTY) in (SlotState.WARMING, SlotState.READY):
            self.move(slot, SlotState.READY)

    def has_asked(self, slot: int) -> bool:
        return self.asked.get(slot, -2) >= -1

    def running(self) -> list[int]:
        """Slots whose worker runs (started, or placed to start)."""
        return sorted(slot for slot, state in self.slots.items() if state is not SlotState.EMPTY)

    def parked(self) -> list[int]:
        """Spares ready now: slots whose worker asked for a place and holds none."""
        return sorted(slot for slot, state in self.slots.items() if state is SlotState.READY)

    def offered(self, slots: Iterable[int], nproc: int) -> tuple[int, ...]:
        """What a join offers of the workers that asked: those placed before first (survivors
        keep their places), then spares, at most ``nproc``."""
        return tuple(
            sorted(slots, key=lambda s: (self.slots.get(s) is not SlotState.PLACED, s))[:nproc]
        )

    def sync(self, group: WorkerGroup) -> None:
        """A worker whose process ended leaves its slot EMPTY."""
        for slot in ended(group):
            self.warm_until.pop(slot, None)
            if self.slots.get(slot, SlotState.EMPTY) is not SlotState.EMPTY:
                self.move(slot, SlotState.EMPTY)

    def forget(self, slot: int) -> None:
        """What ``slot``'s worker asked and where it was placed is void (a new one comes)."""
        self.asked.pop(slot, None)
        self.placed.pop(slot, None)
        self.warm_until.pop(slot, None)

    def width(self, size: int) -> int:
        """Slot numbers of a pool of ``size`` slots: its own and those it gave back (a slot
        keeps its number for good: LOCAL_RANK names the worker's device)."""
        return size + len(self.given)

    def own(self, size: int) -> list[int]:
        """The slots a pool of ``size`` holds: every slot number but those given back."""
        return [slot for slot in range(self.width(size)) if slot not in self.given]
