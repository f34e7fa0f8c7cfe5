"""faults.py: a key logged once per interval, what was held back told with its next line or
summed up once the interval is over (pure, with ``now`` passed in), and loops that outlive
an unexpected exception without swallowing a cancellation."""

from __future__ import annotations

import asyncio
import logging

import pytest

from elasticd.faults import Faults, Throttle, held_back


def test_a_key_is_logged_once_per_interval_and_the_rest_counted():
    throttle = Throttle(interval=60.0)
    assert throttle.check("k", 0.0) == 0
    assert [throttle.check("k", t) for t in (1.0, 30.0, 59.9)] == [None, None, None]
    assert throttle.check("other", 5.0) == 0  # each key has its own allowance
    assert throttle.check("k", 60.0) == 3  # the next line tells how many were held back
    assert throttle.check("k", 61.0) is None
    assert throttle.check("k", 130.0) == 1
    assert held_back(3) == " (3 more since the last such line)" and held_back(0) == ""


def test_the_keys_remembered_are_bounded():
    throttle = Throttle(interval=60.0, max_keys=4)
    assert [throttle.check(f"k{i}", 0.0) for i in range(4)] == [0, 0, 0, 0]
    # a fifth key within the interval shares one allowance with every other new key
    assert throttle.check("k4", 1.0) == 0
    assert throttle.check("k5", 2.0) is None
    assert throttle.check("k6", 3.0) is None
    assert len(throttle._seen) <= 5
    # once the interval passed, old keys are forgotten and new ones have their own again
    assert throttle.check("k7", 61.5) == 0
    assert throttle.check("k7", 62.0) is None
    for i in range(10_000):  # any number of keys: still bounded
        throttle.check(f"x{i}", 200.0 + i * 0.001)
    assert len(throttle._seen) <= 5


def test_counts_that_may_stop_coming_are_told_once_their_interval_is_over():
    """Refused peer handshakes (docs/security.md, "Between daemons"): the first is logged, the rest counted and
    summed up by a line of their own (``flush``) once the interval is over, with the newest
    one's detail, even if no other comes."""
    throttle = Throttle(interval=60.0)
    assert throttle.check("peer", 0.0, "a") == 0
    assert [throttle.check("peer", 1.0 + i * 0.01, f"b{i}") for i in range(1499)] == [None] * 1499
    assert throttle.due() == 60.0
    assert throttle.flush(59.9) == []
    assert throttle.flush(60.0) == [("peer", 1499, "b1498")]
    assert throttle.due() is None and throttle.flush(200.0) == []  # nothing since
    assert throttle.check("peer", 70.0, "c") is None  # within the interval the summary opened
    assert throttle.flush(120.0) == [("peer", 1, "c")]


def test_after_a_quiet_interval_the_next_one_is_logged_itself():
    throttle = Throttle(interval=60.0)
    assert throttle.check("peer", 0.0, "a") == 0
    assert throttle.check("peer", 30.0, "b") is None
    assert throttle.flush(60.0) == [("peer", 1, "b")]
    assert throttle.check("peer", 130.0, "c") == 0  # a whole quiet interval since the last line
    assert throttle.due() is None


def test_each_key_is_summed_up_when_its_own_interval_is_over():
    throttle = Throttle(interval=60.0)
    for key, at in (("x", 0.0), ("y", 30.0)):
        throttle.check(key, at)
        throttle.check(key, at + 1.0, "newest")
    assert throttle.due() == 60.0
    assert throttle.flush(60.0) == [("x", 1, "newest")]
    assert throttle.due() == 90.0 and throttle.flush(90.0) == [("y", 1, "newest")]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_contained_fault_is_counted_logged_with_its_traceback_and_the_loop_goes_on(caplog):
    counted: list[str] = []
    clock = Clock()
    faults = Faults(counted.append, clock=clock)
    steps: list[int] = []

    async def loop() -> None:
        for step in range(5):
            async with faults.contained("board_follower"):
                steps.append(step)
                if step % 2 == 0:
                    raise IndexError(f"bad record {step}")
            clock.now += 10.0

    with caplog.at_level(logging.ERROR, logger="elasticd"):
        asyncio.run(loop())
    assert steps == [0, 1, 2, 3, 4]
    assert counted == ["board_follower"] * 3
    lines = [r for r in caplog.records if "board_follower" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # once per interval per loop
    assert lines[0].exc_info and lines[0].exc_info[0] is IndexError  # with its traceback


def test_a_cancellation_is_never_contained():
    faults = Faults()
    entered = asyncio.Event()

    async def step() -> None:
        async with faults.contained("heartbeat", backoff=0.0):
            entered.set()
            await asyncio.Event().wait()

    async def scenario() -> None:
        task = asyncio.create_task(step())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_a_back_off_follows_a_fault_and_is_cancellable():
    faults = Faults()

    async def scenario() -> None:
        async def failing() -> None:
            async with faults.contained("board_follower", backoff=3600.0):
                raise RuntimeError("boom")

        task = asyncio.create_task(failing())
        await asyncio.sleep(0.01)
        assert not task.done()  # in its back-off
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_supervise_starts_a_loop_again_until_it_returns(caplog):
    counted: list[str] = []
    faults = Faults(counted.append)
    runs: list[int] = []

    async def run() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise KeyError("one record")

    with caplog.at_level(logging.ERROR, logger="elasticd"):
        asyncio.run(faults.supervise("discovery", run, backoff=0.0))
    assert runs == [0, 1, 2] and counted == ["discovery", "discovery"]
    assert "the discovery loop: unexpected error; it goes on" in caplog.text


def test_a_detail_is_told_but_is_no_key_of_its_own(caplog):
    faults = Faults()
    with caplog.at_level(logging.ERROR, logger="elasticd"):
        for job in ("j-1", "j-2"):
            try:
                raise ValueError("x")
            except ValueError:
                faults.report("board_changes", f"job {job}")
    assert "(job j-1)" in caplog.text and "j-2" not in caplog.text
