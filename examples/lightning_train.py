"""A Lightning ``Trainer(strategy="ddp")`` script, written as Lightning's docs write one
(CPU, gloo): a small regression MLP, ``ModelCheckpoint`` keeping ``last.ckpt``, and
``fit(ckpt_path="last")`` so that a restarted round resumes from it.

The same command line under torchrun and under elasticd:

    torchrun --nproc-per-node 2 examples/lightning_train.py --ckpt-dir /tmp/ck
    elasticctl submit --nproc-per-node 2 --wait examples/lightning_train.py -- --ckpt-dir /tmp/ck

``--num-nodes N`` is Lightning's ``Trainer(num_nodes=N)``, a constant; on a job whose node
count changes (``--nnodes 2:3``) add ``--elasticd``: ``num_nodes`` then goes through
``elasticd.elastic.lightning.elastic_trainer_kwargs``, which gives Lightning each round's
count. Rank 0 prints ``start step S world W nodes N`` when training starts and ``final step
S checksum C`` at the end (C: sha256 of the parameters' bytes, for comparing runs).

``--in-place`` is the same training for an ``--in-place`` job (one worker per node):
``elasticd.elastic.lightning.elastic_fit`` builds a Trainer per round and commits Lightning's
state in memory every ``--every`` steps (no checkpoint files, no shared directory; with
``--ckpt-dir`` too, ``last.ckpt`` is where a group restart resumes):

    elasticctl submit --in-place --nnodes 1:3 examples/lightning_train.py -- --in-place --num-nodes 3

With ``--report FILE`` rank 0 also appends a JSON line per step there, and every rank one
when it starts training (the recovery bench and the tests read it; a user can ignore it).
"""

import argparse
import hashlib
import json
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 16


class Regressor(L.LightningModule):
    def __init__(self, lr: float, step_seconds: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.lr = lr
        self.step_seconds = step_seconds

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero:
            print(
                f"start step {self.trainer.global_step} world {self.trainer.world_size} "
                f"nodes {self.trainer.num_nodes}",
                flush=True,
            )


class Report(L.Callback):
    """Rank 0's steps, one JSON line each: when, which step, in which world, by which process;
    and every rank's start of training (a round's first step, its rank and process)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        with open(self.path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "event": "start",
                        "t": time.time(),
                        "step": trainer.global_step,
                        "world": trainer.world_size,
                        "rank": trainer.global_rank,
                        "pid": os.getpid(),
                    }
                )
                + "\n"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "event": "step",
                            "t": time.time(),
                            "step": trainer.global_step,
                            "world": trainer.world_size,
                            "pid": os.getpid(),
                        }
                    )
                    + "\n"
                )


def data(samples: int) -> TensorDataset:
    """The same synthetic data on every rank: y = X·w + noise."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(samples, 1, generator=gen))


def checksum(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...)")
    p.add_argument("--devices", type=int, default=1, help="Trainer(devices=...)")
    p.add_argument(
        "--elasticd", action="store_true", help="num_nodes through elastic_trainer_kwargs"
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="an --in-place job: elastic_fit, commits in memory every --every steps",
    )
    p.add_argument(
        "--ckpt-dir",
        default="",
        help="ModelCheckpoint's directory (last.ckpt); none: no checkpoints",
    )
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--step-seconds", type=float, default=0.0, help="stretch each step (for tests)")
    p.add_argument("--report", default="", help="(benchmarks) append rank 0's steps to this file")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    model = Regressor(args.lr, args.step_seconds)
    loader = DataLoader(data(args.samples), batch_size=args.batch)
    callbacks = (
        [
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                save_last=True,
                save_top_k=0,
                every_n_train_steps=args.every,
                enable_version_counter=False,
            )
        ]
        if args.ckpt_dir
        else []
    )
    callbacks += [Report(args.report)] if args.report else []
    if args.in_place:
        from elasticd import elastic
        from elasticd.elastic.lightning import elastic_fit

        elastic.init("gloo")

        def make_trainer(**round_kwargs):  # the round's num_nodes and cluster environment
            return L.Trainer(
                accelerator="cpu",
                devices=args.devices,
                strategy="ddp",
                max_steps=args.max_steps,
                callbacks=list(callbacks),
                enable_checkpointing=bool(args.ckpt_dir),
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                **round_kwargs,
            )

        # --ckpt-dir as well: last.ckpt is where a group restart (every worker new, the
        # in-place fallback) resumes; the survivors of a change resume from memory.
        trainer = elastic_fit(
            make_trainer,
            model,
            loader,
            num_nodes=args.num_nodes,
            every_n_steps=args.every,
            ckpt_path="last" if args.ckpt_dir else None,
        )
        if trainer.is_global_zero:
            print(f"final step {trainer.global_step} checksum {checksum(model)}", flush=True)
        return
    if args.elasticd:
        from elasticd.elastic.lightning import elastic_trainer_kwargs

        nodes = elastic_trainer_kwargs(num_nodes=args.num_nodes)
    else:
        nodes = {"num_nodes": args.num_nodes}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_steps=args.max_steps,
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **nodes,
    )
    trainer.fit(model, loader, ckpt_path="last" if args.ckpt_dir else None)
    if trainer.is_global_zero:
        print(f"final step {trainer.global_step} checksum {checksum(model)}", flush=True)
    # Lightning leaves the process group up; gloo's threads then die with the interpreter,
    # and a rank may abort at exit ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
