"""The blacklist policy (pure): failures within a window, a cooldown that doubles in a row
with jitter and stays within its range, expiry, an operator's lift; which workers failed."""

from __future__ import annotations

import pytest

from elasticd.blacklist import Blacklist, BlacklistPolicy, worker_failures
from elasticd.model import PartState
from elasticd.records import Part

POLICY = BlacklistPolicy(failures=2, window=10.0, cooldown_min=2.0, cooldown_max=20.0)


@pytest.mark.parametrize("strikes, jitter, seconds", [
    (1, 0.0, 2.0), (1, 0.5, 2.5), (1, 0.999, 2.999),
    (2, 0.0, 4.0), (3, 0.0, 8.0), (3, 1.0, 12.0), (4, 0.0, 16.0),
    (4, 1.0, 20.0),            # clamped to the max
    (5, 0.0, 20.0), (10_000, 0.5, 20.0),   # no overflow, however many
    (0, 0.0, 2.0),             # never below the min
])
def test_cooldown(strikes, jitter, seconds):
    assert POLICY.cooldown(strikes, jitter) == pytest.approx(seconds)


def test_a_range_of_one_value_is_that_value():
    assert BlacklistPolicy(2, 10.0, 5.0, 5.0).cooldown(3, 0.9) == 5.0


# Each step: (operation, argument, now) -> what it returns, and whether the node is blacklisted
# afterwards.  failed: a failure key; expire/lift: no argument.
SCENARIOS = {
    "two failures within the window blacklist": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 9.0, 11.0, True),
    ],
    "the same failure twice counts once": [
        ("failed", "a", 0.0, None, False), ("failed", "a", 1.0, None, False),
        ("failed", "b", 2.0, 4.0, True),
    ],
    "a failure that left the window does not count": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 10.0, None, False),
        ("failed", "c", 12.0, 14.0, True),
    ],
    "failures while blacklisted are not counted": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 1.0, 3.0, True),
        ("failed", "c", 2.0, None, True), ("expire", None, 3.0, True, False),
        ("failed", "d", 4.0, None, False),          # c did not count: one failure so far
        ("failed", "c", 4.5, None, False),          # and seen already
    ],
    "the cooldown ends at its time, not before": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 1.0, 3.0, True),
        ("expire", None, 2.9, False, True), ("expire", None, 3.0, True, False),
        ("expire", None, 4.0, False, False),
    ],
    "in a row the cooldown doubles": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 1.0, 3.0, True),
        ("expire", None, 3.0, True, False),
        ("failed", "c", 5.0, None, False), ("failed", "d", 6.0, 10.0, True),     # 4 s
        ("expire", None, 10.0, True, False),
        ("failed", "e", 11.0, None, False), ("failed", "f", 12.0, 20.0, True),   # 8 s
    ],
    "after a quiet spell longer than the max it starts again at the min": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 1.0, 3.0, True),
        ("expire", None, 3.0, True, False),
        ("failed", "c", 30.0, None, False), ("failed", "d", 31.0, 33.0, True),   # 2 s again
    ],
    "an operator's lift readmits and forgets": [
        ("failed", "a", 0.0, None, False), ("failed", "b", 1.0, 3.0, True),
        ("lift", None, 2.0, True, False), ("lift", None, 2.5, False, False),
        ("failed", "c", 3.0, None, False), ("failed", "d", 4.0, 6.0, True),     # strike 1 again
        ("expire", None, 6.0, True, False),
    ],
}


@pytest.mark.parametrize("steps", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_blacklist(steps):
    blacklist = Blacklist(POLICY, rand=lambda: 0.0)
    for number, (op, arg, now, returns, active) in enumerate(steps):
        result = blacklist.failed(arg, now) if op == "failed" else \
            blacklist.expire(now) if op == "expire" else blacklist.lift()
        assert (result, blacklist.active) == (returns, active), f"step {number}: {op} {arg} at {now}"


def test_the_jitter_comes_from_the_random_source():
    blacklist = Blacklist(POLICY, rand=lambda: 0.5)
    blacklist.failed("a", 0.0)
    assert blacklist.failed("b", 0.0) == 2.5


def test_off():
    blacklist = Blacklist(BlacklistPolicy(failures=0))
    assert all(blacklist.failed(i, 0.0) is None for i in range(100)) and not blacklist.active


def test_one_failure_is_enough_when_failures_is_1():
    assert Blacklist(BlacklistPolicy(1, 10.0, 3.0, 3.0)).failed("a", 5.0) == 8.0


def part(round, workers, node="n2"):
    return Part(node=node, state=PartState.RESTARTING, round=round, workers=tuple(workers))


def worker(local_rank, pid, state, exit_code):
    return {"rank": local_rank, "local_rank": local_rank, "node": "n2", "pid": pid,
            "state": state, "exit_code": exit_code}


@pytest.mark.parametrize("workers, keys", [
    ([worker(0, 10, "HEALTHY", None), worker(1, 11, "FAILED", 1)], [("j-1", 3, 1, 11)]),
    ([worker(0, 10, "FAILED", -9), worker(1, 11, "FAILED", 127)], [("j-1", 3, 0, 10), ("j-1", 3, 1, 11)]),
    ([worker(0, None, "FAILED", 127)], [("j-1", 3, 0, None)]),       # could not start
    ([worker(0, 10, "STOPPED", -15)], []),                           # stopped by the daemon
    ([worker(0, 10, "SUCCEEDED", 0)], []),
    ([], []),
])
def test_worker_failures(workers, keys):
    assert worker_failures("j-1", part(3, workers)) == keys
