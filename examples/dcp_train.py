"""A plain torchrun script that keeps its training state with torch.distributed.checkpoint
(DCP) in ``ELASTICD_CHECKPOINT_DIR``: unchanged, it gets elasticd's checkpoint tier (each
node's share held in memory, a copy on another node, the newest complete checkpoint put back
in place before a restarted round's workers start, resharded by DCP to the new world).

    elasticctl submit --nnodes 2:3 --max-restarts 3 examples/dcp_train.py --steps 200
    torchrun --nnodes 2 ... examples/dcp_train.py --ckpt-dir /shared/ckpt   # elsewhere

``--model fsdp`` shards the model with FSDP2 (``fully_shard`` on a mesh of the world),
``ddp`` replicates it.  The global batch is the same at every world size (each rank takes its
slice), so a run that resumes at another size trains on the same data.  With ``--report DIR``
each rank appends JSON lines to DIR/events.jsonl (``start``, ``save``, ``done``: step, world;
``start`` the times its phases ended, ``done`` a checksum of the whole model; ``step`` too with
``--report-steps``) and the final parameters' SHA-256 to DIR/final-<rank>.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

STEP = re.compile(r"step_(\d+)")


def make_optimizer(kind: str, parameters, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    return torch.optim.AdamW(parameters, lr=lr)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--save-every", type=int, default=5, help="a checkpoint every N steps")
    parser.add_argument("--model", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--hidden", type=int, default=64, help="the model's width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="sgd: with momentum (one tensor of state per parameter, AdamW's two)",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--ckpt-dir", default="", help="without elasticd: where to save")
    parser.add_argument("--report", default="", help="append events to DIR/events.jsonl")
    parser.add_argument("--report-steps", action="store_true", help="a `step` event per step")
    parser.add_argument(
        "--pause-after-save",
        type=int,
        default=-1,
        help="(tests) after saving this step, wait there until stopped (not when resumed at it)",
    )
    parser.add_argument(
        "--die-in-save",
        type=int,
        default=-1,
        help="(tests) rank 1 kills itself as the others save this step: a torn save",
    )
    return parser.parse_args()


def build(args: argparse.Namespace) -> nn.Module:
    """The model, as a fresh run starts it (a checkpoint loaded overwrites every value)."""
    torch.manual_seed(0)  # every rank, every run: the same initial parameters
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.Tanh()]
    layers.append(nn.Linear(args.hidden, 1))
    return nn.Sequential(*layers)


def shard(model: nn.Module, kind: str) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (the same data at any world size)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(args.global_batch, args.hidden, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (a DTensor gathered), in order: a collective on FSDP."""
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
        for p in model.parameters()
    ]


def digest(model: nn.Module) -> tuple[float, str]:
    tensors = full_parameters(model)
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.numpy().tobytes())
    return float(sum(t.double().sum() for t in tensors)), sha.hexdigest()


def latest(root: str) -> int:
    """The newest complete checkpoint's step (DCP writes .metadata last), or -1."""
    steps = [
        int(m.group(1))
        for name in (os.listdir(root) if os.path.isdir(root) else ())
        if (m := STEP.fullmatch(name)) and os.path.exists(os.path.join(root, name, ".metadata"))
    ]
    return max(steps, default=-1)


def once(directory: str, name: str) -> bool:
    """True the first time (a marker file in ``directory`` remembers it)."""
    try:
        os.close(os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL))
        return True
    except (FileExistsError, FileNotFoundError):
        return False


class Reporter:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, event: str, **doc: object) -> None:
        if not self.directory:
            return
        line = {"event": event, "pid": os.getpid(), "rank": dist.get_rank(), "time": time.time()}
        with open(os.path.join(self.directory, "events.jsonl"), "a") as f:
            f.write(json.dumps({**line, **doc}) + "\n")


def main() -> None:
    began = time.time()
    args = parse()
    root = os.environ.get("ELASTICD_CHECKPOINT_DIR") or args.ckpt_dir
    report = Reporter(args.report)
    dist.init_process_group("gloo")
    formed = time.time()
    world = dist.get_world_size()
    found = latest(root) if root else -1
    if found >= 0 and args.model == "fsdp":  # FSDP2's way: no values made only to be loaded over
        with torch.device("meta"):
            model = shard(build(args), args.model)
        model.to_empty(device="cpu")
    else:
        model = shard(build(args), args.model)
    built = time.time()
    optimizer = make_optimizer(args.optimizer, model.parameters(), 1e-3)
    step = 0
    if found >= 0:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(root, f"step_{found}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        step = int(state["step"])
    started_at = step
    phases = {"began": began, "formed": formed, "built": built, "loaded": time.time()}
    report("start", step=step, world=world, phases=phases)

    while step < args.steps:
        x, y = batch(step, args)
        loss = nn.functional.mse_loss(model(x), y) * (x.shape[0] * world / args.global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if args.report_steps:
            report("step", step=step, world=world)
        if root and step % args.save_every == 0:
            if step == args.die_in_save and dist.get_rank() == 1 and once(args.report, "died"):
                os.kill(os.getpid(), 9)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save(
                {"model": model_sd, "optim": optim_sd, "step": step},
                checkpoint_id=os.path.join(root, f"step_{step}"),
            )
            report("save", step=step, world=world)
            while step == args.pause_after_save and started_at < step:
                time.sleep(0.1)
        if args.step_time:
            time.sleep(args.step_time)
    checksum, sha = digest(model)
    report("done", step=step, world=world, checksum=checksum, sha256=sha)
    if args.report:
        path = os.path.join(args.report, f"final-{dist.get_rank()}.json")
        with open(path, "w") as f:
            json.dump({"step": step, "world": world, "sha256": sha}, f)
    # every rank is done before any tears its group down: one that destroyed its gloo pairs
    # while a peer still sent (FSDP2's last collectives) made that peer abort (SIGABRT)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the model's reference cycles hold its process group: collect them while the
    # interpreter is whole (torch 2.13: a gloo group destroyed during its teardown aborts
    # the process, SIGABRT, "terminate called without an active exception")
    gc.collect()
