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
1 s x 3.  A prober sends ``version`` over a fresh control connection every 50 ms all along.
Phases, each on a cluster of its own:

- empty: once the cluster is steady, a simulated node is killed (its heartbeat loop
  cancelled); until the real daemon's ``nodes`` shows it lost, then 10 s more;
- loaded: the real daemon starts with ``--jobs`` waiting jobs of ``--users`` users in its
  job history (a daemon restarted with that queue: users u000.. that need not exist, as
  no simulated node runs anything and the real node, with one slot, fits none); once its
  schedule is steady (the allocator's schedule number stands still for 5 s), the same
  node loss;
- submits: ``--submits`` more jobs written to the cluster's board, one after the other,
  as daemons write submits (signed with the cluster key); until the daemon holds them.

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
    """The daemon's scheduler and job metrics ({} when it does not answer in 30 s)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            text = reply.read().decode()
    except OSError as exc:
        print(f"  (the metrics endpoint did not answer: {exc})", flush=True)
        return {}
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


def until(condition: Any, timeout: float, every: float = 0.05) -> float | None:
    """Seconds until ``condition()`` holds (polled ``every`` s), or None past ``timeout``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        try:
            if condition():
                return time.monotonic() - began
        except (AssertionError, OSError):
            pass
        time.sleep(every)
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
    """Write ``specs`` to the cluster's board one after the other, as submits do."""
    from elasticd.jobs.board import JobBoard
    from elasticd.store.signing import Signer

    store = await open_store("c10d", endpoint, connections=2)
    board = JobBoard(store, Signer(SIGNER_KEY, cluster), cluster)
    began = time.monotonic()
    try:
        for spec in specs:
            await board.publish_spec(spec)
    finally:
        await store.close()
    return time.monotonic() - began


def seed_history(state_dir: Path, specs: list[JobSpec]) -> None:
    """The daemon's own job history, as a daemon that held ``specs`` leaves it."""
    from elasticd.core.records import history_row
    from elasticd.jobs.history import History, path_in

    history = History(path_in(str(state_dir)))
    try:
        for seq, spec in enumerate(specs, 1):
            history.save(history_row(JobRecord(spec, seq)))
    finally:
        history.close()


class Cluster:
    """One real daemon (it hosts the store and allocates) and ``nodes - 1`` simulated ones."""

    def __init__(self, args: argparse.Namespace, specs: list[JobSpec]) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="bench-schedule-"))
        self.name = f"bsched{uuid.uuid4().hex[:6]}"
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        key = self.base / "cluster.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, SIGNER_KEY.hex().encode() + b"\n")
        os.close(fd)
        config = self.base / "elasticd.toml"
        config.write_text(
            f"[jobs]\nmax_per_user = 0\nallow_root = true\n[node]\npeer_port = {free_port()}\n"
            "[store]\nfirewall = false\n"
        )
        self.daemon = Daemon(
            self.base,
            "real",
            args=(
                *("--cluster", self.name, "--store", self.endpoint, "--store-host"),
                *("--node-address", "127.0.0.1", "--cluster-key", str(key)),
                *("--slots", "1", "--gpus", "0", "--config", str(config)),
            ),
            standalone=False,
            metrics_port=self.metrics_port,
        )
        seed_history(self.daemon.state_dir, specs)
        self.names = [node_name(i) for i in range(1, args.nodes)]
        self.crowd: Crowd | None = None
        self.prober: Prober | None = None
        try:
            self._start(args)
        except BaseException:
            self.close()
            raise

    def _start(self, args: argparse.Namespace) -> None:
        self.daemon.start()
        if until(lambda: self.metrics().get("elasticd_allocator_term", 0) > 0, 120, 1.0) is None:
            raise RuntimeError("the real daemon does not allocate")
        self.crowd = Crowd(
            self.endpoint, self.name, 1, args.nodes - 1, args.nodes, self.base / "crowd.log"
        )
        self.crowd.ask(cmd="start", first=time.monotonic(), t0=time.monotonic(), stagger=1.0)
        if until(lambda: all(node_state(self.daemon, n) == "up" for n in self.names), 120) is None:
            raise RuntimeError("the simulated nodes are not up")
        self.prober = Prober(self.daemon.socket)
        self.prober.start()

    def metrics(self) -> dict[str, float]:
        return metrics(self.metrics_port)

    def lose_a_node(self, index: int, after: float = 10.0) -> dict[str, Any]:
        """Kill simulated node ``index``; until the daemon shows it lost, then ``after``
        seconds more: what it took, and the control round trips and plans meanwhile."""
        mark = self.metrics()
        killed = self.crowd.ask(cmd="kill", index=index)["killed_at"]
        seen = until(lambda: node_state(self.daemon, node_name(index)) == "lost", 120)
        lost = time.monotonic()
        time.sleep(after)
        return {
            "lost_seen_s": round(lost - killed, 2) if seen is not None else None,
            **latency(self.prober.between(killed, time.monotonic())),
            **plans(mark, self.metrics()),
        }

    def close(self) -> None:
        if self.prober is not None:
            self.prober.halt.set()
        if self.crowd is not None:
            self.crowd.close()
        self.daemon.stop()

    def log_lines(self, *words: str) -> list[str]:
        return [
            line for line in self.daemon.log_text().splitlines() if any(w in line for w in words)
        ]


def live(args: argparse.Namespace) -> dict[str, Any]:
    """The empty cluster's figures, then a cluster whose allocating daemon restarts with
    ``--jobs`` waiting jobs in its history; then jobs submitted to the board (--submits)."""
    out: dict[str, Any] = {}
    empty = Cluster(args, [])
    try:
        until(lambda: _steady(empty.metrics_port), 60, 0.0)
        out["empty"] = empty.lose_a_node(1)
    finally:
        empty.close()
    print(f"live, empty: {json.dumps(out['empty'])}", flush=True)

    specs = waiting_specs(args.jobs, args.users, time.time())
    began = time.monotonic()
    try:
        loaded = Cluster(args, specs)
    except RuntimeError as exc:  # the code before stalls at start: say so, and how long
        out["loaded"] = {"error": str(exc), "after_s": round(time.monotonic() - began, 1)}
        print(f"live, loaded: {json.dumps(out['loaded'])}", flush=True)
        return out
    try:
        out["restarted_s"] = round(time.monotonic() - began, 1)
        steady = until(lambda: _steady(loaded.metrics_port), args.timeout, 0.0)
        out["settled_after_s"] = round(steady, 1) if steady is not None else None
        mark = loaded.metrics()
        out["steady"] = {
            **latency(loaded.prober.between(time.monotonic() - 10, time.monotonic())),
            "term": mark.get("elasticd_allocator_term"),
        }
        print(f"live, restarted with {args.jobs} waiting jobs: {json.dumps(out)}", flush=True)
        out["loaded"] = loaded.lose_a_node(1)
        print(f"live, loaded: {json.dumps(out['loaded'])}", flush=True)
        if args.submits:
            mark, began = loaded.metrics(), time.monotonic()
            extra = [
                job_spec(500000 + i, i % args.users, 2, (1, 1), time.time())
                for i in range(args.submits)
            ]
            written = asyncio.run(publish(loaded.endpoint, loaded.name, extra))
            held = until(
                lambda: jobs_held(loaded.metrics_port) >= args.jobs + args.submits,
                args.timeout,
                2.0,
            )
            out["submits"] = {
                "jobs": args.submits,
                "written_s": round(written, 1),
                "held_after_s": round(time.monotonic() - began, 1) if held is not None else None,
                **latency(loaded.prober.between(began, time.monotonic())),
                **plans(mark, loaded.metrics()),
            }
            print(f"live, submits: {json.dumps(out['submits'])}", flush=True)
        out["log"] = loaded.log_lines("plan took", "ERROR")[-5:]
    finally:
        loaded.close()
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
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.node()}: {model or platform.processor()}, {os.cpu_count()} cores, "
        f"Linux {platform.release()}, load average {load} (other work shares the machine)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--ended", type=int, default=10000)
    parser.add_argument("--part", choices=("pure", "live", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of each wait (s)")
    parser.add_argument(
        "--submits", type=int, default=100, help="jobs written to the board once loaded"
    )
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
        for line in report["live"].get("log", []):
            print(f"  log: {line}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
