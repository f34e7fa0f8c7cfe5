"""faults.py: a key logged once per interval (pure, with ``now`` passed in), and loops that
outlive an unexpected exception without swallowing a cancellation."""

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
    assert throttle.check("k", 60.0) == 3      # the next line tells how many were held back
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
