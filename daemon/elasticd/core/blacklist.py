"""The blacklist (Horovod's, per user), pure: when failures of workers on this node keep a
user's jobs off it, or the whole node out of new rounds, and for how long.

One user's failing job must not evict everyone else's (docs/discovery.md), so failures count against
the user whose job failed: ``failures`` failures of one user's workers here (of any of
their jobs) within ``window`` seconds *keep that user's jobs off this node* (they leave it
through a clean new round and are not placed here) for a cooldown.  The node itself is
blacklisted only when the jobs of several users fail here: when a user's jobs are kept off
while another user's are too, or were within the last ``window`` seconds
(:func:`several_users`).  A blacklisted node takes no new job and leaves its jobs (like a
drained node) for a cooldown of its own.

A cooldown lasts ``min * 2**(k-1)``, plus up to half of that again as jitter, clamped to
``[min, max]`` (``cooldown_range``); ``k`` counts the cooldowns in a row of the same user
(or of the node), each one beginning within ``max`` seconds after the previous one ended.
Failures of a user whose jobs are kept off, and any failure while the node is blacklisted,
are not counted.  An operator's ``elasticctl undrain`` lifts every cooldown here.  ``now``
is passed in (monotonic seconds) and the jitter comes from a random source given to the
:class:`Blacklist`.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from elasticd.core.model import WorkerState
from elasticd.core.records import Part

_SEEN = 4096  # failures remembered for deduplication (the newest)
USERS_FOR_NODE = 2  # users whose jobs were kept off within the window that blacklist the node


@dataclass(frozen=True)
class BlacklistPolicy:
    failures: int = 0  # failures of one user's workers within the window; 0: off
    window: float = 60.0
    cooldown_min: float = 10.0
    cooldown_max: float = 300.0

    @property
    def enabled(self) -> bool:
        return self.failures > 0

    def cooldown(self, strikes: int, jitter: float) -> float:
        """Seconds the ``strikes``-th cooldown in a row lasts; ``jitter`` in [0, 1)."""
        base = self.cooldown_min * 2.0 ** min(max(strikes, 1) - 1, 64)
        return min(self.cooldown_max, max(self.cooldown_min, base * (1 + jitter / 2)))


def worker_failures(job_id: str, part: Part) -> list[Hashable]:
    """One key per worker of ``part`` that failed (a non-zero exit): its job, round, local rank
    and pid.  The same failure, reported again in a later part, has the same key."""
    return [
        (job_id, part.round, w.get("local_rank"), w.get("pid"))
        for w in part.workers
        if w.get("state") == WorkerState.FAILED and w.get("exit_code") not in (None, 0)
    ]


def several_users(
    began: Mapping[Hashable, float], in_force: Iterable[Hashable], now: float, window: float
) -> bool:
    """Whether the jobs of enough users failed here to blame the node: users whose jobs are
    kept off now (``in_force``) or were kept off within ``window`` seconds before ``now``
    (``began``: when each user's latest cooldown began) number ``USERS_FOR_NODE`` or more."""
    recent = {user for user, when in began.items() if when > now - window}
    return len(recent | set(in_force)) >= USERS_FOR_NODE


@dataclass
class Cooldown:
    """One user's (or the node's) cooldowns: the one in force and how many came in a row."""

    until: float | None = None  # when the one in force ends; None: none is
    strikes: int = 0  # cooldowns in a row
    ended: float | None = None  # when the last one ended

    @property
    def active(self) -> bool:
        return self.until is not None

    def begin(self, now: float, policy: BlacklistPolicy, jitter: float) -> float:
        in_a_row = self.ended is not None and now - self.ended <= policy.cooldown_max
        self.strikes = self.strikes + 1 if in_a_row else 1
        self.until = now + policy.cooldown(self.strikes, jitter)
        return self.until

    def expire(self, now: float) -> bool:
        """End the cooldown if it is over; True if it ended now."""
        if self.until is None or now < self.until:
            return False
        self.ended, self.until = self.until, None
        return True


@dataclass(frozen=True)
class Verdict:
    """What one failure began: the end of its user's cooldown, of the node's (None: none)."""

    user_until: float | None = None
    node_until: float | None = None


@dataclass
class _User:
    failures: deque[float] = field(default_factory=deque)  # when their counted failures happened
    cooldown: Cooldown = field(default_factory=Cooldown)
    began: float | None = None  # when their latest cooldown began


class Blacklist:
    """This node's failures by user and the cooldowns they began (no clock of its own)."""

    def __init__(self, policy: BlacklistPolicy, rand: Callable[[], float] = random.random) -> None:
        self.policy = policy
        self._rand = rand
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._users: dict[Hashable, _User] = {}
        self.node = Cooldown()

    @property
    def active(self) -> bool:
        """Whether the node is blacklisted."""
        return self.node.active

    @property
    def until(self) -> float | None:
        return self.node.until

    @property
    def strikes(self) -> int:
        return self.node.strikes

    def kept_off(self) -> set[Hashable]:
        """The users whose jobs are kept off this node now."""
        return {user for user, state in self._users.items() if state.cooldown.active}

    def user_until(self, user: Hashable) -> float | None:
        state = self._users.get(user)
        return state.cooldown.until if state is not None else None

    def user_strikes(self, user: Hashable) -> int:
        state = self._users.get(user)
        return state.cooldown.strikes if state is not None else 0

    def failed(self, key: Hashable, user: Hashable, now: float) -> Verdict:
        """Count one failure of a worker of ``user``'s job (once per key); what it began."""
        if not self.policy.enabled or key in self._seen:
            return Verdict()
        self._seen[key] = None
        if len(self._seen) > _SEEN:
            self._seen.popitem(last=False)
        state = self._users.setdefault(user, _User())
        if self.node.active or state.cooldown.active:
            return Verdict()
        state.failures.append(now)
        while state.failures[0] <= now - self.policy.window:
            state.failures.popleft()
        if len(state.failures) < self.policy.failures:
            return Verdict()
        state.failures.clear()
        user_until = state.cooldown.begin(now, self.policy, self._rand())
        state.began = now
        began = {u: s.began for u, s in self._users.items() if s.began is not None}
        if not several_users(began, self.kept_off(), now, self.policy.window):
            return Verdict(user_until)
        for other in self._users.values():
            other.failures.clear()
        return Verdict(user_until, self.node.begin(now, self.policy, self._rand()))

    def expire(self, now: float) -> bool:
        """End the node's cooldown if it is over; True if it ended now."""
        return self.node.expire(now)

    def expire_user(self, user: Hashable, now: float) -> bool:
        """End ``user``'s cooldown if it is over; True if it ended now."""
        state = self._users.get(user)
        return state is not None and state.cooldown.expire(now)

    def lift(self) -> bool:
        """An operator readmits the node and every user: the cooldowns, the failures counted
        and the strikes are forgotten.  True if any cooldown was in force."""
        was = self.node.active or bool(self.kept_off())
        self.node = Cooldown()
        self._users.clear()
        return was
