"""The etcd store's history, compacted by the daemon that observes the cluster.

etcd keeps every value every key ever had until its history is compacted, and counts that
history against its space quota (2 GiB by default); past the quota it refuses every write,
and a cluster whose heartbeats cannot be written has lost every node.  Each daemon writes a
revision or two a second (its heartbeat, and the observer's), so without compaction an idle
three-node cluster grows its database by about 80 kB a minute, and a hundred nodes fill
etcd's default quota within a day.  etcd does not compact unless its operator started it so
(``--auto-compaction-retention``), so the observer does it, as Kubernetes' API server does
for its etcd: every ``store.compact_interval`` it compacts up to the revision it saw one
interval before, so a watch that starts up to an interval in the past still can (this
daemon's own watches start at a revision read a moment before).  A daemon that is not the
observer, or stops being it, keeps no mark; one that becomes it compacts within two
intervals.  Two daemons that both think they observe for a while compact to
revisions they both saw: harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elasticd.aio import wait_or_timeout
from elasticd.errors import StoreError
from elasticd.faults import Throttle, held_back

log = logging.getLogger(__name__)


class StoreHistory(Protocol):
    """What compaction needs of the store (EtcdStore's): the newest revision its replies
    showed (this daemon's heartbeats keep it a second old at most), and the call."""

    revision: int

    async def compact(self, revision: int) -> bool: ...


@dataclass(frozen=True)
class Mark:
    """The store's revision at a moment (this process's monotonic clock)."""

    at: float
    revision: int


def next_compaction(
    mark: Mark | None, revision: int, now: float, interval: float
) -> tuple[int | None, Mark | None]:
    """The revision to compact up to now (None: none) and the mark to keep, given the last
    ``mark``, the store's ``revision`` now and the interval between two compactions."""
    if mark is None:
        return None, Mark(now, revision)
    if now - mark.at < interval:
        return None, mark
    if mark.revision < 1 or revision <= mark.revision:
        # no reply seen yet at the mark; nothing written since; a store restored older
        return None, Mark(now, revision)
    return mark.revision, Mark(now, revision)


class Compactor:
    """Compacts the store's history every ``interval`` seconds while ``observing()``."""

    def __init__(
        self,
        history: StoreHistory,
        observing: Callable[[], bool],
        interval: float,
        told: Throttle,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._history = history
        self._observing = observing
        self.interval = interval
        self._told = told
        self._clock = clock
        self.mark: Mark | None = None
        self.compacted = 0  # the revision last compacted up to here

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.step()
            await wait_or_timeout(stop, self.interval)

    async def step(self) -> None:
        """Mark, or compact up to the last mark, if this node observes; a store that fails
        or refuses is told (once per log interval) and asked again at the next step."""
        if not self._observing():
            self.mark = None
            return
        revision = self._history.revision
        target, self.mark = next_compaction(self.mark, revision, self._clock(), self.interval)
        if target is None:
            return
        try:
            if await self._history.compact(target):
                self.compacted = target
                log.debug("compacted the store's history up to revision %d", target)
        except StoreError as exc:
            if (held := self._told.check("failed", self._clock())) is not None:
                log.warning(
                    "could not compact the store's history (etcd keeps every revision until it "
                    "is compacted: where this goes on, set etcd's --auto-compaction-retention): "
                    "%s%s",
                    exc,
                    held_back(held),
                )
