"""Sharing benchmark (docs/benchmarks.md, "Sharing the cluster"): one seeded trace of jobs replayed on a cluster of real daemons,
under today's placement and under the cluster's scheduler, side by side.

    python tests/bench/bench_sharing.py [--system today|scheduler|both] [--seed 1] [--jobs 30]
                                        [--nodes 8] [--load 1.3] [--step 0.5]
                                        [--resize-interval S] [--restart-path] [--json] [--keep]
                                        [--trace]

Needs root: the trace's four users are real Unix users, made for the run (``useradd``, no home,
no login shell) and removed at its end; each submits its jobs with ``elasticctl submit`` as
itself, so jobs are charged to its own group (``--account``).

The trace (sharing_trace.py): many small short jobs, a few large long ones, heavy-tailed work,
Poisson arrivals, four users with unequal load; ``--trace`` prints it and runs nothing.  The
cluster: ``--nodes`` daemons on 127.0.0.1.. with one slot each, one cluster on a TCPStore that
n1 hosts (tests/system/conftest.py's Cluster), a fresh one per system, with
``[scheduler] enabled = false`` (today) or ``true`` (scheduler) in its config.  A daemon that
does not know the ``[scheduler]`` section (``elasticd --check-config`` refuses it) skips the
scheduler with that message, and runs today's placement, its only one, without the section.
After a warm-up job on every node, each job is submitted at its arrival time, on a node drawn
from the seed, with ``--nnodes MIN:MAX --nproc-per-node 1`` and the trace's ``--account``,
``--preemptible``, ``--nnodes-step`` where elasticctl has those options (else left out, said
on stderr).

The workers (sharing_worker.py) do a fixed amount of work whose time shrinks with world size,
kept in a checkpoint in the job's working directory.  They import no torch: 8 daemons and up
to 8 workers share 2 cores.  By default every job is submitted ``--in-place`` and its workers
speak the agent's channel themselves (the protocol elasticd.elastic's runtime speaks): a
shrink or a grow keeps the survivors' processes and new members warm up before they join,
as for a script that uses elasticd.elastic.  ``--restart-path`` submits them without it: a
resize then stops every worker of the job and starts them at the new size (a job whose
script does not use elasticd.elastic), losing at most one step.

Measured from the daemons' records (``elasticctl list --all --json``: each job's submit
``created``, ``started``, ``ended``) and the workers' own timestamps (each worker's exec and
exit, in the job's ``events.jsonl``); see DEFINITIONS below for each figure.  The bench polls
the daemons' job list every second (benchmarks may; tests may not).  Not a pass/fail test:
it prints the table (the scheduler's targets beside it) and, with ``--json``, one JSON document.
Interrupted (Ctrl-C, SIGTERM) or failing, it stops every daemon it started (their workers
with them; n1 hosts the store), kills any process left of the trace's users and removes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "system"))
from conftest import Cluster
from harness import CLIENT_ENV, PY, START_TIMEOUT, Control, Daemon, python_for_everyone
from sharing_metrics import DEFINITIONS, JobRun, compare, rounds_run, summarize, worker_intervals
from sharing_trace import TraceJob, make_trace

WORKER = HERE / "sharing_worker.py"
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
SYSTEMS = ("today", "scheduler")
SHARING_FLAGS = ("--account", "--preemptible", "--nnodes-step", "--priority")
JOIN_TIMEOUT = "3600"  # a job may queue for the whole run: its join must not time out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait while the cleanup runs (a second Ctrl-C must not leave daemons)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- users -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class User:
    name: str  # the Unix name (its primary group has the same name: the job's account)
    uid: int
    gid: int


@contextmanager
def unix_users(roles: list[str]) -> Iterator[dict[str, User]]:
    """One Unix user per trace user (``useradd -M -U``), removed at the end; every process
    left running as one of them is killed first."""
    tag = uuid.uuid4().hex[:6]
    made: dict[str, User] = {}
    try:
        for role in roles:
            name = f"esh{tag}{role}"
            subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", name], check=True)
            entry = pwd.getpwnam(name)
            made[role] = User(name, entry.pw_uid, entry.pw_gid)
        yield made
    finally:
        with signals_held():
            kill_processes_of({u.uid for u in made.values()})
            for user in made.values():
                subprocess.run(["userdel", "-f", user.name], check=False, capture_output=True)


def kill_processes_of(uids: set[int]) -> list[int]:
    """SIGKILL every process that runs as one of ``uids`` (workers a daemon did not stop)."""
    killed = []
    for proc in psutil.process_iter(["uids"]):
        owner = proc.info["uids"]
        if owner is not None and owner.real in uids:
            try:
                proc.kill()
                killed.append(proc)
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(killed, timeout=10)
    if killed:
        log(f"killed {len(killed)} processes left by the trace's users: {[p.pid for p in killed]}")
    return [p.pid for p in killed]


# -- the cluster -----------------------------------------------------------------------------


def scheduler_lines(enabled: bool, resize_interval: float | None) -> str:
    lines = f"[scheduler]\nenabled = {'true' if enabled else 'false'}\n"
    if resize_interval is not None:
        lines += f"resize_interval = {resize_interval}\n"
    return lines


def config_refusal(path: Path) -> str | None:
    """What ``elasticd --check-config`` says is wrong with the file (None: nothing)."""
    done = subprocess.run(
        [PY, "-m", "elasticd", "--check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=CLIENT_ENV,
    )
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip().splitlines()[0]


def sharing_flags_known() -> set[str]:
    """Which of the scheduler's submit options this elasticctl has."""
    done = subprocess.run(
        [PY, "-m", "elasticctl", "submit", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLIENT_ENV,
    )
    return {
        flag for flag in SHARING_FLAGS if f"{flag} " in done.stdout or f"{flag}\n" in done.stdout
    }


def stop_all(daemons: list[Daemon]) -> None:
    """SIGTERM every daemon but the store's host, wait for them, then the host (n1): stopping
    together, not one after another (each stops its workers, up to the grace period)."""
    host, others = daemons[:1], daemons[1:]
    for group in (others, host):
        for daemon in group:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in group:
            daemon.stop()


# -- one replay ------------------------------------------------------------------------------


@dataclass
class Submitted:
    job: TraceJob
    proc: subprocess.Popen[str]
    daemon: Daemon
    at: float
    id: str | None = None


@dataclass
class Replay:
    system: str
    trace: list[TraceJob]
    users: dict[str, User]
    base: Path
    args: argparse.Namespace
    flags: set[str]
    note: str = ""
    cluster: Cluster | None = None
    submitted: list[Submitted] = field(default_factory=list)
    held: list[tuple[float, int]] = field(default_factory=list)  # (when, slots the nodes hold)
    last_sample: float = 0.0
    last_progress: float = 0.0

    def prepare(self) -> str | None:
        """Make the cluster (not started); returns why this system cannot run, or None."""
        self.base.mkdir(mode=0o755)
        self.cluster = cluster = Cluster(self.base, self.args.nodes, slots=1, resize_interval=None)
        # a name of its own: the store port's nftables table is named after the cluster and
        # the node, and other clusters on this host (the tests') are called "test"
        cluster.name = f"sharing{uuid.uuid4().hex[:6]}"
        cluster.daemons = [cluster._daemon(i + 1, 1, None, ()) for i in range(self.args.nodes)]
        # peer_port 0: any free port (its default, 29401, may be another cluster's on 127.0.0.1)
        plain = cluster.config.read_text() + "[node]\npeer_port = 0\n"
        self.cluster.config.write_text(
            plain + scheduler_lines(self.system == "scheduler", self.args.resize_interval)
        )
        refused = config_refusal(self.cluster.config)
        if refused is None:
            return None
        if self.system == "scheduler":
            return f"the daemon refuses [scheduler] enabled = true: {refused}"
        self.cluster.config.write_text(plain)
        self.note = (
            f"no [scheduler] section (the daemon refuses it: {refused}); "
            "today's placement is its only one"
        )
        return None

    def run(self) -> dict[str, Any]:
        assert self.cluster is not None
        started = time.time()
        host, *others = self.cluster.daemons
        host.start()  # the store's host first; the others together (each waits for its READY=1)
        for daemon in others:
            daemon.start(wait=False)
        for daemon in others:
            daemon.wait_notify("READY=1", START_TIMEOUT)
        log(
            f"[{self.system}] {len(self.cluster.daemons)} daemons up in {time.time() - started:.1f} s; "
            "a warm-up job on every node"
        )
        self.warm_up()
        t0 = self.submit_all()
        timed_out = self.follow(t0)
        return self.collect(t0, timed_out)

    def warm_up(self) -> None:
        """One job on every node (as root), so that no node pays its first job's costs in the trace."""
        n = str(self.args.nodes)
        workdir = self.base / "warm-up"
        workdir.mkdir()
        doc = self.cluster[0].submit_wait(
            "--nnodes",
            n,
            "--nproc-per-node",
            "1",
            "--python",
            PY,
            "--workdir",
            str(workdir),
            "--join-timeout",
            "300",
            str(WORKER),
            "--",
            "--work",
            n,
            "--step",
            "0.1",
            timeout=600,
        )
        if doc["state"] != "SUCCEEDED":
            raise RuntimeError(f"the warm-up job did not succeed: {doc}")

    def submit_argv(self, job: TraceJob, daemon: Daemon, workdir: Path, python: str) -> list[str]:
        user = self.users[job.user]
        sharing = {
            "--account": ["--account", user.name],
            "--priority": ["--priority", str(job.priority)],
            "--preemptible": ["--preemptible"] if job.preemptible else [],
            "--nnodes-step": ["--nnodes-step", str(job.nnodes_step)] if job.nnodes_step > 1 else [],
        }
        extra = [arg for flag in SHARING_FLAGS if flag in self.flags for arg in sharing[flag]]
        return [
            python,
            "-m",
            "elasticctl",
            "--socket",
            daemon.socket,
            "--json",
            "submit",
            "--name",
            job.name,
            "--nnodes",
            job.nnodes,
            "--nproc-per-node",
            "1",
            *extra,
            *([] if self.args.restart_path else ["--in-place"]),
            "--python",
            os.path.realpath(python),
            "--workdir",
            str(workdir),
            "--join-timeout",
            JOIN_TIMEOUT,
            str(WORKER),
            "--",
            "--work",
            str(job.work),
            "--step",
            str(self.args.step),
        ]

    def submit(self, job: TraceJob, daemon: Daemon, t0: float) -> None:
        venv = python_for_everyone()
        user = self.users[job.user]
        workdir = self.base / "jobs" / job.name
        workdir.mkdir(parents=True, mode=0o755)
        os.chown(workdir, user.uid, user.gid)
        env = {**CLIENT_ENV, "VIRTUAL_ENV": venv, "HOME": "/"}
        proc = subprocess.Popen(
            self.submit_argv(job, daemon, workdir, f"{venv}/bin/python3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(workdir),
            user=user.uid,
            group=user.gid,
            extra_groups=[],
        )
        self.submitted.append(Submitted(job, proc, daemon, time.time() - t0))

    def reap_submits(self) -> None:
        """Take the job id of each submit that returned; a refused submit ends the run."""
        for sub in self.submitted:
            if sub.id is not None or sub.proc.poll() is None:
                continue
            out, err = sub.proc.communicate()
            if sub.proc.returncode != 0:
                raise RuntimeError(
                    f"elasticctl submit of {sub.job.name} exited {sub.proc.returncode}: "
                    f"{err.strip() or out.strip()}"
                )
            sub.id = json.loads(out)["id"]

    def submit_all(self) -> float:
        """Submit each job at its arrival time (the submits run while the next ones wait);
        returns the replay's start."""
        draw = random.Random(self.args.seed + 1)
        t0 = time.time()
        for job in self.trace:
            while (left := t0 + job.arrival - time.time()) > 0:
                self.tick(t0)
                time.sleep(min(left, 0.1))
            self.submit(job, draw.choice(self.cluster.daemons), t0)
        return t0

    def tick(self, t0: float) -> None:
        """Between submits and while following: take in finished submits; every second, how
        many slots the nodes hold; a progress line now and then."""
        self.reap_submits()
        now = time.time()
        if now - self.last_sample >= 1.0:
            self.last_sample = now
            with Control(self.cluster[0].socket) as control:
                nodes = control.call("nodes", {}, 30).result or []
            self.held.append((now, sum(n["slots_total"] - n["slots_free"] for n in nodes)))
        if now - self.last_progress >= self.args.progress:
            self.last_progress = now
            self.progress(t0)

    def rows(self) -> dict[str, dict[str, Any]]:
        """Every job in n1's list (one control-protocol call: cheaper than a CLI every second)."""
        with Control(self.cluster[0].socket) as control:
            return {
                row["id"]: row
                for batch in control.stream("list", {"all": True}, 30)
                for row in batch.get("jobs", [])
            }

    def progress(self, t0: float) -> None:
        rows = self.rows()
        states = [
            rows[sub.id]["state"] if sub.id in rows else "?" for sub in self.submitted if sub.id
        ]
        busy = sum(row["workers_up"] for row in rows.values() if row["state"] not in FINAL)
        held = self.held[-1][1] if self.held else 0
        log(
            f"[{self.system}] {time.time() - t0:6.0f} s: submitted {len(self.submitted)}/{len(self.trace)}, "
            f"pending {sum(s in ('PENDING', 'RENDEZVOUS') for s in states)}, "
            f"running {sum(s in ('RUNNING', 'RESTARTING') for s in states)}, "
            f"ended {sum(s in FINAL for s in states)}; slots: {busy} running a worker, "
            f"{held} held, of {self.args.nodes}"
        )

    def follow(self, t0: float) -> bool:
        """Until every job ended (True: the run's time ran out first)."""
        while True:
            self.tick(t0)
            if all(sub.id for sub in self.submitted):
                rows = self.rows()
                if all(rows.get(sub.id, {}).get("state") in FINAL for sub in self.submitted):
                    return False
            if time.time() - t0 > self.args.timeout:
                log(f"[{self.system}] not every job ended within --timeout {self.args.timeout:g} s")
                return True
            time.sleep(1.0)

    def collect(self, t0: float, timed_out: bool) -> dict[str, Any]:
        """The records (the real CLI's ``list --all --json``) and the workers' events, summed up."""
        now = time.time()
        listed = {row["id"]: row for row in self.cluster[0].ctl("list", "--all")}
        runs = [self.job_run(sub, listed.get(sub.id or "", {}), t0, now) for sub in self.submitted]
        for run in runs:
            if run.state != "SUCCEEDED":
                error = self.cluster[0].ctl("status", run.id).get("error") if run.id else None
                log(f"[{self.system}] {run.job.name} ({run.id}) is {run.state}: {error}")
        summary = summarize(
            runs, slots=self.args.nodes, step=self.args.step, until=now, held=self.held
        )
        return {
            "system": self.system,
            "note": self.note or None,
            "timed_out": timed_out,
            "summary": summary,
            "jobs": [r.to_json(self.args.step) for r in runs],
            "held_samples": self.held,
        }

    def job_run(self, sub: Submitted, row: dict[str, Any], t0: float, now: float) -> JobRun:
        events = read_events(self.base / "jobs" / sub.job.name / "events.jsonl")
        ended = row.get("ended")
        rounds = rounds_run(events)
        return JobRun(
            sub.job,
            sub.id,
            row.get("state", "UNKNOWN"),
            float(row.get("created") or t0 + sub.at),
            row.get("started"),
            ended,
            worker_intervals(events, ended or now),
            rounds,
        )

    def stop(self) -> None:
        if self.cluster is not None:
            stop_all(self.cluster.daemons)
        stop_strays(self.base)


def stop_strays(base: Path) -> None:
    """Stop any daemon of this replay that its Daemon lost (an interrupt that landed after the
    fork and before the Daemon kept the Popen): found by its directories in its arguments."""
    strays = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(arg.startswith(f"{base}/") for arg in proc.info["cmdline"] or ()):
            strays.append(proc)
    for proc in strays:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(strays, timeout=30)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    if strays:
        log(f"stopped {len(strays)} daemons whose start was cut short: {[p.pid for p in strays]}")


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a SIGKILL mid-write
    return events


# -- output ----------------------------------------------------------------------------------


def fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "s":
        return f"{value:.1f}"
    if kind == "ratio":
        return f"{value:.3f}"
    return str(value)


ROWS = (
    ("jobs completed / submitted", "completed", "n"),
    ("average JCT (s)", "avg_jct", "s"),
    ("p95 JCT (s)", "p95_jct", "s"),
    ("makespan (s)", "makespan", "s"),
    ("utilization while jobs wait", "util_waiting", "pct"),
    ("utilization over the makespan", "util_makespan", "pct"),
    ("slots held while jobs wait (nodes)", "held_waiting", "pct"),
    ("longest wait (s)", "longest_wait", "s"),
    ("average wait (s)", "avg_wait", "s"),
    ("longest wait beyond fair share (s)", "excess_wait", "s"),
    ("jobs waiting > 10 s beyond fair share", "excess_jobs", "n"),
    ("Jain's fairness between users", "jain", "ratio"),
    ("re-formations (resizes, requeues)", "reformations", "n"),
    ("job-seconds between rounds", "between_rounds_s", "s"),
)


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    ran = [name for name in SYSTEMS if name in results]
    print(
        f"trace: seed {args.seed}, {args.jobs} jobs, {args.nodes} nodes x 1 slot, load {args.load:g}, "
        f"{args.step:g} s a step, " + ("restart path" if args.restart_path else "in place")
    )
    for name in ran:
        if results[name].get("skipped"):
            print(f"{name}: skipped: {results[name]['skipped']}")
        elif results[name].get("note"):
            print(f"{name}: {results[name]['note']}")
    summaries = {name: results[name]["summary"] for name in ran if "summary" in results[name]}
    verdict = compare(summaries.get("today"), summaries.get("scheduler"))
    print(f"{'figure':36} " + " ".join(f"{name:>12}" for name in SYSTEMS) + "   target")
    for label, key, kind in ROWS:
        cells = []
        for name in SYSTEMS:
            summary = summaries.get(name)
            if summary is None:
                cells.append("-")
            elif key == "completed":
                cells.append(f"{summary['completed']}/{summary['submitted']}")
            else:
                cells.append(fmt(summary.get(key), kind))
        print(f"{label:36} " + " ".join(f"{c:>12}" for c in cells) + "   " + verdict.get(key, ""))
    print()
    for name, summary in summaries.items():
        print(
            f"{name}: per user  "
            + "; ".join(
                f"{user}: {u['jobs']} jobs, slowdown {u['avg_slowdown']:.2f}, {u['slot_s']:.0f} slot-s"
                for user, u in summary["users"].items()
            )
        )
    print()
    print(DEFINITIONS)


# -- main ------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--system", choices=("today", "scheduler", "both"), default="both")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=30)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument(
        "--load", type=float, default=1.3, help="offered work / capacity while jobs arrive"
    )
    p.add_argument("--step", type=float, default=0.5, help="seconds a worker's step takes")
    p.add_argument(
        "--resize-interval",
        type=float,
        default=None,
        help="[scheduler] resize_interval (default: the daemon's)",
    )
    p.add_argument(
        "--restart-path",
        action="store_true",
        help="submit the jobs without --in-place: a resize stops and restarts their workers",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="give up on a system's run after S s"
    )
    p.add_argument(
        "--progress", type=float, default=15.0, help="a progress line every S s (stderr)"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON document instead of the table"
    )
    p.add_argument("--keep", action="store_true", help="keep the daemons' logs and the jobs' files")
    p.add_argument(
        "--trace", action="store_true", help="print the trace (JSON lines) and run nothing"
    )
    args = p.parse_args(argv)
    if args.jobs < 1 or args.nodes < 2 or args.step <= 0 or args.load <= 0:
        p.error("--jobs must be at least 1, --nodes at least 2, --step and --load more than 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    trace = make_trace(args.seed, args.jobs, args.nodes, load=args.load, step=args.step)
    if args.trace:
        for job in trace:
            print(json.dumps(job.to_json()))
        return 0
    if os.getuid() != 0:
        log("bench_sharing.py needs root: its users are real Unix users, made for the run")
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):  # a kill cleans up as Ctrl-C does, also where
        signal.signal(sig, signal.default_int_handler)  # SIGINT came ignored (a shell's `&`)
    systems = SYSTEMS if args.system == "both" else (args.system,)
    flags = sharing_flags_known()
    missing = [f for f in SHARING_FLAGS if f not in flags]
    if missing:
        log(
            f"elasticctl submit has no {', '.join(missing)}: the trace's jobs are submitted without them"
        )
    base = Path(tempfile.mkdtemp(prefix="elasticd-sharing-", dir="/tmp"))
    base.chmod(0o755)
    results: dict[str, dict[str, Any]] = {}
    ok = False
    try:
        with unix_users(sorted({job.user for job in trace})) as users:
            replays = []
            for system in systems:  # every config checked before the first run
                replay = Replay(system, trace, users, base / system, args, flags)
                refused = replay.prepare()
                if refused:
                    log(f"[{system}] skipped: {refused}")
                    results[system] = {"system": system, "skipped": refused}
                else:
                    replays.append(replay)
            for replay in replays:
                results[replay.system] = run_replay(replay, users)
        ok = True
    except KeyboardInterrupt:
        log("interrupted: every daemon, worker and user of the run was stopped and removed")
        ok = not args.keep  # its files go too, unless kept
        return 130
    finally:
        if args.keep or not ok:
            log(f"the run's daemon logs and job files: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    report = {
        "trace": {
            "seed": args.seed,
            "jobs": args.jobs,
            "nodes": args.nodes,
            "load": args.load,
            "step": args.step,
            "resize_interval": args.resize_interval,
            "in_place": not args.restart_path,
            "flags_left_out": missing,
        },
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_table(results, args)
    return 0


def run_replay(replay: Replay, users: dict[str, User]) -> dict[str, Any]:
    try:
        return replay.run()
    finally:
        with signals_held():
            replay.stop()
            kill_processes_of({u.uid for u in users.values()})


if __name__ == "__main__":
    sys.exit(main())
