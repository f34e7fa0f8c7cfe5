"""The pure parts of tests/bench/bench_sharing.py: its seeded trace and its metrics' maths
(the benchmark itself is not a test: it replays the trace on real daemons and prints)."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from sharing_metrics import (
    JobRun,
    excess_waits,
    held_share,
    jain,
    max_min_fair,
    merged,
    overlap,
    percentile,
    rounds_run,
    summarize,
    utilization,
    worker_intervals,
)
from sharing_trace import KINDS, USER_WEIGHTS, USERS, TraceJob, make_trace


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    assert make_trace(7, 40, 8) == make_trace(7, 40, 8)
    assert make_trace(7, 40, 8) != make_trace(8, 40, 8)


def test_every_job_is_valid_for_the_cluster():
    for seed in range(20):
        trace = make_trace(seed, 50, 8)
        arrivals = [job.arrival for job in trace]
        assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
        assert len({job.name for job in trace}) == len(trace)
        for job in trace:
            assert 1 <= job.min_nodes <= job.max_nodes <= 8
            lo, hi = KINDS[job.kind][4]
            assert lo <= job.work <= hi
            assert job.user in USERS
            low = -(-job.min_nodes // job.nnodes_step) * job.nnodes_step
            assert low <= job.max_nodes, job  # some node count is a multiple of the step
            assert not (job.preemptible and job.kind == "large")


def test_a_small_cluster_caps_the_sizes():
    assert all(job.max_nodes <= 2 for job in make_trace(3, 60, 2))


def test_the_trace_has_the_published_shapes():
    """Most jobs small, a few large ones holding most of the work, users unequal, and the
    offered load what was asked for over the arrivals."""
    trace = make_trace(1, 3000, 8, load=1.3, step=0.5)
    kinds = Counter(job.kind for job in trace)
    assert abs(kinds["small"] / 3000 - 0.7) < 0.03 and abs(kinds["large"] / 3000 - 0.1) < 0.02
    work = Counter()
    for job in trace:
        work[job.kind] += job.work
    assert work["large"] > work["small"]
    users = Counter(job.user for job in trace)
    for user, weight in zip(USERS, USER_WEIGHTS):
        assert abs(users[user] / 3000 - weight) < 0.03
    offered = sum(job.work for job in trace) * 0.5 / (8 * trace[-1].arrival)
    assert offered == pytest.approx(1.3, rel=0.08)


def test_jain():
    assert jain([2.0, 2.0, 2.0]) == 1.0
    assert jain([5.0, 0.0, 0.0, 0.0]) == 0.25
    assert jain([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)
    assert jain([]) is None


def test_percentile_is_linear_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 95) is None


def test_merged_and_overlap():
    assert merged([(5, 6), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 6)]
    # two slots busy, overlapping windows count once
    assert overlap([(0, 10), (5, 20)], [(2, 6), (4, 8), (30, 40)]) == pytest.approx(6 + 3)


def test_utilization_counts_busy_slots_inside_the_windows_only():
    busy = [(0, 10), (0, 10), (0, 5)]  # 3 slots, the third idle from 5
    assert utilization(busy, [(0, 10)], 4) == pytest.approx(25 / 40)
    assert utilization(busy, [(5, 10)], 2) == pytest.approx(1.0)
    assert utilization(busy, [(20, 30)], 4) == 0.0
    assert utilization(busy, [], 4) is None


def test_worker_intervals_from_the_workers_events():
    events = [
        {"event": "start", "pid": 1, "t": 1.5, "exec": 1.0},
        {"event": "start", "pid": 2, "t": 2.5, "exec": 2.0},
        {"event": "done", "pid": 1, "t": 8.0},
        {"event": "exit", "pid": 1, "t": 9.0},
        {"event": "start", "pid": 3, "t": 12.0},
    ]  # no exit: killed outright
    assert worker_intervals(events, otherwise=20.0) == [(1.0, 9.0), (2.0, 20.0), (12.0, 20.0)]


def test_an_in_place_worker_is_busy_only_while_placed():
    events = [
        {"event": "start", "pid": 1, "t": 1.5, "exec": 1.0, "rank": -1},
        {"event": "placed", "pid": 1, "t": 3.0, "rank": 0},  # warmed up 2 s: not busy
        {"event": "asked", "pid": 1, "t": 7.0, "rank": 0},  # a resize
        {"event": "placed", "pid": 1, "t": 7.5, "rank": 1},
        {"event": "exit", "pid": 1, "t": 10.0, "rank": 1},
        {"event": "start", "pid": 2, "t": 4.0, "exec": 4.0, "rank": -1},
        {"event": "placed", "pid": 2, "t": 7.5, "rank": 0},
    ]  # killed outright
    assert worker_intervals(events, otherwise=12.0) == [(3.0, 7.0), (7.5, 10.0), (7.5, 12.0)]
    assert rounds_run(events) == 2
    assert rounds_run([{"event": "start", "pid": 1, "rank": 0}] * 3) == 3


def test_max_min_fair_shares_fill_up_to_each_demand():
    assert max_min_fair({"a": 1, "b": 8, "c": 8}, 8) == {"a": 1.0, "b": 3.5, "c": 3.5}
    assert max_min_fair({"a": 2, "b": 2}, 8) == {"a": 2.0, "b": 2.0}
    assert max_min_fair({}, 8) == {}


def run_of(
    name: str,
    user: str,
    created: float,
    start: float | None,
    end: float | None,
    workers: list[tuple[float, float]],
    min_nodes: int = 1,
    max_nodes: int = 4,
) -> JobRun:
    return JobRun(
        TraceJob(name, user, "small", created, min_nodes, max_nodes, 100),
        name,
        "SUCCEEDED" if end else "RUNNING",
        created,
        start,
        end,
        workers,
        1,
    )


def test_a_wait_beyond_fair_share_counts_only_while_the_user_is_owed_a_node():
    # u1's 4-node job holds the whole cluster of 4 from 0 to 20; u2's 1-node job waits 5 -> 15:
    # u2 is owed 2 of the 4 and u1 lends 3 above its min of 1: every waiting second is excess
    hog = run_of("hog", "u1", 0.0, 0.0, 20.0, [(0.0, 20.0)] * 4)
    late = run_of("late", "u2", 5.0, 15.0, 25.0, [(15.0, 25.0)])
    assert excess_waits([hog, late], 4, until=30.0) == {"hog": 0.0, "late": pytest.approx(10.0)}
    # the same job at its min of 4 lends nothing: waiting is no excess
    rigid = run_of("hog", "u1", 0.0, 0.0, 20.0, [(0.0, 20.0)] * 4, min_nodes=4)
    assert excess_waits([rigid, late], 4, until=30.0)["late"] == 0.0
    # a user's second waiting job waits behind its first
    first = run_of("first", "u2", 5.0, 15.0, 25.0, [(15.0, 25.0)])
    second = run_of("second", "u2", 6.0, 15.0, 25.0, [(15.0, 25.0)])
    assert excess_waits([hog, first, second], 4, until=30.0)["second"] == 0.0


def job(name: str, user: str, work: int, max_nodes: int) -> TraceJob:
    return TraceJob(name, user, "small", 0.0, 1, max_nodes, work)


def test_summarize_two_users():
    """Two one-slot jobs on a 2-slot cluster; b waits 10 s for a (which holds both slots,
    one idle), then a resize gap of 2 s: the figures by hand."""
    a = JobRun(
        job("a", "u1", 20, 2),
        "j-a",
        "SUCCEEDED",
        created=0.0,
        started=0.5,
        ended=10.0,
        workers=[(0.5, 10.0)],
        rounds=1,
    )
    b = JobRun(
        job("b", "u2", 20, 1),
        "j-b",
        "SUCCEEDED",
        created=2.0,
        started=12.0,
        ended=24.0,
        workers=[(12.0, 16.0), (18.0, 24.0)],
        rounds=2,
    )
    s = summarize(
        [a, b], slots=2, step=1.0, until=30.0, held=[(1.0, 2), (5.0, 2), (11.0, 1), (20.0, 1)]
    )
    assert s["completed"] == 2 and s["avg_jct"] == pytest.approx(16.0)
    assert s["makespan"] == pytest.approx(24.0)
    assert s["longest_wait"] == pytest.approx(10.0) and s["avg_wait"] == pytest.approx(5.25)
    # waiting: [0, 0.5) and [2, 12); busy there: a's slot over [2, 10) -> 8 of 2 x 10.5
    assert s["util_waiting"] == pytest.approx(8.0 / 21.0)
    assert s["held_waiting"] == pytest.approx((2 + 1) / (2 * 2))  # the samples at 5 and 11
    assert s["util_makespan"] == pytest.approx((9.5 + 10.0) / 48.0)
    assert s["reformations"] == 1 and s["between_rounds_s"] == pytest.approx(2.0)
    # slowdown: a 10 / (20/2), b 22 / 20: Jain over (1.0, 1.1)
    assert s["users"]["u1"]["avg_slowdown"] == pytest.approx(1.0)
    assert s["users"]["u2"]["avg_slowdown"] == pytest.approx(1.1)
    assert s["jain"] == pytest.approx(2.1**2 / (2 * (1.0 + 1.21)))


def test_a_job_that_never_started_waits_until_the_end_and_is_not_completed():
    a = JobRun(
        job("a", "u1", 10, 1),
        "j-a",
        "PENDING",
        created=5.0,
        started=None,
        ended=None,
        workers=[],
        rounds=0,
    )
    s = summarize([a], slots=1, step=1.0, until=65.0)
    assert s["completed"] == 0 and s["avg_jct"] is None and s["jain"] is None
    assert s["longest_wait"] == pytest.approx(60.0) and s["util_waiting"] == 0.0
    assert math.isnan(s["users"]["u1"]["avg_slowdown"])
    assert held_share([], [(0, 1)], 1) is None
