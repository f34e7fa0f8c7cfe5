"""The blacklist (Horovod's), pure: when this node's own worker failures keep it out of new
rounds, and for how long.

``failures`` failures of this node's workers (of any job) within ``window`` seconds blacklist
the node for a cooldown of ``min * 2**(k-1)``, plus up to half of that again as jitter,
clamped to ``[min, max]`` (``cooldown_range``): ``k`` counts the blacklistings in a row, each
one beginning within ``max`` seconds after the previous one ended.  While blacklisted the
node takes no new job and leaves its jobs through a clean new round (like a drained node);
when the cooldown ends, or an operator lifts it (``elasticctl undrain``), it takes work
again.  ``now`` is passed in (monotonic seconds) and the jitter comes from a random source
given to the :class:`Blacklist`.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Hashable

from .model import WorkerState
from .records import Part

_SEEN = 4096  # failures remembered for deduplication (the newest)


@dataclass(frozen=True)
class BlacklistPolicy:
    failures: int = 0              # failures within the window that blacklist; 0: off
    window: float = 60.0
    cooldown_min: float = 10.0
    cooldown_max: float = 300.0

    @property
    def enabled(self) -> bool:
        return self.failures > 0

    def cooldown(self, strikes: int, jitter: float) -> float:
        """Seconds the ``strikes``-th blacklisting in a row lasts; ``jitter`` in [0, 1)."""
        base = self.cooldown_min * 2.0 ** min(max(strikes, 1) - 1, 64)
        return min(self.cooldown_max, max(self.cooldown_min, base * (1 + jitter / 2)))


def worker_failures(job_id: str, part: Part) -> list[Hashable]:
    """One key per worker of ``part`` that failed (a non-zero exit): its job, round, local rank
    and pid.  The same failure, reported again in a later part, has the same key."""
    return [(job_id, part.round, w.get("local_rank"), w.get("pid")) for w in part.workers
            if w.get("state") == WorkerState.FAILED and w.get("exit_code") not in (None, 0)]


class Blacklist:
    """This node's failures and cooldown (no clock of its own: ``now`` is passed in)."""

    def __init__(self, policy: BlacklistPolicy, rand: Callable[[], float] = random.random) -> None:
        self.policy = policy
        self._rand = rand
        self._failures: deque[float] = deque()  # when the counted failures happened
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self.until: float | None = None   # when the cooldown ends; None: not blacklisted
        self.strikes = 0                  # blacklistings in a row
        self._ended: float | None = None  # when the last cooldown ended

    @property
    def active(self) -> bool:
        return self.until is not None

    def failed(self, key: Hashable, now: float) -> float | None:
        """Count one failure (once per key); the end of the cooldown if it blacklisted the
        node now, else None.  Failures while blacklisted are not counted."""
        if not self.policy.enabled or key in self._seen:
            return None
        self._seen[key] = None
        if len(self._seen) > _SEEN:
            self._seen.popitem(last=False)
        if self.until is not None:
            return None
        self._failures.append(now)
        while self._failures[0] <= now - self.policy.window:
            self._failures.popleft()
        if len(self._failures) < self.policy.failures:
            return None
        in_a_row = self._ended is not None and now - self._ended <= self.policy.cooldown_max
        self.strikes = self.strikes + 1 if in_a_row else 1
        self._failures.clear()
        self.until = now + self.policy.cooldown(self.strikes, self._rand())
        return self.until

    def expire(self, now: float) -> bool:
        """End the cooldown if it is over; True if it ended now."""
        if self.until is None or now < self.until:
            return False
        self._ended, self.until = self.until, None
        return True

    def lift(self) -> bool:
        """An operator readmits the node: the cooldown, the failures counted and the strikes
        are forgotten.  True if it was blacklisted."""
        was = self.until is not None
        self.until, self._ended, self.strikes = None, None, 0
        self._failures.clear()
        return was
