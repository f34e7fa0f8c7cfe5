"""Pure decisions of an in-place job (``--in-place``): which rounds keep the workers, what
the survivors are told, and where each kept worker stands in a round.

A round holds only workers that are up and asked for a place (they run ``elastic.run``). A
worker that failed is replaced by a new process that warms up (imports, builds its model)
while the others train on; once it asks for a place its node opens a scale-up round, so
nobody waits for a newcomer's start-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .model import Worker, WorkerGroup
from .rendezvous import Reason, RendezvousInfo

ABORTING = frozenset({Reason.FAILURE, Reason.NODE_LOST, Reason.DRAIN, Reason.SHUTDOWN,
                      Reason.STALLED})  # rounds whose old group has lost a member


def keeps_workers(reason: Reason) -> bool:
    """Whether an in-place job's workers live on into a round opened for ``reason``."""
    return reason is not Reason.STALLED


def aborts(reason: Reason) -> bool:
    """Whether the survivors' group must be aborted at once: someone in it is gone."""
    return reason in ABORTING


@dataclass(frozen=True)
class Notice:
    abort: bool   # a member of the previous round is missing or has fewer workers
    added: bool   # a node is new or has more workers (the newcomers need the state)


def notice(previous: RendezvousInfo | None, current: RendezvousInfo) -> Notice:
    """What the survivors of ``previous`` hear when ``current`` is formed."""
    if previous is None:
        return Notice(False, False)
    before = {m.node: m.nproc for m in previous.members}
    after = {m.node: m.nproc for m in current.members}
    removed = any(after.get(node, 0) < n for node, n in before.items())
    added = any(before.get(node, 0) < n for node, n in after.items())
    return Notice(removed, added)


def place(info: RendezvousInfo, node: str, job_id: str, slots: Iterable[int],
          gpus: tuple[str, ...] = ()) -> WorkerGroup:
    """This node's workers in ``info``: the given slots (kept first, in slot order) take the
    ranks ``rank_base + i``; LOCAL_RANK stays the slot (it names the worker's device)."""
    workers = tuple(Worker(local_rank=slot, rank=info.rank_base + i, world_size=info.world_size,
                           node=node) for i, slot in enumerate(sorted(slots)))
    return WorkerGroup(job_id, info.round, info.restart_count, info.group_rank,
                       info.group_world_size, info.rank_base, info.world_size, info.master_addr,
                       info.master_port, workers, gpus)


def standby(job_id: str, node: str, nproc: int, gpus: tuple[str, ...] = ()) -> WorkerGroup:
    """Every slot, none placed yet (round -1: workers get no rank in their environment)."""
    workers = tuple(Worker(local_rank=i, rank=-1, world_size=0, node=node) for i in range(nproc))
    return WorkerGroup(job_id, -1, 0, -1, 0, -1, 0, "", 0, workers, gpus)
