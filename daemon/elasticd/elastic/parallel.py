"""What a sharded script builds anew in each round of an ``--in-place`` job: the world it is
in, its device mesh, and its share of the global batch.  Torch and the standard library only.

A re-form changes the data-parallel size.  The ``elastic.run`` function runs again in the
same process after each one, so what depends on the world is computed at its top::

    @elastic.run
    def train(state):
        mesh = elastic.device_mesh(tp=2)                  # ("dp", "tp") for this world
        model = build(mesh)                               # fully_shard, parallelize_module
        state.attach(model, torch.optim.AdamW(model.parameters()))
        share = elastic.batch_share(512, mesh=mesh, micro_batch=32)
        while state.step < steps:
            rows = global_batch(state.step)[share.rows]   # the same global batch at any size
            for part, weight in share.micro:              # gradient accumulation
                (loss_of(rows[part]) * weight).backward()
            ...

The global batch stays the same at every size: each data-parallel rank takes its rows of
it, in micro-batches of at most ``micro_batch`` rows, and weighs each micro-batch's mean
loss so that the gradients FSDP averages over the ranks are those of the global batch's
mean loss.  The data position is the step (``state.step``), committed with the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from . import runtime


class MeshError(ValueError):
    """This round's world cannot hold the mesh the script asked for."""


@dataclass(frozen=True)
class World:
    """This worker's place in the round it trains in."""

    rank: int
    size: int
    local_rank: int  # its slot on the node: the device it uses, the same in every round
    local_size: int  # the workers on its node in this round
    nodes: int  # the nodes that hold workers in this round
    round: int  # the in-place round (-1 outside an in-place job)


def world() -> World:
    """The round's world, from the process group (formed by ``elastic.run``) and the
    environment the daemon set for the round."""
    grouped = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if grouped else int(os.environ.get("RANK", "0"))
    size = dist.get_world_size() if grouped else int(os.environ.get("WORLD_SIZE", "1"))
    return World(
        rank=rank,
        size=size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        round=int(os.environ.get("ELASTICD_ROUND", "-1")),
    )


def device_mesh(tp: int = 1, device_type: str | None = None) -> Any:
    """A device mesh over this round's world: one dimension ``("dp",)`` when ``tp`` is 1,
    else two, ``("dp", "tp")``, with ``tp`` ranks a tensor-parallel group (neighbours: the
    workers of a node when ``tp`` divides ``--nproc-per-node``).  MeshError when the world
    is not a multiple of ``tp``: that round cannot hold the model's sharding."""
    if tp < 1:
        raise ValueError("tp must be at least 1")
    size = world().size
    if size % tp:
        raise MeshError(
            f"this round has {size} workers, and a tensor-parallel size of {tp} needs a "
            f"multiple of {tp}: the job must run {tp}, {2 * tp}, ... workers (a lost worker's "
            f"place is kept at once by a hot spare: --spares)"
        )
    kind = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    if tp == 1:
        mesh = init_device_mesh(kind, (size,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh(kind, (size // tp, tp), mesh_dim_names=("dp", "tp"))
    worker = runtime.current()
    if worker is not None:
        # the mesh's groups opened sockets of their own: an abort must shut them down too,
        # else a rank blocked in a tensor-parallel collective with a partner on its own node
        # (alive, gone to rejoin) waits for gloo's timeout, and the round stalls
        worker.note_group_sockets()
    return mesh


@dataclass(frozen=True)
class BatchShare:
    """A data-parallel rank's share of a global batch: its rows, and the micro-batches to
    run them in, each with the weight of its mean loss."""

    rows: slice
    micro: tuple[tuple[slice, float], ...]  # (rows of ``rows``, the weight of their mean loss)

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start


def batch_share(
    global_batch: int,
    *,
    rank: int | None = None,
    size: int | None = None,
    mesh: Any = None,
    micro_batch: int | None = None,
) -> BatchShare:
    """This data-parallel rank's share of a batch of ``global_batch`` rows: the ranks take
    contiguous rows, the first ``global_batch % size`` one more.  The rank and size are
    given, or the mesh's ``"dp"`` dimension's, or the world's.  A micro-batch's weight is
    ``rows / global_batch * size``: the mean loss of its rows times it, summed over the
    micro-batches and averaged over the ranks (FSDP's reduce-scatter), is the global batch's
    mean loss."""
    if rank is None or size is None:
        if mesh is not None:
            dp = mesh["dp"] if mesh.mesh_dim_names and "dp" in mesh.mesh_dim_names else mesh
            rank, size = dp.get_local_rank(), dp.size()
        else:
            here = world()
            rank, size = here.rank, here.size
    if not (global_batch > 0 and 0 <= rank < size):
        raise ValueError(f"no share of a batch of {global_batch} for rank {rank} of {size}")
    if global_batch < size:
        raise ValueError(f"a global batch of {global_batch} rows cannot feed {size} ranks")
    base, extra = divmod(global_batch, size)
    start = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    step = micro_batch or count
    if step < 1:
        raise ValueError("micro_batch must be at least 1")
    micro = tuple(
        (slice(i, min(i + step, count)), (min(i + step, count) - i) / global_batch * size)
        for i in range(0, count, step)
    )
    return BatchShare(slice(start, start + count), micro)
