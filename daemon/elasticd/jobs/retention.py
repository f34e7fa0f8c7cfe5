"""Retention: a job that ended ``history.retention`` seconds ago is forgotten on this node,
its history row and its output (``<log_dir>/<job>``) deleted.  A job without an outcome,
or whose agent still runs here (stopping its workers, draining their output), is kept.

The pruner looks at start, then when the next ended job is due, and at least once per
``min(retention, 1 h)`` (a job that ends meanwhile is due no sooner): a timer, not a poll.
Directories are deleted in a thread; rows in one transaction per batch of jobs, on the
event loop (the registry is their one writer).  A log directory of a job this node does not
know (its row was lost with a corrupt history) goes once it has not changed for the
retention.  The decisions are pure functions of the records and ``now``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping

from elasticd.aio import back_off, wait_or_timeout
from elasticd.core.records import JobRecord, Outcome, expired
from elasticd.errors import StoreError
from elasticd.faults import Throttle, held_back
from elasticd.jobs.board import JobBoard
from elasticd.jobs.history import HistoryError
from elasticd.jobs.registry import JobRegistry

log = logging.getLogger(__name__)

MOST = 3600.0  # seconds between two passes at most
LEAST = 1.0  # and at least
AFTER_ERROR = 60.0  # seconds before a pass that the history refused is tried again
BATCH = 256  # jobs forgotten per transaction


def prunable(
    records: Iterable[JobRecord], now: float, retention: float, busy: set[str]
) -> list[str]:
    """The jobs to forget now: past the retention and not running here."""
    return [r.id for r in records if expired(r.outcome, now, retention) and r.id not in busy]


def next_pass(
    records: Iterable[JobRecord], now: float, retention: float, busy: Iterable[str] = ()
) -> float:
    """Seconds until the next pass: when the next ended job is due, at most
    ``min(retention, MOST)`` from now, at least LEAST.  A due job still busy here does not
    count (it is looked at again within MOST): a worker stuck in the kernel must not turn
    the timer into a poll every LEAST."""
    busy = set(busy)
    due = min(
        (
            r.outcome.ended + retention
            for r in records
            if r.outcome is not None and r.id not in busy
        ),
        default=float("inf"),
    )
    return max(LEAST, min(due - now, retention, MOST))


def stale_dirs(
    entries: Iterable[tuple[str, float]], known: set[str], now: float, retention: float
) -> list[str]:
    """Of the log directories (name, last change), those of jobs this node does not know
    that did not change for the retention."""
    return [
        name
        for name, changed in entries
        if name not in known and retention > 0 and changed <= now - retention
    ]


def sweepable(ended: Mapping[str, Outcome], now: float, retention: float) -> list[str]:
    """Of the store's ended jobs (id -> outcome), those to delete from it now, oldest first,
    at most BATCH."""
    due = [job_id for job_id, outcome in ended.items() if expired(outcome, now, retention)]
    return sorted(due, key=lambda job_id: ended[job_id].ended)[:BATCH]


class BoardSweeper:
    """The store's side of retention: while this daemon observes the cluster, it deletes the
    records of jobs that ended ``retention`` seconds ago from the store (every node forgets
    them from its history on its own).  Without it the store kept every job ever submitted
    (about 7 kB and 30 keys a job), and every snapshot (a daemon's start, a reset store) read
    them all.  A pass every ``min(retention, MOST)`` seconds, or at once after a full batch."""

    def __init__(
        self,
        board: JobBoard,
        observing: Callable[[], bool],
        retention: float,
        told: Throttle,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._board = board
        self._observing = observing
        self._retention = retention
        self._told = told
        self._clock = clock

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            swept: list[str] = []
            try:
                swept = await self.sweep()
            except StoreError as exc:
                if (held := self._told.check("failed", time.monotonic())) is not None:
                    log.warning("retention: could not prune the store: %s%s", exc, held_back(held))
            # a full batch: more may be due (a store that kept jobs from before retention)
            pause = LEAST if len(swept) == BATCH else max(LEAST, min(self._retention, MOST))
            await wait_or_timeout(stop, pause)

    async def sweep(self) -> list[str]:
        """One pass (when observing); the jobs deleted from the store."""
        if not self._observing():
            return []
        due = sweepable(await self._board.ended_jobs(), self._clock(), self._retention)
        forgotten = await self._board.forget(due)
        if forgotten:
            log.info("retention: deleted %d ended jobs from the store", len(forgotten))
        return forgotten


class Pruner:
    def __init__(
        self,
        registry: JobRegistry,
        log_root: str,
        *,
        busy: Callable[[], Iterable[str]],
        on_pruned: Callable[[list[str]], None] = lambda job_ids: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._log_root = log_root
        self._busy = busy
        self._on_pruned = on_pruned
        self._clock = clock
        self._refused = False  # the last pass could not delete rows

    async def run(self) -> None:
        """Prune now and whenever the next job is due, until cancelled (retention 0: never)."""
        retention = self._registry.retention
        if not retention:
            return
        while True:
            try:
                await self.prune()
            except Exception:  # whatever went wrong, the daemon goes on and so does retention
                log.exception("retention: the pass failed")
                self._refused = True
            delay = next_pass(self._registry.jobs(), self._clock(), retention, self._busy())
            # back_off: a cancellation that came as the pass's error ends the loop (elasticd.aio)
            await back_off(max(delay, AFTER_ERROR) if self._refused else delay)

    async def prune(self) -> list[str]:
        """One pass; returns the jobs forgotten."""
        now, retention = self._clock(), self._registry.retention
        due = prunable(self._registry.jobs(), now, retention, set(self._busy()))
        pruned: list[str] = []
        self._refused = False
        for start in range(0, len(due), BATCH):
            batch = due[start : start + BATCH]
            await asyncio.to_thread(self._remove, batch)
            try:
                self._registry.forget(batch)
            except HistoryError as exc:
                log.warning("retention: %s (tried again in %.0f s)", exc, AFTER_ERROR)
                self._refused = True
                break
            pruned += batch
        known = {r.id for r in self._registry.jobs()}
        stale = await asyncio.to_thread(self._stale, known, now, retention)
        await asyncio.to_thread(self._remove, stale)
        if pruned or stale:
            log.info(
                "retention: forgot %d jobs that ended %.0f s ago or more%s",
                len(pruned),
                retention,
                f", and the output of {len(stale)} unknown ones" if stale else "",
            )
        if pruned:
            self._on_pruned(pruned)
        return pruned

    def _stale(self, known: set[str], now: float, retention: float) -> list[str]:
        entries = []
        for name in _listdir(self._log_root):
            try:
                info = os.lstat(os.path.join(self._log_root, name))
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                entries.append((name, info.st_mtime))
        return stale_dirs(entries, known, now, retention)

    def _remove(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            if job_id in ("", ".", "..") or os.sep in job_id:
                continue  # not a name in the log directory
            path = os.path.join(self._log_root, job_id)
            shutil.rmtree(path, ignore_errors=True)
            if os.path.lexists(path):
                log.warning("retention: could not delete all of %s", path)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
