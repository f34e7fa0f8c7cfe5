"""What the tests of one node's real checkpoint tier (shell/checkpoints.py) share: a job of
this test's user, the size and digest of some bytes, a wait with a bound, and the other
nodes as a fake data plane (their bytes in a dict; what this node sent and dropped)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

from elasticd.core import checkpoints as cp
from elasticd.core import events as ev
from elasticd.core.model import JobSpec, PartState
from elasticd.core.records import JobRecord, Part
from elasticd.shell.checkpoints import CheckpointTier, TierSettings

TierTest = Callable[[CheckpointTier, str, "Peers", list[ev.Event], JobSpec], Awaitable[None]]


def job_spec(workdir: Path, job: str) -> JobSpec:
    """Job ``job``, run as this test's user."""
    return JobSpec(
        id=job,
        argv=("train.py",),
        python=sys.executable,
        workdir=str(workdir),
        uid=os.getuid(),
        gid=os.getgid(),
        user="tester",
        env={},
        join_timeout=60.0,
        created=1.0,
    )


def facts(data: bytes) -> cp.FileFacts:
    return cp.FileFacts(len(data), hashlib.sha256(data).hexdigest())


async def until(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait until ``done()``; fail, saying ``what`` did not happen, after ``timeout``."""
    ends = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < ends, f"not in {timeout} s: {what}"
        await asyncio.sleep(0.02)


class Peers:
    """The other nodes: what they hold (``held``: (owner, checkpoint, file) -> bytes), and
    what this node sent and dropped.  Every send lands whole; a node in ``lost`` is not
    alive; each node is its own failure domain."""

    def __init__(self, held: dict[tuple[str, str, str], bytes] | None = None) -> None:
        self.held = held or {}
        self.sent: list[tuple[str, str, str]] = []  # (to, checkpoint, file)
        self.dropped: list[tuple[str, str]] = []  # (at, checkpoint)
        self.lost: set[str] = set()

    async def send(self, node: str, job: str, ckpt: str, name: str, source: BinaryIO) -> Any:
        self.sent.append((node, ckpt, name))
        return facts(source.read())

    async def drop(self, node: str, job: str, ckpt: str) -> None:
        self.dropped.append((node, ckpt))

    async def fetch(
        self, node: str, job: str, owner: str, ckpt: str, name: str, into: int, **_: Any
    ) -> Any:
        data = self.held.get((owner, ckpt, name))
        assert data is not None, f"{owner}'s {ckpt}/{name} is fetched, and held nowhere"
        os.pwrite(into, data, 0)
        return facts(data)

    def alive(self, node: str) -> bool:
        return node not in self.lost

    def domain(self, node: str) -> str:
        return node


def published(posted: list[ev.Event]) -> list[cp.Manifest]:
    """This node's manifests as its part carries them now (its last news)."""
    news = [e for e in posted if isinstance(e, ev.CheckpointsChanged)]
    return [cp.parse(m) for m in news[-1].manifests] if news else []


def on_a_tier(
    tmp_path: Path,
    job_id: str,
    test: TierTest,
    *,
    node: str = "c",
    held: dict[tuple[str, str, str], bytes] | None = None,
    spec: JobSpec | None = None,
) -> None:
    """Run ``test`` on node ``node``'s real tier, with job ``job_id`` open (``spec``, else
    the test user's), the other nodes holding ``held``; the tier closed after it."""

    async def main() -> None:
        posted: list[ev.Event] = []
        peers = Peers(held)
        tier = CheckpointTier(
            TierSettings(node, str(tmp_path / "tier"), 0, 0), peers, posted.append
        )
        running = asyncio.create_task(tier.run())
        job = spec or job_spec(tmp_path, job_id)
        path = tier.open(job)
        try:
            await test(tier, path, peers, posted, job)
        finally:
            await tier.close(job_id)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())


def round_record(
    job: JobSpec,
    members: tuple[str, ...],
    round: int,
    theirs: dict[str, tuple[cp.Manifest, ...]] | None = None,
) -> JobRecord:
    """The job's record with ``members`` running ``round`` (group ranks in that order), each
    carrying its manifests in ``theirs``."""
    parts = [
        Part(
            node,
            PartState.RUNNING,
            round=round,
            group_rank=rank,
            checkpoints=tuple(m.to_json() for m in (theirs or {}).get(node, ())),
        )
        for rank, node in enumerate(members)
    ]
    return JobRecord(spec=job, seq=1, parts={p.node: p for p in parts})
