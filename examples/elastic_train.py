"""In-place elastic training (Horovod's elastic State, for PyTorch): when a node dies, a
worker fails or a node joins, the surviving workers keep their process, their imports and
their model; they roll back to the last commit (after a failure), take rank 0's state, and
train on from the committed batch. No checkpoint file is read.

    elasticctl submit --in-place --nnodes 1:3 --max-restarts 3 examples/elastic_train.py --batches 3000

With ``--report DIR`` every worker appends one JSON line per event to DIR/events.jsonl
(``start`` after each (re)formation, ``commit``, ``done``): pid, rank, world size, round,
batch and a checksum of the parameters. The tests read it; a user can ignore it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from elasticd import elastic


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=1000, help="train until this batch")
    parser.add_argument("--commit-every", type=int, default=5, help="commit every N batches")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--report", default="", help="append events to DIR/events.jsonl")
    parser.add_argument(
        "--fail-at-batch",
        type=int,
        default=-1,
        help="(tests) the worker of rank --fail-rank raises here, once",
    )
    parser.add_argument("--fail-rank", type=int, default=1)
    return parser.parse_args()


def batch_data(batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for the same (batch, rank) on every run: rolling back replays it."""
    generator = torch.Generator().manual_seed(batch * 4099 + rank)
    x = torch.randn(16, 32, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class Reporter:
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "events.jsonl") if directory else ""

    def __call__(self, event: str, state: elastic.TorchState, **extra: object) -> None:
        if not self.path:
            return
        doc = {
            "event": event,
            "pid": os.getpid(),
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "round": int(os.environ.get("ELASTICD_ROUND", -1)),
            "master_port": int(os.environ.get("MASTER_PORT", 0)),
            "batch": state.batch,
            "checksum": checksum(state.model),
            "time": time.time(),
            **extra,
        }
        with open(self.path, "a") as f:  # one short line per write: appends do not interleave
            f.write(json.dumps(doc) + "\n")


def main() -> None:
    args = parse()
    report = Reporter(args.report)
    elastic.init("gloo")
    torch.manual_seed(os.getpid())  # a newcomer starts from other parameters: sync() fixes that
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = elastic.TorchState(model, optimizer, epoch=0, batch=0)
    injected = os.path.join(args.report, "failed-once") if args.report else ""

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        ddp = DistributedDataParallel(state.model)  # the group is new after every change
        rank = dist.get_rank()
        report("start", state)
        while state.batch < args.batches:
            if (
                state.batch == args.fail_at_batch
                and rank == args.fail_rank
                and injected
                and not os.path.exists(injected)
            ):
                open(injected, "w").close()
                raise RuntimeError(f"injected failure at batch {state.batch}")
            x, y = batch_data(state.batch, rank)
            loss = nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.batch += 1
            if state.batch % args.commit_every == 0:
                report("commit", state, loss=loss.item())
                state.commit()
            if args.step_time:
                time.sleep(args.step_time)

    train(state)
    report("done", state)


if __name__ == "__main__":
    main()
