"""The StoreBackend contract (elasticd.store.base), run against every backend."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.errors import NotACounter, StoreConnectionError
from elasticd.store.base import StoreBackend


def test_is_a_store_backend(store):
    assert isinstance(store, StoreBackend)


def test_get_of_a_missing_key_returns_none_at_once(store, key):
    started = time.monotonic()
    assert store.get(key) is None
    assert time.monotonic() - started < 1.0


def test_set_then_get(store, key):
    store.set(key, b"v1")
    store.set(key, b"v2")
    assert store.get(key) == b"v2"


def test_values_are_bytes_and_binary_safe(store, key):
    value = bytes(range(1, 256)) + b"\n{}"
    store.set(key, value)
    assert store.get(key) == value


def test_compare_set_on_missing_key_with_none_creates_it(store, key):
    assert store.compare_set(key, None, b"first") == (True, b"first")
    assert store.get(key) == b"first"


def test_compare_set_with_none_on_existing_key_returns_current(store, key):
    store.set(key, b"there")
    assert store.compare_set(key, None, b"other") == (False, b"there")
    assert store.get(key) == b"there"


def test_compare_set_swaps_on_match(store, key):
    store.set(key, b"old")
    assert store.compare_set(key, b"old", b"new") == (True, b"new")
    assert store.get(key) == b"new"


def test_compare_set_refuses_on_mismatch_and_returns_current(store, key):
    store.set(key, b"current")
    assert store.compare_set(key, b"stale", b"new") == (False, b"current")
    assert store.get(key) == b"current"


def test_compare_set_on_missing_key_with_expected_value_does_not_create(store, key):
    assert store.compare_set(key, b"expected", b"new") == (False, None)
    assert store.get(key) is None


def test_compare_set_to_the_same_value_reports_the_current_value(store, key):
    assert store.compare_set(key, b"same", b"same") == (False, None)
    store.set(key, b"same")
    assert store.compare_set(key, b"same", b"same") == (True, b"same")


def test_compare_set_refuses_an_empty_expected_value(store, key):
    with pytest.raises(ValueError):
        store.compare_set(key, b"", b"x")


def test_compare_set_has_one_winner_among_threads(store, key):
    results: list[bool] = []
    start = threading.Barrier(8)

    def contend(i: int) -> None:
        start.wait()
        results.append(store.compare_set(key, None, f"writer-{i}".encode())[0])

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results.count(True) == 1


def test_add_creates_counters_at_zero_and_counts(store, key):
    assert store.add(key, 0) == 0
    assert store.add(key, 1) == 1
    assert store.add(key, 5) == 6
    assert store.add(key, -2) == 4
    assert store.get(key) == b"4"


def test_add_is_atomic_across_threads(store, key):
    def bump() -> None:
        for _ in range(50):
            store.add(key, 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert store.add(key, 0) == 200


@pytest.mark.parametrize(
    "junk",
    [b"junk", b"9" * 5000, b"[" * 10000 + b"]" * 10000],
    ids=["word", "5000-digits", "20k-brackets"],  # the id names the test's key (conftest)
)
def test_an_add_over_a_value_that_is_no_count_raises_not_a_counter_and_writes_nothing(
    store, key, junk
):
    """Anyone who reaches the store may write junk to a counter: the add says so with what is
    there (for a compare-and-set that repairs it), the client goes on, and the junk can be
    replaced by a count that the next add counts on from."""
    store.set(key, junk)
    with pytest.raises(NotACounter) as raised:
        store.add(key, 1)
    assert raised.value.value == junk and raised.value.key == key
    assert store.get(key) == junk
    assert store.compare_set(key, junk, b"41") == (True, b"41")
    assert store.add(key, 1) == 42


def test_an_empty_counter_is_repaired_by_a_compare_set_against_none(store, key):
    """An empty value is no count to TCPStore (NotACounter), and etcd reads it as 0; either
    way a compare-and-set against None ("missing": TCPStore cannot tell it from empty)
    gives the repair, or the add counts from 0."""
    store.set(key, b"")
    try:
        assert store.add(key, 1) == 1
    except NotACounter as junk:
        assert junk.value == b""
        assert store.compare_set(key, None, b"41") == (True, b"41")
        assert store.add(key, 1) == 42


def test_append_creates_and_extends(store, key):
    store.append(key, b"ab")
    store.append(key, b"cd\n")
    assert store.get(key) == b"abcd\n"


def test_get_many_returns_values_in_order_with_none_for_missing(store, key):
    store.set(f"{key}/a", b"1")
    store.set(f"{key}/c", b"3")
    assert store.get_many([f"{key}/a", f"{key}/b", f"{key}/c"]) == [b"1", None, b"3"]
    assert store.get_many([f"{key}/c", f"{key}/a"]) == [b"3", b"1"]
    assert store.get_many([]) == []


def test_wait_for_an_existing_key_returns_true_at_once(store, key):
    store.set(key, b"x")
    assert store.wait_for(key, 5.0) is True
    assert store.wait_for(key, 0) is True


def test_wait_for_returns_false_at_its_timeout(store, key):
    started = time.monotonic()
    assert store.wait_for(key, 0.2) is False
    assert 0.15 <= time.monotonic() - started < 2.0
    assert store.wait_for(key, 0) is False


def test_wait_for_wakes_on_another_threads_set(store, key):
    waiting = threading.Event()
    woke_at: list[float] = []

    def waiter() -> None:
        waiting.set()
        if store.wait_for(key, 20.0):
            woke_at.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(10)
    set_at = time.monotonic()
    store.set(key, b"go")
    thread.join(timeout=20)
    assert woke_at and woke_at[0] - set_at < 1.0


def test_delete(store, key):
    store.set(key, b"x")
    assert store.delete(key) is True
    assert store.get(key) is None
    assert store.delete(key) is False


def test_delete_under_deletes_the_keys_under_the_prefixes_and_no_others(store, key):
    under = [f"{key}/a/1", f"{key}/a/2/x", f"{key}/\xe9/1"]  # a key past ASCII too
    others = [f"{key}/a", f"{key}/ab/1", f"{key}/a0", f"{key}/\xe9", f"{key}/c/1"]
    for k in under + others:
        store.set(k, b"v")
    assert store.delete_under([f"{key}/a/", f"{key}/\xe9/", f"{key}/none/"]) == len(under)
    assert store.get_many(under) == [None] * len(under)
    assert store.get_many(others) == [b"v"] * len(others)
    assert store.delete_under([f"{key}/a/"]) == 0
    assert store.delete_under([]) == 0


def test_closed_store_raises_connection_error(store, key):
    store.close()
    with pytest.raises(StoreConnectionError):
        store.get(key)
    with pytest.raises(StoreConnectionError):
        store.set(key, b"x")
