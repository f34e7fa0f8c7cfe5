"""Lightning under elasticd (or torchrun) when the number of nodes changes between rounds.

Lightning takes ``Trainer(num_nodes=N, devices=D)`` as a constant and checks it against the
launcher's world size (``D * N == WORLD_SIZE``) before it trains; its DistributedSampler
shards the data into ``D * N`` parts. A job submitted with ``--nnodes 2:3`` that loses a
node re-forms on 2 nodes, and a script that says ``num_nodes=3`` then fails in every round
("the product (1 * 3) does not match the world size (2)"). Here the round's node count
comes from the launcher (``GROUP_WORLD_SIZE``) instead::

    import lightning as L
    from elasticd.elastic.lightning import elastic_trainer_kwargs

    trainer = L.Trainer(devices=1, strategy="ddp", **elastic_trainer_kwargs(num_nodes=3))

Outside a torchrun-style launch (a plain ``python train.py``, SLURM without torchrun) the
call gives back ``num_nodes=3`` unchanged and adds no plugin.

In an ``--in-place`` job, :func:`elastic_fit` keeps the workers through membership changes
(``elasticd.elastic.run`` around a Trainer per round), with Lightning's whole state
committed in memory every few steps::

    from elasticd import elastic
    from elasticd.elastic.lightning import elastic_fit

    elastic.init("gloo")
    trainer = elastic_fit(lambda **kw: L.Trainer(devices=1, strategy="ddp", max_steps=1000, **kw),
                          model, train_loader, num_nodes=3, every_n_steps=10)

Imported only by scripts that use Lightning (the package ``lightning``; with only
``pytorch_lightning`` installed, its ``lightning_fabric``): the rest of ``elasticd.elastic``
needs torch and the standard library alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

if TYPE_CHECKING:  # the checker reads the package `lightning`; at run time either will do
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch import Callback
else:
    try:
        from lightning.fabric.plugins.environments import ClusterEnvironment
    except ImportError:
        try:  # only pytorch_lightning installed: its base class lives there
            from lightning_fabric.plugins.environments import ClusterEnvironment
        except ImportError as exc:
            raise ImportError(
                "elasticd.elastic.lightning needs Lightning (pip install lightning)"
            ) from exc

    try:  # elastic_fit's pieces; the environment above needs only the fabric
        from lightning.fabric.plugins import CheckpointIO
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from lightning_fabric.plugins import CheckpointIO
            from pytorch_lightning import Callback
        except ImportError:  # a fabric without the Trainer: elastic_fit says so when called
            Callback = CheckpointIO = object

from . import driver, runtime
from .broadcast import broadcast_into
from .state import ROOT, ObjectState, _snapshot

__all__ = [
    "ElasticdEnvironment",
    "LightningState",
    "ShardedStrategyError",
    "elastic_fit",
    "elastic_trainer_kwargs",
    "round_nodes",
]


def _launched() -> bool:
    """Whether a torchrun-style launcher (elasticd, torchrun) started this process."""
    return torch.distributed.is_available() and torch.distributed.is_torchelastic_launched()


def round_nodes(default: int = 1) -> int:
    """The nodes of this round (``GROUP_WORLD_SIZE``); ``default`` outside a launcher."""
    value = os.environ.get("GROUP_WORLD_SIZE", "")
    return int(value) if _launched() and value.isdigit() and int(value) > 0 else default


class ElasticdEnvironment(ClusterEnvironment):
    """Lightning's view of a round: ranks, world size and node rank from the environment
    that elasticd (or torchrun) sets for every round, and a check of ``devices`` and
    ``num_nodes`` that says what to change when they do not fit the round."""

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the launcher started every worker: Lightning must not spawn any

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return _launched()

    def world_size(self) -> int:
        return int(os.environ["WORLD_SIZE"])

    def set_world_size(self, size: int) -> None:
        pass  # the launcher decides: Lightning's product of devices and num_nodes is checked below

    def global_rank(self) -> int:
        return int(os.environ["RANK"])

    def set_global_rank(self, rank: int) -> None:
        pass  # the launcher's RANK

    def local_rank(self) -> int:
        return int(os.environ["LOCAL_RANK"])

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", 0))

    def num_nodes(self) -> int:
        """The nodes of this round."""
        return round_nodes()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_devices))
        if num_devices != local:
            raise ValueError(
                f"Trainer(devices={num_devices}), but this node runs {local} workers (the job's "
                f"--nproc-per-node): Lightning needs devices to be the workers per node"
            )
        if num_devices * num_nodes != self.world_size():
            nodes = self.num_nodes()
            if num_devices * nodes != self.world_size():
                raise ValueError(
                    f"this round has {self.world_size()} workers on {nodes} nodes, not {num_devices} "
                    f"on each: Lightning needs the same number of workers on every node"
                )
            raise ValueError(
                f"Trainer(num_nodes={num_nodes}), but this round has {nodes} nodes: pass "
                f"**elastic_trainer_kwargs(num_nodes={num_nodes}) (elasticd.elastic.lightning) "
                f"instead of num_nodes, so that Lightning gets each round's count"
            )


def elastic_trainer_kwargs(num_nodes: int = 1, plugins: Iterable[Any] = ()) -> dict[str, Any]:
    """``Trainer`` keyword arguments for this round: ``num_nodes``, the nodes the launcher
    started this round with, and ``plugins`` with an :class:`ElasticdEnvironment` first
    (unless ``plugins`` holds a cluster environment). Outside a torchrun-style launch,
    ``num_nodes`` and ``plugins`` as given: Lightning finds its environment itself. Rank 0
    says so on stderr when the round's count is not ``num_nodes``."""
    extra = list(plugins)
    if not _launched():
        return {"num_nodes": num_nodes, "plugins": extra}
    nodes = round_nodes(num_nodes)
    if nodes != num_nodes and os.environ.get("RANK") == "0":
        print(
            f"elasticd: Trainer(num_nodes={num_nodes}) asked; this round has {nodes} nodes, "
            f"so num_nodes={nodes}",
            file=sys.stderr,
            flush=True,
        )
    environment = (
        [] if any(isinstance(p, ClusterEnvironment) for p in extra) else [ElasticdEnvironment()]
    )
    return {"num_nodes": nodes, "plugins": environment + extra}


# -- in place ---------------------------------------------------------------------------

MEMORY = "elasticd-memory://last-commit"  # the ckpt_path that means "the state's checkpoint"


class LightningState(ObjectState):
    """The elastic state of a Lightning job: ``checkpoint``, the dict that Lightning itself
    writes to a ``.ckpt`` file (``Trainer.save_checkpoint``: the model's weights, the
    optimizers, the LR schedulers, the loops' progress, the callbacks' state), kept in
    memory instead of in a file.

    A commit keeps a copy (tensors cloned); ``sync`` sends rank 0's to a newcomer through
    the process group, as tensors and JSON (so hyper-parameters and callback states must be
    plain values). Before the first commit there is no checkpoint: the model's initial
    weights are kept instead, so that a failure in the first steps goes back to them, and
    a newcomer then takes rank 0's weights."""

    checkpoint: dict[str, Any] | None  # a state attribute (ObjectState): the last commit's

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._initial: dict[str, Any] | None = _snapshot(model.state_dict())
        super().__init__(checkpoint=None)

    def save(self) -> None:
        super().save()
        if self.saved("checkpoint") is not None:
            self._initial = None  # a restore never goes back past a commit

    def restore(self) -> None:
        super().restore()
        if self.checkpoint is None and self._initial is not None:
            self.model.load_state_dict(self._initial)

    def _broadcast_from_root(self) -> None:
        super()._broadcast_from_root()
        if self.checkpoint is None:  # rank 0 has no commit yet: its weights, as they are
            for tensor in self.model.state_dict().values():
                broadcast_into(tensor, root=ROOT)


class _Commit(Callback):
    """Every ``every`` optimizer steps, at the end of a batch (where ``ModelCheckpoint``
    saves its step checkpoints): Lightning's checkpoint dict into the state, then
    ``state.commit()``, whose membership check raises ``HostsUpdatedInterrupt`` inside
    ``fit`` on every rank at this same step."""

    def __init__(self, state: LightningState, every: int) -> None:
        self.state, self.every, self.last = state, every, -1

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # With gradient accumulation a step spans batches: commit at the first batch end
        # after the step was taken (step 0 is before any: mid-accumulation), once.
        if step == 0 or step % self.every or step == self.last:
            return
        self.last = step
        self.state.checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        self.state.commit()


class _FromMemory(CheckpointIO):
    """The strategy's CheckpointIO, except that ``MEMORY`` loads the state's checkpoint:
    ``fit(ckpt_path=MEMORY)`` then restores everything as from a file, with no file."""

    def __init__(self, inner: Any, state: LightningState) -> None:
        self.inner, self.state = inner, state

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        checkpoint = self.state.checkpoint
        if path == MEMORY and checkpoint is not None:  # (elastic_fit asks for it only then)
            return checkpoint
        return self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def elastic_fit(
    make_trainer: Callable[..., Any],
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    datamodule: Any = None,
    *,
    num_nodes: int = 1,
    every_n_steps: int = 10,
    ckpt_path: str | None = None,
    state: LightningState | None = None,
) -> Any:
    """``trainer.fit(model, ...)`` that lives through the rounds of an ``--in-place`` job.

    ``make_trainer(**kwargs)`` builds the Trainer of a round; pass ``kwargs`` on to
    ``Trainer`` (they are :func:`elastic_trainer_kwargs`: the round's ``num_nodes`` and
    the cluster environment). Each round, inside ``elasticd.elastic.run``: a new Trainer,
    a commit callback appended to its callbacks, and ``fit`` resumed from the last commit
    in memory (none in the first round). Every ``every_n_steps`` steps the callback puts
    Lightning's checkpoint dict in the state and checks for membership changes, so a
    change stops ``fit`` at that step on every rank: Lightning tears its Trainer down (the
    process group, which ``run`` formed, stays: Lightning only reuses it) and ``run``
    re-forms the group; a newcomer takes rank 0's checkpoint. A member lost mid-step
    breaks the group: the step in progress and those since the last commit are redone
    (at most ``every_n_steps``). The model object, the process and its imports stay;
    Lightning builds the DDP wrapper, the optimizers and the dataloaders anew each round
    (``configure_optimizers`` is called again: it must not depend on earlier rounds).

    ``ckpt_path`` is where ``fit`` resumes while there is no commit in memory: the job's
    first round, and a group restart, which starts every worker afresh (the in-place
    fallback): e.g. ``"last"`` with a ``ModelCheckpoint(save_last=True)`` in a directory
    that every node sees. Without it such a round starts from the model as built.

    Returns the last round's Trainer, after ``fit``. Outside an in-place job, one round:
    ``fit`` as usual, with the commits in memory only."""
    if Callback is object:
        raise ImportError("elastic_fit needs Lightning's Trainer (pip install lightning)")
    if every_n_steps < 1:
        raise ValueError("every_n_steps must be at least 1")
    state = state if state is not None else LightningState(model)

    @driver.run
    def rounds(state: LightningState) -> Any:
        trainer = make_trainer(**elastic_trainer_kwargs(num_nodes))
        if runtime.current() is not None:
            refuse_sharded(trainer.strategy)
        trainer.callbacks.append(_Commit(state, every_n_steps))
        resume = ckpt_path
        if state.checkpoint is not None:
            trainer.strategy.checkpoint_io = _FromMemory(trainer.strategy.checkpoint_io, state)
            resume = MEMORY
        trainer.fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path=resume)
        return trainer

    return rounds(state)


# Lightning's strategies whose state no rank holds whole (by class name: DeepSpeed's module
# is imported only where it is installed)
SHARDED_STRATEGIES = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


class ShardedStrategyError(ValueError):
    """An ``--in-place`` job's Trainer uses a strategy that shards the model."""


def refuse_sharded(strategy: Any) -> None:
    """ShardedStrategyError when ``strategy`` shards the model: ``elastic_fit`` keeps a
    commit as Lightning's checkpoint dict in each rank's memory and syncs rank 0's to the
    others, which holds for replicated models (DDP) only.  A sharded model in place:
    ``elastic.TorchState`` with ``fully_shard`` in the script (docs/in-place.md)."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    found = sorted(names.intersection(SHARDED_STRATEGIES))
    if found:
        raise ShardedStrategyError(
            f"elasticd: elastic_fit in an --in-place job supports replicated strategies "
            f"(ddp) only, not {found[0]}: its state is sharded and no rank holds it whole. "
            f"Submit without --in-place (the restart path, with the checkpoint tier), or "
            f"write the loop with elasticd.elastic.TorchState and fully_shard "
            f"(examples/fsdp_elastic_train.py)"
        )
