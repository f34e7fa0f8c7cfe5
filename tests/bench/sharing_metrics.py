"""The metrics of bench_sharing.py (pure, stdlib only): from each job's record (submit, end)
and its workers' own intervals to the table's figures.  DEFINITIONS says what each one is."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sharing_trace import TraceJob

DEFINITIONS = """\
definitions:
  JCT            a job's completion time: its submit (the daemon's record, `created`) to its end (`ended`)
  wait           its submit to its first worker's exec (the worker's own timestamp)
  makespan       the first submit to the last end
  busy slot      a slot running a worker of some job, from the worker's exec to its exit (the
                 workers' own timestamps); an in-place worker only from being placed in a
                 round to its next ask for a place or its exit; a slot held by a job between
                 rounds (a resize, a requeue) or waiting in a rendezvous is not busy
  utilization while jobs wait
                 busy slot-seconds / (slots x seconds), over the times when at least one
                 submitted job has not started
  slots held     the slots the nodes say a job holds (`elasticctl nodes`: a part there, its
                 workers running or not; sampled every second), averaged over the same times
  Jain's fairness
                 (sum x)^2 / (n * sum x^2) over the n users' average slowdown x, a job's slowdown
                 being its JCT / its run time alone on the cluster at its largest size; 1: every
                 user's jobs are slowed alike; 1/n: one user's alone
  wait beyond fair share
                 for each job, the seconds it waited while its fair share said it should run:
                 it was its user's next job (priority, then age), its min fitted in what its
                 user held below the user's max-min fair share of the slots (equal shares
                 between the users with unfinished jobs, each wanting at most its jobs' max),
                 and that many slots were idle or held above fair share by other users' jobs
                 above their min (all of a --preemptible job); busy slots as above, sampled
                 every 0.5 s. Target: none longer than 10 s (a reclaim and a start)
  re-formations  rounds that jobs ran beyond their first (a grow, a shrink, a requeue): rank 0's
                 starts (in place: rank 0's placements)
  between rounds seconds in which a started job that had not ended had no worker, summed over jobs"""

JCT_TARGET = 0.35  # the scheduler's target: average JCT at least 35 % lower than today's
UTIL_TARGET = 0.95  # the scheduler's target: utilization at least 95 % while jobs wait
FAIR_GRACE = (
    10.0  # the scheduler's target: no wait beyond fair share, but for a reclaim and a start
)
FAIR_TICK = 0.5  # the excess wait is sampled this often

Interval = tuple[float, float]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when every x is equal, 1/n when one
    of n takes everything."""
    if not values:
        return None
    squares = sum(x * x for x in values)
    return 1.0 if squares == 0 else sum(values) ** 2 / (len(values) * squares)


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals, as disjoint sorted ones (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in merged(intervals))


def overlap(busy: Iterable[Interval], windows: Iterable[Interval]) -> float:
    """Busy slot-seconds inside the windows: each busy interval (one slot each) counted over
    its overlap with the windows' union."""
    union = merged(windows)
    total = 0.0
    for start, end in busy:
        for a, b in union:
            total += max(0.0, min(end, b) - max(start, a))
    return total


def utilization(busy: Sequence[Interval], windows: Iterable[Interval], slots: int) -> float | None:
    """Busy slot-seconds over available slot-seconds (slots x the windows' length) within the
    windows; None when the windows are empty."""
    available = slots * length(windows)
    return overlap(busy, windows) / available if available > 0 else None


def worker_intervals(events: Iterable[dict[str, Any]], otherwise: float) -> list[Interval]:
    """Each worker's busy intervals from its events: (exec, exit), or for an in-place worker
    (one with ``placed`` events) each (placed, its next ask or exit); a worker that wrote no
    exit (killed outright) is taken to have run until ``otherwise``."""
    starts: dict[int, float] = {}
    exits: dict[int, float] = {}
    marks: dict[int, list[tuple[float, bool]]] = {}  # pid -> (when, placed) in order
    for event in events:
        pid, kind = event.get("pid"), event.get("event")
        if kind == "start":
            starts[pid] = float(event.get("exec", event["t"]))
        elif kind == "exit":
            exits[pid] = float(event["t"])
        elif kind in ("placed", "asked"):
            marks.setdefault(pid, []).append((float(event["t"]), kind == "placed"))
    out: list[Interval] = []
    for pid, start in starts.items():
        end = max(start, exits.get(pid, otherwise))
        if pid not in marks:
            out.append((start, end))
            continue
        placed: float | None = None
        for when, is_placed in sorted(marks[pid]) + [(end, False)]:
            if is_placed and placed is None:
                placed = when
            elif not is_placed and placed is not None:
                out.append((placed, max(placed, when)))
                placed = None
    return sorted(out)


def rounds_run(events: Iterable[dict[str, Any]]) -> int:
    """The rounds a job ran: rank 0's placements (in place), else rank 0's starts."""
    events = list(events)
    placed = sum(1 for e in events if e.get("event") == "placed" and e.get("rank") == 0)
    return placed or sum(1 for e in events if e.get("event") == "start" and e.get("rank") == 0)


@dataclass
class JobRun:
    """One job of the trace as it ran: its record's times and its workers' intervals."""

    job: TraceJob
    id: str | None
    state: str
    created: float
    started: float | None  # the record's (its first node's part started)
    ended: float | None
    workers: list[Interval]
    rounds: int  # rank 0's starts

    @property
    def start(self) -> float | None:
        """Its first worker's exec (else the record's start)."""
        return min((a for a, _ in self.workers), default=self.started)

    def wait(self, until: float) -> float:
        return (self.start if self.start is not None else until) - self.created

    @property
    def succeeded(self) -> bool:
        return self.state == "SUCCEEDED" and self.ended is not None

    @property
    def jct(self) -> float | None:
        return None if self.ended is None else self.ended - self.created

    def slowdown(self, step: float) -> float | None:
        return None if self.jct is None else self.jct / self.job.ideal(step)

    def between_rounds(self, until: float) -> float:
        if self.start is None:
            return 0.0
        end = self.ended if self.ended is not None else until
        return max(0.0, (end - self.start) - length(self.workers))

    def to_json(self, step: float) -> dict[str, Any]:
        return {
            **self.job.to_json(),
            "id": self.id,
            "state": self.state,
            "created": self.created,
            "started": self.started,
            "first_exec": self.start,
            "ended": self.ended,
            "jct": self.jct,
            "slowdown": self.slowdown(step),
            "rounds": self.rounds,
            "workers": [list(w) for w in self.workers],
        }


def held_share(
    samples: Sequence[tuple[float, int]], windows: Iterable[Interval], slots: int
) -> float | None:
    """The average share of slots the nodes held (a job's part on them, running or not) over
    the samples taken within the windows; None when none was."""
    union = merged(windows)
    inside = [held for t, held in samples if any(a <= t < b for a, b in union)]
    return sum(inside) / (slots * len(inside)) if inside else None


def summarize(
    runs: Sequence[JobRun],
    *,
    slots: int,
    step: float,
    until: float,
    held: Sequence[tuple[float, int]] = (),
) -> dict[str, Any]:
    """The table's figures for one system (``until``: when the run was looked at last, the end
    of what has not ended; ``held``: samples of the slots the nodes held, (when, how many))."""
    done = [r for r in runs if r.succeeded]
    jcts = [r.jct for r in done]
    first = min((r.created for r in runs), default=until)
    last = max((r.ended if r.ended is not None else until for r in runs), default=until)
    busy = [w for r in runs for w in r.workers]
    waits = [r.wait(until) for r in runs]
    waiting = [(r.created, r.created + r.wait(until)) for r in runs]
    excess = excess_waits(runs, slots, until)
    users = {}
    for user in sorted({r.job.user for r in runs}):
        mine = [r for r in runs if r.job.user == user]
        slowdowns = [r.slowdown(step) for r in mine if r.succeeded]
        users[user] = {
            "jobs": len(mine),
            "completed": len(slowdowns),
            "avg_slowdown": sum(slowdowns) / len(slowdowns) if slowdowns else math.nan,
            "avg_jct": mean([r.jct for r in mine if r.succeeded]),
            "slot_s": sum(b - a for r in mine for a, b in r.workers),
        }
    slowdowns = [u["avg_slowdown"] for u in users.values() if u["completed"]]
    return {
        "submitted": len(runs),
        "completed": len(done),
        "avg_jct": mean(jcts),
        "p95_jct": percentile(jcts, 95),
        "makespan": last - first,
        "busy_slot_s": sum(b - a for a, b in busy),
        "util_waiting": utilization(busy, waiting, slots),
        "held_waiting": held_share(held, waiting, slots),
        "util_makespan": utilization(busy, [(first, last)], slots),
        "longest_wait": max(waits, default=None),
        "avg_wait": mean(waits),
        "excess_wait": max(excess.values(), default=None),
        "excess_jobs": sum(1 for x in excess.values() if x > FAIR_GRACE),
        "jain": jain(slowdowns),
        "reformations": sum(max(0, r.rounds - 1) for r in runs),
        "between_rounds_s": sum(r.between_rounds(until) for r in runs),
        "users": users,
    }


def max_min_fair(demands: dict[str, int], slots: int) -> dict[str, float]:
    """Equal shares of ``slots``, none above its demand (water-filling)."""
    fair = {user: 0.0 for user in demands}
    left, open_users = float(slots), {u for u, d in demands.items() if d > 0}
    while open_users and left > 1e-9:
        level = left / len(open_users)
        for user in sorted(open_users):
            give = min(level, demands[user] - fair[user])
            fair[user] += give
            left -= give
        open_users = {u for u in open_users if demands[u] - fair[u] > 1e-9}
    return fair


def excess_waits(runs: Sequence[JobRun], slots: int, until: float) -> dict[str, float]:
    """Each job's wait beyond its fair share (DEFINITIONS), in seconds, by job name."""

    def size(run: JobRun, t: float) -> int:
        return sum(1 for a, b in run.workers if a <= t < b)

    out: dict[str, float] = {}
    for run in runs:
        start = run.start if run.start is not None else until
        excess, t = 0.0, run.created
        while t < start:
            excess += FAIR_TICK if _entitled(run, runs, slots, t, size, until) else 0.0
            t += FAIR_TICK
        out[run.job.name] = excess
    return out


def _entitled(
    run: JobRun, runs: Sequence[JobRun], slots: int, t: float, size: Any, until: float
) -> bool:
    def active(r: JobRun) -> bool:
        return r.created <= t < (r.ended if r.ended is not None else until)

    live = [r for r in runs if active(r)]
    user = run.job.user
    waiting = [r for r in live if r.job.user == user and (r.start is None or t < r.start)]
    if min(waiting, key=lambda r: (-r.job.priority, r.created)) is not run:
        return False
    held: dict[str, int] = {}
    lendable: dict[str, int] = {}
    demand: dict[str, int] = {}
    for r in live:
        n = size(r, t)
        held[r.job.user] = held.get(r.job.user, 0) + n
        lend = n if r.job.preemptible else max(0, n - r.job.min_nodes)
        lendable[r.job.user] = lendable.get(r.job.user, 0) + lend
        demand[r.job.user] = min(slots, demand.get(r.job.user, 0) + r.job.max_nodes)
    fair = max_min_fair(demand, slots)
    if held.get(user, 0) + run.job.min_nodes > fair[user] + 1e-9:
        return False
    free = slots - sum(held.values())
    free += sum(
        min(held[v] - fair[v], lendable[v]) for v in held if v != user and held[v] > fair[v]
    )
    return free >= run.job.min_nodes


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compare(today: dict[str, Any] | None, scheduler: dict[str, Any] | None) -> dict[str, str]:
    """The target column: the targets the scheduler was built to meet, and whether each system met them."""
    out = {
        "avg_jct": f">= {JCT_TARGET:.0%} lower than today's",
        "util_waiting": f">= {UTIL_TARGET:.0%}",
        "jain": "1 = every user's jobs slowed alike",
    }
    if today and scheduler and today.get("avg_jct") and scheduler.get("avg_jct") is not None:
        cut = 1 - scheduler["avg_jct"] / today["avg_jct"]
        out["avg_jct"] += f": {cut:.0%} lower, {'met' if cut >= JCT_TARGET else 'MISSED'}"
        for key in ("p95_jct", "makespan", "longest_wait", "avg_wait"):
            if today.get(key) and scheduler.get(key) is not None:
                change = scheduler[key] / today[key] - 1
                out[key] = (
                    out.get(key, "") + "; " if key in out else ""
                ) + f"scheduler {change:+.0%}"
    out["excess_wait"] = f"<= {FAIR_GRACE:g} s for every job"
    fair = [
        f"{name} {'met' if s['excess_wait'] <= FAIR_GRACE else 'MISSED'}"
        for name, s in (("today", today), ("scheduler", scheduler))
        if s and s.get("excess_wait") is not None
    ]
    if fair:
        out["excess_wait"] += ": " + ", ".join(fair)
    verdicts = [
        f"{name} {'met' if s['util_waiting'] >= UTIL_TARGET else 'MISSED'}"
        for name, s in (("today", today), ("scheduler", scheduler))
        if s and s.get("util_waiting") is not None
    ]
    if verdicts:
        out["util_waiting"] += ": " + ", ".join(verdicts)
    return out
