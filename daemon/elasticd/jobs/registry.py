"""The job registry: this daemon's view of every job in the cluster (the records of
:mod:`elasticd.core.records`).  The registry is the only writer of local job records and of the
history database; agents and the board watcher send it changes, and it wakes whoever waits
on a job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from elasticd.core.model import JOB_STATES, NEW_PART, PART_STATES, JobSpec
from elasticd.core.records import (
    JobRecord,
    Outcome,
    Part,
    expired,
    history_row,
    job_doc,
    record_from_history,
)
from elasticd.core.usage import carried
from elasticd.errors import NotFound
from elasticd.jobs.history import History, HistoryError
from elasticd.journal import about, excerpt

log = logging.getLogger(__name__)


class JobRegistry:
    """Holds every known job; the single writer of local records and of the history.

    All methods run on the event loop.  ``on_change`` subscribers (the scheduler, metrics)
    are called after every change with the new record.

    The history is this node's journal, not the cluster's truth (that is the store): a
    change it cannot take (a full disk) still happens, and its row is kept and written
    again every ``retry`` seconds until it fits.  Only a new job needs the history first
    (``reserve``): one that could not be recorded is refused, with nothing left behind.

    A job that ended ``retention`` seconds ago is forgotten (``forget``, by the retention
    pruner) and not taken back from the board (``expired``).
    """

    def __init__(
        self,
        history: History,
        *,
        on_unsaved: Callable[[str], None] | None = None,
        retry: float = 5.0,
        retention: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._history = history
        self.retention = retention
        self._clock = clock
        self._jobs: dict[str, JobRecord] = {}
        self._changed = asyncio.Event()  # set and replaced at every change
        self._subscribers: list[Callable[[JobRecord], None]] = []
        self._unsaved: dict[str, dict[str, Any]] = {}  # job id -> row the history did not take
        self._on_unsaved = on_unsaved or (lambda why: None)
        self._retry = retry
        self._retrying: asyncio.TimerHandle | None = None
        self.skipped = 0  # history rows that restore() could not read

    def subscribe(self, callback: Callable[[JobRecord], None]) -> None:
        self._subscribers.append(callback)

    def get(self, job_id: str) -> JobRecord:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id!r}") from None

    def find(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def jobs(self) -> list[JobRecord]:
        return sorted(self._jobs.values(), key=lambda r: (r.spec.created, r.seq))

    def restore(self, rows: Iterable[tuple[str, Any]]) -> list[JobRecord]:
        """Load the history; returns the records that were still active when we stopped.
        A row that does not make a whole job (a spec that fails validation, a part or an
        outcome of the wrong shape) is skipped with a warning and counted."""
        unfinished = []
        for job_id, doc in rows:
            try:
                record = record_from_history(doc)
                job_doc(record)  # it must render: `list` shows every job to everyone
            except Exception as exc:
                self.skipped += 1
                log.warning(
                    "job history %s: skipping the row of job %s: %s",
                    self._history.path,
                    job_id,
                    exc,
                )
                continue
            self._jobs[record.id] = record
            if record.outcome is None:
                unfinished.append(record)
        return unfinished

    def reserve(self, spec: JobSpec, seq: int) -> None:
        """Record a new job in the history before it exists anywhere else; raises
        HistoryError (and nothing changed) when the history cannot take it."""
        self._history.save(history_row(JobRecord(spec, seq)))

    def unreserve(self, job_id: str) -> None:
        """Take back a reservation whose job could not be published (best effort)."""
        if job_id not in self._jobs:
            try:
                self._history.forget(job_id)
            except HistoryError as exc:
                log.warning("%s", exc)

    def expired(self, outcome: Outcome) -> bool:
        """Whether a job that ended so is past the retention: forgotten here, or soon."""
        return expired(outcome, self._clock(), self.retention)

    def forget(self, job_ids: list[str]) -> None:
        """Drop these jobs' records and history rows, all or none (HistoryError)."""
        self._history.forget_all(job_ids)
        for job_id in job_ids:
            self._jobs.pop(job_id, None)
            self._unsaved.pop(job_id, None)
        self._changed.set()
        self._changed = asyncio.Event()

    def add(self, spec: JobSpec, seq: int) -> JobRecord:
        known = self._jobs.get(spec.id)
        if known is not None:
            return known
        return self._put(JobRecord(spec, seq))

    def set_part(self, job_id: str, part: Part, *, own: bool = False) -> JobRecord | None:
        """A node's part changed; ``own``: this node's (its agent's moves are checked: a
        new agent's part starts again at RENDEZVOUS; while this node holds the job, the
        part says why; it carries the usage spans of this node's earlier parts of the job)."""
        record = self._jobs.get(job_id)
        if record is not None and own and record.held and record.outcome is None:
            part = replace(part, held=record.held)
        if record is not None and own:
            part = carried(record.parts.get(part.node), part)
        if record is None or record.parts.get(part.node) == part:
            return record
        if own:
            old = record.parts.get(part.node)
            if old is not None and not (not old.state.active and part.state is NEW_PART):
                PART_STATES.check(old.state, part.state)
        return self._put(record.with_part(part))

    def set_outcome(self, job_id: str, outcome: Outcome) -> JobRecord | None:
        """Record the outcome unless one is already known (the first one is final)."""
        record = self._jobs.get(job_id)
        if record is None or record.outcome is not None:
            return record
        return self._put(replace(record, outcome=outcome, held="", version=record.version + 1))

    def hold(self, job_id: str, why: str) -> JobRecord | None:
        """This node refuses a record the job needs (its outcome; its rendezvous state, which
        no member restored): it never places the job again, until a valid outcome (a cancel)
        replaces what was refused.  A job whose outcome is known here stays as it ended."""
        record = self._jobs.get(job_id)
        if record is None or record.outcome is not None or record.held == why:
            return record
        log.warning("job %s is held: %s", job_id, why, extra=about(job_id))
        return self._put(replace(record, held=why, version=record.version + 1))

    def _put(self, record: JobRecord) -> JobRecord:
        """The one place a record changes: its job state moves by JOB_STATES, or nothing
        changes (IllegalTransition)."""
        old = self._jobs.get(record.id)
        JOB_STATES.check(old.state if old else None, record.state)
        self._jobs[record.id] = record
        self._unsaved[record.id] = history_row(record)
        self.flush()
        for callback in self._subscribers:
            callback(record)
        self._changed.set()
        self._changed = asyncio.Event()
        return record

    def flush(self) -> bool:
        """Write the rows the history has not taken yet; True when none is left."""
        for job_id, row in list(self._unsaved.items()):
            try:
                self._history.save(row)
            except HistoryError as exc:
                self._on_unsaved(str(exc))
                self._retry_later()
                return False
            del self._unsaved[job_id]
        return True

    def _retry_later(self) -> None:
        if (
            self._retrying is None
            or self._retrying.cancelled()
            or self._retrying.when() <= asyncio.get_running_loop().time()
        ):
            self._retrying = asyncio.get_running_loop().call_later(self._retry, self.flush)

    def close(self) -> None:
        """A last attempt at the rows not written yet; what still does not fit is named in
        the daemon's log (id, state, outcome: no environment), the one record left of it."""
        if self._retrying is not None:
            self._retrying.cancel()
        if self._unsaved and not self.flush():
            for row in self._unsaved.values():
                outcome = row.get("outcome") or {}
                log.error(
                    "job history: unsaved record of job %s: state %s, ended %s, %s",
                    row["id"],
                    row["state"],
                    row.get("ended"),
                    excerpt(outcome.get("message", "")),
                    extra=about(row["id"]),
                )

    async def wait_change(self, job_id: str, seen_version: int) -> JobRecord:
        """Wait until the job's record is newer than ``seen_version``."""
        while (record := self.get(job_id)).version <= seen_version:
            await self._changed.wait()
        return record
