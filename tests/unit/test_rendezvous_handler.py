"""The rendezvous executor on the in-memory store: event-driven waits, batched joins, and
recovery when the store loses the state."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elasticd.errors import RendezvousClosedError, RendezvousTimeoutError
from blocking_rendezvous import BlockingRendezvous
from elasticd.rendezvous import NextRound, RendezvousSettings
from elasticd.rendezvous.handler import Keys
from elasticd.rendezvous.state import decode
from elasticd.store.memory import MemoryStore
from elasticd.store.signing import Signer

PREFIX = "elasticd/test/rdzv/job"
SIGNER = Signer(b"k" * 32, "c")


@pytest.fixture
def store():
    store = MemoryStore()
    yield store
    store.close()


@pytest.fixture
def handlers(store):
    made: list[BlockingRendezvous] = []

    def make(nodes, settings):
        made.extend(BlockingRendezvous(store, SIGNER, settings, n, f"{n}.addr", prefix=PREFIX) for n in nodes)
        return made[-len(nodes):]

    yield make
    for handler in made:
        handler.shutdown()
    for handler in made:
        handler.shutdown(wait=True)


def form(handlers, nproc=1):
    with ThreadPoolExecutor(len(handlers)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(h.next_rendezvous, nproc, 1) for h in handlers]]


def test_a_waiting_joiner_wakes_on_the_next_revision_not_on_a_timer(store, handlers):
    settings = RendezvousSettings("job", 2, 2, keep_alive_interval=5.0, last_call_timeout=5.0)
    first, second = handlers(["a", "b"], settings)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(first.next_rendezvous, 1, 1)
        assert store.wait_for(Keys(PREFIX).joins(0), 5.0)  # "a" is in and waiting
        second.next_rendezvous(1, 1)
        arrived = time.monotonic()
        waiting.result(timeout=10)
        assert time.monotonic() - arrived < 1.0  # far below the 5 s duty period


def test_simultaneous_joiners_are_folded_in_by_one_state_write(store, handlers):
    settings = RendezvousSettings("job", 32, 32, keep_alive_interval=5.0)
    infos = form(handlers([f"n{i:02d}" for i in range(32)], settings))
    assert sorted(i.group_rank for i in infos) == list(range(32))
    assert store.keys(f"{PREFIX}/rev/") == [f"{PREFIX}/rev/1"]  # one write formed the round


def test_a_vanished_state_is_restored_by_a_member_and_everyone_converges(store, handlers):
    settings = RendezvousSettings("job", 3, 3, max_restarts=2, keep_alive_interval=0.1)
    nodes = handlers(["a", "b", "c"], settings)
    infos = form(nodes)
    watching = nodes[0].watch(0)
    state_key = Keys(PREFIX).state
    for key in store.keys(PREFIX):  # the store host restarted: everything is gone
        store.delete(key)
    assert store.wait_for(state_key, 10.0)  # a keeper wrote its copy back
    restored = decode(SIGNER.open(state_key, store.get(state_key)).body)
    assert (restored.round, restored.complete, restored.order) == (0, True, ("a", "b", "c"))
    assert not watching.done()  # nothing happened to the round
    assert [h.num_nodes_waiting() for h in nodes] == [0, 0, 0]
    assert nodes[1].request_next_round(0, "failure") is NextRound.OPENED
    again = form(nodes)
    assert (again[0].round, again[0].restart_count, again[0].members) == (1, 1, infos[0].members)
    assert watching.result(timeout=5).kind == "next_round"


def test_a_handler_that_never_saw_the_state_does_not_invent_one(store, handlers):
    (outsider,) = handlers(["z"], RendezvousSettings("job", 1, 1))
    assert outsider.num_nodes_waiting() == 0 and not outsider.is_closed()
    assert store.get(Keys(PREFIX).state) is None


def test_shutdown_ends_a_pending_join_and_cancels_watches(store, handlers):
    settings = RendezvousSettings("job", 2, 2, keep_alive_interval=0.1)
    a, b = handlers(["a", "b"], settings)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(a.next_rendezvous, 1, 1)
        assert store.wait_for(Keys(PREFIX).joins(0), 5.0)
        watching = a.watch(0)
        a.shutdown(wait=True)
        with pytest.raises(RendezvousClosedError, match="shut down"):
            joining.result(timeout=5)
    assert watching.cancelled() and a.watch(0).cancelled()


def test_unknown_reasons_are_refused(store, handlers):
    (a,) = handlers(["a"], RendezvousSettings("job", 1, 1))
    with pytest.raises(ValueError, match="is not a valid Reason"):
        a.request_next_round(0, "because")


def test_a_wait_listed_node_times_out_and_leaves_the_wait_list(store, handlers):
    a, b = handlers(["a", "b"], RendezvousSettings("job", 1, 1, join_timeout=0.3, keep_alive_interval=0.1))
    a.next_rendezvous(1, 1)
    with pytest.raises(RendezvousTimeoutError, match="wait list of round 0 .1 members, max_nodes is 1"):
        b.next_rendezvous(1, 1)
    state = decode(SIGNER.open(Keys(PREFIX).state, store.get(Keys(PREFIX).state)).body)
    assert state.complete and not state.wait_list
