"""Recovery of a Lightning job from a node loss, elasticd side by side with torchrun.

    python tests/bench/bench_lightning.py [--runs 1] [--json] [--only "in place" ...]

bench_recovery.py's setting (each node a process on this host with its own 127.0.0.x
address: an elasticd daemon, node 1 hosting the store, or a torchrun agent with c10d
rendezvous on node 1, ``--monitor-interval 0.1``, ``last_call_timeout=1``), running
examples/lightning_train.py instead of a bare all_reduce loop: ``--nnodes 2:3``, one worker
per node, ``Trainer(num_nodes=3)`` through ``elastic_trainer_kwargs`` (both launchers set
GROUP_WORLD_SIZE), ``last.ckpt`` every 5 steps, steps stretched to 0.2 s. Once rank 0 has
taken 17 steps in the world of 3 (2 past a checkpoint), node 3 is SIGKILLed (the daemon or the agent, with its
worker). Figures, from rank 0's steps (the script's ``--report``):

- *resumed*: from the kill to rank 0's first step in the world of 2;
- *steps lost*: the newest step before the kill minus the step the world of 2 starts from
  (it resumes from ``last.ckpt``; a step is redone, not lost, but costs its time again).

Three columns: elasticd's restart path (every worker started afresh, ``last.ckpt``),
elasticd ``--in-place`` (the script's ``--in-place``: ``elastic_fit``, Lightning's state
committed in memory every 5 steps, no checkpoint files; the survivors re-form in their own
processes) and torchrun. The bench polls the report file (benchmarks may).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_recovery import ENV, LAUNCHER, PY, Elasticd, Events, Torchrun

ROOT = HERE.parent.parent
SCRIPT = str(ROOT / "examples" / "lightning_train.py")
CAP = 300.0  # seconds a run may take to resume before it counts as not resumed


def script_args(base: Path) -> list[str]:
    return [
        "--num-nodes",
        "3",
        "--elasticd",
        "--ckpt-dir",
        str(base / "ckpt"),
        "--every",
        "5",
        "--max-steps",
        "100000",
        "--step-seconds",
        "0.2",
        "--report",
        str(base / "events.jsonl"),
    ]


class ElasticdLightning(Elasticd):
    name = "elasticd"

    def launch(self, count: int, nnodes: str) -> float:
        for daemon in self.cluster.daemons[:count]:
            daemon.start()
        job = self.cluster[0].submit(
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "3",
            "--python",
            PY,
            SCRIPT,
            "--",
            *script_args(self.base),
        )
        return float(job["created"])


class ElasticdLightningInPlace(ElasticdLightning):
    name = "in place"

    def launch(self, count: int, nnodes: str) -> float:
        for daemon in self.cluster.daemons[:count]:
            daemon.start()
        args = [
            a for a in script_args(self.base) if a not in ("--ckpt-dir", str(self.base / "ckpt"))
        ]
        job = self.cluster[0].submit(
            "--in-place",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "3",
            "--python",
            PY,
            SCRIPT,
            "--",
            "--in-place",
            *args,
        )
        return float(job["created"])


class TorchrunLightning(Torchrun):
    name = "torchrun"
    env = {
        **ENV,
        "PYTHONPATH": str(ROOT / "daemon"),
    }  # elasticd.elastic.lightning, as elasticd's workers get it

    def add_node(self) -> tuple[float, int]:
        index = len(self.agents) + 1
        argv = [
            PY,
            LAUNCHER,
            str(self.base),
            "torch.distributed.run",
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv-id",
            "bench",
            "--rdzv-conf",
            "last_call_timeout=1,join_timeout=120",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.1",
            "--local-addr",
            f"127.0.0.{index}",
            SCRIPT,
            *script_args(self.base),
        ]
        started = time.time()
        log = open(self.base / f"torchrun{index}.log", "wb")
        self.agents.append(
            subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        )
        return started, self.agents[-1].pid


def steps(events: list[dict[str, Any]], world: int, after: float = 0.0) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "step" and e["world"] == world and e["t"] > after]


def node_loss(system: Any) -> dict[str, float] | None:
    system.launch(3, "2:3")
    events: Events = system.events
    if not events.wait(lambda ev: True if len(steps(ev, 3)) >= 17 else None, CAP):
        raise RuntimeError(
            f"{system.name}: no 17 steps in a world of 3 within {CAP:g} s ({system.base})"
        )
    t0 = system.kill_node(2)
    before = max(e["step"] for e in events.read() if e["event"] == "step" and e["t"] <= t0)
    first = events.wait(lambda ev: (steps(ev, 2, t0) or [None])[0], CAP)
    if first is None:
        return None
    return {"resumed": first["t"] - t0, "steps lost": float(before - (first["step"] - 1))}


def measure(kind: Any) -> dict[str, float] | None:
    base = Path(tempfile.mkdtemp(prefix="elasticd-lightning-"))
    base.chmod(0o755)
    system = kind(base, 3)
    try:
        result = node_loss(system)
    finally:
        system.stop()
    if result is None:
        print(f"{kind.name} did not resume within {CAP:g} s; its logs: {base}", file=sys.stderr)
    else:
        shutil.rmtree(base, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--only",
        action="append",
        choices=["elasticd", "in place", "torchrun"],
        help="measure only these (repeatable; default: all three)",
    )
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    report = {}
    kinds = tuple(
        k
        for k in (ElasticdLightning, ElasticdLightningInPlace, TorchrunLightning)
        if not args.only or k.name in args.only
    )
    for kind in kinds:
        report[kind.name] = [measure(kind) for _ in range(args.runs)]
        print(f"{kind.name:9} {report[kind.name]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report))
        return
    print(f"{'node SIGKILLed (3 -> 2), Lightning':40}" + "".join(f"{k.name:>12}" for k in kinds))
    for key in ("resumed", "steps lost"):
        cells = []
        for kind in kinds:
            done = [r[key] for r in report[kind.name] if r is not None]
            cells.append(f"{statistics.median(done):.1f}" if done else f"none in {CAP:g} s")
        print(
            f"{key + (' (s)' if key == 'resumed' else ''):40}" + "".join(f"{c:>12}" for c in cells)
        )


if __name__ == "__main__":
    main()
