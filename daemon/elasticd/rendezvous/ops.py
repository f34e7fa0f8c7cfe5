"""Pure rendezvous decisions: ``(state, node, settings, view, now) -> Action``.

Nothing here reads a clock or a store. ``now`` and every time in a :class:`View` are on the
deciding node's own monotonic clock, and only differences of them are compared, so a node
whose clocks are skewed decides exactly like the others.

Joining is batched. A node joins an open round by taking a number from the round's join
counter and writing its signed record under that number (two store round trips, no
contention); whoever writes the state next folds the records read into ``participants``
(``state.folded``: every number up to it is consumed; a joiner whose number was consumed
before its record was written announces again). When N nodes arrive at once that is
O(N) work in total, where a compare-and-set per joiner would make them retry O(N²) times.
A node reads each record at most once (:func:`log_window`), and only when it has to
(:func:`reads_log`): N joiners read O(N) records in all, not the whole log at every step.
The counter is unsigned: it says how far to look, never who joined.
"""

from __future__ import annotations

import bisect
import enum
import math
import zlib
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from elasticd.core.liveness import Beat, observe, silent
from elasticd.rendezvous.locality import by_locality
from elasticd.rendezvous.state import (
    CHARGED,
    Announcement,
    EventKind,
    Member,
    Participant,
    Reason,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousState,
    RoundEvent,
    may_restart,
    members_of,
)


class Act(enum.Enum):
    # Writes: Action.state is the state to compare-and-set.
    JOIN_WAIT_LIST = "join_wait_list"
    COMPLETE = "complete"
    REMOVE = "remove"  # drop nodes from an open round or from the wait list
    OPEN_ROUND = "open_round"
    CLOSE = "close"
    RESTORE = "restore"  # the state vanished: write back our copy
    # I/O that is not a state write.
    ANNOUNCE = "announce"  # append this node's record to the round's join log
    WAIT = "wait"  # until Action.until or the next state revision
    # Outcomes.
    DONE = "done"
    NOTHING = "nothing"
    CLOSED = "closed"
    TIMED_OUT = "timed_out"
    ALREADY = "already"
    EXHAUSTED = "exhausted"


@dataclass(frozen=True)
class Action:
    act: Act
    state: RendezvousState | None = None
    until: float = math.inf
    record: Participant | None = None  # ANNOUNCE: what this node declares in the join log


class LastCall(NamedTuple):
    round: int
    since: float  # when this node first saw min_nodes joined in `round`


@dataclass(frozen=True)
class View:
    """This node's own observations, beside the shared state."""

    record: Participant | None = None  # what this node declares when it joins
    announced: tuple[Announcement, ...] = ()  # join-log records of state.round not folded yet
    log_end: int | None = None  # where a write folds the join log to (default: folded + announced)
    pending: float | None = (
        None  # when this node wrote its own entry, while its reading has not reached it
    )
    whole: bool = True  # False: the join log was read no further than this node's own entry
    last_call: LastCall | None = None
    deadline: float = math.inf  # join deadline
    beats: Mapping[str, Beat] = field(default_factory=dict)
    scheduled: frozenset[str] = frozenset()  # the nodes the cluster's schedule gives the job


# -- joining -------------------------------------------------------------------------------


def decide_join(
    state: RendezvousState, node: str, settings: RendezvousSettings, view: View, now: float
) -> Action:
    """The next step of ``next_rendezvous`` for ``node``."""
    if state.closed:
        return Action(Act.CLOSED)
    if state.complete and node in state.participants:
        return Action(Act.DONE)
    if now >= view.deadline:
        return Action(
            Act.TIMED_OUT, without(state, {node}, view) if involved(state, node, view) else None
        )
    if state.complete:
        if node in state.wait_list:
            return Action(Act.WAIT, until=_next_duty(state, settings, view, now))
        assert view.record is not None, "a joining node declares its record"
        return Action(
            Act.JOIN_WAIT_LIST, state.next(wait_list={**state.wait_list, node: view.record})
        )
    nodes = joined(state, view)
    if node not in nodes:
        assert view.record is not None, "a joining node declares its record"
        if view.pending is not None and now < view.pending + settings.keep_alive_interval:
            return Action(
                Act.WAIT,
                until=min(
                    view.pending + settings.keep_alive_interval,
                    _next_duty(state, settings, view, now),
                ),
            )
        return Action(Act.ANNOUNCE, record=view.record)
    if barrier_reached(state, nodes, settings, view, now):
        return Action(Act.COMPLETE, complete(state, nodes, settings, view))
    return Action(Act.WAIT, until=_next_duty(state, settings, view, now))


def joined(state: RendezvousState, view: View) -> dict[str, Participant]:
    """The open round's participants with the logged joiners folded in (later records win)."""
    nodes = dict(state.participants)
    if not state.complete:
        nodes.update((a.node, a.participant) for a in view.announced)
    return nodes


def barrier_reached(
    state: RendezvousState,
    nodes: Mapping[str, Participant],
    settings: RendezvousSettings,
    view: View,
    now: float,
) -> bool:
    """At least min_nodes joined and: every expected node is in (the previous round's, or
    those the cluster's schedule gave the job); or max_nodes are in and no member of the
    previous round is missing; or last call is over."""
    if len(nodes) < settings.min_nodes:
        return False
    expected = set(state.expected)
    if (expected and expected <= nodes.keys()) or (
        view.scheduled and view.scheduled <= nodes.keys()
    ):
        return True
    survivors = expected & set(state.order)
    if len(nodes) >= settings.max_nodes and survivors <= nodes.keys():
        return True
    end = _last_call_end(state, settings, view)
    return end is not None and now >= end


def track_last_call(
    state: RendezvousState, settings: RendezvousSettings, view: View, now: float
) -> View:
    """Start this node's last-call window when it first sees min_nodes joined in a round."""
    if state.complete or len(joined(state, view)) < settings.min_nodes:
        return replace(view, last_call=None)
    if view.last_call is not None and view.last_call.round == state.round:
        return view
    return replace(view, last_call=LastCall(state.round, now))


def complete(
    state: RendezvousState,
    nodes: Mapping[str, Participant],
    settings: RendezvousSettings,
    view: View,
) -> RendezvousState:
    """Fix the ranks: survivors first in their old order (or in the order that leaves the
    least of the job's state to fetch: ``locality``), then new nodes by name; nodes beyond
    max_nodes go to the wait list."""
    ranked = rank_order(state.order, nodes)
    members, spares = ranked[: settings.max_nodes], ranked[settings.max_nodes :]
    members = by_locality(members, len(set(members) & set(state.order)), nodes)
    return state.next(
        complete=True,
        participants={n: nodes[n] for n in members},
        wait_list={n: nodes[n] for n in spares},
        order=tuple(members),
        expected=(),
        folded=_log_end(state, view),
    )


def rank_order(order: Iterable[str], nodes: Iterable[str]) -> list[str]:
    nodes = set(nodes)
    survivors = [n for n in order if n in nodes]
    return survivors + sorted(nodes.difference(survivors))


def timeout_message(
    state: RendezvousState, node: str, settings: RendezvousSettings, view: View
) -> str:
    """What a join that timed out says."""
    waited = f"rendezvous '{settings.run_id}': {node} waited {settings.join_timeout:g}s"
    if state.complete:
        return (
            f"{waited} on the wait list of round {state.round} ({len(state.participants)} members, "
            f"max_nodes is {settings.max_nodes})"
        )
    return f"{waited}: {len(joined(state, view))} node(s) joined round {state.round}, min_nodes is {settings.min_nodes}"


def _next_duty(
    state: RendezvousState, settings: RendezvousSettings, view: View, now: float
) -> float:
    end = _last_call_end(state, settings, view)
    return min(view.deadline, now + settings.keep_alive_interval, math.inf if end is None else end)


def _last_call_end(
    state: RendezvousState, settings: RendezvousSettings, view: View
) -> float | None:
    if view.last_call is None or view.last_call.round != state.round:
        return None
    return view.last_call.since + settings.last_call_timeout


def _log_end(state: RendezvousState, view: View) -> int:
    return state.folded + len(view.announced) if view.log_end is None else view.log_end


# -- reading the join log --------------------------------------------------------------------

LOG_BATCH = 128  # join-log entries read in one round trip, at most


def log_window(read: Container[int], low: int, upper: int, batch: int = LOG_BATCH) -> list[int]:
    """The next join-log numbers to read: the first ``batch`` from ``low`` to ``upper`` not
    read yet.  A number taken but not written yet stays unread: it is read again next time."""
    numbers: list[int] = []
    while low <= upper and len(numbers) < batch:
        if low not in read:
            numbers.append(low)
        low += 1
    return numbers


def reads_log(
    own: int, count: int | None, since: float, now: float, settings: RendezvousSettings
) -> bool:
    """Whether a node reads the new entries of the join log, or only the state and the
    counter (its own entry stands for itself): when its entry is the newest (it is the one to
    find the barrier reached), when the counter has not moved for as long as a node takes to
    count as dead (the newest may be: everyone reads, and watches the joiners), or when the
    counter is not a count.  So N joiners read O(N) entries in all, not N each.  (Before a
    write that folds the log, a node reads it whatever this says.)"""
    return count is None or 0 < count <= own or now - since >= settings.dead_after


def log_upper(count: int | None, top: int, batch: int = LOG_BATCH) -> int:
    """How far to read: up to the counter; a batch past the highest number read when the
    counter is not a count.  (Unsigned, it only says where to look; a bumped one costs a
    batch of missing keys per read: reading goes on only while a batch brings records.)"""
    return top + batch if count is None else count


def claim(missing: Sequence[int], top: int, node: str) -> int:
    """The number a node writes its entry under without the counter: one that was read as
    missing (spread by name), or the next after the highest read.  For a counter that is not
    a count, or an entry the reading never reached (beyond numbers an attacker took)."""
    return missing[zlib.crc32(node.encode()) % len(missing)] if missing else top + 1


def ends_joining(old: RendezvousState, new: RendezvousState) -> bool:
    """Whether writing ``new`` over ``old`` ends the open round's joining (its log is stale)."""
    return (
        not (old.complete or old.closed) and old.round == new.round and (new.complete or new.closed)
    )


# -- liveness ------------------------------------------------------------------------------


def observe_beats(
    beats: Mapping[str, Beat], counts: Mapping[str, int | None], now: float
) -> dict[str, Beat]:
    """Fold freshly read heartbeat counters into the observations (only ``counts``' nodes stay)."""
    return {node: observe(beats.get(node), count, now) for node, count in counts.items()}


def watched(state: RendezvousState, view: View) -> set[str]:
    """Every node the rendezvous is waiting on or counting on."""
    nodes = set(state.participants) | set(state.wait_list) | set(state.expected)
    return nodes | set(joined(state, view))


RING_WIDTH = 2  # each node reads the heartbeats of this many others


def ring_watch(nodes: set[str], node: str, width: int = RING_WIDTH) -> set[str]:
    """The nodes whose heartbeats ``node`` reads: the ``width`` before it in name order,
    around a ring.  Every node is then read by ``width`` others: O(1) reads per node per
    interval instead of O(N), with a watcher to spare.  A dead node whose watchers all died
    too is read once the ring closes over them (every removal moves the ring)."""
    return ring_around(sorted(nodes - {node}), node, width)


def ring_around(ring: Sequence[str], node: str, width: int = RING_WIDTH) -> set[str]:
    """:func:`ring_watch` on the sorted names ``ring`` (``node`` among them or not), found by
    bisection: a ring built once per state serves every node of a process."""
    at = bisect.bisect_left(ring, node)
    if len(ring) - (at < len(ring) and ring[at] == node) <= width:
        return set(ring) - {node}
    return {ring[(at - k) % len(ring)] for k in range(1, width + 1)}


def ring_of(state: RendezvousState) -> tuple[list[str], frozenset[str]]:
    """The nodes ``state`` involves, sorted (for :func:`ring_around`) and as a set."""
    names = watched(state, View())
    return sorted(names), frozenset(names)


def involved(state: RendezvousState, node: str, view: View) -> bool:
    return node in watched(state, view) or view.pending is not None


def decide_liveness(
    state: RendezvousState, node: str, settings: RendezvousSettings, view: View, now: float
) -> Action:
    """Drop nodes whose heartbeat stood still for ``settings.dead_after`` of this node's clock.

    A dead member of a complete round opens the next round ("node_lost"); elsewhere the dead
    are just removed (from an open round or from the wait list).
    """
    keep_alive = settings.keep_alive
    silent_ones = {n for n, beat in view.beats.items() if silent(beat, keep_alive, now)} - {node}
    if state.closed or not silent_ones or not involved(state, node, view):  # the cheap test first
        return Action(Act.NOTHING)
    dead = silent_ones & watched(state, view)
    if not dead:
        return Action(Act.NOTHING)
    if state.complete and dead & state.participants.keys():
        return Action(Act.OPEN_ROUND, open_round(state, Reason.NODE_LOST, leaving=dead))
    return Action(Act.REMOVE, without(state, dead, view))


# -- rounds, leaving, closing ----------------------------------------------------------------


def decide_next_round(
    state: RendezvousState,
    round: int | None,
    reason: Reason,
    settings: RendezvousSettings,
    lost: Iterable[str] = (),
) -> Action:
    """Open round ``round + 1``, once: later requests for the same round get ALREADY
    (``round`` None: the round after the current one, for a node outside it).  The new round
    does not wait for the ``lost`` nodes (they may still join it)."""
    if state.closed:
        return Action(Act.CLOSED)
    if (round is not None and state.round != round) or not state.complete:
        return Action(Act.ALREADY)
    if reason in CHARGED and not may_restart(state.restarts_used, settings.max_restarts):
        return Action(Act.EXHAUSTED)
    return Action(Act.OPEN_ROUND, open_round(state, reason, leaving=lost))


def open_round(
    state: RendezvousState, reason: Reason, leaving: Iterable[str] = ()
) -> RendezvousState:
    """The next round, expecting the current members and the wait list, minus ``leaving``."""
    expected = (set(state.participants) | set(state.wait_list)).difference(leaving)
    return state.next(
        round=state.round + 1,
        complete=False,
        reason=reason,
        restarts_used=state.restarts_used + (reason in CHARGED),
        participants={},
        wait_list={},
        expected=tuple(sorted(expected)),
        folded=0,
    )


def without(state: RendezvousState, nodes: Iterable[str], view: View) -> RendezvousState:
    """``nodes`` removed from the open round (logged joiners folded in) or from the wait list."""
    nodes = set(nodes)
    if state.complete:
        return state.next(wait_list=_drop(state.wait_list, nodes))
    return state.next(
        participants=_drop(joined(state, view), nodes),
        expected=tuple(n for n in state.expected if n not in nodes),
        folded=_log_end(state, view),
    )


def decide_leave(state: RendezvousState, node: str, reason: Reason, view: View) -> Action:
    if state.closed:
        return Action(Act.NOTHING)
    if state.complete and node in state.participants:
        return Action(Act.OPEN_ROUND, open_round(state, reason, leaving={node}))
    if involved(state, node, view):
        return Action(Act.REMOVE, without(state, {node}, view))
    return Action(Act.NOTHING)


def decide_close(state: RendezvousState) -> Action:
    return Action(Act.NOTHING) if state.closed else Action(Act.CLOSE, state.next(closed=True))


def decide_restore(copy: RendezvousState, node: str) -> Action:
    """The state key is gone (the store lost its data): a node of the rendezvous writes back
    the newest state it saw, so that every node converges on one state again."""
    if copy.version == 0 or not involved(copy, node, View()):
        return Action(Act.NOTHING)
    return Action(Act.RESTORE, copy.next(folded=copy.folded if copy.complete else 0))


def _drop(nodes: Mapping[str, Participant], drop: set[str]) -> dict[str, Participant]:
    return {n: p for n, p in nodes.items() if n not in drop}


# -- what the handler reports --------------------------------------------------------------


def num_waiting(state: RendezvousState, settings: RendezvousSettings) -> int:
    """Wait-listed nodes that would fit: spares beyond max_nodes do not count."""
    if not state.complete or len(state.participants) >= settings.max_nodes:
        return 0
    return len(state.wait_list)


def round_event(
    state: RendezvousState, round: int, settings: RendezvousSettings, *, waiting: bool = True
) -> RoundEvent | None:
    """What a watcher of ``round`` should hear about, if anything."""
    if state.closed:
        return RoundEvent(EventKind.CLOSED)
    if state.round > round:
        nodes = (
            (tuple(state.participants) if state.complete else state.expected)
            if state.round == round + 1
            else ()
        )
        return RoundEvent(EventKind.NEXT_ROUND, reason=state.reason, nodes=tuple(sorted(nodes)))
    count = num_waiting(state, settings) if waiting and state.round == round else 0
    return RoundEvent(EventKind.WAITING, waiting=count) if count else None


def info_for(
    state: RendezvousState, node: str, run_id: str, members: tuple[Member, ...] | None = None
) -> RendezvousInfo:
    """This node's view of a complete round, ranked as ``members_of`` ranks (``members``:
    ``members_of(state)``, built already)."""
    members = members_of(state) if members is None else members
    me = next(m for m in members if m.node == node)
    first = members[0]
    return RendezvousInfo(
        run_id=run_id,
        round=state.round,
        reason=state.reason,
        restart_count=state.restarts_used,
        group_rank=me.group_rank,
        group_world_size=sum(1 for m in members if m.nproc),
        nproc=me.nproc,
        rank_base=me.rank_base,
        world_size=members[-1].rank_base + members[-1].nproc,
        master_addr=first.addr,
        master_port=state.participants[first.node].master_port,
        members=members,
    )
