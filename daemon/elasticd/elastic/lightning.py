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
call gives back ``num_nodes=3`` unchanged and adds no plugin. Imported only by scripts that
use Lightning (the package ``lightning``; with only ``pytorch_lightning`` installed, its
``lightning_fabric``): the rest of ``elasticd.elastic`` needs torch and the standard
library alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import torch.distributed

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
except ImportError:
    try:  # only pytorch_lightning installed: its base class lives there
        from lightning_fabric.plugins.environments import ClusterEnvironment
    except ImportError as exc:
        raise ImportError("elasticd.elastic.lightning needs Lightning (pip install lightning)") from exc

__all__ = ["ElasticdEnvironment", "elastic_trainer_kwargs", "round_nodes"]


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
                f"--nproc-per-node): Lightning needs devices to be the workers per node")
        if num_devices * num_nodes != self.world_size():
            nodes = self.num_nodes()
            if num_devices * nodes != self.world_size():
                raise ValueError(
                    f"this round has {self.world_size()} workers on {nodes} nodes, not {num_devices} "
                    f"on each: Lightning needs the same number of workers on every node")
            raise ValueError(
                f"Trainer(num_nodes={num_nodes}), but this round has {nodes} nodes: pass "
                f"**elastic_trainer_kwargs(num_nodes={num_nodes}) (elasticd.elastic.lightning) "
                f"instead of num_nodes, so that Lightning gets each round's count")


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
        print(f"elasticd: Trainer(num_nodes={num_nodes}) asked; this round has {nodes} nodes, "
              f"so num_nodes={nodes}", file=sys.stderr, flush=True)
    environment = [] if any(isinstance(p, ClusterEnvironment) for p in extra) else [ElasticdEnvironment()]
    return {"num_nodes": nodes, "plugins": environment + extra}
