"""Rendezvous data: the shared state of one job's rendezvous, its JSON codec, and the
values the handler hands out. Pure data; nothing here touches a store or a clock."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from elasticd.core.checkpoints import Holding, valid_name
from elasticd.core.liveness import KeepAlive
from elasticd.core.tables import IllegalTransition, StateTable
from elasticd.errors import RendezvousStateError

SCHEMA = 1
T = TypeVar("T")


class Reason(enum.StrEnum):
    """Why a round was opened."""

    INITIAL = "initial"  # the job's first round
    FAILURE = "failure"  # a worker failed: spends one restart of the job-wide budget
    SCALE_UP = "scale_up"  # nodes are waiting and the job is below its max
    NODE_LOST = "node_lost"  # a member's daemon died
    DRAIN = "drain"  # a member leaves because it is being drained
    SHUTDOWN = "shutdown"  # a member leaves because its daemon stops
    RECLAIM = (
        "reclaim"  # a member leaves because the cluster's scheduler gave its node to another job
    )
    STALLED = "stalled"  # in place: a survivor did not rejoin in time; every worker
    #                          restarts (spends a restart, like a failure)
    LATE_EXIT = "late_exit"  # in place: a worker carried into a round opened for a failure
    #                          died before it took its place: that failure, seen late (spends
    #                          nothing: the round it opened spent the restart); or one that
    #                          ended itself because its old round was given up (status 75)


CHARGED = frozenset({Reason.FAILURE, Reason.STALLED})  # rounds that spend the restart budget


class EventKind(enum.StrEnum):
    """What a watched round learned."""

    NEXT_ROUND = "next_round"  # it was superseded: stop and join the next one
    WAITING = "waiting"  # nodes wait to join (a chance to scale up)
    CLOSED = "closed"  # the job ended


@dataclass(frozen=True)
class RendezvousSettings:
    run_id: str
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0  # job-wide restart budget, consumed by "failure" rounds
    join_timeout: float = 600.0
    last_call_timeout: float = 1.0
    keep_alive_interval: float = KeepAlive.interval
    keep_alive_max_attempt: int = KeepAlive.attempts

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}:{self.max_nodes}"
            )
        if self.max_restarts < 0 or self.keep_alive_max_attempt < 1:
            raise ValueError("max_restarts must be >= 0 and keep_alive_max_attempt >= 1")
        if min(self.join_timeout, self.keep_alive_interval) <= 0 or self.last_call_timeout < 0:
            raise ValueError("timeouts and intervals must be positive")

    @property
    def keep_alive(self) -> KeepAlive:
        return KeepAlive(self.keep_alive_interval, self.keep_alive_max_attempt)

    @property
    def dead_after(self) -> float:
        """How long a heartbeat counter may stand still before its node counts as dead."""
        return self.keep_alive.dead_after


def may_restart(restarts_used: int, max_restarts: int) -> bool:
    """Whether a worker failure may restart the job: the job-wide budget is not spent."""
    return restarts_used < max_restarts


@dataclass(frozen=True)
class Participant:
    """What a node declares when it joins a round."""

    addr: str
    nproc: int
    master_port: int
    holds: Holding | None = None


@dataclass(frozen=True)
class Announcement:
    """One record of a round's join log: a node asking to be folded into the round."""

    node: str
    participant: Participant


class RoundState(enum.StrEnum):
    """Where a round stands (``RendezvousState.phase``, from its two flags)."""

    FORMING = "forming"  # nodes join it
    COMPLETE = "complete"  # its ranks are fixed; latecomers wait for the next round
    CLOSED = "closed"  # the job ended: nobody joins again


ROUND_STATES = StateTable(
    "a rendezvous round",
    {
        RoundState.FORMING: (RoundState.COMPLETE, RoundState.CLOSED),
        RoundState.COMPLETE: (RoundState.CLOSED,),  # a complete round is superseded, never reopened
        RoundState.CLOSED: (),
    },
)


@dataclass(frozen=True)
class RendezvousState:
    """The shared state, written only by compare-and-set.

    ``order`` is the rank order of the last completed round (oldest node first) and carries
    across rounds. ``expected`` lists the nodes whose arrival completes a newly opened round
    without waiting for last call. ``folded``: the records of this round's join log numbered
    up to it are folded into ``participants`` (see ``elasticd.rendezvous.ops``). ``nonce`` is
    random per write: two nodes that decide the same successor state still write different
    bytes, so compare_set tells the winner from the loser (TCPStore reports a swap whenever
    the key already holds the desired bytes).
    """

    version: int = 0
    round: int = 0
    complete: bool = False
    closed: bool = False
    reason: Reason = Reason.INITIAL
    restarts_used: int = 0
    participants: Mapping[str, Participant] = field(default_factory=dict)
    wait_list: Mapping[str, Participant] = field(default_factory=dict)
    order: tuple[str, ...] = ()
    expected: tuple[str, ...] = ()
    folded: int = 0
    nonce: str = ""

    @property
    def phase(self) -> RoundState:
        return (
            RoundState.CLOSED
            if self.closed
            else RoundState.COMPLETE
            if self.complete
            else RoundState.FORMING
        )

    def next(self, **changes: Any) -> RendezvousState:
        """The successor state: ``changes`` applied and the version bumped.  Within a round
        its phase moves by ROUND_STATES; a new round (the next number) begins FORMING."""
        new = replace(self, version=self.version + 1, **changes)
        if new.round == self.round:
            ROUND_STATES.check(self.phase, new.phase)
        elif new.round != self.round + 1 or new.phase is not RoundState.FORMING:
            raise IllegalTransition(
                f"a rendezvous cannot go from round {self.round} ({self.phase}) "
                f"to round {new.round} ({new.phase})"
            )
        return new


@dataclass(frozen=True)
class Member:
    node: str
    addr: str
    nproc: int
    group_rank: int
    rank_base: int
    holds: Holding | None = None  # what it declared it holds of the job's state, joining


@dataclass(frozen=True)
class RendezvousInfo:
    run_id: str
    round: int
    reason: Reason  # why this round was opened
    restart_count: int  # failures consumed so far, job-wide (TORCHELASTIC_RESTART_COUNT)
    group_rank: int
    group_world_size: int
    nproc: int  # this node's local world size
    rank_base: int  # global rank of this node's local rank 0
    world_size: int
    master_addr: str
    master_port: int
    members: tuple[Member, ...]  # in group-rank order


class NextRound(enum.Enum):
    OPENED = "opened"
    ALREADY = "already"  # the round was superseded already (by this or another request)
    EXHAUSTED = "exhausted"  # a failure restart was asked for, but the budget is used up
    CLOSED = "closed"


@dataclass(frozen=True)
class RoundEvent:
    kind: EventKind
    reason: Reason | None = None  # of the next round
    waiting: int = 0
    nodes: tuple[
        str, ...
    ] = ()  # NEXT_ROUND: the nodes that round expects or holds (empty: not known)


class Decoded:
    """The states opened lately, by the signer that opened them, their key and their sealed
    bytes: a state is checked and decoded once per change, however many handlers of one
    process read it (a daemon's jobs; the simulated nodes of a bench).  Also what is built
    from a state for every node alike (its members in rank order, the ring of the nodes it
    involves), built once per state.  Holds a few of each; the oldest goes first."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._states: dict[tuple[object, str, bytes], RendezvousState] = {}
        self._built: dict[tuple[int, Callable[..., Any]], tuple[RendezvousState, Any]] = {}

    def get(self, signer: object, key: str, raw: bytes) -> RendezvousState | None:
        return self._states.get((signer, key, raw))

    def put(self, signer: object, key: str, raw: bytes, state: RendezvousState) -> None:
        self._states[(signer, key, raw)] = state
        _bound(self._states, self._size)

    def built(self, state: RendezvousState, build: Callable[[RendezvousState], T]) -> T:
        """``build(state)``, a pure function of the state, built once for this state object."""
        held = self._built.get((id(state), build))
        if held is None or held[0] is not state:
            held = self._built[(id(state), build)] = (state, build(state))
            _bound(self._built, 4 * self._size)
        return held[1]

    def members(self, state: RendezvousState) -> tuple[Member, ...]:
        """The members of a complete round in group-rank order (``state.order``)."""
        return self.built(state, members_of)


def _bound(entries: dict[Any, Any], size: int) -> None:
    while len(entries) > size:
        del entries[next(iter(entries))]


def members_of(state: RendezvousState) -> tuple[Member, ...]:
    """A complete round's members, ranks following ``state.order``, except that a member
    with no workers (in place: its new ones warm up) ranks after those with some.  So the
    master is the node of global rank 0, and GROUP_RANK and GROUP_WORLD_SIZE count the
    nodes that train, as WORLD_SIZE counts their workers."""
    training = sorted(state.order, key=lambda name: state.participants[name].nproc == 0)
    members, base = [], 0
    for rank, name in enumerate(training):
        participant = state.participants[name]
        members.append(
            Member(name, participant.addr, participant.nproc, rank, base, participant.holds)
        )
        base += participant.nproc
    return tuple(members)


# -- codec ---------------------------------------------------------------------------------


def encode(state: RendezvousState) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "version": state.version,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "reason": state.reason,
        "restarts_used": state.restarts_used,
        "participants": {node: _encode_participant(p) for node, p in state.participants.items()},
        "wait_list": {node: _encode_participant(p) for node, p in state.wait_list.items()},
        "order": list(state.order),
        "expected": list(state.expected),
        "folded": state.folded,
        "nonce": state.nonce,
    }


def decode(body: Any) -> RendezvousState:
    """A state from its JSON body; RendezvousStateError for anything else."""
    fields = _object(body, "state")
    if fields.get("schema") != SCHEMA:
        raise RendezvousStateError(
            f"rendezvous state has schema {fields.get('schema')!r}; this elasticd reads {SCHEMA}"
        )
    return RendezvousState(
        version=_int(fields, "version"),
        round=_int(fields, "round"),
        complete=_typed(fields, "complete", bool),
        closed=_typed(fields, "closed", bool),
        reason=_reason(fields),
        restarts_used=_int(fields, "restarts_used"),
        participants=_participants(fields, "participants"),
        wait_list=_participants(fields, "wait_list"),
        order=_names(fields, "order"),
        expected=_names(fields, "expected"),
        folded=_int(fields, "folded"),
        nonce=_typed(fields, "nonce", str),
    )


def encode_announcement(announcement: Announcement) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "node": announcement.node,
        **_encode_participant(announcement.participant),
    }


def decode_announcement(body: Any) -> Announcement:
    fields = _object(body, "join record")
    if fields.get("schema") != SCHEMA:
        raise RendezvousStateError(f"join record has schema {fields.get('schema')!r}")
    return Announcement(_typed(fields, "node", str), _decode_participant(fields))


def _encode_participant(participant: Participant) -> dict[str, Any]:
    out: dict[str, Any] = {
        "addr": participant.addr,
        "nproc": participant.nproc,
        "master_port": participant.master_port,
    }
    held = participant.holds
    if held is not None:
        out["holds"] = {
            "checkpoint": held.checkpoint,
            "world": held.world,
            "ranks": list(held.ranks),
            "round": held.round,
            "saved": held.saved,
        }
    return out


def _decode_participant(body: Any) -> Participant:
    # the common case first (a state names every node of a round): no holding
    if type(body) is dict and "holds" not in body:
        addr, nproc, port = body.get("addr"), body.get("nproc"), body.get("master_port")
        if (
            type(addr) is str
            and type(nproc) is int
            and type(port) is int
            and nproc >= 0
            and port >= 0
        ):
            return Participant(addr, nproc, port)
    fields = _object(body, "participant")  # raises, naming what is wrong
    return Participant(
        _typed(fields, "addr", str),
        _int(fields, "nproc"),
        _int(fields, "master_port"),
        None if fields.get("holds") is None else _decode_holding(fields["holds"]),
    )


def _decode_holding(body: Any) -> Holding:
    fields = _object(body, "holding")
    name, world = _typed(fields, "checkpoint", str), _int(fields, "world")
    ranks, saved = fields.get("ranks"), fields.get("saved")
    if (
        world < 1
        or not isinstance(saved, (int, float))
        or isinstance(saved, bool)
        or not math.isfinite(saved)
        or not valid_name(name)
        or not isinstance(ranks, list)
        or not all(type(r) is int and 0 <= r < world for r in ranks)
        or ranks != sorted(set(ranks))
    ):
        raise RendezvousStateError(
            "rendezvous holding is not a checkpoint's name, round, time and world, and its "
            "sorted ranks below that world"
        )
    return Holding(name, world, tuple(ranks), _int(fields, "round"), float(saved))


def _participants(fields: Mapping[str, Any], name: str) -> dict[str, Participant]:
    return {node: _decode_participant(p) for node, p in _object(fields.get(name), name).items()}


def _names(fields: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = fields.get(name)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RendezvousStateError(f"rendezvous state field {name!r} is not a list of names")
    return tuple(value)


def _reason(fields: Mapping[str, Any]) -> Reason:
    try:
        return Reason(_typed(fields, "reason", str))
    except ValueError:
        raise RendezvousStateError(
            f"rendezvous state has an unknown reason {fields.get('reason')!r}"
        ) from None


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise RendezvousStateError(f"rendezvous {what} is not a JSON object")
    return value


def _int(fields: Mapping[str, Any], name: str) -> int:
    value = _typed(fields, name, int)
    if isinstance(value, bool) or value < 0:
        raise RendezvousStateError(f"rendezvous state field {name!r} is not a count")
    return value


def _typed(fields: Mapping[str, Any], name: str, kind: type[T]) -> T:
    value = fields.get(name)
    if not isinstance(value, kind):
        raise RendezvousStateError(f"rendezvous state field {name!r} is not a {kind.__name__}")
    return value
