"""Hugging Face accelerate under elasticd, and across the rounds of an ``--in-place`` job.

What an ``Accelerator`` reads under torchrun: ``LOCAL_RANK`` (whether it is a distributed
launch at all), ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (given to ``init_process_group``), then the group's rank and size, plus the
``ACCELERATE_*`` variables that ``accelerate launch`` exports from its config. It has no
node count of its own (``num_machines`` is ``accelerate launch``'s). elasticd sets the
torchrun variables for every round, and a job without ``--in-place`` starts its workers
afresh each round, so an ``Accelerator()`` made at the start of a script sees each round's
rank and world size with no help: such a script needs nothing from here. (``accelerate
launch`` is a launcher: submit the script itself, and give ``Accelerator(...)`` the options
its config held, e.g. ``mixed_precision``. On a machine without GPUs accelerate trains in
parallel only with ``Accelerator(cpu=True)``, under torchrun as here.)

An ``--in-place`` worker lives through rounds, and accelerate keeps its view of the world
(rank, size, device) in process-wide singletons that the first ``Accelerator`` fills and
later ones reuse. :func:`elastic_accelerator` drops them and makes a new ``Accelerator``,
which reads the group that ``elasticd.elastic.run`` has just formed::

    @elastic.run
    def train(state):
        accelerator = elastic_accelerator(cpu=True)          # this round's rank and size
        model, optimizer = accelerator.prepare(state.model, state.optimizer)
        ...

Imported only by scripts that use accelerate: the rest of ``elasticd.elastic`` needs torch
and the standard library alone.
"""

from __future__ import annotations

from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType
except ImportError as exc:
    raise ImportError(
        "elasticd.elastic.accelerate needs accelerate (pip install accelerate)"
    ) from exc

from . import runtime

__all__ = ["ShardedAcceleratorError", "elastic_accelerator", "refuse_sharded"]

# accelerate's kinds of distribution whose state no rank holds whole
SHARDED = frozenset({DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM})


class ShardedAcceleratorError(ValueError):
    """An ``--in-place`` job's Accelerator shards the model."""


def elastic_accelerator(**kwargs: Any) -> Accelerator:
    """``Accelerator(**kwargs)`` for the process group as it is now: accelerate's shared
    state from an earlier round (``AcceleratorState``, ``PartialState``, ``GradientState``:
    accelerate's own reset) is dropped first, so objects prepared in that round belong to
    it and must be prepared again. Call it once per round, inside the ``elastic.run``
    function, and prepare the state's own model and optimizer (never a prepared wrapper)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(**kwargs)
    if runtime.current() is not None:
        refuse_sharded(accelerator.distributed_type)
    return accelerator


def refuse_sharded(kind: DistributedType) -> None:
    """ShardedAcceleratorError for FSDP, DeepSpeed and Megatron-LM in an ``--in-place``
    job: the in-place path syncs rank 0's whole state, which a sharded model has nowhere.
    (A script may shard with ``fully_shard`` itself and keep its state in
    ``elastic.TorchState``: docs/in-place.md.)"""
    if kind in SHARDED:
        raise ShardedAcceleratorError(
            f"elasticd: elastic_accelerator in an --in-place job supports replicated "
            f"training only, not {kind.value}: its state is sharded and no rank holds it "
            f"whole. Submit without --in-place, or shard with fully_shard and keep the "
            f"state in elasticd.elastic.TorchState (examples/fsdp_elastic_train.py)"
        )
