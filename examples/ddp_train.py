"""Train a small regression MLP with DistributedDataParallel (gloo, CPU).

A script written for torchrun; run it with elasticd unchanged:

    elasticctl submit examples/ddp_train.py --nproc-per-node 2 --wait -- --epochs 5

It checkpoints at the end of every epoch (rank 0 writes, atomically) and resumes from the
checkpoint when restarted (rank 0 reads it and shares it), so a restart after a failure or a membership change loses at
most one epoch.  Training does not depend on the world size: every global batch is split
evenly across the ranks and DDP averages their gradients, which is the gradient of the
whole batch.  A run that lost a node therefore ends with the loss of an undisturbed run,
up to floating-point summation order.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

FEATURES = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=96 * 32, help="dataset size")
    p.add_argument(
        "--batch", type=int, default=96, help="global batch (divisible by the world size)"
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", default="", help="checkpoint file (default: none)")
    p.add_argument(
        "--epoch-seconds",
        type=float,
        default=0.0,
        help="stretch each epoch to at least this long (for demos)",
    )
    return p.parse_args()


def dataset(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same synthetic data on every rank: y = X·w + noise."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return x, x @ w + 0.1 * torch.randn(samples, 1, generator=gen)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


def load(path: str, net: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Resume from the checkpoint if there is one; returns the first epoch to run."""
    if not path or not os.path.exists(path):
        return 0
    state = torch.load(path, weights_only=True)
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return int(state["epoch"]) + 1


def save(path: str, net: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": net.state_dict(), "optim": opt.state_dict(), "epoch": epoch}, tmp)
    os.replace(tmp, path)


@record
def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} is not divisible by the world size {world}")
    x, y = dataset(args.samples)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    # Only rank 0 needs the checkpoint (it may be on rank 0's disk alone): it tells the
    # others where to start, and DDP's constructor broadcasts its parameters.  Plain SGD
    # keeps no optimizer state that would also need sharing.
    start = torch.tensor([load(args.checkpoint, net, opt) if rank == 0 else 0])
    dist.broadcast(start, src=0)
    start = int(start.item())
    ddp = DistributedDataParallel(net)
    if rank == 0:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(
            f"world size {world}, starting at epoch {start} (restart count {restart})", flush=True
        )
    for epoch in range(start, args.epochs):
        began = time.monotonic()
        for first in range(0, args.samples, args.batch):
            mine = slice(first + rank, first + args.batch, world)  # this rank's share of the batch
            loss = torch.nn.functional.mse_loss(ddp(x[mine]), y[mine])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            full = torch.nn.functional.mse_loss(net(x), y).item()
        time.sleep(max(0.0, args.epoch_seconds - (time.monotonic() - began)))
        if rank == 0:
            print(f"epoch {epoch} loss {full:.6f} world_size {world}", flush=True)
            if args.checkpoint:
                save(args.checkpoint, net, opt, epoch)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the model's reference cycles hold its process group: collect them while the
    # interpreter is whole (torch 2.13: a gloo group destroyed during its teardown aborts
    # the process, SIGABRT, "terminate called without an active exception")
    gc.collect()
