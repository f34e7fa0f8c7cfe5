"""A node's parts onto the board (daemon/elasticd/shell/publisher.py): a part whose publishing
is cancelled half-way (its record written, its change not yet in the board's log, as at a
daemon's shutdown) stays pending, and the next flush publishes it, so the other nodes read
it.  Real board, real follower, an in-memory store whose log writes wait at a gate.  And a
store that stays away is told once per 10 s, by the publisher and by the follower:
a private daemon's warnings go to its elasticrun's stderr, two lines a second for 20 s."""

from __future__ import annotations

import asyncio
import logging

from elasticd.core.model import JobSpec, PartState
from elasticd.core.records import Part
from elasticd.errors import StoreConnectionError
from elasticd.faults import Faults
from elasticd.jobs import board as board_module
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


class AwayStore(AsyncMemoryStore):
    """A store that does not answer."""

    async def set(self, key: str, value: bytes) -> None:
        raise StoreConnectionError("cannot reach the store at 127.0.0.1:1: refused")


def test_a_store_that_stays_away_is_told_once_not_at_every_try(caplog):
    async def main() -> None:
        board = JobBoard(AwayStore(MemoryStore()), Signer(b"k" * 32, "c"), "c")
        publisher = PartPublisher(board, Faults())
        for _ in range(20):  # a try every 2 s for 40 s, as while the store's node is down
            publisher.publish(SPEC.id, Part(node="n2", state=PartState.RUNNING))
            assert not await publisher.flush()

    with caplog.at_level(logging.WARNING, logger="elasticd"):
        asyncio.run(main())
    told = [r.getMessage() for r in caplog.records if "could not publish" in r.getMessage()]
    assert told == [
        "could not publish n2's part of j-00000a: cannot reach the store at 127.0.0.1:1: refused"
    ]


class AwayBoard:
    """A board whose store does not answer."""

    async def follow(self, position: int, timeout: float) -> tuple[int, list]:
        raise StoreConnectionError("cannot reach the store at 127.0.0.1:1: refused")


def test_a_follower_whose_store_stays_away_says_so_once_not_at_every_try(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(board_module, "_FOLLOW_TIMEOUT", 0.0)  # its back-off: a second
    ups: list[bool] = []
    follower = BoardFollower(
        AwayBoard(),  # type: ignore[arg-type]
        JobRegistry(History(str(tmp_path / "history"))),
        "n1",
        on_store=ups.append,
    )

    async def main() -> None:
        for _ in range(20):
            await follower._step()

    with caplog.at_level(logging.WARNING, logger="elasticd"):
        asyncio.run(main())
    told = [r.getMessage() for r in caplog.records if "following the board" in r.getMessage()]
    assert told == [
        "store unreachable while following the board: cannot reach the store at "
        "127.0.0.1:1: refused"
    ]
    assert ups == [False] * 20  # each try still says the store is away
