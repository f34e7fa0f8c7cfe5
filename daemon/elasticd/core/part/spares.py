"""Hot spares given back (docs/in-place.md), pure: spares are the first capacity a node
gives back.

An in-place job's spares (``--spares``) sit in the free slots of its nodes, never charged as
its share.  When a job that a node would start fits only in the room of spares there, the
parts holding them give some back, the lowest-priority, newest job's first: each part stops
up to that many of its unplaced workers (parked ones first, then warming ones; never a placed
one), has that many spares fewer for good, and the node counts their slots and GPUs free
once their processes are reaped (ShedSpares -> SparesShed), never before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.part.phases import Phase
from elasticd.core.part.pool import SlotState
from elasticd.core.part.port import PartPort
from elasticd.core.placement import Offer, Resources

Instructions = list[do.Instruction]


def given_gpus(part: PartPort) -> tuple[str, ...]:
    """The GPUs of the slots this part gave back (``part.gpus`` is one per slot number)."""
    return slot_gpus(part, sorted(part.pool.given) if part.pool is not None else ())


def slot_gpus(part: PartPort, slots: Iterable[int]) -> tuple[str, ...]:
    return tuple(part.gpus[slot] for slot in slots if slot < len(part.gpus))


def sheddable(part: PartPort) -> list[int]:
    """The spares' slots this part can give back now, the first to go first: parked ones
    (READY), then warming ones; never a placed worker, nor as many unplaced ones as the
    round lacks (they warm up for its places).  Only a part that watches a round gives
    any: a join or a request may be about to place them."""
    pool = part.pool
    if pool is None or part.phase is not Phase.RUNNING or pool.first or part.spares <= 0:
        return []
    unplaced = [
        slot
        for want in (SlotState.READY, SlotState.WARMING)
        for slot, state in sorted(pool.slots.items())
        if state is want
    ]
    placed = sum(state is SlotState.PLACED for state in pool.slots.values())
    lacking = max(0, part.nproc - placed)
    return unplaced[: max(0, min(part.spares, len(unplaced) - lacking))]


def shed(
    part: PartPort, n: int, now: ev.Now, stimulus_id: str = ""
) -> tuple[tuple[int, ...], Instructions]:
    """Give back up to ``n`` spares (``sheddable``): the part has that many spares fewer for
    good (none warms up there again), their slots are EMPTY now (no round offers them) and
    what their channel heard is void.  The node stops their processes."""
    pool = part.pool
    assert pool is not None
    slots = tuple(sorted(sheddable(part)[: max(0, n)]))
    if not slots:
        return (), []
    for slot in slots:
        pool.move(slot, SlotState.EMPTY)
        pool.forget(slot)
    pool.given.update(slots)
    part.give_back_spares(len(slots))
    out: Instructions = [do.ForgetSlots(part.job, slots)]
    out += part.report(part.report_state, now, part.info, part.group)
    return slots, part.told(f"shed [{stimulus_id}]", now, out)


@dataclass(frozen=True)
class Holder:
    """A part here with spares it could give back: what each would free, first to go first."""

    job: str
    slots: tuple[int, ...]
    gpus: tuple[str, ...]  # the GPUs of those slots (none on a node without GPUs)


def room(free: Resources, extra: Iterable[tuple[int, tuple[str, ...]]]) -> Resources:
    """``free`` and ``extra`` (slots and GPUs coming free) together."""
    slots, gpus = free.slots, list(free.gpus)
    for count, more in extra:
        slots += count
        gpus += [g for g in more if g not in gpus]
    return replace(free, slots=slots, gpus=tuple(gpus))


def wanted(offers: Iterable[Offer], free: Resources, has_gpus: bool) -> int:
    """How many spares must go for ``offers`` (their workers: a newcomer's own spares take
    only what is free) to fit beside ``free``: each spare gives back a slot, and on a node
    with GPUs its GPU."""
    offers = list(offers)
    slots = sum(o.nproc for o in offers) - free.slots
    gpus = sum(len(o.gpus[: o.nproc]) for o in offers) - len(free.gpus) if has_gpus else 0
    return max(0, slots, gpus)


def plan(holders: Iterable[Holder], n: int) -> list[tuple[str, int]]:
    """Which parts give back how many spares for ``n``, in the holders' order."""
    out: list[tuple[str, int]] = []
    for holder in holders:
        if n <= 0:
            break
        take = min(n, len(holder.slots))
        if take:
            out.append((holder.job, take))
            n -= take
    return out
