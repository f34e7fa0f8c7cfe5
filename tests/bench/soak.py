"""Soak: three daemons, many short jobs, random cancels and worker kills (docs/benchmarks.md).

    python tests/bench/soak.py [--minutes 30] [--jobs 500] [--seed 1] [--json]

Three elasticd daemons on this host form a cluster (node 1 hosts the store; 127.0.0.1..3,
4 slots each).  Jobs are submitted at an even pace over the run with elasticctl on a random
node: 1, 2 or 1:3 nodes, 1 or 2 workers per node, 0 to 2 restarts, workers that sleep 0.5 to
5 s and print, some with a child in their process group and some with a child that escapes
it (setsid).  A random 15 % are cancelled and 15 % get one worker SIGKILLed, at a random
moment.  After the last job ended and the cluster settled:

- each daemon's RSS, open fds and threads at the start (after a warm-up job) and at the end;
- every job accounted for: in every daemon's `list --all` in a final state, and in the
  history file of the daemon it was submitted to;
- processes left: any process of a job (workers and their children) still alive.

Not a pass/fail test: it prints its figures (and exits 1 if a job is unaccounted for or a
process is left, so that a run in a loop stops there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
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
from harness import Daemon, worker_args

FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def usage(daemon: Daemon) -> dict[str, int]:
    proc = psutil.Process(daemon.proc.pid)
    return {
        "rss_mib": proc.memory_info().rss >> 20,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
    }


def job_args(rng: random.Random) -> list[str]:
    nnodes = rng.choice(["1", "1", "2", "1:3"])
    extra = rng.choice([[], [], ["--child"], ["--escape"]])
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(rng.choice([1, 2])),
        "--max-restarts",
        str(rng.choice([0, 1, 2])),
        "--join-timeout",
        "120",
        *worker_args(
            "--sleep", f"{rng.uniform(0.5, 5):.2f}", "--print", str(rng.randint(0, 50)), *extra
        ),
    ]


class Soak:
    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self.jobs: dict[str, Daemon] = {}  # job id -> the daemon it was submitted to
        self.actions: list[tuple[float, str, str]] = []  # (when, "cancel" | "kill", job)
        self.done = {"cancel": 0, "kill": 0}

    def submit(self) -> None:
        daemon = self.rng.choice(self.cluster.daemons)
        done = daemon.ctl_run("--json", "submit", *job_args(self.rng))
        if done.returncode != 0:
            print(f"submit refused: {done.stderr.strip()}", file=sys.stderr)
            return
        job = json.loads(done.stdout)["id"]
        self.jobs[job] = daemon
        roll = self.rng.random()
        if roll < 0.15:
            self.actions.append((time.monotonic() + self.rng.uniform(0.2, 4), "cancel", job))
        elif roll < 0.30:
            self.actions.append((time.monotonic() + self.rng.uniform(0.5, 4), "kill", job))

    def act(self, now: float) -> None:
        due = [a for a in self.actions if a[0] <= now]
        self.actions = [a for a in self.actions if a[0] > now]
        for _, action, job in due:
            daemon = self.jobs[job]
            if action == "cancel":
                if daemon.ctl_run("cancel", job).returncode == 0:
                    self.done["cancel"] += 1
                continue
            status = json.loads(daemon.ctl_run("--json", "status", job).stdout or "{}")
            live = [
                w["pid"]
                for w in status.get("workers", [])
                if w.get("pid") and w["state"] == "HEALTHY"
            ]
            if live:
                try:
                    os.kill(self.rng.choice(live), signal.SIGKILL)
                    self.done["kill"] += 1
                except ProcessLookupError:
                    pass

    def unfinished(self) -> list[str]:
        states = {j["id"]: j["state"] for j in self.cluster[0].ctl("list", "--all")}
        return [job for job in self.jobs if states.get(job) not in FINAL]


def accounted(cluster: Cluster, jobs: dict[str, Daemon]) -> dict[str, Any]:
    """Jobs missing from a daemon's list or from their submitter's history (after stop)."""
    listed_missing = {}
    for daemon in cluster.daemons:
        states = {j["id"]: j["state"] for j in daemon.ctl("list", "--all")}
        listed_missing[daemon.name] = [j for j in jobs if states.get(j) not in FINAL]
    return listed_missing


def history_missing(jobs: dict[str, Daemon]) -> list[str]:
    missing = []
    for job, daemon in jobs.items():
        db = sqlite3.connect(f"file:{daemon.state_dir / 'history.sqlite'}?mode=ro", uri=True)
        row = db.execute("SELECT state FROM jobs WHERE id = ?", (job,)).fetchone()
        db.close()
        if row is None or row[0] not in FINAL:
            missing.append(job)
    return missing


def job_processes() -> list[int]:
    """Processes still running a worker of this run (the fixture's command line)."""
    needle = str(worker_args()[0])
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(needle in part for part in cmdline) or cmdline[-1:] == [
            "import time; time.sleep(3600)"
        ]:
            left.append(proc.info["pid"])
    return left


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--jobs", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="elasticd-soak-", dir="/tmp"))
    base.chmod(0o755)
    cluster = Cluster(base, 3, slots=4, resize_interval=None)  # the daemon's defaults
    started_at = time.time()
    try:
        cluster.start()
        for daemon in cluster.daemons:
            daemon.submit_wait(*worker_args())  # warm-up: every code path loaded once
        before = {d.name: usage(d) for d in cluster.daemons}
        soak = Soak(cluster, rng)
        interval = args.minutes * 60 / args.jobs
        deadline = time.monotonic()
        for n in range(args.jobs):
            deadline += interval
            soak.submit()
            while (now := time.monotonic()) < deadline:
                soak.act(now)
                time.sleep(min(0.2, max(0.0, deadline - now)))
            if n % 10 == 0:
                print(f"{n}/{args.jobs} jobs, {soak.done}", file=sys.stderr, flush=True)
        while soak.actions:
            soak.act(time.monotonic())
            time.sleep(0.2)
        end = time.monotonic() + 600
        while (left := soak.unfinished()) and time.monotonic() < end:
            time.sleep(1)
        time.sleep(10)  # settle: heartbeats, cleanup
        after = {d.name: usage(d) for d in cluster.daemons}
        listed = accounted(cluster, soak.jobs)
        states: dict[str, int] = {}
        for doc in cluster[0].ctl("list", "--all"):
            if doc["id"] in soak.jobs:
                states[doc["state"]] = states.get(doc["state"], 0) + 1
        cluster.stop()
        history = history_missing(soak.jobs)
        left_pids = [p for p in job_processes() if psutil.pid_exists(p)]
        report = {
            "minutes": round((time.time() - started_at) / 60, 1),
            "jobs": len(soak.jobs),
            "cancelled_by_soak": soak.done["cancel"],
            "workers_killed": soak.done["kill"],
            "final_states": states,
            "before": before,
            "after": after,
            "unfinished": left,
            "missing_from_list": listed,
            "missing_from_history": history,
            "processes_left": left_pids,
        }
        print(json.dumps(report, indent=None if args.json else 2))
        bad = left or any(listed.values()) or history or left_pids
        return 1 if bad else 0
    finally:
        cluster.stop()
        for pid in job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main())
