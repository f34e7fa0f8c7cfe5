"""The blacklist policy (pure): a user's failures within a window keep that user's jobs off
the node, several users kept off blacklist the node; a cooldown that doubles in a row with
jitter and stays within its range, expiry, an operator's lift; which workers failed."""

from __future__ import annotations

import pytest

from elasticd.core.blacklist import (
    Blacklist,
    BlacklistPolicy,
    Verdict,
    several_users,
    worker_failures,
)
from elasticd.core.model import PartState
from elasticd.core.records import Part

POLICY = BlacklistPolicy(failures=2, window=10.0, cooldown_min=2.0, cooldown_max=20.0)


@pytest.mark.parametrize(
    "strikes, jitter, seconds",
    [
        (1, 0.0, 2.0),
        (1, 0.5, 2.5),
        (1, 0.999, 2.999),
        (2, 0.0, 4.0),
        (3, 0.0, 8.0),
        (3, 1.0, 12.0),
        (4, 0.0, 16.0),
        (4, 1.0, 20.0),  # clamped to the max
        (5, 0.0, 20.0),
        (10_000, 0.5, 20.0),  # no overflow, however many
        (0, 0.0, 2.0),  # never below the min
    ],
)
def test_cooldown(strikes, jitter, seconds):
    assert POLICY.cooldown(strikes, jitter) == pytest.approx(seconds)


def test_a_range_of_one_value_is_that_value():
    assert BlacklistPolicy(2, 10.0, 5.0, 5.0).cooldown(3, 0.9) == 5.0


# Each step: (operation, argument, now, what it returns, the users kept off afterwards, whether
# the node is blacklisted afterwards).  failed: (key, user) -> (user's until, node's until);
# expire: -> whether the node's cooldown ended; expire_user: user -> whether theirs ended;
# lift: -> whether any cooldown was in force.
A, B, C = "alice", "bob", "carol"
SCENARIOS = {
    "two failures of one user's jobs keep that user off, not the node": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 9.0, (11.0, None), {A}, False),
    ],
    "failures of different jobs of one user count together": [
        ("failed", (("j-1", 0), A), 0.0, (None, None), set(), False),
        ("failed", (("j-2", 0), A), 1.0, (3.0, None), {A}, False),
    ],
    "one failure each of two users keeps nobody off": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", B), 1.0, (None, None), set(), False),
    ],
    "a second user kept off while the first is blacklists the node": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 1.0, (3.0, None), {A}, False),
        ("failed", ("c", B), 2.0, (None, None), {A}, False),
        ("failed", ("d", B), 2.5, (4.5, 4.5), {A, B}, True),
    ],
    "a second user kept off within the window of the first blacklists the node": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 1.0, (3.0, None), {A}, False),
        ("expire_user", A, 3.0, True, set(), False),
        ("failed", ("c", B), 8.0, (None, None), set(), False),
        ("failed", ("d", B), 10.9, (12.9, 12.9), {B}, True),
    ],
    "a second user kept off after the window of the first does not": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 1.0, (3.0, None), {A}, False),
        ("expire_user", A, 3.0, True, set(), False),
        ("failed", ("c", B), 10.0, (None, None), set(), False),
        ("failed", ("d", B), 11.0, (13.0, None), {B}, False),
    ],
    "the same failure twice counts once": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("a", A), 1.0, (None, None), set(), False),
        ("failed", ("b", A), 2.0, (4.0, None), {A}, False),
    ],
    "a failure that left the window does not count": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 10.0, (None, None), set(), False),
        ("failed", ("c", A), 12.0, (14.0, None), {A}, False),
    ],
    "failures of a user kept off are not counted; others' are": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 1.0, (3.0, None), {A}, False),
        ("failed", ("c", A), 2.0, (None, None), {A}, False),
        ("expire_user", A, 2.9, False, {A}, False),  # not before its time
        ("expire_user", A, 3.0, True, set(), False),
        ("failed", ("d", A), 4.0, (None, None), set(), False),  # c did not count
        ("failed", ("c", A), 4.5, (None, None), set(), False),  # and is seen already
    ],
    "failures while the node is blacklisted are not counted": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 0.5, (2.5, None), {A}, False),
        ("failed", ("c", B), 1.0, (None, None), {A}, False),
        ("failed", ("d", B), 1.5, (3.5, 3.5), {A, B}, True),
        ("failed", ("e", C), 2.0, (None, None), {A, B}, True),
        ("failed", ("f", C), 2.1, (None, None), {A, B}, True),
        ("expire", None, 3.4, False, {A, B}, True),
        ("expire", None, 3.5, True, {A, B}, False),
        ("failed", ("g", C), 3.6, (None, None), {A, B}, False),  # C's count starts again
    ],
    "in a row a user's cooldown doubles": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 1.0, (3.0, None), {A}, False),
        ("expire_user", A, 3.0, True, set(), False),
        ("failed", ("c", A), 5.0, (None, None), set(), False),
        ("failed", ("d", A), 6.0, (10.0, None), {A}, False),  # 4 s
        ("expire_user", A, 10.0, True, set(), False),
        ("failed", ("e", A), 11.0, (None, None), set(), False),
        ("failed", ("f", A), 12.0, (20.0, None), {A}, False),  # 8 s
    ],
    "after a quiet spell longer than the max it starts again at the min": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 1.0, (3.0, None), {A}, False),
        ("expire_user", A, 3.0, True, set(), False),
        ("failed", ("c", A), 30.0, (None, None), set(), False),
        ("failed", ("d", A), 31.0, (33.0, None), {A}, False),  # 2 s again
    ],
    "an operator's lift readmits every user and the node, and forgets": [
        ("failed", ("a", A), 0.0, (None, None), set(), False),
        ("failed", ("b", A), 0.5, (2.5, None), {A}, False),
        ("failed", ("c", B), 1.0, (None, None), {A}, False),
        ("failed", ("d", B), 1.5, (3.5, 3.5), {A, B}, True),
        ("lift", None, 2.0, True, set(), False),
        ("lift", None, 2.5, False, set(), False),
        ("failed", ("e", A), 3.0, (None, None), set(), False),
        ("failed", ("f", A), 4.0, (6.0, None), {A}, False),  # strike 1 again, B forgotten
    ],
}


def step(blacklist: Blacklist, op: str, arg, now: float):
    if op == "failed":
        verdict = blacklist.failed(arg[0], arg[1], now)
        return verdict.user_until, verdict.node_until
    if op == "expire":
        return blacklist.expire(now)
    if op == "expire_user":
        return blacklist.expire_user(arg, now)
    return blacklist.lift()


@pytest.mark.parametrize("steps", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_blacklist(steps):
    blacklist = Blacklist(POLICY, rand=lambda: 0.0)
    for number, (op, arg, now, returns, kept_off, active) in enumerate(steps):
        result = step(blacklist, op, arg, now)
        assert (result, blacklist.kept_off(), blacklist.active) == (returns, kept_off, active), (
            f"step {number}: {op} {arg} at {now}"
        )


@pytest.mark.parametrize(
    "began, in_force, now, several",
    [
        ({}, set(), 0.0, False),
        ({A: 0.0}, {A}, 0.0, False),  # one user: never the node
        ({A: 0.0, B: 5.0}, {B}, 5.0, True),  # A's began within the window
        ({A: 0.0, B: 10.0}, {B}, 10.0, False),  # ... and 10 s ago is outside it
        ({A: 0.0, B: 30.0}, {A, B}, 30.0, True),  # both in force, however long ago
        ({A: 0.0, B: 1.0, C: 2.0}, set(), 50.0, False),  # all long over
        ({A: 45.0, B: 46.0}, set(), 50.0, True),
    ],
)
def test_several_users(began, in_force, now, several):
    assert several_users(began, in_force, now, POLICY.window) is several


def test_the_jitter_comes_from_the_random_source():
    blacklist = Blacklist(POLICY, rand=lambda: 0.5)
    blacklist.failed("a", A, 0.0)
    assert blacklist.failed("b", A, 0.0).user_until == 2.5


def test_off():
    blacklist = Blacklist(BlacklistPolicy(failures=0))
    assert all(blacklist.failed(i, i % 3, 0.0) == Verdict() for i in range(100))
    assert not blacklist.active and not blacklist.kept_off()


def test_one_failure_is_enough_when_failures_is_1():
    blacklist = Blacklist(BlacklistPolicy(1, 10.0, 3.0, 3.0))
    assert blacklist.failed("a", A, 5.0) == Verdict(8.0, None)
    assert blacklist.failed("b", B, 6.0) == Verdict(9.0, 9.0)


def part(round, workers, node="n2"):
    return Part(node=node, state=PartState.RESTARTING, round=round, workers=tuple(workers))


def worker(local_rank, pid, state, exit_code):
    return {
        "rank": local_rank,
        "local_rank": local_rank,
        "node": "n2",
        "pid": pid,
        "state": state,
        "exit_code": exit_code,
    }


@pytest.mark.parametrize(
    "workers, keys",
    [
        ([worker(0, 10, "HEALTHY", None), worker(1, 11, "FAILED", 1)], [("j-1", 3, 1, 11)]),
        (
            [worker(0, 10, "FAILED", -9), worker(1, 11, "FAILED", 127)],
            [("j-1", 3, 0, 10), ("j-1", 3, 1, 11)],
        ),
        ([worker(0, None, "FAILED", 127)], [("j-1", 3, 0, None)]),  # could not start
        ([worker(0, 10, "STOPPED", -15)], []),  # stopped by the daemon
        ([worker(0, 10, "SUCCEEDED", 0)], []),
        ([], []),
    ],
)
def test_worker_failures(workers, keys):
    assert worker_failures("j-1", part(3, workers)) == keys
