"""Small asyncio helpers shared by the daemon's loops.

Deadlines are ``asyncio.timeout`` blocks, never ``asyncio.wait_for``: in Python 3.11
``wait_for`` swallows a cancellation that arrives as its inner future completes (CPython
gh-86296), and a task that lost its cancellation runs on (a keeper that never stops).

A cancellation can also arrive as another exception: ``asyncio.gather`` ends with the first
error of a child, even one that failed as the caller's cancellation reached it (a store
client closed under it), and the caller then gets that error instead of CancelledError.
A loop that handles the error and waits again has lost its cancellation for good (a
rendezvous keeper did, and never ended).  So the daemon gathers with :func:`gather`, and a
loop that handled an error pauses with :func:`back_off`, which stops a task that was asked
to.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any


async def race(**contenders: Awaitable[Any]) -> tuple[str, asyncio.Future[Any]]:
    """Wait until the first of the named ``contenders`` is done; returns its name and its
    future (the first in the order given when several are).  Coroutines are run as tasks of
    this call and cancelled, and awaited, when they lose: none outlives it.  Futures passed in
    belong to their owners and are left as they are."""
    owned = {
        name: asyncio.ensure_future(aw)
        for name, aw in contenders.items()
        if not asyncio.isfuture(aw)
    }
    futures = {name: aw if asyncio.isfuture(aw) else owned[name] for name, aw in contenders.items()}
    try:
        done, _ = await asyncio.wait(futures.values(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        losers = [task for task in owned.values() if not task.done()]
        for task in losers:
            task.cancel()
        if losers:
            await asyncio.wait(losers)
        for task in owned.values():  # two that failed in one turn: the other's error is seen
            if task.done() and not task.cancelled():
                task.exception()
    name = next(name for name, future in futures.items() if future in done)
    return name, futures[name]


async def gather(*awaitables: Awaitable[Any]) -> list[Any]:
    """Every result, in order, once all are done; else the first error (in order), raised
    once all are done (none is left running).  A cancellation of the caller arrives as
    CancelledError, whatever the children ended with."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def back_off(seconds: float) -> None:
    """The pause of a loop that handled an error and goes on; CancelledError instead when
    this task was asked to stop meanwhile (the error may be how its cancellation came)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    await asyncio.sleep(seconds)


async def wait_or_timeout(event: asyncio.Event, seconds: float) -> bool:
    """A timer that ends early when ``event`` is set; True if it was."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


def on_own_thread(call: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """``call()`` on a daemon thread of its own (asyncio.to_thread's, but for a call that may
    never return: it blocks neither the loop nor the exit; the executor joins its threads)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as exc:  # handed to the loop, raised there
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class BackOff:
    """The pause of a wait that came back without news.  Anyone who reaches the store can
    end a wait on a key: write it, or, on TCPStore, merely read it while it is missing (the
    server wakes its waiters then); a waiter that read nothing new and waited again at once
    would spin.  Each pause is ``first`` seconds, twice the one before, at most
    ``longest``; :meth:`reset` when the wait brought real news."""

    def __init__(self, first: float = 0.05, longest: float = 1.0) -> None:
        self.first, self.longest = first, longest
        self._next = first
        self.pauses = 0  # all told

    def reset(self) -> None:
        self._next = self.first

    def delay(self) -> float:
        """The next pause's length (the one after it is twice as long, up to ``longest``)."""
        delay, self._next = self._next, min(self._next * 2, self.longest)
        return delay

    async def pause(self, limit: float = float("inf")) -> None:
        """Sleep the next pause, ``limit`` seconds at most."""
        self.pauses += 1
        await asyncio.sleep(max(0.0, min(self.delay(), limit)))
