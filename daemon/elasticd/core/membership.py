"""The cluster's membership, as one observer judges it: who is lost, and which version of
each node's record is current.  Pure: ``now`` and ``wall`` are passed in.

Why one observer: if every node read every node's heartbeat and record each interval, the
store would serve N² reads per interval (2048 nodes: 8 M key reads/s).  Instead each node
writes its heartbeat (which carries its record's version), and one elected node, the
observer, reads all heartbeats, judges them by the one liveness rule (liveness.py: its own
monotonic clock, so clock skew kills nobody, and a stalled store or observer makes every
counter look still for one read only) and publishes what *changed* as a numbered entry of
a feed.  Every other node reads the feed's head each interval and only the entries and the
records that changed: O(1) per node per interval, O(changes) for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticd.core.liveness import Beat, KeepAlive, silent
from elasticd.wire.numbers import json_number


@dataclass(frozen=True)
class Membership:
    """One node's membership as the observer published it."""

    record: int  # the version of its record that its heartbeat announced
    lost: bool = False
    since: float = 0.0  # the observer's wall clock when ``lost`` last changed (display only)

    def to_json(self) -> list[Any]:
        return [self.record, self.lost, self.since]

    @classmethod
    def from_json(cls, doc: Any) -> Membership:
        record, lost, since = doc
        if not isinstance(record, int) or not isinstance(lost, bool):
            raise ValueError(f"not a member: {doc!r}")
        return cls(record, lost, json_number(since, "since"))


Members = Mapping[str, Membership]


def parse_members(doc: Any) -> dict[str, Membership]:
    if not isinstance(doc, dict):
        raise ValueError("members must be an object")
    return {str(name): Membership.from_json(entry) for name, entry in doc.items()}


def members_json(members: Members) -> dict[str, Any]:
    return {name: member.to_json() for name, member in sorted(members.items())}


def judge(
    members: Members,
    beats: Mapping[str, Beat],
    records: Mapping[str, int | None],
    keep_alive: KeepAlive,
    now: float,
    wall: float,
) -> dict[str, Membership]:
    """The entries that change, given every node's heartbeat as this observer saw it and
    the record versions those heartbeats announced (None: not readable this time).

    A node becomes a member at its first heartbeat that names a record; a member is lost
    once its heartbeat is silent and back at its next beat; its record version follows its
    heartbeat.  A node never seen by this observer is never silent (a new observer kills
    nobody before it watched for ``keep_alive.dead_after``)."""
    changes = {}
    for name, beat in beats.items():
        old = members.get(name)
        lost = silent(beat, keep_alive, now)
        record = records.get(name)
        if record is None:
            record = old.record if old is not None else None
        if old is None:
            if record is not None and not lost:
                changes[name] = Membership(record, False, wall)
        elif lost != old.lost or record != old.record:
            changes[name] = Membership(
                record if record is not None else old.record,
                lost,
                wall if lost != old.lost else old.since,
            )
    return changes


@dataclass(frozen=True)
class Head:
    """The feed's head: the observer's term and the number of its newest entry.  The
    observer rewrites it every duty, so that it is also the observer's heartbeat."""

    term: int
    number: int

    def to_json(self) -> dict[str, int]:
        return {"term": self.term, "number": self.number}

    @classmethod
    def from_json(cls, doc: Any) -> Head:
        term, number = doc["term"], doc["number"]
        if not isinstance(term, int) or not isinstance(number, int) or number < 0:
            raise ValueError(f"not a head: {doc!r}")
        return cls(term, number)


@dataclass(frozen=True)
class Catch:
    """How a follower catches up with a head: the entry numbers to read, or a snapshot."""

    entries: range = range(0)
    snapshot: bool = False


def catch_up(term: int, number: int, head: Head | None, keep: int) -> Catch:
    """What a follower at entry ``number`` of ``term`` reads to reach ``head``: nothing when
    it is there; the entries in between when they are all still kept; else the snapshot
    (a new observer, a feed that went back: a reset store, or one too far ahead)."""
    if head is None or (head.term, head.number) == (term, number):
        return Catch()
    if head.term != term or head.number < number or head.number - number > keep:
        return Catch(snapshot=True)
    return Catch(entries=range(number + 1, head.number + 1))


def takes_over(
    observer_known: bool, head_beat: Beat | None, keep_alive: KeepAlive, now: float
) -> bool:
    """Whether a node should try to become the observer: there is none, or its head (its
    heartbeat) stood still by the liveness rule."""
    return not observer_known or silent(head_beat, keep_alive, now)
