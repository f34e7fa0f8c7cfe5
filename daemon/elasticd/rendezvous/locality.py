"""A round's ranks given where the job's state already is.

A sharded model's state (FSDP2, tensor parallel) is split along the ranks: a checkpoint
saved by W ranks holds rank r's part of each tensor at [r/W, (r+1)/W) of it, and DCP
reshards it to any new world at the same fractions, so that new rank s of R reads
[s/R, (s+1)/R) of each.  What a node fetches from the others is what its new ranks read
less what it holds: its own workers' parts and the copies it keeps for other nodes (the
checkpoint tier's ``Holding``).  Keeping the survivors in their old order is not always the
least: with each copy on the next node, losing the last of three nodes moves half the
state (the first survivor keeps the lost part's copy that the second one reads), where the
survivors swapped move a sixth.  So the survivors take the places that leave the least to
fetch; newcomers, who hold nothing, come after them as before, and rank 0 (whose values a
replicated state's sync broadcasts) stays a survivor.  Pure: a function of the round's
records."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from elasticd.core.checkpoints import Holding, newest
from elasticd.rendezvous.state import Participant

EXACT_UP_TO = 7  # survivors whose every order is tried (7! = 5040); beyond, a greedy one


def by_locality(
    members: Sequence[str], survivors: int, participants: Mapping[str, Participant]
) -> list[str]:
    """``members`` (the first ``survivors`` of them from the round before) with those
    survivors reordered so that the members fetch the least of the newest checkpoint they
    hold.  Unchanged where nobody holds one, where the members run different numbers of
    workers (the places would move with the order), or where no order is strictly better."""
    members = list(members)
    movable = members[:survivors]
    nprocs = {participants[n].nproc for n in members}
    common = _common(participants[n].holds for n in movable)
    if common is None or len(movable) < 2 or len(nprocs) != 1:
        return members
    nproc = nprocs.pop()
    world = nproc * len(members)
    have = [_overlaps(participants[n].holds, common, nproc, world, survivors) for n in movable]
    best = tuple(range(len(movable)))
    most = sum(have[i].get(i, 0) for i in best)
    if len(movable) <= EXACT_UP_TO:
        orders: Iterable[tuple[int, ...]] = itertools.permutations(best)
    else:
        orders = (_greedy(have),)
    for order in orders:
        total = sum(have[node].get(slot, 0) for slot, node in enumerate(order))
        if total > most:
            best, most = order, total
    return [movable[i] for i in best] + members[survivors:]


def _common(holdings: Iterable[Holding | None]) -> Holding | None:
    """The newest checkpoint a member holds a part of (the one the ranks will load: they
    agree on the newest any of them knows); None when none does.  A member whose view
    lags, holding an older one, counts as holding nothing of it."""
    return newest(holdings)


def _overlaps(
    held: Holding | None, common: Holding, nproc: int, world: int, slots: int
) -> dict[int, int]:
    """For each of the first ``slots`` places (``nproc`` ranks of ``world`` each), how much
    of what it reads ``held`` holds, in units of 1 / (saved world x world); places it holds
    nothing of are left out."""
    if held is None or held.age != common.age or held.world != common.world:
        return {}
    saved, out = common.world, dict[int, int]()
    width = nproc * saved  # a place's span in those units; a saved rank's is ``world``
    for r in held.ranks:
        low, high = r * world, (r + 1) * world
        for slot in range(low // width, min(slots, -(-high // width))):
            part = min(high, (slot + 1) * width) - max(low, slot * width)
            if part > 0:
                out[slot] = out.get(slot, 0) + part
    return out


def _greedy(have: list[dict[int, int]]) -> tuple[int, ...]:
    """Place by place, the node left that holds the most of it (the first on a tie, and
    the first left where none holds any)."""
    by_slot: dict[int, list[int]] = {}
    for node, slots in enumerate(have):
        for slot in slots:
            by_slot.setdefault(slot, []).append(node)
    left, order, first = set(range(len(have))), list[int](), 0
    for slot in range(len(have)):
        candidates = [n for n in by_slot.get(slot, ()) if n in left]
        if candidates:
            node = max(candidates, key=lambda n: (have[n][slot], -n))
        else:
            while first not in left:
                first += 1
            node = first
        left.remove(node)
        order.append(node)
    return tuple(order)
