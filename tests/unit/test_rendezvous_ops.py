"""Tables over the pure rendezvous decisions (elasticd.rendezvous.ops): no store, no clock."""

from __future__ import annotations

import pytest

from elasticd.rendezvous.ops import (
    Act,
    Beat,
    LastCall,
    View,
    claim,
    decide_close,
    decide_join,
    decide_leave,
    decide_liveness,
    decide_next_round,
    decide_restore,
    ends_joining,
    info_for,
    log_upper,
    log_window,
    num_waiting,
    observe_beats,
    rank_order,
    reads_log,
    round_event,
    track_last_call,
)
from elasticd.rendezvous.state import (
    Announcement,
    Member,
    Participant,
    Reason,
    RendezvousSettings,
    RendezvousState,
    RoundEvent,
)

NOW = 1000.0
SETTINGS = RendezvousSettings(
    "job",
    min_nodes=2,
    max_nodes=4,
    max_restarts=1,
    last_call_timeout=5.0,
    keep_alive_interval=1.0,
    keep_alive_max_attempt=3,
)


def p(name: str, nproc: int = 1) -> Participant:
    return Participant(f"{name}.host", nproc, 29500 + ord(name[-1]))


def nodes(*names: str) -> dict[str, Participant]:
    return {n: p(n) for n in names}


def st(*members: str, complete: bool = False, **fields) -> RendezvousState:
    """A state at version 7 whose participants are ``members`` (rank order when complete)."""
    order = fields.pop("order", members if complete else ())
    return RendezvousState(
        version=7, participants=nodes(*members), complete=complete, order=tuple(order), **fields
    )


def logged(*names: str) -> tuple[Announcement, ...]:
    return tuple(Announcement(n, p(n)) for n in names)


def view(*announced: str, **fields) -> View:
    return View(record=p("me"), announced=logged(*announced), **fields)


# -- joining ---------------------------------------------------------------------------------

JOIN_TABLE = [
    # (case, state, view, act, check on the written state)
    ("closed refuses", st("a", closed=True), view(), Act.CLOSED, None),
    ("member of a complete round is done", st("a", "me", complete=True), view(), Act.DONE, None),
    ("not yet in the open round: announce", st("a"), view(), Act.ANNOUNCE, None),
    ("announced alone, below min: wait", st(), view("me"), Act.WAIT, None),
    (
        "max reached by announcements: complete",
        st("a"),
        view("b", "me", "c"),
        Act.COMPLETE,
        lambda s: (
            s.complete and s.order == ("a", "b", "c", "me") and s.folded == 3 and not s.wait_list
        ),
    ),
    (
        "min reached, last call not over: wait",
        st("a"),
        view("me", last_call=LastCall(0, NOW - 1)),
        Act.WAIT,
        None,
    ),
    (
        "last call over: complete",
        st("a"),
        view("me", last_call=LastCall(0, NOW - 5)),
        Act.COMPLETE,
        lambda s: s.order == ("a", "me") and s.version == 8,
    ),
    (
        "a last call of another round does not count",
        st("a", round=3),
        view("me", last_call=LastCall(2, NOW - 60)),
        Act.WAIT,
        None,
    ),
    (
        "all expected back: complete at once without last call",
        st("b", round=1, expected=("a", "b", "me"), order=("me", "a", "b")),
        view("a", "me"),
        Act.COMPLETE,
        lambda s: s.order == ("me", "a", "b"),
    ),
    (
        "an expected node missing: wait for it or for last call",
        st("b", round=1, expected=("a", "b", "me"), order=("a", "b", "me")),
        view("me"),
        Act.WAIT,
        None,
    ),
    (
        "every node the schedule gave the job is in: complete at once, no last call",
        st("a"),
        view("me", last_call=LastCall(0, NOW), scheduled=frozenset({"a", "me"})),
        Act.COMPLETE,
        lambda s: s.order == ("a", "me"),
    ),
    (
        "a scheduled node missing: wait for it or for last call",
        st("a"),
        view("me", last_call=LastCall(0, NOW), scheduled=frozenset({"a", "b", "me"})),
        Act.WAIT,
        None,
    ),
    (
        "scheduled, but below min: wait",
        st(),
        view("me", scheduled=frozenset({"me"})),
        Act.WAIT,
        None,
    ),
    (
        "max reached but a survivor is still missing: wait",
        st("x", "y", round=1, expected=("a", "me", "x", "y"), order=("a", "me")),
        view("me", "z"),
        Act.WAIT,
        None,
    ),
    (
        "more than max: survivors first, spares to the wait list",
        st("z", "y", round=1, expected=("me", "z", "b"), order=("me", "b")),
        view("b", "me", "a"),
        Act.COMPLETE,
        lambda s: s.order == ("me", "b", "a", "y") and set(s.wait_list) == {"z"},
    ),
    (
        "complete round without us: go on the wait list",
        st("a", "b", complete=True),
        view(),
        Act.JOIN_WAIT_LIST,
        lambda s: s.wait_list == {"me": p("me")},
    ),
    (
        "already on the wait list: wait",
        st("a", "b", complete=True, wait_list=nodes("me")),
        view(),
        Act.WAIT,
        None,
    ),
    (
        "refused log records are skipped but consumed",
        st("a"),
        view("me", "b", "c", log_end=5),
        Act.COMPLETE,
        lambda s: s.folded == 5,
    ),
]


@pytest.mark.parametrize(
    ("case", "state", "seen", "act", "check"), JOIN_TABLE, ids=[row[0] for row in JOIN_TABLE]
)
def test_decide_join(case, state, seen, act, check):
    action = decide_join(state, "me", SETTINGS, seen, NOW)
    assert action.act is act
    if check is None:
        assert action.state is None
    else:
        assert check(action.state)


def test_join_wait_is_bounded_by_the_next_duty():
    assert (
        decide_join(st(), "me", SETTINGS, view("me"), NOW).until
        == NOW + SETTINGS.keep_alive_interval
    )
    last_call = view("me", "a", last_call=LastCall(0, NOW - 4.5))
    assert decide_join(st(), "me", SETTINGS, last_call, NOW).until == NOW + 0.5
    assert decide_join(st(), "me", SETTINGS, view("me", deadline=NOW + 0.1), NOW).until == NOW + 0.1


def test_an_own_entry_not_read_yet_is_waited_for_an_interval_then_written_again():
    """Its reading may lag its writing (numbers taken but not written yet before it); past an
    interval the entry lies beyond a gap nobody reads (a bumped counter): announce again."""
    pending = view(pending=NOW - 0.5)
    action = decide_join(st("a"), "me", SETTINGS, pending, NOW)
    assert action.act is Act.WAIT and action.until == NOW + 0.5
    assert decide_join(st("a"), "me", SETTINGS, view(pending=NOW - 1.0), NOW).act is Act.ANNOUNCE


def test_a_node_whose_entry_is_pending_is_involved_and_leaves_past_it():
    state = st("a", folded=3)
    assert decide_leave(state, "me", Reason.DRAIN, View(pending=NOW, log_end=7)).state.folded == 7


def test_join_timeout_leaves_the_open_round():
    action = decide_join(
        st("a", "me", expected=("me", "x")), "me", SETTINGS, view("b", deadline=NOW), NOW
    )
    assert action.act is Act.TIMED_OUT
    assert set(action.state.participants) == {"a", "b"} and action.state.expected == ("x",)


def test_join_timeout_leaves_the_wait_list():
    state = st("a", "b", complete=True, wait_list=nodes("me", "c"))
    action = decide_join(state, "me", SETTINGS, view(deadline=NOW), NOW)
    assert action.act is Act.TIMED_OUT and set(action.state.wait_list) == {"c"}


def test_join_timeout_without_having_joined_writes_nothing():
    action = decide_join(st("a"), "me", SETTINGS, view(deadline=NOW - 1), NOW)
    assert action == action.__class__(Act.TIMED_OUT)


LAST_CALL_TABLE = [
    ("below min: no window", st(), ("a",), None, None),
    ("min reached: window starts now", st("a"), ("b",), None, LastCall(0, NOW)),
    (
        "window kept within the round",
        st("a", "b"),
        ("c",),
        LastCall(0, NOW - 2),
        LastCall(0, NOW - 2),
    ),
    ("a new round restarts it", st("a", "b", round=1), (), LastCall(0, NOW - 2), LastCall(1, NOW)),
    ("drops below min: window closes", st("a"), (), LastCall(0, NOW - 2), None),
    ("complete: no window", st("a", "b", complete=True), (), LastCall(0, NOW - 2), None),
]


@pytest.mark.parametrize(
    ("case", "state", "announced", "before", "after"),
    LAST_CALL_TABLE,
    ids=[row[0] for row in LAST_CALL_TABLE],
)
def test_track_last_call(case, state, announced, before, after):
    assert (
        track_last_call(state, SETTINGS, view(*announced, last_call=before), NOW).last_call == after
    )


@pytest.mark.parametrize(
    ("order", "joined", "ranked"),
    [
        ((), {"b", "a", "c"}, ["a", "b", "c"]),
        (("c", "a"), {"a", "b", "c", "d"}, ["c", "a", "b", "d"]),
        (("c", "a", "x"), {"a", "x2"}, ["a", "x2"]),
    ],
)
def test_rank_order_keeps_survivors_first_then_new_nodes_by_name(order, joined, ranked):
    assert rank_order(order, joined) == ranked


# -- reading the join log (docs/store.md): O(new entries) a read ----------------------------------

LOG_WINDOW_TABLE = [
    # (case, read, low, upper, batch, numbers)
    ("nothing new", {1, 2, 3}, 4, 3, 128, []),
    ("new ones up to the counter", {1, 2}, 3, 6, 128, [3, 4, 5, 6]),
    ("a taken number not written yet is read again", {1, 3, 4}, 2, 5, 128, [2, 5]),
    ("a batch at most", set(), 1, 10**12, 3, [1, 2, 3]),
    ("numbers read are skipped, not counted", {2, 3}, 1, 10**12, 3, [1, 4, 5]),
]


@pytest.mark.parametrize(
    ("case", "read", "low", "upper", "batch", "numbers"),
    LOG_WINDOW_TABLE,
    ids=[row[0] for row in LOG_WINDOW_TABLE],
)
def test_log_window(case, read, low, upper, batch, numbers):
    assert log_window(read, low, upper, batch) == numbers


def test_log_upper_follows_the_counter_or_looks_one_batch_past_the_last_record():
    assert log_upper(7, 3) == 7
    assert log_upper(None, 3, batch=128) == 131  # a counter that is not a count


def test_claim_takes_a_missing_number_spread_by_name_or_the_next_one():
    missing = list(range(10, 20))
    picks = {claim(missing, 0, f"n{i}") for i in range(50)}
    assert picks <= set(missing) and len(picks) > 5
    assert claim(missing, 0, "a") == claim(missing, 0, "a")  # the same everywhere
    assert claim([], 41, "a") == 42


READS_LOG_TABLE = [
    # (case, own, count, since, read)
    ("the newest entry is this node's", 9, 9, NOW, True),
    ("others joined since: their newest reads", 9, 12, NOW, False),
    ("no entry, the counter moving", 0, 12, NOW - 2.9, False),
    ("the counter stood still for dead_after: the newest may be dead", 0, 12, NOW - 3.0, True),
    ("a counter that is not a count", 3, None, NOW, True),
    ("an empty log", 0, 0, NOW, False),
]


@pytest.mark.parametrize(
    ("case", "own", "count", "since", "read"),
    READS_LOG_TABLE,
    ids=[row[0] for row in READS_LOG_TABLE],
)
def test_reads_log(case, own, count, since, read):
    assert reads_log(own, count, since, NOW, SETTINGS) is read


def test_ends_joining():
    open_ = st("a")
    assert ends_joining(open_, open_.next(complete=True)) and ends_joining(
        open_, open_.next(closed=True)
    )
    assert not ends_joining(open_, open_.next(participants={}))  # a removal: joining goes on
    done = st("a", complete=True)
    assert not ends_joining(done, done.next(closed=True)) and not ends_joining(
        done, done.next(round=1, complete=False)
    )


# -- liveness --------------------------------------------------------------------------------


def test_observe_beats_records_when_a_counter_changed():
    beats = {"a": Beat(5, 10.0), "b": Beat(3, 10.0), "gone": Beat(1, 1.0)}
    assert observe_beats(beats, {"a": 5, "b": 4, "new": None}, 20.0) == {
        "a": Beat(5, 10.0, reads=1),
        "b": Beat(4, 20.0),
        "new": Beat(None, 20.0),
    }


def test_a_stalled_store_does_not_kill_anyone():
    """One read after a long stall finds every counter unchanged: not enough to call it dead."""
    settings = RendezvousSettings("r", 1, 3)
    stalled = {"a": Beat(1, NOW - 10, reads=1)}
    state = st("a", "me", complete=True)
    assert decide_liveness(state, "me", settings, View(beats=stalled), NOW).act is Act.NOTHING


def beats(**since: float) -> dict[str, Beat]:
    return {n: Beat(1, t, reads=3) for n, t in since.items()}


LIVENESS_TABLE = [
    ("all fresh", st("a", "me", complete=True), beats(a=NOW - 2.9), Act.NOTHING, None),
    (
        "a member went silent: open the next round",
        st("a", "b", "me", complete=True, wait_list=nodes("w")),
        beats(a=NOW - 3, b=NOW, w=NOW),
        Act.OPEN_ROUND,
        lambda s: (
            s.round == 1
            and s.reason == "node_lost"
            and s.expected == ("b", "me", "w")
            and s.restarts_used == 0
        ),
    ),
    (
        "a silent wait-listed node is just removed",
        st("a", "me", complete=True, wait_list=nodes("w")),
        beats(a=NOW, w=NOW - 9),
        Act.REMOVE,
        lambda s: s.round == 0 and s.complete and not s.wait_list,
    ),
    (
        "a silent joiner is dropped before completion, its log record consumed",
        st("a", "me", expected=("a", "me", "x")),
        beats(a=NOW - 3, x=NOW - 3, j=NOW - 3),
        Act.REMOVE,
        lambda s: set(s.participants) == {"me"} and s.expected == ("me",) and s.folded == 1,
    ),
    (
        "a node never observed yet is not judged",
        st("a", "me", complete=True),
        {},
        Act.NOTHING,
        None,
    ),
    (
        "not our business when we are not in it",
        st("a", "b", complete=True),
        beats(a=0.0),
        Act.NOTHING,
        None,
    ),
    ("closed", st("a", "me", complete=True, closed=True), beats(a=0.0), Act.NOTHING, None),
]


@pytest.mark.parametrize(
    ("case", "state", "seen", "act", "check"),
    LIVENESS_TABLE,
    ids=[row[0] for row in LIVENESS_TABLE],
)
def test_decide_liveness(case, state, seen, act, check):
    announced = logged("j") if not state.complete else ()
    action = decide_liveness(state, "me", SETTINGS, View(announced=announced, beats=seen), NOW)
    assert action.act is act
    assert (action.state is None) if check is None else check(action.state)


def test_liveness_uses_only_differences_of_the_observers_clock():
    state = st("a", "me", complete=True)
    for offset in (0.0, 3600.0, -1e6):
        seen = View(beats=beats(a=NOW + offset - 2.0))
        assert decide_liveness(state, "me", SETTINGS, seen, NOW + offset).act is Act.NOTHING
        seen = View(beats=beats(a=NOW + offset - 3.0))
        assert decide_liveness(state, "me", SETTINGS, seen, NOW + offset).act is Act.OPEN_ROUND


# -- rounds, leaving, closing, restoring -----------------------------------------------------

NEXT_ROUND_TABLE = [
    (
        "scale up",
        st("a", complete=True, round=2),
        2,
        "scale_up",
        Act.OPEN_ROUND,
        lambda s: s.round == 3 and s.reason == "scale_up" and s.restarts_used == 0,
    ),
    (
        "failure uses the budget",
        st("a", complete=True, round=2),
        2,
        "failure",
        Act.OPEN_ROUND,
        lambda s: s.restarts_used == 1 and s.reason == "failure",
    ),
    (
        "budget used up",
        st("a", complete=True, round=2, restarts_used=1),
        2,
        "failure",
        Act.EXHAUSTED,
        None,
    ),
    (
        "a stalled in-place round uses the budget too",
        st("a", complete=True, round=2),
        2,
        "stalled",
        Act.OPEN_ROUND,
        lambda s: s.restarts_used == 1 and s.reason == "stalled",
    ),
    (
        "no budget, no stalled round",
        st("a", complete=True, round=2, restarts_used=1),
        2,
        "stalled",
        Act.EXHAUSTED,
        None,
    ),
    (
        "used-up budget does not stop scale up",
        st("a", complete=True, restarts_used=1),
        0,
        "scale_up",
        Act.OPEN_ROUND,
        None,
    ),
    ("someone else was first", st(round=3), 2, "failure", Act.ALREADY, None),
    ("the round is still forming", st("a", round=2), 2, "failure", Act.ALREADY, None),
    ("closed", st("a", complete=True, closed=True), 0, "failure", Act.CLOSED, None),
]


@pytest.mark.parametrize(
    ("case", "state", "round", "reason", "act", "check"),
    NEXT_ROUND_TABLE,
    ids=[row[0] for row in NEXT_ROUND_TABLE],
)
def test_decide_next_round(case, state, round, reason, act, check):
    action = decide_next_round(state, round, Reason(reason), SETTINGS)
    assert action.act is act
    if check is not None:
        assert check(action.state)


def test_next_round_expects_members_and_wait_list_and_keeps_order():
    state = st("b", "a", complete=True, wait_list=nodes("w"))
    new = decide_next_round(state, 0, Reason.SCALE_UP, SETTINGS).state
    assert new.expected == ("a", "b", "w") and new.order == ("b", "a")
    assert not new.participants and not new.wait_list and not new.complete and new.folded == 0


def test_next_round_for_lost_nodes_does_not_wait_for_them():
    state = st("b", "a", "dead", complete=True)
    new = decide_next_round(state, 0, Reason.NODE_LOST, SETTINGS, lost=["dead"]).state
    assert new.expected == ("a", "b") and new.restarts_used == 0
    survivors_in = View(record=p("a"), announced=logged("a", "b"))
    assert (
        decide_join(new, "a", SETTINGS, survivors_in, now=0.0).act is Act.COMPLETE
    )  # no last call


LEAVE_TABLE = [
    (
        "member of a complete round: next round without us",
        st("a", "me", complete=True),
        (),
        Act.OPEN_ROUND,
        lambda s: s.reason == "drain" and s.expected == ("a",),
    ),
    (
        "joiner of an open round",
        st("a", "me", expected=("me",)),
        ("b",),
        Act.REMOVE,
        lambda s: set(s.participants) == {"a", "b"} and s.expected == (),
    ),
    (
        "only announced",
        st("a"),
        ("me",),
        Act.REMOVE,
        lambda s: set(s.participants) == {"a"} and s.folded == 1,
    ),
    (
        "on the wait list",
        st("a", complete=True, wait_list=nodes("me")),
        (),
        Act.REMOVE,
        lambda s: not s.wait_list,
    ),
    ("not in it", st("a", complete=True), (), Act.NOTHING, None),
    ("closed", st("a", "me", complete=True, closed=True), (), Act.NOTHING, None),
]


@pytest.mark.parametrize(
    ("case", "state", "announced", "act", "check"), LEAVE_TABLE, ids=[row[0] for row in LEAVE_TABLE]
)
def test_decide_leave(case, state, announced, act, check):
    action = decide_leave(state, "me", Reason.DRAIN, View(announced=logged(*announced)))
    assert action.act is act
    assert (action.state is None) if check is None else check(action.state)


def test_decide_close():
    assert decide_close(st("a")).state == st("a").next(closed=True)
    assert decide_close(st("a", closed=True)).act is Act.NOTHING


@pytest.mark.parametrize(
    ("copy", "act", "folded"),
    [
        (RendezvousState(), Act.NOTHING, None),
        (st("a", complete=True), Act.NOTHING, None),  # we are not in it
        (st("a", "me", complete=True, folded=4), Act.RESTORE, 4),
        (st("a", "me", folded=4), Act.RESTORE, 0),  # the join log went with the store
    ],
)
def test_decide_restore(copy, act, folded):
    action = decide_restore(copy, "me")
    assert action.act is act
    if act is Act.RESTORE:
        assert action.state == copy.next(folded=folded)


# -- reports ---------------------------------------------------------------------------------

WAITING = st("a", "b", complete=True, wait_list=nodes("w"))
FULL = st("a", "b", "c", "d", complete=True, wait_list=nodes("w"))


@pytest.mark.parametrize(
    ("state", "round", "waiting", "event"),
    [
        (st("a", complete=True), 0, True, None),
        (st(round=1, reason="failure"), 0, True, RoundEvent("next_round", reason="failure")),
        # the nodes the next round expects (forming) or holds (complete); a later one: unknown
        (
            st(round=1, reason="node_lost", expected=("b", "a")),
            0,
            True,
            RoundEvent("next_round", reason="node_lost", nodes=("a", "b")),
        ),
        (
            st("a", "c", round=1, reason="node_lost", complete=True),
            0,
            True,
            RoundEvent("next_round", reason="node_lost", nodes=("a", "c")),
        ),
        (
            st("a", "c", round=2, reason="node_lost", complete=True),
            0,
            True,
            RoundEvent("next_round", reason="node_lost"),
        ),
        (WAITING, 0, True, RoundEvent("waiting", waiting=1)),
        (WAITING, 0, False, None),
        (FULL, 0, True, None),  # spares beyond max do not count as waiting
        (st("a", complete=True, closed=True), 0, True, RoundEvent("closed")),
    ],
)
def test_round_event(state, round, waiting, event):
    assert round_event(state, round, SETTINGS, waiting=waiting) == event


def test_num_waiting():
    assert num_waiting(WAITING, SETTINGS) == 1
    assert num_waiting(FULL, SETTINGS) == 0
    assert num_waiting(st("a"), SETTINGS) == 0


def test_info_for_heterogeneous_nodes():
    state = RendezvousState(
        version=9,
        round=2,
        complete=True,
        reason="scale_up",
        restarts_used=1,
        order=("b", "a", "c"),
        participants={
            "a": Participant("10.0.0.1", 4, 1),
            "b": Participant("10.0.0.2", 2, 29400),
            "c": Participant("10.0.0.3", 8, 3),
        },
    )
    info = info_for(state, "c", "job")
    assert (
        info.group_rank,
        info.rank_base,
        info.nproc,
        info.world_size,
        info.group_world_size,
    ) == (2, 6, 8, 14, 3)
    assert (info.master_addr, info.master_port, info.restart_count, info.reason) == (
        "10.0.0.2",
        29400,
        1,
        "scale_up",
    )
    assert info.members == (
        Member("b", "10.0.0.2", 2, 0, 0),
        Member("a", "10.0.0.1", 4, 1, 2),
        Member("c", "10.0.0.3", 8, 2, 6),
    )
    assert info.round == 2 and info.run_id == "job"


def test_info_for_a_member_with_no_workers_ranks_last_and_is_never_the_master():
    """In place, a node whose workers are warming up stays a member with none (docs/in-place.md)."""
    state = RendezvousState(
        version=9,
        round=3,
        complete=True,
        reason="failure",
        restarts_used=1,
        order=("b", "a", "c"),
        participants={
            "a": Participant("10.0.0.1", 1, 1),
            "b": Participant("10.0.0.2", 0, 29400),
            "c": Participant("10.0.0.3", 1, 3),
        },
    )
    a, b = info_for(state, "a", "job"), info_for(state, "b", "job")
    assert (a.master_addr, a.master_port, a.group_rank, a.rank_base) == ("10.0.0.1", 1, 0, 0)
    assert (a.world_size, a.group_world_size) == (2, 2), (
        "WORLD_SIZE and GROUP_WORLD_SIZE count who trains"
    )
    assert [m.node for m in a.members] == ["a", "c", "b"] and len(a.members) == 3
    assert (b.group_rank, b.nproc, b.members) == (2, 0, a.members)


# -- the heartbeat ring (docs/store.md): O(1) reads per node, every node read by two ------------------


def test_ring_watch_reads_two_neighbours_and_covers_everyone():
    from elasticd.rendezvous.ops import ring_watch

    nodes = {f"n{i:02d}" for i in range(10)}
    assert ring_watch(nodes, "n05") == {"n04", "n03"}
    assert ring_watch(nodes, "n00") == {"n09", "n08"}  # around the ring
    readers = [w for n in nodes for w in ring_watch(nodes, n)]
    assert all(readers.count(n) == 2 for n in nodes)  # each node read by exactly two others
    assert ring_watch({"a", "b"}, "a") == {"b"} and ring_watch(set(), "a") == set()
    assert ring_watch({"a", "b", "c"}, "z") == {"c", "b"}  # a node not (yet) in the set


def test_a_dead_node_whose_watchers_died_too_is_dropped_once_the_ring_closes():
    from elasticd.rendezvous.ops import ring_watch

    nodes = {"a", "b", "c", "d", "e"}
    dead = {"b", "c", "d"}  # d's watchers (b, c) died with it
    seen = set()
    while True:
        found = {w for n in nodes - dead for w in ring_watch(nodes, n) if w in dead}
        if not found:
            break
        seen |= found
        nodes -= found
    assert seen == dead
