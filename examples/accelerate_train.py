"""An accelerate script, written as accelerate's docs write one (CPU: ``Accelerator(cpu=True)``,
gloo): a small regression MLP, ``accelerator.save_state`` every few steps and
``load_state`` of the newest one at start, so that a restarted round resumes from it.

The same command line under torchrun and under elasticd:

    torchrun --nproc-per-node 2 examples/accelerate_train.py --ckpt-dir /tmp/ck
    elasticctl submit --nproc-per-node 2 --wait examples/accelerate_train.py -- --ckpt-dir /tmp/ck

``--in-place`` is the same training for an ``--in-place`` job: ``elasticd.elastic.run`` keeps
the workers through membership changes, and ``elastic_accelerator`` gives each round an
``Accelerator`` that sees the round's rank and size (commits in memory, no checkpoint files):

    elasticctl submit --in-place --nproc-per-node 2 examples/accelerate_train.py -- --in-place

Rank 0 prints ``start step S world W accelerate N`` when a round starts training (W: the
process group's size, N: accelerate's ``num_processes``) and ``final step S checksum C`` at
the end (C: sha256 of the parameters' bytes, for comparing runs).
"""

import argparse
import hashlib
import os
import shutil
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 16


class Progress:
    """The step, saved and loaded with the accelerator's state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(samples, 1, generator=gen))


def network() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


def checksum(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def steps(accelerator, model, optimizer, loader, progress, args, after_step) -> None:
    """Train until ``args.max_steps``, resuming mid-epoch at ``progress.step``."""
    accelerator.print(
        f"start step {progress.step} world {dist.get_world_size()} "
        f"accelerate {accelerator.num_processes}",
        flush=True,
    )
    while progress.step < args.max_steps:
        skip = progress.step % len(loader)
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if args.step_seconds:
                time.sleep(args.step_seconds)
            after_step()
            if progress.step >= args.max_steps:
                break


def save(accelerator: Accelerator, directory: str, step: int) -> None:
    """The state in ``step_<n>``; ``latest`` names it once every rank has written its part."""
    path = os.path.join(directory, f"step_{step}")
    accelerator.save_state(path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        latest = os.path.join(directory, "latest")
        previous = open(latest).read().strip() if os.path.exists(latest) else ""
        with open(f"{latest}.tmp", "w") as f:
            f.write(path)
        os.replace(f"{latest}.tmp", latest)
        if previous and previous != path:
            shutil.rmtree(previous, ignore_errors=True)


def restarting(args: argparse.Namespace) -> None:
    accelerator = Accelerator(cpu=True)
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(data(args.samples), batch_size=args.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    latest = os.path.join(args.ckpt_dir, "latest") if args.ckpt_dir else ""
    if latest and os.path.exists(latest):
        with open(latest) as f:
            accelerator.load_state(f.read().strip())
    if args.ckpt_dir and accelerator.is_main_process:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    def after_step() -> None:
        if args.ckpt_dir and progress.step % args.every == 0:
            save(accelerator, args.ckpt_dir, progress.step)

    steps(accelerator, model, optimizer, loader, progress, args, after_step)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(
            f"final step {progress.step} checksum {checksum(accelerator.unwrap_model(model))}",
            flush=True,
        )


def in_place(args: argparse.Namespace) -> None:
    from elasticd import elastic
    from elasticd.elastic.accelerate import elastic_accelerator

    elastic.init("gloo")
    model = network()
    state = elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=args.lr), step=0)

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        accelerator = elastic_accelerator(cpu=True)  # this round's rank and size
        ddp, optimizer, loader = accelerator.prepare(
            state.model, state.optimizer, DataLoader(data(args.samples), batch_size=args.batch)
        )

        def after_step() -> None:
            if state.step % args.every == 0:
                state.commit()  # and check_host_updates(): a new round interrupts here

        steps(accelerator, ddp, optimizer, loader, state, args, after_step)

    train(state)
    if dist.get_rank() == 0:
        print(f"final step {state.step} checksum {checksum(state.model)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--ckpt-dir", default="", help="save_state here every --every steps; none: no checkpoints"
    )
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.0, help="stretch each step (for tests)")
    p.add_argument(
        "--in-place", action="store_true", help="for an --in-place job (elasticd.elastic.run)"
    )
    args = p.parse_args()
    set_seed(0)
    (in_place if args.in_place else restarting)(args)


if __name__ == "__main__":
    main()
