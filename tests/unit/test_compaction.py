"""The observer's compaction of the etcd store's history (cluster/compaction.py): the
decision as a table, and the loop's step on a recording store (the calls to etcd itself are
tests/contract/test_etcd_store.py's, the daemons' tests/system/test_etcd_ha.py's)."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.cluster.compaction import Compactor, Mark, next_compaction
from elasticd.errors import StoreConnectionError
from elasticd.faults import Throttle

INTERVAL = 300.0


@pytest.mark.parametrize(
    ("mark", "revision", "now", "expected"),
    [
        # no mark yet (a daemon that just began to observe): mark, compact nothing
        (None, 50, 10.0, (None, Mark(10.0, 50))),
        # within the interval: keep the mark
        (Mark(10.0, 50), 80, 10.0 + INTERVAL - 1, (None, Mark(10.0, 50))),
        # an interval on: compact up to the mark, mark now
        (Mark(10.0, 50), 80, 10.0 + INTERVAL, (50, Mark(10.0 + INTERVAL, 80))),
        # nothing written since the mark: nothing to compact, mark again
        (Mark(10.0, 50), 50, 10.0 + INTERVAL, (None, Mark(10.0 + INTERVAL, 50))),
        # the mark was taken before the client saw any reply: mark again
        (Mark(10.0, 0), 80, 10.0 + INTERVAL, (None, Mark(10.0 + INTERVAL, 80))),
        # a store whose revision went back (restored from a backup): mark again
        (Mark(10.0, 50), 7, 10.0 + INTERVAL, (None, Mark(10.0 + INTERVAL, 7))),
    ],
)
def test_next_compaction(mark, revision, now, expected):
    assert next_compaction(mark, revision, now, INTERVAL) == expected


class RecordingHistory:
    """A store's history as the compactor sees it: a revision, and the compactions asked."""

    def __init__(self) -> None:
        self.revision = 1
        self.compactions: list[int] = []
        self.floor = 0  # compacted up to here, by anyone
        self.fails: Exception | None = None

    async def compact(self, revision: int) -> bool:
        if self.fails is not None:
            raise self.fails
        self.compactions.append(revision)
        if revision <= self.floor:
            return False
        self.floor = revision
        return True


def test_only_the_observer_compacts_up_to_the_revision_of_an_interval_before():
    history = RecordingHistory()
    observing = [False]
    now = [0.0]
    compactor = Compactor(
        history, lambda: observing[0], INTERVAL, told=Throttle(), clock=lambda: now[0]
    )

    def step(revision: int) -> None:
        history.revision = revision
        asyncio.run(compactor.step())
        now[0] += INTERVAL

    step(10)  # not observing: no mark, no call
    assert compactor.mark is None and history.compactions == []
    observing[0] = True
    step(20)  # marks 20
    assert history.compactions == []
    step(35)  # compacts to 20, marks 35
    step(60)  # compacts to 35
    assert history.compactions == [20, 35] and compactor.compacted == 35
    observing[0] = False  # another daemon observes: this one forgets its mark
    step(90)
    assert compactor.mark is None and history.compactions == [20, 35]
    observing[0] = True  # observing again: a new mark first
    history.floor = 105  # the other observer compacted meanwhile, further
    step(100)
    step(120)  # up to 100: already compacted by the other, which is no error
    assert history.compactions == [20, 35, 100] and compactor.compacted == 35


def test_a_store_that_refuses_is_told_once_per_interval_and_asked_again(caplog):
    history = RecordingHistory()
    now = [0.0]
    compactor = Compactor(history, lambda: True, 1.0, told=Throttle(60.0), clock=lambda: now[0])
    history.fails = StoreConnectionError("etcd at h1:2379 failed the call: no leader")
    with caplog.at_level("WARNING", logger="elasticd.cluster.compaction"):
        for revision in range(10, 15):
            history.revision = revision
            asyncio.run(compactor.step())
            now[0] += 1.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no leader" in warnings[0]
    assert "--auto-compaction-retention" in warnings[0]
    history.fails = None  # etcd answers again: compaction goes on from the last mark
    for revision in (40, 50):
        history.revision = revision
        asyncio.run(compactor.step())
        now[0] += 1.0
    assert history.compactions == [14, 40]
