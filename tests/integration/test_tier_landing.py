"""Copies landing on a node's real checkpoint tier while their owners drop them: the tier
server answers puts from the bulk port's loop and drops from the CURVE port's, so the two
run in threads at once.  A drop must never break a landing (or the other way round) with
anything but the refusal its caller is answered (ValueError, OSError)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

from tier_rig import job_spec

from elasticd.core import checkpoints as cp
from elasticd.core.records import JobRecord
from elasticd.shell.checkpoints import CheckpointTier, TierSettings

JOB = "j-1a2b3c"
CHUNK = b"x" * 4096
WHOLE = cp.FileFacts(2 * len(CHUNK), hashlib.sha256(CHUNK + CHUNK).hexdigest())


class NoPeers:
    async def send(self, *args: object) -> cp.FileFacts:
        raise AssertionError("nothing is sent")

    async def drop(self, *args: object) -> None:
        raise AssertionError("nothing is dropped at others")

    async def fetch(self, *args: object) -> None:
        raise AssertionError("nothing is fetched")

    def alive(self, node: str) -> bool:
        return False


def test_copies_land_and_are_dropped_at_once_and_only_refusals_come_out(tmp_path: Path) -> None:
    async def main() -> None:
        tier = CheckpointTier(
            TierSettings("n1", str(tmp_path / "tier"), 0, 0), NoPeers(), lambda event: None
        )
        running = asyncio.create_task(tier.run())
        path = tier.open(job_spec(tmp_path, JOB))
        stop = threading.Event()
        unexpected: list[str] = []
        landed = dropped = 0

        def landing() -> None:
            nonlocal landed
            i = 0
            while not stop.is_set():
                i += 1
                ckpt, name = f"step_{i % 20}", f"__{i % 3}_0.distcp"
                try:
                    tier.receive("n2", JOB, ckpt, name, 0, CHUNK, None)
                    tier.receive("n2", JOB, ckpt, name, len(CHUNK), CHUNK, WHOLE)
                    landed += 1
                except (ValueError, OSError):
                    pass  # dropped under it: what the sender is answered
                except Exception as exc:
                    unexpected.append(f"receive: {exc!r}")

        def dropping() -> None:
            nonlocal dropped
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    tier.drop("n2", JOB, f"step_{i % 20}")
                    dropped += 1
                except (ValueError, OSError):
                    pass
                except Exception as exc:
                    unexpected.append(f"drop: {exc!r}")

        switching = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch as often as they can
        try:
            both = asyncio.gather(asyncio.to_thread(landing), asyncio.to_thread(dropping))
            await asyncio.sleep(3.0)
            stop.set()
            await both
        finally:
            sys.setswitchinterval(switching)
            stop.set()
        try:
            assert unexpected == [], unexpected[:5]
            assert landed > 0 and dropped > 0
            # and the tier goes on: a copy sent now lands whole
            tier.receive("n2", JOB, "step_99", "__0_0.distcp", 0, CHUNK, None)
            tier.receive("n2", JOB, "step_99", "__0_0.distcp", len(CHUNK), CHUNK, WHOLE)
            kept = [p for p in Path(path).rglob("__0_0.distcp") if "step_99" in str(p)]
            assert len(kept) == 1 and kept[0].read_bytes() == CHUNK + CHUNK
        finally:
            await tier.close(JOB)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 60


def test_record_changes_that_queue_up_are_considered_together(tmp_path: Path) -> None:
    """Each save a node describes comes back as a change of its record; a job's thousand
    small files made a thousand scans of its directory on the event loop (minutes)."""

    async def main() -> None:
        tier = CheckpointTier(
            TierSettings("n1", str(tmp_path / "tier"), 0, 0), NoPeers(), lambda event: None
        )
        running = asyncio.create_task(tier.run())
        job = job_spec(tmp_path, JOB)
        tier.open(job)
        considered: list[int] = []
        scan = tier._consider

        def counted(jd: object) -> None:
            considered.append(len(considered))
            scan(jd)  # type: ignore[arg-type]

        tier._consider = counted  # type: ignore[method-assign]
        try:
            record = JobRecord(spec=job, seq=1, parts={})
            for _ in range(1000):  # as they queue up behind a busy loop
                tier.record_changed(record)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert considered == [0]
            tier.record_changed(record)  # a change that comes alone is considered at once
            await asyncio.sleep(0)
            assert considered == [0, 1]
        finally:
            await tier.close(JOB)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())


class HeldAtTheDoor:
    """The tier's landing lock, but the landing thread's first ``with`` waits at the door
    (after ``receive`` found its job) until ``go``: what a chunk that came as its job closed
    does, every time instead of once in a while."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reached, self.go = threading.Event(), threading.Event()
        self._main = threading.get_ident()

    def __enter__(self) -> None:
        if threading.get_ident() != self._main and not self.reached.is_set():
            self.reached.set()
            self.go.wait(30)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_copy_landing_as_its_job_closes_leaves_nothing_behind(tmp_path: Path) -> None:
    """The job's directory goes with it (its tmpfs unmounted): a chunk that came meanwhile
    landed in what was under the mount, outside any cap, until the daemon restarted."""

    async def main() -> None:
        tier = CheckpointTier(
            TierSettings("n1", str(tmp_path / "tier"), 0, 0), NoPeers(), lambda event: None
        )
        running = asyncio.create_task(tier.run())
        path = tier.open(job_spec(tmp_path, JOB))
        door = HeldAtTheDoor()
        tier._landing = door  # type: ignore[assignment]

        def landing() -> str:
            try:
                tier.receive("n2", JOB, "step_1", "__0_0.distcp", 0, CHUNK, None)
            except ValueError as exc:
                return str(exc)
            return "landed"

        try:
            lands = asyncio.ensure_future(asyncio.to_thread(landing))
            await asyncio.to_thread(door.reached.wait, 30)  # it found the job, and waits
            await tier.close(JOB)
            door.go.set()
            assert await lands == f"job {JOB} has no checkpoints here"
            assert not os.path.exists(path), os.listdir(path)
        finally:
            door.go.set()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
