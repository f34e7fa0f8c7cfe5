"""The rendezvous on a real TCPStore with participants as threads (one client per thread)."""

from __future__ import annotations

import time
from concurrent.futures import wait as wait_futures

import pytest
from rendezvous_support import INTERVAL, join, results, settings

from elasticd.errors import RendezvousClosedError, RendezvousGone, RendezvousTimeoutError
from elasticd.rendezvous import NextRound, RoundEvent
from elasticd.rendezvous.keys import Keys
from elasticd.rendezvous.state import decode

DEAD_AFTER = 3 * INTERVAL


def form(pool, handlers, nproc=1):
    infos = results(join(pool, handlers, nproc))
    assert len({(i.round, i.members) for i in infos}) == 1, "every member reads the same round"
    return infos


def test_formation_with_min_equal_max(make_handler, pool):
    config = settings(4, 4, last_call_timeout=30.0)
    handlers = [make_handler(n, config) for n in ("d", "b", "a", "c")]
    infos = form(pool, handlers, nproc=2)
    by_node = {h.node: i for h, i in zip(handlers, infos)}
    assert [by_node[n].group_rank for n in "abcd"] == [0, 1, 2, 3]  # new nodes: by name
    assert [by_node[n].rank_base for n in "abcd"] == [0, 2, 4, 6]
    info = by_node["c"]
    assert (info.round, info.reason, info.world_size, info.group_world_size, info.nproc) == (
        0,
        "initial",
        8,
        4,
        2,
    )
    assert (info.master_addr, info.master_port) == ("a.addr", 29402)  # what "a" declared


def test_heterogeneous_nproc(make_handler, pool):
    config = settings(3, 3)
    handlers = [make_handler(n, config) for n in ("a", "b", "c")]
    futures = [pool.submit(h.next_rendezvous, nproc, 1) for h, nproc in zip(handlers, (4, 1, 8))]
    infos = results(futures)
    assert [(i.nproc, i.rank_base, i.world_size) for i in infos] == [
        (4, 0, 13),
        (1, 4, 13),
        (8, 5, 13),
    ]


def test_min_less_than_max_completes_after_last_call(make_handler, pool):
    config = settings(2, 4, last_call_timeout=0.5)
    started = time.monotonic()
    infos = form(pool, [make_handler(n, config) for n in ("a", "b")])
    assert time.monotonic() - started >= 0.45
    assert [m.node for m in infos[0].members] == ["a", "b"]


def test_max_nodes_complete_at_once(make_handler, pool):
    config = settings(2, 3, last_call_timeout=30.0)
    started = time.monotonic()
    form(pool, [make_handler(n, config) for n in ("a", "b", "c")])
    assert time.monotonic() - started < 10.0  # far less than the 30 s last call


def test_late_joiner_waits_and_is_admitted_after_scale_up(make_handler, pool):
    config = settings(2, 4, last_call_timeout=0.3)
    a, b, c = (make_handler(n, config) for n in ("m", "n", "a"))
    infos = form(pool, [a, b])
    watching = a.watch(infos[0].round)
    late = pool.submit(c.next_rendezvous, 1, 1)
    assert watching.result(timeout=10) == RoundEvent("waiting", waiting=1)
    assert b.num_nodes_waiting() == 1 and not late.done()
    outcomes = [pool.submit(h.request_next_round, 0, "scale_up") for h in (a, b)]
    assert sorted(f.result(timeout=10).value for f in outcomes) == ["already", "opened"]
    again = results(join(pool, [a, b]) + [late])
    assert {i.round for i in again} == {1} and again[0].reason == "scale_up"
    assert [m.node for m in again[0].members] == ["m", "n", "a"]  # survivors keep their ranks


def test_restart_of_an_unchanged_group_does_not_wait_for_last_call(make_handler, pool):
    config = settings(2, 4, last_call_timeout=0.3, max_restarts=3)
    handlers = [make_handler(n, config) for n in ("a", "b", "c")]
    form(pool, handlers)
    slow_last_call = settings(2, 4, last_call_timeout=60.0, max_restarts=3)
    handlers = [make_handler(n, slow_last_call) for n in ("a", "b", "c")]
    assert handlers[0].request_next_round(0, "failure") is NextRound.OPENED
    started = time.monotonic()
    infos = form(pool, handlers)
    assert time.monotonic() - started < 10.0 and infos[0].round == 1 and infos[0].restart_count == 1


def test_a_member_that_stops_heartbeating_is_removed_and_watchers_hear_node_lost(
    make_handler, pool
):
    config = settings(2, 3)
    a, b, c = (make_handler(n, config) for n in ("a", "b", "c"))
    form(pool, [a, b, c])
    watches = [a.watch(0), b.watch(0)]
    silenced = time.monotonic()
    c.shutdown(wait=True)
    events = [w.result(timeout=10) for w in watches]
    detected = time.monotonic() - silenced
    assert (
        events == [RoundEvent("next_round", reason="node_lost", nodes=("a", "b"))] * 2
    )  # who is kept
    assert detected < DEAD_AFTER + 3 * INTERVAL + 1.0
    infos = form(pool, [a, b])
    assert (infos[0].round, [m.node for m in infos[0].members]) == (1, ["a", "b"])


def test_a_node_dying_mid_rendezvous_is_dropped_and_the_round_completes_with_the_rest(
    make_handler, pool, store, prefix
):
    config = settings(
        2, 4, last_call_timeout=2.0
    )  # the victim is dropped long before last call ends
    victim, a, b = (make_handler(n, config) for n in ("victim", "a", "b"))
    joining = pool.submit(victim.next_rendezvous, 1, 1)
    assert store.wait_for(Keys(prefix).joins(0), 10.0)  # the victim's join record is logged
    victim.shutdown(wait=True)  # its keeper stops: no more heartbeats
    with pytest.raises(RendezvousClosedError):
        joining.result(timeout=10)
    infos = form(pool, [a, b])
    assert [m.node for m in infos[0].members] == ["a", "b"]


def test_close(make_handler, pool):
    config = settings(2, 2)
    a, b = (make_handler(n, config) for n in ("a", "b"))
    form(pool, [a, b])
    watching = b.watch(0)
    a.set_closed()
    assert watching.result(timeout=10) == RoundEvent("closed")
    assert a.is_closed() and b.is_closed()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous(1, 1)
    assert a.request_next_round(0, "failure") is NextRound.CLOSED
    late = make_handler("late", config)
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous(1, 1)


def test_join_timeout(make_handler, pool):
    lonely = make_handler("lonely", settings(3, 3, join_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"1 node\(s\) joined round 0, min_nodes is 3"):
        lonely.next_rendezvous(1, 1)
    assert 0.5 <= time.monotonic() - started < 5.0
    # it left the round on its way out: two others do not count it
    config = settings(2, 3, last_call_timeout=0.3)
    infos = form(pool, [make_handler(n, config) for n in ("a", "b")])
    assert [m.node for m in infos[0].members] == ["a", "b"]


def test_two_run_ids_in_one_store_do_not_interfere(make_handler, pool, prefix):
    job1 = [make_handler(n, settings(2, 2), prefix=f"{prefix}/job1") for n in ("a", "b")]
    job2 = [make_handler(n, settings(3, 3), prefix=f"{prefix}/job2") for n in ("a", "b", "c")]
    futures1, futures2 = join(pool, job1), join(pool, job2)
    infos1, infos2 = results(futures1), results(futures2)
    assert [m.node for m in infos1[0].members] == ["a", "b"]
    assert [m.node for m in infos2[0].members] == ["a", "b", "c"]
    watching = job2[0].watch(0)
    job1[0].set_closed()
    assert job1[1].watch(0).result(timeout=10).kind == "closed"
    assert not job2[0].is_closed() and not watching.done()


def test_a_tampered_state_is_refused_and_the_newest_one_seen_is_restored(
    make_handler, pool, store, prefix, signer
):
    refused: list[str] = []
    config = settings(2, 2, max_restarts=1)
    a, b = (
        make_handler(n, config, on_refused=lambda key, why: refused.append(why)) for n in ("a", "b")
    )
    form(pool, [a, b])
    watching = a.watch(0)
    key = Keys(prefix).state
    tampered = store.get(key).replace(b'"restarts_used":0', b'"restarts_used":9')
    store.set(key, tampered)
    assert b.request_next_round(0, "failure") is NextRound.OPENED  # the budget is the real one
    state = decode(signer.open(key, store.get(key)).body)
    assert (state.round, state.restarts_used) == (1, 1) and any("MAC" in why for why in refused)
    assert watching.result(timeout=10).kind == "next_round"  # the keeper was not fooled either
    store.set(key, b"\x80 not json")
    a.set_closed()
    assert decode(signer.open(key, store.get(key)).body).closed


def test_an_older_state_written_back_is_refused_and_the_newest_restored(
    make_handler, pool, store, prefix, signer
):
    refused: list[str] = []
    config = settings(2, 2, max_restarts=3)
    a, b = (
        make_handler(n, config, on_refused=lambda key, why: refused.append(why)) for n in ("a", "b")
    )
    form(pool, [a, b])
    key = Keys(prefix).state
    round_0 = store.get(key)
    assert b.request_next_round(0, "failure") is NextRound.OPENED
    form(pool, [a, b])
    store.set(key, round_0)  # a replay of round 0's complete state
    assert a.request_next_round(1, "failure") is NextRound.OPENED
    state = decode(signer.open(key, store.get(key)).body)
    assert (state.round, state.restarts_used) == (2, 2)
    assert any("older than version" in why for why in refused)


def test_a_node_that_never_saw_a_ran_jobs_state_does_not_start_it_again(
    make_handler, store, prefix
):
    late = make_handler("late", settings(1, 2), may_create=False)
    with pytest.raises(RendezvousGone):
        late.next_rendezvous(1, 1)
    store.set(Keys(prefix).state, b"forged")
    with pytest.raises(RendezvousGone):
        late.next_rendezvous(1, 1)


def test_a_tampered_join_record_is_refused_and_skipped(make_handler, pool, store, prefix):
    refused: list[str] = []
    keys = Keys(prefix)
    store.add(keys.joins(0), 1)
    store.set(
        keys.join(0, 1),
        b'{"v":2,"ver":0,"body":{"schema":1,"node":"evil","addr":"x","nproc":1,'
        b'"master_port":1},"mac":"00"}',
    )
    config = settings(2, 3, last_call_timeout=0.3)
    infos = form(
        pool,
        [
            make_handler(n, config, on_refused=lambda key, why: refused.append(why))
            for n in ("a", "b")
        ],
    )
    assert [m.node for m in infos[0].members] == ["a", "b"] and refused


@pytest.mark.parametrize("tamper", ["not a count", "empty", "bumped"])
def test_a_tampered_join_counter_freezes_nobody(make_handler, pool, store, prefix, tamper):
    """The counter is unsigned: one that is not a count (an empty one too: TCPStore's server
    drops the connection of an add over it), or that an attacker bumped past a gap nobody
    reads, costs the joiners an interval, not the round."""
    counter = Keys(prefix).joins(0)
    if tamper == "bumped":
        store.add(counter, 10**12)
    else:
        store.set(counter, b"garbage" if tamper == "not a count" else b"")
    started = time.monotonic()
    infos = form(pool, [make_handler(n, settings(3, 3)) for n in ("a", "b", "c")])
    assert [m.node for m in infos[0].members] == ["a", "b", "c"]
    assert time.monotonic() - started < 10 * INTERVAL


def test_a_clock_skewed_by_an_hour_changes_nothing(make_handler, pool):
    config = settings(2, 3, last_call_timeout=0.5)
    skewed_clock = lambda: time.monotonic() + 3600.0  # noqa: E731
    a = make_handler("a", config)
    b = make_handler("b", config, clock=skewed_clock)
    started = time.monotonic()
    infos = form(pool, [a, b])
    assert time.monotonic() - started >= 0.45  # last call still measured in seconds
    watches = [a.watch(0, waiting=False), b.watch(0, waiting=False)]
    done, _ = wait_futures(watches, timeout=5 * DEAD_AFTER)  # many heartbeat periods
    assert not done, "nobody was declared dead"
    assert [m.node for m in infos[0].members] == ["a", "b"]
    c = make_handler("c", config, clock=lambda: time.monotonic() - 7200.0)
    late = pool.submit(c.next_rendezvous, 1, 1)
    assert a.watch(0).result(timeout=10) == RoundEvent("waiting", waiting=1)
    assert b.request_next_round(0, "scale_up") is NextRound.OPENED
    again = results(join(pool, [a, b]) + [late])
    assert [m.node for m in again[0].members] == ["a", "b", "c"]


def test_job_wide_restart_budget(make_handler, pool):
    config = settings(2, 2, max_restarts=1)
    a, b = (make_handler(n, config) for n in ("a", "b"))
    form(pool, [a, b])
    requests = [pool.submit(h.request_next_round, 0, "failure") for h in (a, b)]
    assert sorted(f.result(timeout=10).value for f in requests) == ["already", "opened"]
    infos = form(pool, [a, b])
    assert (infos[0].round, infos[0].restart_count, infos[0].reason) == (1, 1, "failure")
    requests = [pool.submit(h.request_next_round, 1, "failure") for h in (a, b)]
    assert [f.result(timeout=10) for f in requests] == [NextRound.EXHAUSTED] * 2
    assert a.request_next_round(1, "scale_up") is NextRound.OPENED  # scaling needs no budget


def test_stable_ranks_across_rounds(make_handler, pool):
    config = settings(1, 4, last_call_timeout=0.3)
    m, n, a = (make_handler(x, config) for x in ("m", "n", "a"))
    assert [x.node for x in form(pool, [m, n])[0].members] == ["m", "n"]
    late = pool.submit(a.next_rendezvous, 1, 1)
    assert m.watch(0).result(timeout=10).kind == "waiting"
    m.request_next_round(0, "scale_up")
    infos = results(join(pool, [m, n]) + [late])
    assert [x.node for x in infos[0].members] == ["m", "n", "a"]  # "a" sorts first but is newest
    watching = n.watch(1)
    m.shutdown(wait=True)  # the rank-0 node dies
    assert watching.result(timeout=10).reason == "node_lost"
    infos = form(pool, [n, a])
    assert [(x.node, x.group_rank) for x in infos[0].members] == [("n", 0), ("a", 1)]
    assert infos[0].master_addr == "n.addr"


def test_leave_opens_the_next_round_without_the_leaver(make_handler, pool):
    config = settings(1, 3, last_call_timeout=0.3)
    a, b, c = (make_handler(n, config) for n in ("a", "b", "c"))
    form(pool, [a, b, c])
    watching = a.watch(0)
    b.leave("drain")
    assert watching.result(timeout=10) == RoundEvent("next_round", reason="drain", nodes=("a", "c"))
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous(1, 1)
    infos = form(pool, [a, c])
    assert [m.node for m in infos[0].members] == ["a", "c"] and infos[0].restart_count == 0


def test_exit_barrier(make_handler, pool):
    config = settings(3, 3)
    handlers = [make_handler(n, config) for n in ("a", "b", "c")]
    infos = form(pool, handlers)
    assert handlers[0].exit_barrier_progress(infos[0]) == (0, 3)
    handlers[0].exit_barrier_arrive(infos[0])
    handlers[0].exit_barrier_arrive(infos[0])  # idempotent
    assert handlers[1].exit_barrier_progress(infos[1]) == (1, 3)
    assert handlers[0].exit_barrier_wait(infos[0], 0.1) is False
    waiting = pool.submit(handlers[0].exit_barrier_wait, infos[0], 20.0)
    handlers[1].exit_barrier_arrive(infos[1])
    handlers[2].exit_barrier_arrive(infos[2])
    assert waiting.result(timeout=20) is True
    assert handlers[2].exit_barrier_progress(infos[2]) == (3, 3)
