"""This node's parts onto the board: the newest of each job only, in order, again after the
store was away; and everything this node knows again after the store lost its data."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from elasticd.core.records import Part
from elasticd.errors import StoreError
from elasticd.faults import Faults, Throttle, held_back
from elasticd.jobs.board import BoardFollower, JobBoard
from elasticd.jobs.registry import JobRegistry
from elasticd.journal import about

log = logging.getLogger(__name__)

_PUBLISH_TIMEOUT = 5.0  # seconds one part gets to reach the board (the last ones, at shutdown)
_FAILED_LOG = 10.0  # seconds between two lines that say a job's part is still not published
_REPUBLISH_PAUSE = 2.0  # seconds from one try to the next while the store is away


class PartPublisher:
    def __init__(self, board: JobBoard, faults: Faults) -> None:
        self._board = board
        self._faults = faults
        self._unpublished: dict[str, Part] = {}  # job id -> this node's newest part
        self._wanted = asyncio.Event()
        self._failed = Throttle(_FAILED_LOG)  # job id -> its part's failures, told now and then

    def publish(self, job_id: str, part: Part) -> None:
        """Queue ``part`` (it replaces one of the same job not published yet)."""
        self._unpublished[job_id] = part
        self._wanted.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            began = loop.time()
            if not await self.flush():  # the store is away: try again, at most every pause
                # (a try that timed out waited its pause already: an etcd write in flight
                # when its leader died hangs until it times out, the next one goes through)
                await asyncio.sleep(max(0.0, began + _REPUBLISH_PAUSE - loop.time()))
                self._wanted.set()

    async def flush(self) -> bool:
        """Publish every pending part once; False if some failed (they stay pending, unless
        a newer part of the same job came meanwhile): a store that was away and came back
        with its data (etcd, or a TCPStore whose host did not restart) must still learn them.
        A part stays pending until it is published, so that one whose publishing was
        cancelled half-way (its record written, its change not logged: the other nodes would
        never read it) is published again by the next flush, the last one at shutdown."""
        failed: set[str] = set()
        while todo := [job for job in self._unpublished if job not in failed]:
            job_id = todo[0]
            part = self._unpublished[job_id]
            try:
                async with asyncio.timeout(_PUBLISH_TIMEOUT):
                    await self._board.publish_part(job_id, part)
            except (StoreError, TimeoutError) as exc:
                if (held := self._failed.check(job_id, time.monotonic())) is not None:
                    log.warning(
                        "could not publish %s's part of %s: %s%s",
                        part.node,
                        job_id,
                        str(exc) or "timed out",
                        held_back(held),
                        extra=about(job_id),
                    )
                failed.add(job_id)
                continue
            except Exception:  # this part is lost, the others and the loop go on
                self._faults.report("parts", f"job {job_id}")
            if self._unpublished.get(job_id) is part:  # not replaced by a newer one meanwhile
                del self._unpublished[job_id]
        return not failed


@dataclass(frozen=True)
class StoreReset:
    """An event of the node shell's own (the node core is not asked: nothing it decided
    changes): the store lost its data (its host restarted).  ``done`` hears how publishing
    again went, so that the heartbeat that found the reset tries again at its next duty."""

    done: asyncio.Future[None]


async def republish(
    done: asyncio.Future[None],
    board: JobBoard,
    registry: JobRegistry,
    node: str,
    follower: BoardFollower,
) -> None:
    """Publish again what this node knows (open jobs, and this node's parts), then read the
    board afresh; ``done`` gets the result (or the error)."""
    try:
        board.forget_index()
        for record in registry.jobs():
            if record.outcome is not None:
                continue
            await board.publish_spec(record.spec, record.seq)
            part = record.parts.get(node)
            if part is not None:
                await board.publish_part(record.id, part)
        await follower.resync()
    except asyncio.CancelledError:
        done.cancel()
        raise
    except Exception as exc:
        if not done.done():  # not when the heartbeat that awaits it was cancelled
            done.set_exception(exc)
    else:
        if not done.done():
            done.set_result(None)
