"""When a node counts as dead: one rule for the cluster's node list and every rendezvous.

A node bumps its heartbeat counter every ``interval``.  An observer counts it dead once the
counter stood still for ``interval x attempts`` of the observer's own monotonic clock *and*
across ``attempts`` of the observer's reads of it: no wall-clock comparison (clock skew
kills nobody), and a store or an observer that stalled for longer makes every counter look
still for one read only (a stalled store kills nobody).  Pure: ``now`` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeepAlive:
    interval: float = 1.0  # seconds between a node's heartbeats
    attempts: int = 3  # heartbeats missed before it counts as dead

    @property
    def dead_after(self) -> float:
        return self.interval * self.attempts


@dataclass(frozen=True, slots=True)
class Beat:
    """A heartbeat counter as one observer sees it."""

    count: int | None  # as last read (None: no counter yet)
    since: float  # when this observer saw it change (its monotonic clock)
    reads: int = 0  # this observer's reads since then that found it unchanged


def observe(previous: Beat | None, count: int | None, now: float) -> Beat:
    """Fold a fresh read in: any change (a reset store restarts a counter) is a sign of life."""
    if previous is not None and previous.count == count:
        return Beat(count, previous.since, previous.reads + 1)
    return Beat(count, now)


def silent(beat: Beat | None, keep_alive: KeepAlive, now: float) -> bool:
    """Whether the node behind ``beat`` counts as dead (never one not seen yet)."""
    return (
        beat is not None
        and now - beat.since >= keep_alive.dead_after
        and beat.reads >= keep_alive.attempts
    )
