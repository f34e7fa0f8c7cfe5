"""The metrics of bench_sharing.py (pure, stdlib only): from each job's record (submit, end)
and its workers' own intervals to the table's figures.  DEFINITIONS says what each one is."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from sharing_trace import TraceJob

DEFINITIONS = """\
definitions:
  JCT            a job's completion time: its submit (the daemon's record, `created`) to its end (`ended`)
  wait           its submit to its first worker's exec (the worker's own timestamp)
  makespan       the first submit to the last end
  busy slot      a slot running a worker of some job, from the worker's exec to its exit (the
                 workers' own timestamps); a slot held by a job between rounds (a resize, a
                 requeue) or waiting in a rendezvous is not busy
  utilization while jobs wait
                 busy slot-seconds / (slots x seconds), over the times when at least one
                 submitted job has not started
  slots held     the slots the nodes say a job holds (`elasticctl nodes`: a part there, its
                 workers running or not; sampled every second), averaged over the same times
  Jain's fairness
                 (sum x)^2 / (n * sum x^2) over the n users' average slowdown x, a job's slowdown
                 being its JCT / its run time alone on the cluster at its largest size; 1: every
                 user's jobs are slowed alike; 1/n: one user's alone
  re-formations  rounds that jobs ran beyond their first (a grow, a shrink, a requeue): rank 0's starts
  between rounds seconds in which a started job that had not ended had no worker, summed over jobs"""

JCT_TARGET = 0.35      # issue 26: average JCT at least 35 % lower than today's
UTIL_TARGET = 0.95     # issue 26: utilization at least 95 % while jobs wait

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
    """Each worker process's (exec, exit) from its events; one that wrote no exit (killed
    outright) is taken to have run until ``otherwise``."""
    starts: dict[int, float] = {}
    exits: dict[int, float] = {}
    for event in events:
        if event.get("event") == "start":
            starts[event["pid"]] = float(event.get("exec", event["t"]))
        elif event.get("event") == "exit":
            exits[event["pid"]] = float(event["t"])
    return sorted((start, max(start, exits.get(pid, otherwise))) for pid, start in starts.items())


@dataclass
class JobRun:
    """One job of the trace as it ran: its record's times and its workers' intervals."""

    job: TraceJob
    id: str | None
    state: str
    created: float
    started: float | None       # the record's (its first node's part started)
    ended: float | None
    workers: list[Interval]
    rounds: int                 # rank 0's starts

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
        return {**self.job.to_json(), "id": self.id, "state": self.state, "created": self.created,
                "started": self.started, "first_exec": self.start, "ended": self.ended,
                "jct": self.jct, "slowdown": self.slowdown(step), "rounds": self.rounds,
                "workers": [list(w) for w in self.workers]}


def held_share(samples: Sequence[tuple[float, int]], windows: Iterable[Interval], slots: int) -> float | None:
    """The average share of slots the nodes held (a job's part on them, running or not) over
    the samples taken within the windows; None when none was."""
    union = merged(windows)
    inside = [held for t, held in samples if any(a <= t < b for a, b in union)]
    return sum(inside) / (slots * len(inside)) if inside else None


def summarize(runs: Sequence[JobRun], *, slots: int, step: float, until: float,
              held: Sequence[tuple[float, int]] = ()) -> dict[str, Any]:
    """The table's figures for one system (``until``: when the run was looked at last, the end
    of what has not ended; ``held``: samples of the slots the nodes held, (when, how many))."""
    done = [r for r in runs if r.succeeded]
    jcts = [r.jct for r in done]
    first = min((r.created for r in runs), default=until)
    last = max((r.ended if r.ended is not None else until for r in runs), default=until)
    busy = [w for r in runs for w in r.workers]
    waits = [r.wait(until) for r in runs]
    waiting = [(r.created, r.created + r.wait(until)) for r in runs]
    users = {}
    for user in sorted({r.job.user for r in runs}):
        mine = [r for r in runs if r.job.user == user]
        slowdowns = [r.slowdown(step) for r in mine if r.succeeded]
        users[user] = {"jobs": len(mine), "completed": len(slowdowns),
                       "avg_slowdown": sum(slowdowns) / len(slowdowns) if slowdowns else math.nan,
                       "avg_jct": mean([r.jct for r in mine if r.succeeded]),
                       "slot_s": sum(b - a for r in mine for a, b in r.workers)}
    slowdowns = [u["avg_slowdown"] for u in users.values() if u["completed"]]
    return {
        "submitted": len(runs), "completed": len(done),
        "avg_jct": mean(jcts), "p95_jct": percentile(jcts, 95), "makespan": last - first,
        "busy_slot_s": sum(b - a for a, b in busy),
        "util_waiting": utilization(busy, waiting, slots), "held_waiting": held_share(held, waiting, slots),
        "util_makespan": utilization(busy, [(first, last)], slots),
        "longest_wait": max(waits, default=None), "avg_wait": mean(waits),
        "jain": jain(slowdowns), "reformations": sum(max(0, r.rounds - 1) for r in runs),
        "between_rounds_s": sum(r.between_rounds(until) for r in runs), "users": users,
    }


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def compare(today: dict[str, Any] | None, scheduler: dict[str, Any] | None) -> dict[str, str]:
    """The target column: the issue's targets, and whether each system met them."""
    out = {"avg_jct": f">= {JCT_TARGET:.0%} lower than today's",
           "util_waiting": f">= {UTIL_TARGET:.0%}",
           "longest_wait": "none longer than its fair share implies",
           "jain": "1 = every user's jobs slowed alike"}
    if today and scheduler and today.get("avg_jct") and scheduler.get("avg_jct") is not None:
        cut = 1 - scheduler["avg_jct"] / today["avg_jct"]
        out["avg_jct"] += f": {cut:.0%} lower, {'met' if cut >= JCT_TARGET else 'MISSED'}"
        for key in ("p95_jct", "makespan", "longest_wait", "avg_wait"):
            if today.get(key) and scheduler.get(key) is not None:
                change = scheduler[key] / today[key] - 1
                out[key] = (out.get(key, "") + "; " if key in out else "") + f"scheduler {change:+.0%}"
    verdicts = [f"{name} {'met' if s['util_waiting'] >= UTIL_TARGET else 'MISSED'}"
                for name, s in (("today", today), ("scheduler", scheduler))
                if s and s.get("util_waiting") is not None]
    if verdicts:
        out["util_waiting"] += ": " + ", ".join(verdicts)
    return out
