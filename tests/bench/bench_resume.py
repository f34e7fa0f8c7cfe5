"""Training resumed after a lost node, from checkpoints: an FSDP2 job in place and on the
restart path from elasticd's checkpoint tier, against torchrun with the same script saving
to local disk.

    python tests/bench/bench_resume.py [--runs 2] [--hidden 2048] [--layers 8] [--json]
        [--optimizer adamw|sgd]

Three "nodes" on this host (127.0.0.x, as in bench_recovery.py: a daemon or a torchrun agent
each, one worker each), ``--nnodes 2:3``, running the same unchanged script,
examples/dcp_train.py (FSDP2 over the world, AdamW or ``--optimizer sgd`` with momentum,
gloo, one intra-op thread, a DCP checkpoint every ``--save-every`` steps):

- *elasticd, in place*: ``--in-place``, examples/fsdp_elastic_train.py (``TorchState``, a
  commit every ``--commit-every`` steps; each block two ``Linear(H, H/2)``: the same
  parameters and FLOPs as dcp_train's ``Linear(H, H)``): the survivors keep their processes
  and load their new shards from the tier, resharded to 2;
- *elasticd, tier*: the script saves to ``ELASTICD_CHECKPOINT_DIR``: each node's share in its
  daemon's memory, a copy on another node; before the restarted workers start, their
  daemons put the newest complete checkpoint in place (node 3's share from its copy);
- *elasticd, tier, warm restart*: the same with ``--warm-restart``: the restarted workers
  are standbys that imported torch (and the script's torch modules) while the job trained;
- *elasticrun, tier*: torchrun's line with ``s/torchrun/elasticrun/``, no daemon installed
  (a private one per node): the same tier;
- *torchrun, disk*: the script saves to ``--ckpt-dir`` on this host's disk, which stands for
  a shared file system every node reads; *torchrun-unshared* the same with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (bench_recovery.py says why).

Once every rank has saved twice and taken ``--kill-after`` more steps, node 3 (its daemon or
agent, and its worker) is SIGKILLed (``--kill-after 0``: at once after the save, before the
tier's copy of it to another node can have landed: it is then lost with the node, and the
one before it is restored).
The survivors' collectives break, their workers are restarted at world 2 and load the
newest checkpoint, resharded by DCP.  With ``--cold`` (root) the page cache is dropped at
the kill, so that torchrun's load reads the disk, as a restarted node on a shared file
system would (tmpfs pages are not dropped: they are the tier).  Figures, per run:

- *resumed*: the kill -> the last survivor's first step at world 2 (everything: the loss
  noticed, the workers stopped, the rendezvous, Python and torch imported, the load);
- *stall*: the last step any rank took before the kill -> the same;
- *loaded*: that last step -> both ranks at 2 have built their model and loaded the state
  (the stall less the first step at 2, which is the script's and the machine's);
- *loaded at*: the step the world of 2 resumed from; *lost*: the newest step any rank had
  taken before the kill minus it (steps to redo); *kept*: survivors in their own process.

The bench polls the event file every 20 ms.  A run that fails keeps its directory (named on
stderr) and its cell says why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_recovery as recovery  # tests/bench: the nodes as processes
from harness import PY
from hostwide import remove_tree

SCRIPT = str(HERE.parent.parent / "examples" / "dcp_train.py")
IN_PLACE = str(HERE.parent.parent / "examples" / "fsdp_elastic_train.py")
LOSS_CAP = 180.0


class Run:
    """What every system is told: the script's arguments and where it reports."""

    def __init__(self, base: Path, args: argparse.Namespace) -> None:
        self.report = base / "report"
        self.report.mkdir(mode=0o777)
        self.log = recovery.Events(self.report)
        common = ["--steps", "1000000", "--hidden", str(args.hidden), "--layers", str(args.layers)]
        common += ["--global-batch", "24", "--optimizer", args.optimizer]
        common += ["--report", str(self.report)]
        self.script = [*common, "--save-every", str(args.save_every), "--report-steps"]
        # a block of two Linear(H, H/2): the parameters and FLOPs of dcp_train's Linear(H, H)
        self.in_place = [*common, "--commit-every", str(args.commit_every)]
        self.in_place += ["--ffn", str(args.hidden // 2)]

    def events(self) -> list[dict[str, Any]]:
        return self.log.read()


class ElasticdTier(recovery.Elasticd):
    name = "elasticd, tier"
    saved = "save"  # the script's event for a checkpoint taken
    run: Run

    def job_line(self) -> tuple[str, ...]:
        return ("--env", "OMP_NUM_THREADS=1", "--python", PY, SCRIPT, "--", *self.run.script)


class ElasticdWarmTier(ElasticdTier):
    """The tier, and ``--warm-restart``: the restarted workers are standbys that imported
    torch (and the script's torch modules) while the job trained."""

    name = "elasticd, tier, warm restart"
    options = ("--warm-restart",)


class ElasticdInPlace(recovery.Elasticd):
    """``--in-place``: examples/fsdp_elastic_train.py (``elastic.TorchState``), the same
    width, depth and batch; the survivors keep their processes and load their new shards
    from the tier's last commit, resharded to 2."""

    name = "elasticd, in place"
    options = ("--in-place",)
    saved = "commit"
    run: Run

    def job_line(self) -> tuple[str, ...]:
        line = (IN_PLACE, "--", *self.run.in_place)
        return ("--env", "OMP_NUM_THREADS=1", "--python", PY, *line)


class TorchrunLine:
    """The script on a torchrun line, one intra-op thread (``--ckpt-dir`` on disk:
    elasticrun's workers save to ``ELASTICD_CHECKPOINT_DIR`` instead, which the script
    prefers).  Mixed into a bench_recovery system whose nodes run that line."""

    base: Path
    run: Run
    saved = "save"

    def worker_args(self) -> list[str]:
        disk = self.base / "ckpt"
        disk.mkdir(exist_ok=True)
        return [SCRIPT, "--ckpt-dir", str(disk), *self.run.script]

    def node_env(self) -> dict[str, str]:
        return {**super().node_env(), "OMP_NUM_THREADS": "1"}  # type: ignore[misc]  # a mixin


class TorchrunDisk(TorchrunLine, recovery.Torchrun):
    name = "torchrun, disk"


class TorchrunUnsharedDisk(TorchrunDisk):
    """torchrun with its documented opt-out of sharing the rendezvous store with the workers
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""

    name = "torchrun-unshared, disk"
    env = recovery.TorchrunUnshared.env


class ElasticrunTier(TorchrunLine, recovery.Elasticrun):
    """torchrun's line with ``s/torchrun/elasticrun/``: a private daemon per node, and so the
    checkpoint tier, with no elasticd installed."""

    name = "elasticrun, tier"


def wait(run: Run, found: Any, timeout: float, what: str) -> Any:
    result = run.log.wait(found, timeout)
    if result is None:
        raise recovery.Unmeasured(f"{what} (not in {timeout:.0f} s)")
    return result


def past_the_second_save(steps: int, saved: str):
    """Once every rank of the world of 3 saved twice (events ``saved``) and took ``steps``
    more steps."""

    def found(events: list[dict[str, Any]]) -> bool | None:
        saves: dict[int, list[int]] = {}
        for e in events:
            if e["event"] == saved and e["world"] == 3:
                saves.setdefault(e["rank"], []).append(e["step"])
        if len(saves) < 3 or min(len(s) for s in saves.values()) < 2:
            return None
        second = max(s[1] for s in saves.values())
        ranks = {
            e["rank"]
            for e in events
            if e["event"] == "step" and e["world"] == 3 and e["step"] >= second + steps
        }
        return True if len(ranks) == 3 else None

    return found


def back_at_two(t0: float):
    """Once both ranks of the world of 2 took a step after t0: their starts and first steps."""

    def found(events: list[dict[str, Any]]) -> dict[str, Any] | None:
        starts = {
            e["rank"]: e
            for e in events
            if e["event"] == "start" and e["world"] == 2 and e["time"] > t0
        }
        firsts: dict[int, dict[str, Any]] = {}
        for e in events:
            if e["event"] == "step" and e["world"] == 2 and e["time"] > t0:
                firsts.setdefault(e["rank"], e)
        if len(starts) < 2 or len(firsts) < 2:
            return None
        return {"starts": starts, "firsts": firsts}

    return found


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def node_loss(system: Any, run: Run, args: argparse.Namespace) -> dict[str, float]:
    system.run = run
    system.launch(3, "2:3")
    past = past_the_second_save(args.kill_after, system.saved)
    wait(run, past, 600, "three ranks past their second save")
    t0 = system.kill_node(2)
    if args.cold:
        drop_page_cache()
    before = [e for e in run.events() if e["event"] == "step" and e["time"] <= t0]
    found = wait(run, back_at_two(t0), LOSS_CAP, "training at 2 after the kill")
    loaded = {e["step"] for e in found["starts"].values()}
    if len(loaded) != 1:
        raise recovery.Unmeasured(f"the ranks resumed from different steps: {loaded}")
    at = loaded.pop()
    back = max(e["time"] for e in found["firsts"].values())
    ready = max(e["time"] for e in found["starts"].values())
    survivors = {e["pid"] for e in found["starts"].values()} & {e["pid"] for e in before}
    last = max(e["time"] for e in before)
    phases = {  # the script's own phase points, the later rank's, since the kill
        phase: max(e["phases"][phase] for e in found["starts"].values()) - t0
        for phase in next(iter(found["starts"].values())).get("phases", {})
    }
    return {
        **{f"@{phase}": at for phase, at in phases.items()},
        "resumed": back - t0,
        "stall": back - last,
        "loaded": ready - last,
        "loaded at": float(at),
        "lost": float(max(e["step"] for e in before) - at),
        "kept": float(len(survivors)),
    }


def measure(kind: Any, args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="elasticd-resume-", dir=args.disk_dir))
    base.chmod(0o755)
    result: dict[str, Any]
    try:
        system = kind(base, 3)
        try:
            result = node_loss(system, Run(base, args), args)
        finally:
            system.stop()
    except Exception as exc:  # a failed run is its table cell, not the bench's end
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        result = {"unmeasured": f"{type(exc).__name__}: {why}"}
    if "unmeasured" in result or args.keep:
        print(f"{kind.name}: {result.get('unmeasured', 'kept')}; its logs: {base}", file=sys.stderr)
    else:
        remove_tree(base)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default="adamw",
        help="sgd (momentum): half AdamW's state, for a model too large for AdamW here",
    )
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--commit-every", type=int, default=1, help="in place: its commits")
    parser.add_argument("--kill-after", type=int, default=3, help="steps past the second save")
    parser.add_argument("--cold", action="store_true", help="drop the page cache at the kill")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="a local disk's dir")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep every run's directory")
    parser.add_argument(
        "--only", action="append", default=[], help="the systems whose name starts so (again: or)"
    )
    args = parser.parse_args()
    if args.cold and os.geteuid() != 0:
        raise SystemExit("--cold drops the page cache: run as root")
    systems = [
        kind
        for kind in (
            ElasticdInPlace,
            ElasticdTier,
            ElasticdWarmTier,
            ElasticrunTier,
            TorchrunDisk,
            TorchrunUnsharedDisk,
        )
        if not args.only or any(kind.name.startswith(prefix) for prefix in args.only)
    ]
    results = {kind.name: [measure(kind, args) for _ in range(args.runs)] for kind in systems}
    params = args.layers * (args.hidden**2 + args.hidden) + args.hidden + 1
    doc = {"params": params, "args": vars(args), "results": results}
    if args.json:
        print(json.dumps(doc))
        return
    optimizer, moments = ("AdamW", 2) if args.optimizer == "adamw" else ("SGD (momentum)", 1)
    share = params * 4 * (1 + moments) / 3 / 2**20
    print(
        f"node 3 of 3 SIGKILLed, restart at 2; examples/dcp_train.py, FSDP2 + {optimizer}, "
        f"{params / 1e6:.1f}M parameters (~{share:.0f} MiB of parameters "
        f"and moments per rank at 3), a checkpoint every {args.save_every} steps, the kill "
        f"{args.kill_after} steps after the second; "
        f"{'page cache dropped at the kill' if args.cold else 'page cache kept'}; "
        f"medians of {args.runs} runs"
    )
    print(
        f"{'system':<24} {'resumed (s)':>12} {'stall (s)':>10} {'loaded (s)':>11} "
        f"{'steps lost':>11} {'kept':>5} {'runs':>5}"
    )
    for name, runs in results.items():
        good = [r for r in runs if "unmeasured" not in r]
        if not good:
            print(f"{name:<24} {'-':>12} {'-':>10} {'-':>11} {'-':>11} {'-':>5} {0:>5}  ", end="")
            print(f"({runs[0]['unmeasured']})")
            continue
        figure = {key: statistics.median(r[key] for r in good) for key in good[0]}
        print(
            f"{name:<24} {figure['resumed']:12.2f} {figure['stall']:10.2f} "
            f"{figure['loaded']:11.2f} {figure['lost']:11.0f} {figure['kept']:5.0f} "
            f"{len(good):>5}"
        )
    for name, runs in results.items():
        each = [f"{r['loaded']:.2f}" for r in runs if "unmeasured" not in r]
        if len(each) > 1:
            print(f"{name}: loaded, each run: {', '.join(each)}")
        for r in runs:
            points = [f"{key[1:]} {at:.2f}" for key, at in r.items() if key.startswith("@")]
            if points:
                print(f"{name}: since the kill (s): {', '.join(points)}, step {r['resumed']:.2f}")
    print(
        "resumed: the kill -> both survivors' first step at 2; stall: the last step any rank "
        "took before the kill -> the same; loaded: that last step -> both ranks at 2 built "
        "their model and loaded the state (the stall less the first step at 2); kept: "
        "survivors that kept their process; "
        f"in place commits every {args.commit_every} step(s), the others save every "
        f"{args.save_every}"
    )


if __name__ == "__main__":
    main()
