"""What the daemon does with what it did not expect: a log line per key per interval, not per
event (a poisoned store key is read at every heartbeat), and long-lived loops that outlive
an exception from one record.

A leaf (stdlib only).  :class:`Throttle` is pure: ``now`` is passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger("elasticd")

LOG_INTERVAL = 60.0  # seconds: the same key (a store record, a loop) is logged once per interval
_OTHERS = "(other keys)"


class Throttle:
    """Whether to log an event of ``key`` now: the first one, then one per ``interval``; the
    ones held back in between are counted, and told with the key's next line, or, where
    they may stop coming (a caller that asks when one is ``due``), in a line of their own
    once the interval is over (``flush``).  It remembers at most ``max_keys`` keys at once
    (anyone may make new keys: a store key per forged entry); past that, the keys it cannot
    remember share one allowance.  Pure: the caller gives the time."""

    def __init__(self, interval: float = LOG_INTERVAL, max_keys: int = 1024) -> None:
        self.interval = interval
        self._max_keys = max_keys
        # key -> (when last logged, held back since, the newest one's detail)
        self._seen: dict[str, tuple[float, int, str]] = {}

    def check(self, key: str, now: float, detail: str = "", count: int = 1) -> int | None:
        """None: do not log this one; else log it, saying that this many were held back
        since the last line of ``key``.  ``detail``: what the newest held back was (an
        address), for :meth:`flush`; ``count``: how many events this one stands for (a
        line that sums up several)."""
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval:
            self._seen[key] = (seen[0], seen[1] + count, detail)
            return None
        if seen is None and len(self._seen) >= self._max_keys:
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
            if len(self._seen) >= self._max_keys and key != _OTHERS:
                return self.check(_OTHERS, now, detail, count)
        self._seen[key] = (now, 0, detail)
        return seen[1] if seen is not None else 0

    def due(self) -> float | None:
        """When the first count held back may be told (None: nothing is held back)."""
        return min(
            (when + self.interval for when, held, _ in self._seen.values() if held), default=None
        )

    def flush(self, now: float) -> list[tuple[str, int, str]]:
        """(key, how many were held back, the newest one's detail) for each key whose interval
        is over: told now, they open the key's next interval."""
        done = [
            (key, held, detail)
            for key, (when, held, detail) in self._seen.items()
            if held and when + self.interval <= now
        ]
        for key, _, detail in done:
            self._seen[key] = (now, 0, detail)
        return done


def held_back(count: int) -> str:
    """The words a throttled line ends with."""
    return f" ({count} more since the last such line)" if count else ""


class Faults:
    """The daemon's long-lived loops wrap each step in :meth:`contained`: an exception nobody
    expected (a bug that one record's value brought out) is logged with its traceback (once
    per loop per interval), counted (``on_fault(loop)``), and the loop goes on after
    ``backoff`` seconds.  A cancellation is no Exception: it passes, as it must."""

    def __init__(
        self,
        on_fault: Callable[[str], None] = lambda loop: None,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LOG_INTERVAL,
    ) -> None:
        self._on_fault = on_fault
        self._clock = clock
        self._throttle = Throttle(interval)

    @contextlib.asynccontextmanager
    async def contained(self, loop: str, backoff: float = 0.0) -> AsyncIterator[None]:
        try:
            yield
        except Exception:
            self.report(loop)
            await asyncio.sleep(backoff)  # a step that fails again at once must not spin

    async def supervise(
        self, loop: str, run: Callable[[], Awaitable[None]], backoff: float = 1.0
    ) -> None:
        """``run()`` (a loop of the daemon's task group), started again ``backoff`` seconds
        after an unexpected exception ended it, so that it never ends the task group; it
        returns when ``run()`` returns."""
        while True:
            async with self.contained(loop, backoff):
                return await run()

    def report(self, loop: str, detail: str = "") -> None:
        """The exception being handled, in ``loop``: counted, and logged unless throttled
        (``detail``, such as the job it concerns, is told but is no key of its own)."""
        self._on_fault(loop)
        held = self._throttle.check(loop, self._clock())
        if held is not None:
            log.exception(
                "the %s loop: unexpected error%s; it goes on%s",
                loop,
                detail and f" ({detail})",
                held_back(held),
            )
