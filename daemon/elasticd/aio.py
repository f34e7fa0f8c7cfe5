"""Small asyncio helpers shared by the daemon's loops."""

from __future__ import annotations

import asyncio
from typing import Any


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
