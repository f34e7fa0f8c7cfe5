"""The failure detector's rules (core/detector.py), table by table, then in a simulated world
of nodes that tick, send with delays, freeze, pause and are cut off (hypothesis)."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.core.detector import Detector, DetectorSettings, Kind, Lost, Send

S = DetectorSettings()


def ring(me: str, *members: str, now: float = 0.0, answered: bool = True) -> Detector:
    """``me``'s detector in a group of ``members``, each of which (``answered``) it has
    heard once, at ``now``: it knows them, and they know it."""
    d = Detector(me)
    d.watch({"job": members}, now)
    d.know(members)
    if answered:
        for member in members:
            if member != me:
                d.receive(member, Kind.ACK, 0, "", now)
    return d


# -- who is probed, who helps ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "me", "neighbours"),
    [
        (("a", "b"), "a", {"b"}),
        (("a", "b", "c"), "b", {"a", "c"}),
        (("a", "b", "c", "d", "e"), "a", {"b", "e"}),
        (("a", "b", "c", "d", "e"), "c", {"b", "d"}),
        (("a",), "a", set()),
    ],
)
def test_each_node_probes_its_two_neighbours_on_the_ring(members, me, neighbours):
    assert ring(me, *members).neighbours() == neighbours


def test_neighbours_are_the_union_over_groups_and_every_member_is_probed_twice():
    d = Detector("c")
    d.watch({"j1": ("a", "b", "c", "d"), "j2": ("c", "x", "y")}, 0.0)
    assert d.neighbours() == {"b", "d", "x", "y"}
    names = [f"n{i:02d}" for i in range(40)]
    probed = [n for me in names for n in ring(me, *names).neighbours()]
    assert all(probed.count(n) == 2 for n in names)


def test_helpers_are_group_members_after_the_target_then_other_known_nodes():
    d = Detector("a")
    d.watch({"job": ("a", "b", "c", "d", "e")}, 0.0)
    d.know(["a", "b", "c", "d", "e", "x", "y"])
    assert d.helpers("b") == ["c", "d", "e"]
    d.watch({"job": ("a", "b", "c")}, 0.0)
    assert d.helpers("b") == ["c", "d", "e"]  # then the known nodes after b
    d.watch({"job": ("a", "b")}, 0.0)
    d.know(["a", "b"])
    assert d.helpers("b") == []


def test_settings_refuse_a_suspicion_later_than_the_verdict():
    with pytest.raises(ValueError):
        DetectorSettings(suspect_after=0.5, lost_after=0.4)


# -- one detector, stimulus by stimulus ---------------------------------------------------------


def sends(out, kind=None):
    return [o for o in out if isinstance(o, Send) and (kind is None or o.kind is kind)]


def test_a_ping_is_answered_and_any_message_is_a_sign_of_life():
    d = ring("a", "a", "b", "c")
    out = d.receive("b", Kind.PING, 7, "", 0.3)
    assert out == [Send("b", Kind.ACK, 7)]
    assert d.watched["b"] == 0.3


def test_silence_asks_helpers_then_a_nack_confirms_the_loss():
    d = ring("a", "a", "b", "c", "d")
    assert [s.to for s in sends(d.tick(0.0), Kind.PING)] == ["b", "d"]
    t = 0.0
    asks = []
    while not asks:
        t += S.tick
        d.receive("d", Kind.ACK, 0, "", t)  # d answers, b stays silent
        asks = sends(d.tick(t), Kind.ASK)
    assert S.suspect_after <= t <= S.suspect_after + S.tick
    assert {(a.to, a.target) for a in asks} == {("c", "b"), ("d", "b")}
    lost = []
    asked = t
    while t < asked + S.relay_timeout:  # the helper waits its relay timeout, then says so
        t += S.tick
        d.receive("d", Kind.ACK, 0, "", t)
        lost += d.tick(t)
    nack = next(a for a in asks if a.to == "c")
    lost += d.receive("c", Kind.NACK, nack.nonce, "b", t)  # before lost_after: no verdict yet
    assert not [o for o in lost if isinstance(o, Lost)], "a nack before lost_after: not yet"
    while not [o for o in lost if isinstance(o, Lost)]:
        t += S.tick
        d.receive("d", Kind.ACK, 0, "", t)
        lost += d.tick(t)
    assert S.lost_after <= t <= S.lost_after + S.tick + 1e-9
    assert [o for o in lost if isinstance(o, Lost)] == [Lost("b", pytest.approx(t), ("c",))]
    assert not [o for o in d.tick(t + S.tick) if isinstance(o, Lost)], "declared once"


def test_a_relayed_life_clears_the_suspicion():
    d = ring("a", "a", "b", "c")
    t = 0.0
    asks = []
    while not asks:
        t += S.tick
        asks = sends(d.tick(t), Kind.ASK)
    d.receive("c", Kind.ALIVE, asks[0].nonce, "b", t)
    assert d.watched["b"] == t


def test_a_nack_or_alive_that_answers_no_ask_of_this_node_counts_for_nothing():
    d = ring("a", "a", "b", "c")
    t = 0.0
    while t < S.lost_after + S.tick:
        t += S.tick
        d.tick(t)
    before = d.watched["b"]
    assert d.receive("c", Kind.ALIVE, 999, "b", t) == []
    assert d.watched["b"] == before  # no ask had nonce 999: not believed
    assert d.receive("c", Kind.NACK, 999, "b", t) == []


def test_helpers_that_all_stay_silent_make_this_node_doubt_itself_not_declare():
    d = ring("a", "a", "b", "c", "d")
    t = 0.0
    lost = []
    while t < 3 * S.lost_after:
        t += S.tick
        lost += [o for o in d.tick(t) if isinstance(o, Lost)]
    assert lost == []
    assert d.health >= 1


def test_with_no_helper_at_all_the_silence_alone_decides():
    d = ring("a", "a", "b")
    t, lost = 0.0, []
    while not lost:
        t += S.tick
        lost = [o for o in d.tick(t) if isinstance(o, Lost)]
    assert lost[0].node == "b" and S.lost_after <= t <= S.lost_after + S.tick


def test_a_node_not_heard_since_it_was_watched_is_not_judged_until_it_is():
    d = ring("a", "a", "b", answered=False)  # b does not know a yet: it refuses a's pings
    t, out = 0.0, []
    while t < 3 * S.lost_after:
        t += S.tick
        out += d.tick(t)
    assert not [o for o in out if isinstance(o, Lost)] and not sends(out, Kind.ASK)
    d.receive("b", Kind.ACK, 0, "", t)  # it knows a now
    heard, lost = t, []
    while not lost:
        t += S.tick
        lost = [o for o in d.tick(t) if isinstance(o, Lost)]
    assert S.lost_after <= t - heard <= S.lost_after + S.tick + 1e-9


def test_a_late_tick_is_this_nodes_own_stall_not_the_others_silence():
    d = ring("a", "a", "b")
    d.tick(0.0)
    out = d.tick(1.0)  # the process did not run for a second
    assert not [o for o in out if isinstance(o, Lost)]
    assert d.health == 1
    assert d.watched["b"] >= 1.0 - S.tick - 1e-9


def test_local_health_stretches_the_verdict_and_decays():
    d = ring("a", "a", "b")
    d.tick(0.0)
    d.tick(0.5)  # a stall: health 1, verdicts after 2 x lost_after
    t, lost = 0.5, []
    while not lost:
        t += S.tick
        lost = [o for o in d.tick(t) if isinstance(o, Lost)]
    assert t >= 0.5 - S.tick + 2 * S.lost_after - 1e-9
    while t < 10:
        t += S.tick
        d.tick(t)
    assert d.health == 0


def test_a_declared_node_heard_again_is_watched_afresh():
    d = ring("a", "a", "b")
    t, lost = 0.0, []
    while not lost:
        t += S.tick
        lost = [o for o in d.tick(t) if isinstance(o, Lost)]
    d.receive("b", Kind.PING, 5, "", t)
    t2 = t
    lost = []
    while not lost:
        t2 += S.tick
        lost = [o for o in d.tick(t2) if isinstance(o, Lost)]
    assert t2 - t >= S.lost_after - 1e-9


def test_a_helper_relays_the_targets_ack_or_answers_a_nack_in_time():
    h = ring("c", "a", "b", "c")
    out = h.receive("a", Kind.ASK, 41, "b", 1.0)
    ping = sends(out, Kind.PING)[0]
    assert ping.to == "b"
    assert h.receive("b", Kind.ACK, ping.nonce, "", 1.01) == [Send("a", Kind.ALIVE, 41, "b")]
    out = h.receive("a", Kind.ASK, 42, "b", 2.0)
    assert sends(h.tick(2.0 + S.relay_timeout), Kind.NACK) == [Send("a", Kind.NACK, 42, "b")]


def losses(out) -> list[Lost]:
    return [o for o in out if isinstance(o, Lost)]


def test_a_refused_node_is_asked_about_at_once_and_lost_sooner_once_confirmed():
    """Its host said nothing listens at its port (its daemon died, the host lives): helpers
    are asked at once, and a helper's nack ends it at ``suspect_after`` of silence."""
    d = ring("a", "a", "b", "c", "d")
    asks = sends(d.refused("b", 0.05), Kind.ASK)
    assert {(a.to, a.target) for a in asks} == {("c", "b"), ("d", "b")}
    nack = next(a for a in asks if a.to == "c")
    t, lost = 0.06, []
    lost += losses(d.receive("c", Kind.NACK, nack.nonce, "b", t))
    while not lost:
        t += S.tick
        d.receive("d", Kind.ACK, 0, "", t)
        lost += losses(d.tick(t))
    assert S.suspect_after <= t <= S.suspect_after + S.tick + 1e-9 < S.lost_after
    assert lost == [Lost("b", pytest.approx(t), ("c",), refused=True)]


def test_a_refused_node_that_answers_is_not_lost_sooner():
    """The refusal may be forged: anything the node says clears it, and its silence is then
    judged as anyone's."""
    d = ring("a", "a", "b", "c", "d")
    asks = sends(d.refused("b", 0.05), Kind.ASK)
    d.receive("b", Kind.ACK, 0, "", 0.06)
    t, lost = 0.06, []
    for ask in asks:
        lost += losses(d.receive(ask.to, Kind.NACK, ask.nonce, "b", 0.07))
    while t < 0.06 + S.lost_after - S.tick:
        t += S.tick
        d.receive("d", Kind.ACK, 0, "", t)
        lost += losses(d.tick(t))
    assert lost == []


def test_a_refused_node_is_not_lost_on_its_silence_alone_where_helpers_exist():
    d = ring("a", "a", "b", "c", "d")
    d.refused("b", 0.05)
    t, lost = 0.05, []
    while t < S.lost_after:
        t += S.tick
        d.receive("d", Kind.ACK, 0, "", t)
        lost += losses(d.tick(t))
    assert lost == []  # no helper confirmed it yet: as before


def test_a_helper_asked_about_a_refused_node_nacks_at_once():
    h = ring("c", "a", "b", "c")
    h.receive("a", Kind.ASK, 41, "b", 1.0)
    assert sends(h.refused("b", 1.01), Kind.NACK) == [Send("a", Kind.NACK, 41, "b")]
    assert sends(h.tick(1.0 + S.relay_timeout), Kind.NACK) == []  # answered once


def test_a_helper_probes_only_known_nodes_and_keeps_a_bounded_table():
    h = ring("c", "a", "b", "c")
    assert h.receive("a", Kind.ASK, 1, "nobody", 0.0) == []
    assert h.receive("a", Kind.ASK, 1, "c", 0.0) == []  # about itself: its own ack answers
    for n in range(1000):
        h.receive("a", Kind.ASK, n, "b", 0.0)
    assert len(h._relays) <= 256


# -- a simulated world ------------------------------------------------------------------------


class World:
    """Nodes with detectors on one clock.  A message takes ``delay`` seconds; a frozen node
    neither ticks nor reads (what reached it waits until it thaws); a cut-off node's
    messages, both ways, are dropped."""

    def __init__(self, names, delay=0.002, settings=S):
        self.nodes = {n: Detector(n, settings) for n in names}
        for d in self.nodes.values():
            d.watch({"job": names}, 0.0)
            d.know(names)
        self.delay = delay
        self.frozen: dict[str, tuple[float, float]] = {}  # node -> (from, until)
        self.cut: set[str] = set()
        self.queue: list[tuple[float, int, str, Send, str]] = []
        self.order = itertools.count()
        self.lost: list[tuple[float, str, str]] = []  # (when, by, node)
        # pairs of nodes that do not know each other yet (their registries lag) until a time:
        # neither takes the other's datagrams
        self.strangers: dict[frozenset[str], float] = {}
        self.settings = settings

    def asleep(self, node, t):
        span = self.frozen.get(node)
        return span is not None and span[0] <= t < span[1]

    def run(self, until: float, jitter=lambda: 0.0):
        s = self.settings
        ticks = {n: 0.0 for n in self.nodes}
        t = 0.0
        while t < until:
            nxt = min(ticks.values())
            if self.queue and self.queue[0][0] <= nxt:
                at, _, sender, msg, _ = heapq.heappop(self.queue)
                if self.asleep(msg.to, at):
                    heapq.heappush(
                        self.queue, (self.frozen[msg.to][1], next(self.order), sender, msg, "")
                    )
                    continue
                t = at
                self.emit(
                    msg.to,
                    self.nodes[msg.to].receive(sender, msg.kind, msg.nonce, msg.target, t),
                    t,
                )
                continue
            node = min(ticks, key=ticks.get)
            t = ticks[node]
            if self.asleep(node, t):
                ticks[node] = self.frozen[node][1]
                continue
            self.emit(node, self.nodes[node].tick(t), t)
            ticks[node] = t + s.tick + jitter()

    def emit(self, node, out, t):
        for o in out:
            if isinstance(o, Lost):
                self.lost.append((t, node, o.node))
            elif t < self.strangers.get(frozenset((node, o.to)), 0.0):
                continue
            elif node not in self.cut and o.to not in self.cut:
                heapq.heappush(self.queue, (t + self.delay, next(self.order), node, o, ""))


def test_a_frozen_node_is_lost_to_both_neighbours_within_half_a_second():
    w = World(["n1", "n2", "n3", "n4", "n5"])
    w.frozen["n3"] = (1.0, math.inf)
    w.run(3.0)
    by = {by: t for t, by, node in w.lost if node == "n3"}
    assert set(by) == {"n2", "n4"}
    assert all(t - 1.0 <= S.lost_after + S.interval + S.tick for t in by.values()), by
    assert {node for _, _, node in w.lost} == {"n3"}


def test_a_cut_off_node_is_lost_and_it_declares_nobody():
    w = World(["n1", "n2", "n3"])
    w.run(0.5)
    w.cut.add("n2")
    w.run(3.0)
    assert {(by, node) for _, by, node in w.lost} == {("n1", "n2"), ("n3", "n2")}


def test_two_nodes_that_meet_a_second_late_do_not_take_each_other_for_lost():
    w = World(["n1", "n2"])
    w.strangers[frozenset(("n1", "n2"))] = 1.0  # n1 refuses n2 until it knows it
    w.frozen["n1"] = (2.0, math.inf)  # and then a real loss is still found
    w.run(3.0)
    assert [(by, node) for _, by, node in w.lost] == [("n2", "n1")]
    assert 2.0 < w.lost[0][0] <= 2.0 + S.lost_after + S.interval + S.tick


def test_a_pause_of_150_ms_kills_nobody():
    w = World(["n1", "n2", "n3"])
    for k, node in enumerate(["n1", "n2", "n3", "n1", "n3"]):
        w.frozen[node] = (0.5 + k * 1.0, 0.65 + k * 1.0)
        w.run(1.5 + k * 1.0)
    assert w.lost == []


@settings(max_examples=60, deadline=None)
@given(
    pauses=st.lists(
        st.tuples(st.integers(0, 2), st.floats(0.2, 5.0), st.floats(0.0, 0.15)), max_size=8
    ),
    delay=st.floats(0.0005, 0.03),
    size=st.integers(2, 6),
)
def test_pauses_up_to_150_ms_and_slow_links_never_make_a_loss(pauses, delay, size):
    names = [f"n{i}" for i in range(size)]
    w = World(names, delay=delay)
    for index, start, length in pauses:
        node = names[index % size]
        if node not in w.frozen:
            w.frozen[node] = (start, start + length)
    w.run(6.0)
    assert w.lost == []


@settings(max_examples=40, deadline=None)
@given(
    victim=st.integers(0, 5),
    at=st.floats(0.3, 2.0),
    delay=st.floats(0.0005, 0.02),
    size=st.integers(3, 6),
)
def test_a_frozen_member_is_always_found_and_nobody_else(victim, at, delay, size):
    names = [f"n{i}" for i in range(size)]
    dead = names[victim % size]
    w = World(names, delay=delay)
    w.frozen[dead] = (at, math.inf)
    w.run(at + 2.0)
    assert {node for _, _, node in w.lost} == {dead}
    first = min(t for t, _, node in w.lost)
    assert first - at <= S.lost_after + S.interval + S.relay_timeout


def test_near_nodes_are_those_within_reach_on_each_ring():
    d = Detector("n05")
    d.watch({"job": [f"n{i:02d}" for i in range(12)]}, 0.0)
    assert d.near(2) == {"n03", "n04", "n06", "n07"}
    assert d.near(20) == {f"n{i:02d}" for i in range(12)} - {"n05"}
