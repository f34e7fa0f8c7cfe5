"""Small asyncio helpers shared by the daemon's loops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any, Callable

from .errors import StoreTimeout


async def first(*awaitables: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """Wait until one of the futures is done and return it (the others keep running)."""
    done, _ = await asyncio.wait(awaitables, return_when=asyncio.FIRST_COMPLETED)
    return next(iter(done))


async def wait_or_timeout(event: asyncio.Event, seconds: float) -> bool:
    """A timer that ends early when ``event`` is set; True if it was."""
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


class Lane:
    """One daemon thread that runs blocking calls (store I/O) in order, with its own store
    connection, and a deadline on each call as seen from the event loop.

    A TCPStore call on a connection that went silent (a partition) can block far longer
    than the store's own timeout.  Past its deadline the awaiting task gets StoreTimeout
    and the lane moves on with a fresh thread (and so a fresh connection); the stuck thread
    is abandoned.  Being a daemon thread, it never holds up the daemon's exit.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = self._start()

    def _start(self) -> queue.SimpleQueue[Any]:
        work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(work,), name=self._name, daemon=True).start()
        return work

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            self._replace()
            raise StoreTimeout(f"{getattr(fn, '__name__', 'a store call')} did not return "
                               f"within {timeout:g} s") from None

    def _replace(self) -> None:
        """Give the queued calls to a fresh thread; the stuck one ends when (if) it returns."""
        stuck, self._queue = self._queue, self._start()
        while True:
            try:
                item = stuck.get_nowait()
            except queue.Empty:
                break
            self._queue.put(item)
        stuck.put(None)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue a call whose result nobody waits for (it must handle its own errors)."""
        self._queue.put((concurrent.futures.Future(), fn, args))

    def close(self) -> None:
        self._queue.put(None)


def _serve(work: queue.SimpleQueue[Any]) -> None:
    while (item := work.get()) is not None:
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
