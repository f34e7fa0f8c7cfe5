"""Small asyncio helpers shared by the daemon's loops."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[..., T], *args: Any, name: str = "elasticd-call") -> asyncio.Future[T]:
    """Run a blocking call in its own daemon thread and return a future for its result.

    Unlike ``asyncio.to_thread`` (whose pool is joined at exit), a call that blocks for
    long, such as a rendezvous join, never holds up the daemon's shutdown.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def call() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # delivered to the awaiting task, not lost
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    threading.Thread(target=call, name=name, daemon=True).start()
    return future


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
