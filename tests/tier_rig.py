"""What the tests of one node's real checkpoint tier (shell/checkpoints.py) share: a job of
this test's user, the size and digest of some bytes, a wait with a bound, and the other
nodes as a fake data plane (their bytes in a dict; what this node sent and dropped)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from elasticd.core import checkpoints as cp
from elasticd.core.model import JobSpec


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
