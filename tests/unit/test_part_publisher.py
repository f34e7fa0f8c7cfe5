"""A node's parts onto the board (daemon/elasticd/shell/publisher.py): a part whose publishing
is cancelled half-way (its record written, its change not yet in the board's log, as at a
daemon's shutdown) stays pending, and the next flush publishes it, so the other nodes read
it.  Real board, real follower, an in-memory store whose log writes wait at a gate."""

from __future__ import annotations

import asyncio

from elasticd.core.model import JobSpec, PartState
from elasticd.core.records import Part
from elasticd.faults import Faults
from elasticd.jobs.board import BoardFollower, JobBoard
from elasticd.jobs.history import History
from elasticd.jobs.registry import JobRegistry
from elasticd.shell.publisher import PartPublisher
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer

SPEC = JobSpec(id="j-00000a", argv=("x.py",), python="/p", workdir="/w", uid=1, gid=1, user="u")


class GatedStore(AsyncMemoryStore):
    """Writes of the board's change log wait until ``gate`` is set."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def set(self, key: str, value: bytes) -> None:
        if "/jobs/log/" in key:
            self.waiting.set()
            await self.gate.wait()
        await super().set(key, value)


def test_a_part_whose_publishing_was_cancelled_half_way_is_published_by_the_next_flush(tmp_path):
    async def main() -> Part | None:
        shared = MemoryStore()
        signer = Signer(b"k" * 32, "c")
        writer = GatedStore(shared)
        writer.gate.set()
        board = JobBoard(writer, signer, "c")
        await board.publish_spec(SPEC)
        registry = JobRegistry(History(str(tmp_path / "history")))
        reader = BoardFollower(JobBoard(AsyncMemoryStore(shared), signer, "c"), registry, "n1")
        await reader.resync()  # another node, following the board's log
        following = asyncio.create_task(reader.run())
        try:
            writer.gate.clear()
            writer.waiting.clear()
            publisher = PartPublisher(board, Faults())
            publisher.publish(SPEC.id, Part(node="n2", state=PartState.LEFT))
            flushing = asyncio.create_task(publisher.flush())
            await writer.waiting.wait()  # the record is written, its change not logged
            flushing.cancel()  # the shutdown cancels the publishing loop
            await asyncio.wait([flushing])
            writer.gate.set()
            assert await publisher.flush()  # the shutdown's last flush
            record = registry.get(SPEC.id)
            async with asyncio.timeout(15):
                while "n2" not in record.parts:
                    record = await registry.wait_change(SPEC.id, record.version)
            return record.parts["n2"]
        finally:
            following.cancel()
            await asyncio.wait([following])

    assert asyncio.run(main()) == Part(node="n2", state=PartState.LEFT)
