"""Scheduler benchmark: a long queue must not stall the daemon that allocates.

    python tests/bench/bench_schedule.py [--jobs 10000] [--users 100] [--nodes 64]
                                         [--ended 10000] [--part pure|live|both] [--json]

Run it on the code before a change too: ``PYTHONPATH=<old tree>/daemon:<old tree>/ctl python
tests/bench/bench_schedule.py`` (the daemon it starts inherits the path).  Needs root for the
live part (it hosts the store as any daemon does; no other user is made).

*pure*: the allocator's plan in this process, on the input the allocating daemon builds:
``--nodes`` nodes of 8 slots and 8 GPUs, each running one whole-node job; ``--jobs`` waiting
jobs of ``--users`` users (each its own account; sizes 2, 4 or 8 workers or one per GPU,
1, 1:2, 2 or 2:4 nodes) and ``--ended`` ended jobs of theirs, whose usage the fair share
reads.  Figures: the fair share's input (before: every span of every record, decayed, each
plan; now: the running sums, built once, then one record's update and a read per plan),
and a plan: the first, one with nothing changed, one after a submit, one after a node is
lost and one after a running job ended (wall time of ``plan``; for the code before, with
the usage it recomputed each plan).

*live*: one real elasticd (the allocator: it hosts the store and is the observer, started
first) and ``--nodes - 1`` simulated daemons (tests/bench/scale_crowd.py: real
NodeServices, heartbeats and records, no workers; a crowd process) on a TCPStore, keep-alive
1 s x 3.  ``--jobs`` job specs of ``--users`` users are written to the cluster's board as a
daemon writes a submit (signed with the cluster key; users u000.. that need not exist: no
simulated node runs anything, and the real node, with one slot, fits none).  A prober
sends ``version`` over a fresh control connection every 50 ms all along.  Phases:

- empty: a simulated node is killed (its heartbeat loop cancelled); until the real daemon's
  ``nodes`` shows it lost;
- ingest: the specs are written; until the daemon holds them all;
- loaded: once its schedule is steady, a second node is killed; until it is shown lost,
  then 10 s more.

Figures per phase: lost seen (s), the prober's control round trips (p50 / p99 / max, ms;
every request answered or not within 10 s), the plans made (the daemon's
``elasticd_scheduler_plan_seconds``: count, mean, and how many took over 100 ms), and the
allocator's term before and after (a stalled observer is replaced: the term moves).
Targets (the issue): a plan under 100 ms, a lost node shown lost in the same time as with
an empty queue, every control request under 100 ms.  Not a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from harness import PY, Control, Daemon, free_port
from scale_crowd import SIGNER_KEY, node_name, open_store

import elasticd
from elasticd.core import schedule as schedule_module
from elasticd.core.allocation import Policy
from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.records import JobRecord, Outcome, Part
from elasticd.core.schedule import NodeSize, plan
from elasticd.core.usage import decayed, spans

NEW = hasattr(schedule_module, "Planner")  # the code under test plans incrementally
TARGET_PLAN = 0.1
TARGET_CONTROL = 0.1
SIZES = (2, 4, 8, "gpu")
NNODES = ((1, 1), (1, 2), (2, 2), (2, 4))


# -- the input --------------------------------------------------------------------------------


def job_spec(
    index: int, user: int, nproc: int | str, nnodes: tuple[int, int], created: float
) -> JobSpec:
    return JobSpec(
        id=f"j-b{index:06d}",
        argv=("train.py",),
        python="/usr/bin/python3",
        workdir="/tmp",
        uid=30000 + user,
        gid=30000 + user,
        user=f"u{user:03d}",
        account=f"u{user:03d}",
        min_nodes=nnodes[0],
        max_nodes=nnodes[1],
        nproc_per_node=nproc,
        created=created,
    )


def waiting_specs(jobs: int, users: int, now: float, seed: int = 7) -> list[JobSpec]:
    draw = random.Random(seed)
    return [
        job_spec(i, i % users, draw.choice(SIZES), draw.choice(NNODES), now - 100 + i / 1000)
        for i in range(jobs)
    ]


def records(nodes: list[str], jobs: int, users: int, ended: int, now: float) -> list[JobRecord]:
    """What the allocating daemon holds: a whole-node job running on each node, ``ended``
    jobs that ran, ``jobs`` waiting ones."""
    out, seq = [], 0
    for i, node in enumerate(nodes):
        seq += 1
        spec = job_spec(900000 + i, i % users, "gpu", (1, 1), now - 3600)
        part = Part(node, PartState.RUNNING, round=0, ran=now - 3600, slots=8, gpus=8, updated=now)
        out.append(JobRecord(spec, seq, {node: part}))
    for k in range(ended):
        seq += 1
        node = nodes[k % len(nodes)]
        spec = job_spec(800000 + k, k % users, 2, (1, 1), now - 86400)
        start, end = now - 80000 + k, now - 79000 + k
        part = Part(node, PartState.SUCCEEDED, round=0, ran=start, slots=2, gpus=2, updated=end)
        out.append(JobRecord(spec, seq, {node: part}, Outcome(JobState.SUCCEEDED, end)))
    for spec in waiting_specs(jobs, users, now):
        seq += 1
        out.append(JobRecord(spec, seq))
    return out


# -- pure ---------------------------------------------------------------------------------------


def timed(what: Any, name: str = "") -> tuple[float, Any]:
    """Seconds ``what()`` took, and what it returned; printed at once with ``name`` (a run
    of the code before may take minutes a plan: what it finished is said as it goes)."""
    began = time.perf_counter()
    value = what()
    took = time.perf_counter() - began
    if name:
        print(f"  {name:<24} {took * 1000:.0f} ms", flush=True)
    return took, value


def pure(args: argparse.Namespace) -> dict[str, Any]:
    now = time.time()
    names = [f"node{i:05d}" for i in range(args.nodes)]
    nodes = {n: NodeSize(8, 8, 8) for n in names}
    held = records(names, args.jobs, args.users, args.ended, now)
    policy = (
        Policy(resize_interval=30.0, min_run_time=60.0) if NEW else Policy(resize_interval=30.0)
    )
    out: dict[str, Any] = {"code": "incremental" if NEW else "before"}
    if NEW:
        from elasticd.core.usage import UsageSums

        sums = UsageSums(policy.half_life)
        out["fair_share_build_s"], _ = timed(
            lambda: [sums.update(r, now) for r in held], "fair share: build"
        )
        out["fair_share_per_plan_s"], usage = timed(
            lambda: (sums.update(held[0], now + 1), sums.at(now + 1))[1], "fair share: a plan's"
        )
        planner = schedule_module.Planner()

        def plan_at(changed: list[JobRecord], _all: list[JobRecord], *rest: Any) -> Any:
            planner.take(changed)  # the allocator hands over the records that changed
            nodes_, previous, at = rest
            return planner.plan(nodes_, previous, policy, usage, term=1, now=at)
    else:
        out["fair_share_build_s"] = None
        out["fair_share_per_plan_s"], _ = timed(
            lambda: decayed((s for r in held for s in spans(r, str)), now, policy.half_life),
            "fair share: a plan's",
        )

        def plan_at(_changed: list[JobRecord], every: list[JobRecord], *rest: Any) -> Any:
            nodes_, previous, at = rest
            usage = decayed((s for r in every for s in spans(r, str)), at, policy.half_life)
            return plan(every, nodes_, previous, policy, usage, term=1, now=at)

    new = JobRecord(job_spec(999999, 0, 2, (1, 1), now), len(held) + 1)
    submitted = [*held, new]
    lost = {**nodes, names[0]: NodeSize(8, 8, 8, usable=False)}
    ended = JobRecord(held[0].spec, held[0].seq, held[0].parts, Outcome(JobState.SUCCEEDED, now))
    finished = [ended, *submitted[1:]]
    out["first_s"], first = timed(lambda: plan_at(held, held, nodes, None, now), "plan: first")
    out["unchanged_s"], second = timed(
        lambda: plan_at([], held, nodes, first, now + 1), "plan: nothing changed"
    )
    out["after_submit_s"], third = timed(
        lambda: plan_at([new], submitted, nodes, second, now + 2), "plan: after a submit"
    )
    out["after_node_lost_s"], fourth = timed(
        lambda: plan_at([], submitted, lost, third, now + 3), "plan: after a node lost"
    )
    out["after_job_ended_s"], fifth = timed(
        lambda: plan_at([ended], finished, lost, fourth, now + 4), "plan: after a job ended"
    )
    out["listed"] = len(fifth.waiting)
    out["later"] = getattr(fifth, "later", 0)
    out["running"] = len(fifth.nodes)
    return out


# -- live ---------------------------------------------------------------------------------------


class Prober(threading.Thread):
    """``version`` over a fresh control connection every 50 ms; each round trip's seconds
    (a request that is not answered in 10 s counts as 10 s)."""

    def __init__(self, socket_path: str) -> None:
        super().__init__(daemon=True)
        self.socket = socket_path
        self.samples: list[tuple[float, float]] = []  # (when, seconds)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            began = time.monotonic()
            try:
                with Control(self.socket) as control:
                    control.call("version", {}, timeout=10.0)
                took = time.monotonic() - began
            except (AssertionError, OSError):
                took = max(time.monotonic() - began, 10.0)
            self.samples.append((began, took))
            self.halt.wait(max(0.0, 0.05 - took))

    def between(self, start: float, end: float) -> list[float]:
        return [took for when, took in self.samples if start <= when <= end]


def latency(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"requests": 0}
    ordered = sorted(samples)
    return {
        "requests": len(ordered),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
        "max_ms": round(1000 * ordered[-1], 1),
        "over_100ms": sum(1 for s in ordered if s > TARGET_CONTROL),
    }


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith(
            ("elasticd_scheduler_plan_seconds", "elasticd_allocator_", "elasticd_jobs{")
        ):
            found[name] = float(value)
    return found


def plans(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    count = after.get("elasticd_scheduler_plan_seconds_count", 0) - before.get(
        "elasticd_scheduler_plan_seconds_count", 0
    )
    total = after.get("elasticd_scheduler_plan_seconds_sum", 0) - before.get(
        "elasticd_scheduler_plan_seconds_sum", 0
    )
    fast = 'elasticd_scheduler_plan_seconds_bucket{le="0.1"}'
    within = after.get(fast, 0) - before.get(fast, 0)
    return {
        "plans": int(count),
        "plan_mean_ms": round(1000 * total / count, 1) if count else None,
        "plans_over_100ms": int(count - within),
        "term": [before.get("elasticd_allocator_term"), after.get("elasticd_allocator_term")],
    }


def jobs_held(port: int) -> int:
    return int(sum(v for k, v in metrics(port).items() if k.startswith("elasticd_jobs{")))


def node_state(daemon: Daemon, name: str) -> str | None:
    with Control(daemon.socket) as control:
        nodes = control.call("nodes", {}, timeout=30.0).result or []
    return next((n["state"] for n in nodes if n["name"] == name), None)


def until(condition: Any, timeout: float) -> float | None:
    """Seconds until ``condition()`` holds (polled every 50 ms), or None past ``timeout``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        try:
            if condition():
                return time.monotonic() - began
        except (AssertionError, OSError):
            pass
        time.sleep(0.05)
    return None


class Crowd:
    def __init__(
        self, endpoint: str, cluster: str, first: int, count: int, total: int, log: Path
    ) -> None:
        self.proc = subprocess.Popen(
            [
                PY,
                str(HERE / "scale_crowd.py"),
                "--backend",
                "c10d",
                "--endpoint",
                endpoint,
                "--cluster",
                cluster,
                "--first",
                str(first),
                "--count",
                str(count),
                "--total",
                str(total),
                "--connections",
                "16",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "ab"),
            text=True,
        )
        self.ask_raw()

    def ask_raw(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the crowd ended")
        return json.loads(line)

    def ask(self, **msg: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.ask_raw()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


async def publish(endpoint: str, cluster: str, specs: list[JobSpec]) -> float:
    from elasticd.jobs.board import JobBoard
    from elasticd.store.signing import Signer

    store = await open_store("c10d", endpoint, connections=8)
    board = JobBoard(store, Signer(SIGNER_KEY, cluster), cluster)
    began = time.monotonic()
    try:
        pending = iter(specs)

        async def writer() -> None:
            for spec in pending:
                await board.publish_spec(spec)

        await asyncio.gather(*(writer() for _ in range(8)))
    finally:
        await store.close()
    return time.monotonic() - began


def live(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bench-schedule-"))
    cluster = f"bsched{uuid.uuid4().hex[:6]}"
    port, metrics_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    key = base / "cluster.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, SIGNER_KEY.hex().encode() + b"\n")
    os.close(fd)
    config = base / "elasticd.toml"
    config.write_text(
        f"[jobs]\nmax_per_user = 0\nallow_root = true\n[node]\npeer_port = {free_port()}\n"
        "[store]\nfirewall = false\n"
    )
    daemon = Daemon(
        base,
        "real",
        args=(
            "--cluster",
            cluster,
            "--store",
            endpoint,
            "--store-host",
            "--node-address",
            "127.0.0.1",
            "--cluster-key",
            str(key),
            "--slots",
            "1",
            "--gpus",
            "0",
            "--config",
            str(config),
        ),
        standalone=False,
        metrics_port=metrics_port,
    )
    out: dict[str, Any] = {}
    crowd = None
    prober = None
    try:
        daemon.start()
        if until(lambda: metrics(metrics_port).get("elasticd_allocator_term", 0) > 0, 60) is None:
            raise RuntimeError("the real daemon does not allocate")
        crowd = Crowd(endpoint, cluster, 1, args.nodes - 1, args.nodes, base / "crowd.log")
        crowd.ask(cmd="start", first=time.monotonic(), t0=time.monotonic(), stagger=1.0)
        names = [node_name(i) for i in range(1, args.nodes)]
        if until(lambda: all(node_state(daemon, n) == "up" for n in names[-3:]), 60) is None:
            raise RuntimeError("the simulated nodes are not up")
        until(lambda: False, 5)  # every node beats a few times
        prober = Prober(daemon.socket)
        prober.start()

        # empty: a node lost
        mark = metrics(metrics_port)
        killed = crowd.ask(cmd="kill", index=1)["killed_at"]
        seen = until(lambda: node_state(daemon, names[0]) == "lost", 60)
        end = time.monotonic()
        out["empty"] = {
            "lost_seen_s": round(end - killed, 2) if seen is not None else None,
            **latency(prober.between(killed, end)),
            **plans(mark, metrics(metrics_port)),
        }

        # ingest
        mark, began = metrics(metrics_port), time.monotonic()
        specs = waiting_specs(args.jobs, args.users, time.time())
        written = asyncio.run(publish(endpoint, cluster, specs))
        held = until(lambda: jobs_held(metrics_port) >= args.jobs, args.timeout)
        end = time.monotonic()
        out["ingest"] = {
            "written_s": round(written, 1),
            "held_after_s": round(end - began, 1) if held is not None else None,
            **latency(prober.between(began, end)),
            **plans(mark, metrics(metrics_port)),
        }
        steady = until(
            lambda: _steady(metrics_port), args.timeout
        )  # the schedule stands still for 5 s
        out["settled_after_s"] = round(steady, 1) if steady is not None else None

        # loaded: another node lost
        mark = metrics(metrics_port)
        killed = crowd.ask(cmd="kill", index=2)["killed_at"]
        seen = until(lambda: node_state(daemon, names[1]) == "lost", 120)
        end = time.monotonic()
        until(lambda: False, 10)
        out["loaded"] = {
            "lost_seen_s": round(end - killed, 2) if seen is not None else None,
            **latency(prober.between(killed, time.monotonic())),
            **plans(mark, metrics(metrics_port)),
        }
    finally:
        if prober is not None:
            prober.halt.set()
        if crowd is not None:
            crowd.close()
        daemon.stop()
        out["log_tail"] = [
            line
            for line in daemon.log_text().splitlines()
            if "plan took" in line or "ERROR" in line
        ][-5:]
    return out


def _steady(port: int, window: float = 5.0) -> bool:
    first = metrics(port).get("elasticd_allocator_schedule_number")
    time.sleep(window)
    return metrics(port).get("elasticd_allocator_schedule_number") == first


# -- report ---------------------------------------------------------------------------------------


def machine() -> str:
    model = ""
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}: {model or platform.processor()}, {os.cpu_count()} cores, Linux {platform.release()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ended", type=int, default=10000)
    parser.add_argument("--part", choices=("pure", "live", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of each wait (s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(),
        "code": f"{'incremental' if NEW else 'before'} ({os.path.dirname(elasticd.__file__)})",
        "jobs": args.jobs,
        "users": args.users,
        "nodes": args.nodes,
        "ended": args.ended,
    }
    print(f"{report['date']}  {report['machine']}\n{report['code']}", flush=True)
    if args.part in ("pure", "both"):
        print(
            f"pure, {args.jobs} waiting of {args.users} users on {args.nodes} nodes, "
            f"{args.ended} ended:",
            flush=True,
        )
        report["pure"] = p = pure(args)
        print(
            f"  schedule: {p['running']} running, {p['listed']} waiting listed, {p['later']} counted"
        )
    if args.part in ("live", "both"):
        report["live"] = live(args)
        for phase in ("empty", "ingest", "loaded"):
            print(f"live, {phase}: {json.dumps(report['live'].get(phase))}")
        print(f"live, settled after: {report['live'].get('settled_after_s')} s")
        for line in report["live"].get("log_tail", []):
            print(f"  log: {line}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
