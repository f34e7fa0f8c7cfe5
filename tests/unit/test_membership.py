"""The cluster's membership (docs/store.md): the observer's pure rules, and the node registry
over the in-memory store with a clock the test moves: one elected observer, a feed that
each node follows in O(changes), records read only when they changed, takeover when the
observer dies, and what replayed, forged or deleted keys do to it."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.cluster.registry import FEED_KEEP, NodeRecord, NodeRegistry
from elasticd.core.liveness import Beat, KeepAlive
from elasticd.core.membership import Catch, Head, Membership, catch_up, judge, takes_over
from elasticd.core.model import NodeInfo, NodeState
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer

KEEP_ALIVE = KeepAlive(1.0, 3)
SIGNER = Signer(b"k" * 32, "c")
NODES = "elasticd/c/nodes"


# -- the pure rules ------------------------------------------------------------------------------


def test_judge_admits_announces_loses_and_brings_back():
    beats = {"a": Beat(5, 0.0, 0), "b": Beat(9, 0.0, 3), "c": Beat(2, 9.5, 0)}
    members = {"b": Membership(1), "c": Membership(1, lost=True, since=3.0)}
    changes = judge(members, beats, {"a": 4, "b": 1, "c": 2}, KEEP_ALIVE, now=10.0, wall=100.0)
    assert changes == {
        "a": Membership(4, False, 100.0),  # a new member
        "b": Membership(1, True, 100.0),  # silent for 10 s over 3 reads: lost
        "c": Membership(2, False, 100.0),
    }  # back, with a new record


def test_judge_kills_nobody_it_has_not_watched_long_enough_or_read_often_enough():
    members = {"a": Membership(1), "b": Membership(1)}
    beats = {"a": Beat(5, 9.0, 5), "b": Beat(5, 0.0, 1)}  # a: not long enough; b: a stalled store
    assert judge(members, beats, {}, KEEP_ALIVE, now=10.0, wall=0.0) == {}


def test_judge_needs_a_record_before_a_node_is_a_member():
    assert judge({}, {"a": Beat(5, 0.0, 0)}, {"a": None}, KEEP_ALIVE, 1.0, 1.0) == {}
    assert (
        judge({"a": Membership(3)}, {"a": Beat(6, 0.0, 0)}, {"a": None}, KEEP_ALIVE, 1.0, 1.0) == {}
    )


@pytest.mark.parametrize(
    "term, number, head, catch",
    [
        (1, 5, None, Catch()),
        (1, 5, Head(1, 5), Catch()),
        (1, 5, Head(1, 8), Catch(entries=range(6, 9))),
        (1, 5, Head(2, 8), Catch(snapshot=True)),  # a new observer
        (1, 5, Head(1, 3), Catch(snapshot=True)),  # the feed went back
        (1, 5, Head(1, 5 + FEED_KEEP + 1), Catch(snapshot=True)),  # too far behind
    ],
)
def test_catch_up(term, number, head, catch):
    assert catch_up(term, number, head, FEED_KEEP) == catch


def test_takes_over_when_there_is_no_observer_or_its_head_stood_still():
    assert takes_over(False, None, KEEP_ALIVE, 0.0)
    assert not takes_over(True, Beat(3, 0.0, 2), KEEP_ALIVE, 10.0)  # read too few times
    assert takes_over(True, Beat(3, 0.0, 3), KEEP_ALIVE, 10.0)
    assert not takes_over(True, None, KEEP_ALIVE, 10.0)


# -- the registry over a store ------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore(AsyncMemoryStore):
    """Counts the keys each call touches."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.keys = 0

    async def get_many(self, keys):
        self.keys += len(keys)
        return await super().get_many(keys)

    async def get(self, key):
        self.keys += 1
        return await super().get(key)


class Cluster:
    def __init__(self, names: list[str]) -> None:
        self.store = MemoryStore()
        self.clock = Clock()
        self.refused: list[tuple[str, str]] = []
        self.stores = {n: CountingStore(self.store) for n in names}
        self.nodes = {
            n: NodeRegistry(
                self.stores[n],
                SIGNER,
                "c",
                n,
                keep_alive=KEEP_ALIVE,
                clock=self.clock,
                wall_clock=self.clock,
                on_refused=lambda key, why: self.refused.append((key, why)),
            )
            for n in names
        }
        self.records = {n: NodeRecord(NodeInfo(n, "127.0.0.1", 4)) for n in names}
        self.ticks: dict[str, object] = {}

    def round(self, names: list[str] | None = None, seconds: float = 1.0) -> None:
        """One heartbeat duty of each node in ``names`` (all by default), then time moves."""

        async def duties() -> None:
            for name in names if names is not None else list(self.nodes):
                self.ticks[name] = await self.nodes[name].tick(self.records[name])

        asyncio.run(duties())
        self.clock.now += seconds

    def states(self, name: str) -> dict[str, NodeState]:
        node = self.nodes[name]
        return node.states(self.ticks[name].sightings)

    def observer(self) -> str:
        return next(n for n, node in self.nodes.items() if node.observing)


def test_one_observer_is_elected_and_everyone_sees_everyone():
    c = Cluster(["n1", "n2", "n3"])
    asyncio.run(c.nodes["n1"].create_epoch())
    for _ in range(3):
        c.round()
    assert [n for n, node in c.nodes.items() if node.observing] == ["n1"]
    for name in c.nodes:
        assert c.states(name) == {"n1": "up", "n2": "up", "n3": "up"}, name
    assert not c.refused


def test_a_node_reads_o1_keys_per_duty_and_a_record_only_when_it_changed():
    names = [f"n{i}" for i in range(40)]
    c = Cluster(names)
    for _ in range(3):
        c.round()
    follower = c.stores["n7"]
    follower.keys = 0
    c.round()
    assert follower.keys <= 6  # one batch of five small keys (+ nothing else: nothing changed)
    c.records["n9"] = NodeRecord(NodeInfo("n9", "127.0.0.1", 4), draining=True)
    c.round()
    c.round()
    follower.keys = 0
    c.round()
    assert c.states("n7")["n9"] == "drained"
    assert follower.keys <= 6
    assert c.observer() == "n0"
    observer = c.stores["n0"]
    observer.keys = 0
    c.round()
    assert observer.keys <= 5 + 1 + len(names)  # the observer alone reads every heartbeat


def test_a_dead_node_is_lost_then_back_and_a_replayed_heartbeat_is_no_sign_of_life():
    c = Cluster(["n1", "n2", "n3"])
    c.round()
    old_beat = c.store.get(f"{NODES}/n3/hb")
    c.round()
    c.round()
    for _ in range(5):  # n3 died; someone writes its old heartbeat back every second
        c.store.set(f"{NODES}/n3/hb", old_beat)
        c.round(["n1", "n2"])
    assert c.states("n2")["n3"] == "lost" and c.states("n1")["n3"] == "lost"
    assert any(key == f"{NODES}/n3/hb" and "older" in why for key, why in c.refused)
    c.round()  # n3 comes back
    c.round(["n1", "n2"])
    assert c.states("n2")["n3"] == "up"


def test_a_stalled_store_kills_nobody():
    c = Cluster(["n1", "n2"])
    for _ in range(3):
        c.round()
    c.clock.now += 60  # nothing read for a minute (a stalled store or observer)
    c.round()
    c.round()
    assert c.states("n2") == {"n1": "up", "n2": "up"}


def test_the_observer_dies_another_takes_over_and_kills_nobody_else():
    c = Cluster(["n1", "n2", "n3"])
    for _ in range(3):
        c.round()
    assert c.observer() == "n1"
    for _ in range(5):  # n1 gone: its head stands still, n2 (or n3) takes over
        c.round(["n2", "n3"])
    assert [n for n in ("n2", "n3") if c.nodes[n].observing] == ["n2"]
    states = [c.states(n) for n in ("n2", "n3")]
    assert all(s["n2"] == "up" and s["n3"] == "up" for s in states), states
    for _ in range(4):  # the new observer watches n1 for dead_after before it judges
        c.round(["n2", "n3"])
    assert c.states("n3")["n1"] == "lost"
    c.round()  # n1 comes back: it follows the new observer and observes no more
    c.round()
    assert c.observer() == "n2" and c.states("n1")["n1"] == "up"


def test_forged_or_deleted_feed_entries_send_a_follower_to_the_snapshot():
    c = Cluster(["n1", "n2"])
    for _ in range(3):
        c.round()
    c.records["n1"] = NodeRecord(NodeInfo("n1", "127.0.0.1", 4), draining=True)
    c.round(["n1"])  # n1 observes: it publishes entry k for its own record change
    head = SIGNER.open(f"{NODES}/feed/head", c.store.get(f"{NODES}/feed/head")).body
    c.store.set(f"{NODES}/feed/{head['number']}", b'{"forged": 1}')
    c.round(["n2"])
    assert c.states("n2")["n1"] == "drained"  # from the snapshot
    assert any(key == f"{NODES}/feed/{head['number']}" for key, _ in c.refused)


def test_a_forged_observer_record_or_head_does_not_hold_the_cluster():
    c = Cluster(["n1", "n2"])
    for _ in range(3):
        c.round()
    c.store.set(f"{NODES}/observer", b"junk")
    for _ in range(2):
        c.round()
    assert sum(node.observing for node in c.nodes.values()) == 1  # a new term took over the junk
    observer = c.observer()
    other = "n2" if observer == "n1" else "n1"
    for _ in range(5):  # the observer died and someone keeps writing junk heads
        c.store.set(f"{NODES}/feed/head", b"junk")
        c.round([other])
    assert c.nodes[other].observing


def test_junk_written_again_before_the_observer_reads_who_took_over_leaves_one_observer():
    """Found by tests/chaos/test_store_poison.py: n2 took over the junk, and new junk covered
    its record before n1, the observer, read it; both then observed for good."""
    c = Cluster(["n1", "n2"])
    for _ in range(3):
        c.round()
    assert c.observer() == "n1"
    c.store.set(f"{NODES}/observer", b"junk")
    c.round(["n2"])  # n2 takes over (term 2)
    assert c.nodes["n2"].observing and c.nodes["n1"].observing
    c.store.set(f"{NODES}/observer", b"[1,2,3]")  # before n1 reads n2's record
    for _ in range(3):
        c.round()
    assert sum(node.observing for node in c.nodes.values()) == 1
    assert b"junk" not in c.store.get(f"{NODES}/observer") and b"[1,2,3]" != c.store.get(
        f"{NODES}/observer"
    )


def test_the_feed_keeps_a_bounded_number_of_entries():
    c = Cluster(["n1", "n2"])
    for i in range(FEED_KEEP + 10):
        c.records["n2"] = NodeRecord(NodeInfo("n2", "127.0.0.1", 4), slots_used=i % 2)
        c.round()
    entries = [
        k for k in c.store.keys() if k.startswith(f"{NODES}/feed/") and k.split("/")[-1].isdigit()
    ]
    assert len(entries) <= FEED_KEEP + 1


def test_a_census_shows_a_node_that_registered_before_the_observer_admitted_it():
    c = Cluster(["n1", "n2", "n3"])
    c.round(["n1", "n2"])
    c.round(["n1", "n2"])
    c.round(["n3"])  # n3 registers; the observer (n1) has not read it yet

    async def census():
        return await c.nodes["n2"].tick(c.records["n2"], census=True)

    assert "n3" not in asyncio.run(c.nodes["n2"].tick(c.records["n2"])).sightings
    assert c.nodes["n2"].states(asyncio.run(census()).sightings)["n3"] == "up"
    c.store.delete(f"{NODES}/n3/hb")  # n3 died before the observer read its heartbeat
    for _ in range(4):
        c.round(["n1", "n2"])
    assert "n3" not in c.ticks["n2"].sightings  # the census' word expired; the observer's decides
