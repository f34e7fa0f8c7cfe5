"""Soak of the failure detector: no false losses on a loaded machine (docs/benchmarks.md).

    python tests/bench/soak_detector.py [--minutes 30] [--load 4] [--seed 1] [--json]

Three elasticd daemons on this host (127.0.0.1..3, node 1 hosts the store) run a 3-node
in-place job (tests/bench/recovery_worker.py: an all_reduce every 100 ms, a commit each
step) for the whole run, while:

- ``--load`` processes spin on the CPUs (plain Python loops, the daemons' own priority);
- every 0.5 to 3 s a random daemon (its process only, not its workers) is paused
  (SIGSTOP) for a random 0 to 150 ms, then resumed;
- every ``--probe-every`` seconds (180) a node other than the store's host is frozen whole
  (its daemon and worker) for 2.5 s, then resumed: a real loss, to time the detection
  under the same load (it comes back as a newcomer).

The daemons' logs are followed (every 20 ms): a "detector: node X is lost" line for a node
that was not frozen whole in the 10 s before is a false loss.  Printed at the end: the
false-loss count, the detection latency distribution (frozen -> first survivor's verdict,
as its log line appeared), the silence at each verdict (the daemons' histogram), the
pauses made, and the machine's load average.  Not a pass/fail test; it exits 1 when a
false loss happened, so that a run in a loop stops there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "system"))
from conftest import Cluster
from harness import PY

WORKER = str(HERE / "recovery_worker.py")
LOST = re.compile(r"detector: node (\S+) is lost \(silent ([0-9.]+) s")
SPIN = "while True: pass"


class LogFollower:
    """New "lost" lines of each daemon's log, with the time they were seen."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.offsets = {d.name: 0 for d in cluster}

    def poll(self) -> list[tuple[float, str, str, float]]:
        """(seen, by, node, silent) for each new verdict."""
        found = []
        now = time.time()
        for daemon in self.cluster:
            try:
                with open(daemon.log_path, "rb") as f:
                    f.seek(self.offsets[daemon.name])
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[daemon.name] += len(complete)
            for match in LOST.finditer(complete.decode(errors="replace")):
                found.append((now, daemon.name, match.group(1), float(match.group(2))))
        return found


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(values),
        "min": ordered[0],
        "p50": statistics.median(ordered),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": ordered[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=int, default=4, help="CPU-spinning processes")
    p.add_argument("--probe-every", type=float, default=180.0, help="seconds between real freezes")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    base = Path(tempfile.mkdtemp(prefix="elasticd-soak-detector-"))
    base.chmod(0o755)
    cluster = Cluster(base, 3, slots=1, resize_interval=None)
    spinners: list[subprocess.Popen[bytes]] = []
    frozen: list[psutil.Process] = []
    pauses: list[float] = []
    latencies: list[float] = []
    false_losses: list[tuple[float, str, str, float]] = []
    silences: list[float] = []
    loads: list[float] = []
    try:
        cluster.start()
        job = cluster[0].submit(
            "--in-place",
            "--nnodes",
            "2:3",
            "--max-restarts",
            "100",
            "--python",
            PY,
            WORKER,
            "--",
            str(base),
            "inplace",
        )["id"]
        follow = LogFollower(cluster)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            doc = cluster[0].ctl("status", job)
            if doc["state"] == "RUNNING" and doc.get("world_size") == 3:
                break
            time.sleep(0.5)
        else:
            print(f"the job never ran at 3; logs in {base}", file=sys.stderr)
            return 2
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.load)]
        end = time.monotonic() + args.minutes * 60
        next_pause = time.monotonic() + rng.uniform(0.5, 3.0)
        next_probe = time.monotonic() + args.probe_every
        freeze_at: dict[str, float] = {}  # node -> when it was frozen whole (wall clock)
        timed: set[tuple[str, float]] = set()
        thaw_due = 0.0
        next_load = 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_load:
                loads.append(os.getloadavg()[0])
                next_load = now + 30
            if now >= next_pause:
                daemon = rng.choice(cluster.daemons)
                length = rng.uniform(0.0, 0.150)
                os.kill(daemon.proc.pid, signal.SIGSTOP)
                time.sleep(length)
                os.kill(daemon.proc.pid, signal.SIGCONT)
                pauses.append(length)
                next_pause = time.monotonic() + rng.uniform(0.5, 3.0)
            if now >= next_probe and not frozen:
                victim = rng.choice(cluster.daemons[1:])
                root = psutil.Process(victim.proc.pid)
                frozen = [root, *root.children(recursive=True)]
                freeze_at[victim.name] = time.time()
                for proc in frozen:
                    proc.suspend()
                thaw_due = now + 2.5
                next_probe = now + args.probe_every
            if frozen and now >= thaw_due:
                for proc in frozen:
                    try:
                        proc.resume()
                    except psutil.NoSuchProcess:
                        pass
                frozen = []
            for seen, by, node, silent in follow.poll():
                silences.append(silent)
                at = freeze_at.get(node)
                if at is not None and 0 <= seen - at < 10.0:
                    if (node, at) not in timed:  # the first survivor's verdict counts
                        timed.add((node, at))
                        latencies.append(seen - at)
                else:
                    false_losses.append((seen, by, node, silent))
                    print(
                        f"FALSE LOSS: {by} declared {node} lost (silent {silent} s)",
                        file=sys.stderr,
                    )
            time.sleep(0.02)
    finally:
        for proc in frozen:
            try:
                proc.resume()
            except psutil.NoSuchProcess:
                pass
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        cluster.stop()
    report: dict[str, Any] = {
        "minutes": args.minutes,
        "load_processes": args.load,
        "load_average": percentiles(loads),
        "pauses": {"count": len(pauses), "longest_ms": round(1000 * max(pauses, default=0), 1)},
        "false_losses": len(false_losses),
        "detection_latency_s": percentiles(latencies),
        "silence_at_verdict_s": percentiles(silences),
        "logs": str(base),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:22} {value}")
    return 1 if false_losses else 0


if __name__ == "__main__":
    sys.exit(main())
