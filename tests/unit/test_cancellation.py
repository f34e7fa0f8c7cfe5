"""No cancellation lost (daemon/elasticd/aio.py says why): a task that is cancelled ends, even when its
cancellation reaches it as another exception.

The fault: ``asyncio.gather`` ends with the first error of a child even when the caller's
cancellation reached the gather first (one child failed, its done callback not run yet,
another still pending).  The rendezvous keeper's sweeper caught that error ("could not
delete stale keys: the store client ... is closed"), went back to waiting for keys to
delete, and ``keep()`` never ended: bench_rendezvous's participants hung in 3 of 4 runs.
Here the store's timing is the test's (one connection for the deletes: the first waits for
its answer, the second for the connection), so the interleaving is the same every run.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from elasticd import aio
from elasticd.errors import StoreConnectionError
from elasticd.rendezvous import RendezvousSettings
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous.keys import Keys
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer

PREFIX = "elasticd/test/rdzv/job"
SIGNER = Signer(b"k" * 32, "c")
BOUND = 5.0  # seconds a cancelled task gets to end (it needs a few turns of the loop)


class OneConnection(AsyncMemoryStore):
    """Deletes go over one connection that the store does not answer on: the first waits for
    its answer, the next ones for the connection.  ``close`` fails the call on the
    connection (as TCPStoreClient.close does); a call that gets the connection after that
    fails as closed.  Everything else is the in-memory store's."""

    def __init__(self, backend: MemoryStore) -> None:
        super().__init__(backend)
        self.deleting: list[str] = []
        self.closed = False
        self._connection = asyncio.Lock()
        self._answer: asyncio.Future[bool] | None = None

    async def delete(self, key: str) -> bool:
        self.deleting.append(key)
        async with self._connection:
            if self.closed:
                raise StoreConnectionError("the store client for memory is closed")
            self._answer = asyncio.get_running_loop().create_future()
            return await self._answer

    async def close(self) -> None:
        self.closed = True
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(StoreConnectionError("lost the store at memory: closed"))


async def until(condition, timeout: float = BOUND) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_keep_ends_when_cancelled_while_the_sweeper_deletes_and_the_store_closes(caplog):
    """The round's writer sweeps its join log (two keys); the store closes under the
    deletes and the keeper is cancelled in the same turn of the loop: keep() ends."""
    settings = RendezvousSettings("job", 1, 1, keep_alive_interval=5.0)

    async def run() -> tuple[bool, list[str]]:
        store = OneConnection(MemoryStore())
        handler = RendezvousHandler(store, SIGNER, settings, "a", "a.addr", prefix=PREFIX)
        keeper = asyncio.create_task(handler.keep())
        await handler.next_rendezvous(1, 1)  # completes round 0: its join log is swept
        await until(lambda: len(store.deleting) == 2)
        await store.close()
        keeper.cancel()
        done, _ = await asyncio.wait([keeper], timeout=BOUND)
        return keeper in done and keeper.cancelled(), store.deleting

    with caplog.at_level(logging.WARNING, logger="elasticd.rendezvous.handler"):
        ended, deleting = asyncio.run(run())
    keys = Keys(PREFIX)
    assert sorted(deleting) == sorted([keys.joins(0), keys.join(0, 1)])  # the scenario happened
    assert ended, f"keep() did not end within {BOUND:g}s of its cancellation: {caplog.text}"


def test_a_failed_sweep_is_logged_and_the_keeper_goes_on():
    """Best effort stays best effort: a delete that fails (not cancelled) costs a warning,
    not the heartbeat beside it."""
    settings = RendezvousSettings("job", 1, 1, keep_alive_interval=0.05)
    backend = MemoryStore()

    class Failing(AsyncMemoryStore):
        async def delete(self, key: str) -> bool:
            await asyncio.sleep(0)
            raise StoreConnectionError("lost the store at memory")

    async def run() -> None:
        handler = RendezvousHandler(
            Failing(backend), SIGNER, settings, "a", "a.addr", prefix=PREFIX
        )
        keeper = asyncio.create_task(handler.keep())
        await handler.next_rendezvous(1, 1)
        beat = Keys(PREFIX).heartbeat("a")
        first = backend.get(beat)
        await until(lambda: backend.get(beat) != first)  # beats go on after the failed sweep
        assert not keeper.done()
        keeper.cancel()
        done, _ = await asyncio.wait([keeper], timeout=BOUND)
        assert keeper in done and keeper.cancelled()

    asyncio.run(run())
    keys = Keys(PREFIX)
    assert backend.get(keys.joins(0)) is not None  # it stays behind: never read again


# -- the helpers: aio.gather and aio.back_off ---------------------------------------------------


async def _failing_and_pending(gather) -> tuple[asyncio.Task, asyncio.Future, asyncio.Future]:
    """A task gathering two futures; the first fails and the task is cancelled in the same
    turn of the loop, before the gather saw the failure."""
    first = asyncio.get_running_loop().create_future()
    second = asyncio.get_running_loop().create_future()

    async def child(future: asyncio.Future) -> None:
        await future

    gathering = asyncio.create_task(gather(child(first), child(second)))
    await asyncio.sleep(0)  # the children started and wait
    await asyncio.sleep(0)
    first.set_exception(StoreConnectionError("closed"))
    await asyncio.sleep(0)  # the first child ended with the error; the gather has not seen it
    gathering.cancel()
    return gathering, first, second


def test_asyncio_gather_turns_this_cancellation_into_the_childs_error():
    """The scenario is the fault's: the standard gather gives the error, not CancelledError."""

    async def run() -> BaseException | None:
        async def plain(*awaitables):
            return await asyncio.gather(*awaitables)

        gathering, _, _ = await _failing_and_pending(plain)
        await asyncio.wait([gathering], timeout=BOUND)
        return gathering.exception() if not gathering.cancelled() else None

    assert isinstance(asyncio.run(run()), StoreConnectionError)


def test_aio_gather_delivers_the_cancellation():
    async def run() -> asyncio.Task:
        gathering, _, _ = await _failing_and_pending(aio.gather)
        await asyncio.wait([gathering], timeout=BOUND)
        return gathering

    gathering = asyncio.run(run())
    assert gathering.done() and gathering.cancelled()


def test_aio_gather_raises_the_first_error_once_every_child_ended():
    async def run() -> None:
        finished: list[str] = []

        async def fails() -> None:
            await asyncio.sleep(0)
            raise ValueError("first")

        async def slow() -> str:
            await asyncio.sleep(0.05)
            finished.append("slow")
            return "slow"

        with pytest.raises(ValueError, match="first"):
            await aio.gather(fails(), slow())
        assert finished == ["slow"]  # not left running behind the error
        assert await aio.gather(slow(), asyncio.sleep(0, "x")) == ["slow", "x"]

    asyncio.run(run())


def test_aio_race_leaves_no_error_unseen_when_two_fail_in_one_turn():
    """Two contenders that fail in the same turn (a store lost under both of a joiner's
    waits): the first is the answer, and the other's error is not logged as "never
    retrieved" when its task is collected."""
    errors: list[dict] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(context)
        )

        async def fails(why: str) -> None:
            raise StoreConnectionError(why)

        name, first = await aio.race(one=fails("one"), two=fails("two"))
        assert name == "one" and str(first.exception()) == "one"

    asyncio.run(run())
    gc.collect()  # a task's unseen error is told when the task is collected
    assert errors == []


def test_back_off_stops_a_loop_whose_cancellation_came_as_an_error():
    """A loop that handles an error and waits again: with its cancellation requested, the
    back-off raises CancelledError instead of sleeping (and looping) on."""
    rounds: list[int] = []

    async def loop_with_lost_cancel(gate: asyncio.Future) -> None:
        while True:
            rounds.append(1)
            try:
                await asyncio.gather(gate, asyncio.sleep(3600))
            except StoreConnectionError:
                await aio.back_off(3600)

    async def run() -> asyncio.Task:
        gate = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(loop_with_lost_cancel(gate))
        await asyncio.sleep(0)
        gate.set_exception(StoreConnectionError("closed"))
        task.cancel()  # reaches the gather before it saw the error
        await asyncio.wait([task], timeout=BOUND)
        return task

    task = asyncio.run(run())
    assert task.done() and task.cancelled() and rounds == [1]


def test_back_off_sleeps_when_nobody_cancelled():
    async def run() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await aio.back_off(0.05)
        return loop.time() - started

    assert asyncio.run(run()) >= 0.05
