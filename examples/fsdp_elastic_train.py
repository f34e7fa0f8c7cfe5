"""A sharded model (FSDP2, optionally x tensor parallel) trained in place: when a node dies,
a worker fails or a node joins, the surviving workers keep their process; each round they
build the model for the new world (its device mesh, ``fully_shard``) and
``state.attach`` loads the last commit into it, resharded, from the job's checkpoint tier
in memory (a lost node's shards come from their copy on another node).  The global batch is
the same at every world size: each data-parallel rank takes its rows of it.

    elasticctl submit --in-place --nnodes 2:3 --max-restarts 3 examples/fsdp_elastic_train.py -- --steps 500
    elasticctl submit --in-place --nnodes 2 --nproc-per-node 2 examples/fsdp_elastic_train.py -- --tp 2

It runs unchanged under torchrun too (one round; commits go to the tier only under
elasticd).  ``--resume-from DIR`` starts from a commit on disk (the copy the daemon writes to
the job's ``--checkpoint-dir``).  With ``--report DIR`` each rank appends JSON lines to
DIR/events.jsonl (``start`` per round: the commit loaded; ``step``: the global batch's loss;
``commit``: how long it blocked; ``done``) and, at the end, the parameters' SHA-256 to
DIR/final-<rank>.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from elasticd import elastic


def make_optimizer(kind: str, parameters, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    return torch.optim.AdamW(parameters, lr=lr)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--commit-every", type=int, default=1, help="commit every N steps")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=64, help="each block's inner width")
    parser.add_argument("--layers", type=int, default=2, help="blocks")
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per forward (0: all)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="sgd: with momentum (one tensor of state per parameter, AdamW's two)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2D mesh)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--resume-from", default="", help="a commit's directory on disk")
    parser.add_argument("--report", default="", help="append events to DIR/events.jsonl")
    parser.add_argument("--digest", action="store_true", help="report the parameters' sums")
    parser.add_argument(
        "--hold-at",
        type=int,
        action="append",
        default=[],
        help="(tests) after committing this step, wait there (once per process), checking "
        "the membership, until the job changes; may be given again",
    )
    return parser.parse_args()


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(args.hidden, args.ffn) for _ in range(args.layers))
        self.head = nn.Linear(args.hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(args: argparse.Namespace, mesh) -> nn.Module:
    """The model for this round's mesh: made on the meta device (no memory), each block's
    pair of layers split over "tp" (column- then row-wise), each block and the whole sharded
    over "dp" (FSDP2), then given memory for this rank's shards only."""
    with torch.device("meta"):
        model = Model(args)
    if "tp" in (mesh.mesh_dim_names or ()):
        for block in model.blocks:
            parallelize_module(
                block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
            )
    dp = mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    return model


def initialize(model: nn.Module, seed: int = 0) -> None:
    """The same initial values at any world size and sharding: each parameter made whole
    from a seed of its own, and this rank's shards of it kept (one parameter at a time)."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    for index, (name, param) in enumerate(model.named_parameters()):
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        full = torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5
        set_model_state_dict(model, {name: full}, options=options)


def global_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: the same rows whatever the world."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(args.global_batch, args.hidden, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
        for p in model.parameters()
    ]


def digest(model: nn.Module) -> tuple[float, str]:
    """The parameters' sum and SHA-256, whole (a collective)."""
    sha = hashlib.sha256()
    total = 0.0
    for tensor in full_parameters(model):
        sha.update(tensor.numpy().tobytes())
        total += float(tensor.double().sum())
    return total, sha.hexdigest()


class Reporter:
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "events.jsonl") if directory else ""

    def __call__(self, event: str, **doc: object) -> None:
        if not self.path:
            return
        here = elastic.world()
        line = {"event": event, "pid": os.getpid(), "rank": here.rank, "world": here.size}
        line.update({"round": here.round, "time": time.time(), **doc})
        with open(self.path, "a") as f:  # one short line per write: appends do not interleave
            f.write(json.dumps(line) + "\n")


def main() -> None:
    args = parse()
    report = Reporter(args.report)
    elastic.init("gloo")
    state = elastic.TorchState(step=0)
    held: set[int] = set()  # the --hold-at steps this process held at (once each)

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        mesh = elastic.device_mesh(tp=args.tp)  # this round's world: ("dp",) or ("dp", "tp")
        model = build(args, mesh)
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
        loaded = state.attach(model, optimizer)  # the last commit, resharded to this world
        if not loaded and args.resume_from:
            state.load_from(args.resume_from)
        elif not loaded:
            initialize(model)
        share = elastic.batch_share(
            args.global_batch, mesh=mesh, micro_batch=args.micro_batch or None
        )
        start = {"step": state.step, "loaded": state.last_commit if loaded else None}
        start["dp"] = mesh["dp"].size()
        if args.digest:
            start["checksum"] = digest(model)[0]
        report("start", **start)
        while state.step < args.steps:
            x, y = global_batch(state.step, args)
            x, y = x[share.rows], y[share.rows]
            optimizer.zero_grad()
            total = torch.zeros(())
            for rows, weight in share.micro:  # gradient accumulation over micro-batches
                loss = nn.functional.mse_loss(model(x[rows]), y[rows])
                (loss * weight).backward()
                total += loss.detach() * weight
            optimizer.step()
            dist.all_reduce(total)  # the global batch's mean loss, for the report
            state.step += 1
            stepped = {"loss": float(total) / mesh["dp"].size() / args.tp}
            if args.digest:  # what the commit of this step holds
                stepped["checksum"] = digest(model)[0]
            report("step", step=state.step, **stepped)
            if state.step % args.commit_every == 0:
                blocked = time.monotonic()
                state.commit()
                blocked = time.monotonic() - blocked
                report(
                    "commit",
                    step=state.step,
                    blocked=blocked,
                    name=state.last_commit,
                    **state.commit_timings,  # waited (for the one before), staged
                )
            while state.step in args.hold_at and state.step not in held:
                time.sleep(0.05)
                try:
                    elastic.check_host_updates()  # raises on every rank once the job changes
                except Exception:
                    held.add(state.step)
                    raise
            if args.step_time:
                time.sleep(args.step_time)
        checksum, sha = digest(model)
        report("done", step=state.step, checksum=checksum, sha256=sha)
        if args.report:
            path = os.path.join(args.report, f"final-{dist.get_rank()}.json")
            with open(path, "w") as f:
                json.dump({"step": state.step, "world": dist.get_world_size(), "sha256": sha}, f)

    train(state)
    # every rank is done before any tears its group down (one that left early breaks a
    # peer's last collective), and the group is left before the interpreter's teardown
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the model's reference cycles hold its process group: collect them while the
    # interpreter is whole (torch 2.13: a gloo group destroyed during its teardown aborts
    # the process, SIGABRT, "terminate called without an active exception")
    gc.collect()
