"""How long the training loop is blocked per checkpoint of an FSDP2 model with AdamW, side by
side in one run: elasticd's writer into the checkpoint tier against a bare copy of the rank's
tensors, ``dcp.save`` and ``dcp.async_save`` to local disk, and ``torch.save`` of the full
state from rank 0.

    python tests/bench/bench_checkpoint.py [--ranks 3] [--params 250e6] [--saves 3] [--json]

``--ranks`` gloo ranks on this host (one process each, one intra-op thread), a stack of
bias-free ``Linear(H, H)`` layers of about ``--params`` parameters, each layer and the whole
``fully_shard``-ed over the ranks, one AdamW step taken (its moments exist), then the state
dict of DCP (``get_state_dict``) saved ``--saves`` times by each method.  Figures, medians
over the saves of the slowest rank's time:

- *bare copy*: a clone of each of the rank's tensors (model and optimizer shards): the floor
  for any staging;
- *elasticd commit*: what a ``TorchState`` commit of a sharded model blocks for: DCP's
  ``DefaultStager`` copies the rank's tensors into CPU buffers it keeps from one save to the
  next (the first save allocates them: not in the median), then a thread writes the staged
  copy with ``elasticd.elastic.checkpoint.save`` on a gloo group of its own; *in tier* once
  that write is done (the commit's own wait for the daemons' copy to another node is not
  here: no daemon runs);
- *elasticd tier*: ``elasticd.elastic.checkpoint.save`` into a directory on tmpfs
  (``/dev/shm``), as a worker's ``ELASTICD_CHECKPOINT_DIR`` is: the call returns once the
  rank's bytes are in the node's memory and rank 0's metadata is written.  No daemon runs
  here: what the daemon does next (hash, copy to another node, to disk) runs in its own
  process and is not part of these figures; in an ``--in-place`` job a ``TorchState``
  commit also waits for the commit before it to be complete (not measured here);
- *dcp.save disk*: DCP's ``FileSystemWriter`` into a directory on local disk (it fsyncs);
- *dcp.async_save disk*: blocked until ``async_save`` returns (its staging), *on disk* once
  its future is done;
- *torch.save rank 0*: the full state gathered to rank 0's CPU (``full_state_dict``,
  ``cpu_offload``) and ``torch.save``d there, fsynced; every rank waits (a barrier).

``--in-place``: instead, commits every step in an ``--in-place`` job on 3 real daemons (one
worker each, examples/fsdp_elastic_train.py, FSDP2, ``--commit-every 1``): how long each
``state.commit()`` blocked (the write into the tier, and the wait for the commit before it
to be complete: hashed and copied to another node by the daemons), against the step; from
the daemons' metrics (the job has a ``--checkpoint-dir`` on local disk), the lags from a
save to its copy on another node and to disk, and the most bytes each node held, in shares.

Each save is deleted before the next.  Memory: the state (parameters, gradients, two
moments: 16 bytes a parameter over the ranks), one save's staging per rank, and the full
state on rank 0 for the last method: about 5 GB at 250M parameters.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
METHODS = (
    "bare copy",
    "elasticd commit",
    "elasticd tier",
    "dcp.save disk",
    "dcp.async_save disk",
    "torch.save rank 0",
)
HIDDEN = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a rank ---------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from elasticd.elastic import checkpoint

    torch.set_num_threads(1)
    rank, world = args.rank, args.ranks
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=1800),
    )
    layers = max(1, round(args.params / HIDDEN**2))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, HIDDEN**-0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, HIDDEN)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}

    def local_tensors() -> list[torch.Tensor]:
        found = []
        for value in [*model_sd.values(), *_leaves(optim_sd)]:
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                found.append(value)
        return found

    shard_bytes = sum(t.numel() * t.element_size() for t in local_tensors())
    memory = Path(args.memory)
    disk = Path(args.disk)

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def clean(path: Path) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            if path.with_suffix(".pt").exists():
                path.with_suffix(".pt").unlink()
        dist.barrier()

    results: dict[str, dict[str, list[float]]] = {m: {"blocked": []} for m in METHODS}
    results["dcp.async_save disk"]["on disk"] = []
    results["elasticd commit"]["in tier"] = []
    stager = DefaultStager(StagingOptions(False, False, False, False))
    writers = dist.new_group(backend="gloo")
    background = ThreadPoolExecutor(1)
    for save in range(args.saves):
        # a bare copy of the rank's tensors
        dist.barrier()
        started = time.monotonic()
        copies = [t.clone() for t in local_tensors()]
        results["bare copy"]["blocked"].append(slowest(time.monotonic() - started))
        del copies

        path = memory / f"commit-{save}"
        dist.barrier()
        started = time.monotonic()
        staged = stager.stage(state)
        blocked = time.monotonic() - started
        written = background.submit(checkpoint.save, staged, str(path), process_group=writers)
        written.result()
        results["elasticd commit"]["blocked"].append(slowest(blocked))
        results["elasticd commit"]["in tier"].append(slowest(time.monotonic() - started))
        clean(path)

        path = memory / f"tier-{save}"
        dist.barrier()
        started = time.monotonic()
        checkpoint.save(state, str(path))
        results["elasticd tier"]["blocked"].append(slowest(time.monotonic() - started))
        clean(path)

        path = disk / f"dcp-{save}"
        dist.barrier()
        started = time.monotonic()
        dcp.save(state, checkpoint_id=str(path))
        results["dcp.save disk"]["blocked"].append(slowest(time.monotonic() - started))
        clean(path)

        path = disk / f"async-{save}"
        dist.barrier()
        started = time.monotonic()
        pending = dcp.async_save(state, checkpoint_id=str(path))
        blocked = time.monotonic() - started
        future = getattr(pending, "upload_completion", pending)
        future.result()
        results["dcp.async_save disk"]["blocked"].append(slowest(blocked))
        results["dcp.async_save disk"]["on disk"].append(slowest(time.monotonic() - started))
        clean(path)

        path = disk / f"full-{save}"
        dist.barrier()
        started = time.monotonic()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_model, full_optim = get_state_dict(model, optimizer, options=options)
        if rank == 0:
            with open(path.with_suffix(".pt"), "wb") as f:
                torch.save({"model": full_model, "optim": full_optim}, f)
                f.flush()
                os.fsync(f.fileno())
        del full_model, full_optim
        dist.barrier()
        results["torch.save rank 0"]["blocked"].append(time.monotonic() - started)
        clean(path)

    if rank == 0:
        doc = {
            "ranks": world,
            "params": sum(p.numel() for p in model.parameters()),
            "layers": layers,
            "shard_bytes": shard_bytes,
            "results": results,
        }
        Path(args.out).write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


# -- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    memory = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.disk_dir))
    out = disk / "result.json"
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT / 'daemon'}:{os.environ.get('PYTHONPATH', '')}",
    }
    env.pop("ELASTICD_CHECKPOINT_DIR", None)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--rank", str(rank), "--port", str(port)]
            + ["--ranks", str(args.ranks), "--params", str(args.params)]
            + ["--saves", str(args.saves), "--memory", str(memory), "--disk", str(disk)]
            + ["--out", str(out)],
            env=env,
        )
        for rank in range(args.ranks)
    ]
    try:
        codes = [proc.wait() for proc in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return json.loads(out.read_text())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def scrape(daemon: Any) -> dict[str, float]:
    """The daemon's metric samples, ``name{labels}`` -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read()
    found = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            found[sample] = float(value)
    return found


def held_bytes(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith("elasticd_checkpoint_bytes{"))


def lag(samples: list[dict[str, float]], name: str) -> dict[str, float]:
    """A histogram over every node: the count, the mean and the bucket bounds of its median
    and p90 (the smallest ``le`` holding that share of the observations)."""
    count = sum(s.get(f"{name}_count", 0.0) for s in samples)
    total = sum(s.get(f"{name}_sum", 0.0) for s in samples)
    buckets: dict[float, float] = {}
    for s in samples:
        for key, value in s.items():
            if key.startswith(f"{name}_bucket{{"):
                le = float(key.split('le="')[1].split('"')[0])
                buckets[le] = buckets.get(le, 0.0) + value
    bound = {
        q: next((le for le, n in sorted(buckets.items()) if n >= q * count), float("inf"))
        for q in (0.5, 0.9)
    }
    return {"count": count, "mean": total / count if count else float("nan"), **bound}


def ended(status: dict[str, Any]) -> None:
    """Stop the bench (its ``finally`` cleans up) where the job ended before its workers
    finished: a commit over the tier's cap fails the job, as documented."""
    if status.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"):
        why = (status.get("error") or {}).get("message") or "no reason given"
        raise SystemExit(f"the in-place job ended {status['state']} before its steps: {why}")


def in_place(args: argparse.Namespace) -> dict[str, Any]:
    """Commits every step in an --in-place job on 3 daemons: blocked per commit, per step;
    from the daemons' metrics: the lags to the copy on another node and to disk, and the
    bytes each node holds (sampled every 0.2 s)."""
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE.parent / "system"))
    from conftest import Cluster
    from hostwide import remove_tree

    base = Path(tempfile.mkdtemp(prefix="bench-ckpt-inplace-", dir="/tmp"))
    base.chmod(0o755)
    report = base / "report"
    report.mkdir(mode=0o777)
    disk = Path(tempfile.mkdtemp(prefix="bench-ckpt-inplace-disk-", dir=args.disk_dir))
    disk.chmod(0o777)
    cluster = Cluster(base, 3, slots=1, resize_interval=None)
    peak = [0.0, 0.0, 0.0]
    try:
        for daemon in cluster.daemons:
            daemon.start()
        steps = args.steps
        job = cluster[0].submit(
            "--in-place",
            "--nnodes",
            "3",
            "--max-restarts",
            "0",
            "--checkpoint-dir",
            str(disk),
            "--keep-checkpoints",
            "2",
            "--env",
            "OMP_NUM_THREADS=1",
            str(ROOT / "examples" / "fsdp_elastic_train.py"),
            "--",
            "--steps",
            str(steps),
            "--commit-every",
            "1",
            "--hidden",
            str(args.hidden),
            "--ffn",
            str(4 * args.hidden),
            "--layers",
            str(args.layers),
            "--report",
            str(report),
        )["id"]
        path = report / "events.jsonl"
        deadline = time.monotonic() + 1200
        events: list[dict[str, Any]] = []
        asked = 0.0
        while time.monotonic() < deadline:
            for i, daemon in enumerate(cluster.daemons):
                peak[i] = max(peak[i], held_bytes(scrape(daemon)))
            if path.exists():
                events = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
            if len([e for e in events if e["event"] == "done"]) == 3:
                break
            if time.monotonic() - asked > 2.0:  # a job that ended short of its steps
                asked = time.monotonic()
                ended(cluster[0].ctl("status", job))
            time.sleep(0.2)
        else:
            raise SystemExit("the in-place job did not finish in 1200 s")
        checkpoint = cluster[0].ctl("status", job).get("checkpoint") or {}
        metrics = [scrape(daemon) for daemon in cluster.daemons]
    finally:
        cluster.stop()
        remove_tree(base)
        shutil.rmtree(disk, ignore_errors=True)
    commits = [e for e in events if e["event"] == "commit" and e["step"] > 1]
    blocked = [e["blocked"] for e in commits]
    by_rank: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "step":
            by_rank.setdefault(e["rank"], []).append(e["time"])
    intervals = [b - a for times in by_rank.values() for a, b in itertools.pairwise(times)]
    hidden, layers = args.hidden, args.layers
    params = layers * (2 * hidden * 4 * hidden + 5 * hidden) + hidden + 1
    return {
        "params": params,
        "state_bytes_per_rank": params * 12 / 3,
        "commits": len(blocked),
        "blocked": blocked,
        "waited": [e.get("waited", 0.0) for e in commits],
        "staged": [e.get("staged", 0.0) for e in commits],
        "step_intervals": intervals,
        "share_bytes": (checkpoint.get("size") or 0) / 3,
        "held_peak": peak,
        "save_lag": lag(metrics, "elasticd_checkpoint_save_seconds"),
        "copy_lag": lag(metrics, "elasticd_checkpoint_copy_seconds"),
        "disk_lag": lag(metrics, "elasticd_checkpoint_disk_seconds"),
    }


def print_in_place(doc: dict[str, Any]) -> None:
    blocked = sorted(doc["blocked"])
    p90 = blocked[int(0.9 * (len(blocked) - 1))]
    print(
        f"in place, 3 daemons, FSDP2, {doc['params'] / 1e6:.1f}M parameters "
        f"(~{doc['state_bytes_per_rank'] / 2**20:.0f} MiB of parameters and moments per rank), "
        f"a commit every step: {doc['commits']} commits; blocked per commit median "
        f"{statistics.median(blocked):.3f} s, p90 {p90:.3f} s, max {blocked[-1]:.3f} s "
        f"(of which waiting for the commit before it: median "
        f"{statistics.median(doc['waited']):.3f} s; staging: median "
        f"{statistics.median(doc['staged']):.3f} s); "
        f"step to step (commit included) median {statistics.median(doc['step_intervals']):.3f} s"
    )
    for name, what in (
        ("save_lag", "first file -> share described, hashed and copied"),
        ("copy_lag", "share whole -> its copy landed on another node"),
        ("disk_lag", "first file -> share in --checkpoint-dir"),
    ):
        m = doc[name]
        print(
            f"  {what}: {m['count']:.0f} shares, mean {m['mean']:.2f} s, "
            f"median <= {m[0.5]:g} s, p90 <= {m[0.9]:g} s"
        )
    share = doc["share_bytes"]
    if share:
        peaks = ", ".join(f"{p / share:.1f}" for p in doc["held_peak"])
        print(
            f"  held in each node's memory at most (in shares of {share / 2**20:.0f} MiB): "
            f"{peaks} (bound: its own share and the copy it keeps, of the newest complete "
            "checkpoint and of the save in flight: 4)"
        )


def print_table(doc: dict[str, Any]) -> None:
    results = doc["results"]
    median = {m: statistics.median(results[m]["blocked"]) for m in METHODS}
    kept = results["elasticd commit"]["blocked"][1:]  # the first save allocates the buffers
    median["elasticd commit"] = statistics.median(kept or results["elasticd commit"]["blocked"])
    print(
        f"{doc['params'] / 1e6:.0f}M parameters ({doc['layers']} x Linear({HIDDEN}, {HIDDEN})), "
        f"AdamW, FSDP2 over {doc['ranks']} gloo ranks; {doc['shard_bytes'] / 2**20:.0f} MiB "
        f"of state per rank; medians of {len(results['bare copy']['blocked'])} saves"
    )
    print(f"{'method':<22} {'blocked (s)':>12} {'x bare copy':>12} {'done (s)':>12}")
    for method in METHODS:
        on_disk = results[method].get("on disk") or results[method].get("in tier")
        disk = f"{statistics.median(on_disk):12.2f}" if on_disk else f"{'':>12}"
        if method in ("dcp.save disk", "torch.save rank 0"):
            disk = f"{median[method]:12.2f}"
        ratio = median[method] / median["bare copy"]
        print(f"{method:<22} {median[method]:12.2f} {ratio:12.1f} {disk}")
    commit = median["elasticd commit"]
    print(
        f"elasticd commit: {commit / median['bare copy']:.2f}x a bare copy (target <= 1.5), "
        f"dcp.save to disk {median['dcp.save disk'] / commit:.1f}x longer (target >= 10), "
        f"dcp.async_save's staging {median['dcp.async_save disk'] / commit:.1f}x longer; "
        f"its first save (buffers allocated) {results['elasticd commit']['blocked'][0]:.2f} s; "
        "done: in the tier (elasticd commit), on disk (the others)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--params", type=float, default=250e6)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="a local disk's dir")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--in-place", action="store_true", help="commits every step, in place")
    parser.add_argument("--steps", type=int, default=30, help="--in-place: steps")
    parser.add_argument("--hidden", type=int, default=1024, help="--in-place: model width")
    parser.add_argument("--layers", type=int, default=4, help="--in-place: blocks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--memory", default="", help=argparse.SUPPRESS)
    parser.add_argument("--disk", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    doc = in_place(args) if args.in_place else run(args)
    if args.json:
        print(json.dumps(doc))
    elif args.in_place:
        print_in_place(doc)
    else:
        print_table(doc)


if __name__ == "__main__":
    main()
