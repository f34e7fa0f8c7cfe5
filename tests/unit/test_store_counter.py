"""store/counter.py and the board's two counters (no unsigned value can freeze the
cluster: docs/security.md): a counter holding junk is written back by the daemon that meets it, with the
highest value it can justify, compare-and-set against the junk (the first repair wins, a
count written meanwhile is kept), and counted as refused; no number is taken twice.  Over
the in-memory store (TCPStore's semantics); the real daemons on c10d and etcd are in
tests/chaos/test_store_poison.py, each backend's NotACounter in tests/contract."""

from __future__ import annotations

import asyncio

import pytest

from elasticd.core.model import JobSpec
from elasticd.errors import AddInDoubt, NotACounter, StoreConnectionError
from elasticd.jobs.board import JobBoard
from elasticd.store.base import lost_add
from elasticd.store.counter import REPAIRS, StoreCounter
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer

KEY = "elasticd/c/jobs/log"
JOBS = "elasticd/c/jobs"
SIGNER = Signer(b"k" * 32, "c")
DEEP = b"[" * 100000 + b"]" * 100000


def run(coro):
    return asyncio.run(coro)


class Counted:
    """A StoreCounter over a MemoryStore whose justification is ``seen + 5``."""

    def __init__(self, justify=None) -> None:
        self.store = MemoryStore()
        self.refused: list[tuple[str, str]] = []

        async def plus_five(seen: int) -> int:
            return seen + 5

        self.counter = StoreCounter(
            AsyncMemoryStore(self.store),
            KEY,
            justify or plus_five,
            lambda key, why: self.refused.append((key, why)),
        )


@pytest.mark.parametrize("junk", [b"junk", b"9" * 5000, DEEP, b"", b"-3"])
def test_junk_is_written_back_with_the_justified_value_and_counted(junk):
    c = Counted()
    c.counter.saw(10)
    c.store.set(KEY, junk)
    assert run(c.counter.take()) == 16  # written back as 10 + 5, then counted on
    assert c.store.get(KEY) == b"16"
    [(key, why)] = c.refused
    assert key == KEY and "is no count; wrote back 15" in why and len(why) < 200


def test_a_count_written_meanwhile_is_kept():
    """Another daemon repaired the counter (and took a number) between this one's read of the
    junk and its compare-and-set: that count stands, and this daemon counts on from it."""

    async def another_daemon_first(seen: int) -> int:
        c.store.set(KEY, b"40")
        return seen + 5

    c = Counted(another_daemon_first)
    c.store.set(KEY, b"junk")
    assert run(c.counter.take()) == 41
    assert "changed meanwhile" in c.refused[0][1]


def test_junk_written_again_as_fast_as_it_is_repaired_fails_the_add_after_a_few_repairs():

    async def junk_again(seen: int) -> int:
        c.store.set(KEY, b"junk %d" % len(c.refused))  # new junk each time
        return seen + 5

    c = Counted(junk_again)
    c.store.set(KEY, b"junk")
    with pytest.raises(NotACounter):
        run(c.counter.read())
    assert len(c.refused) == REPAIRS


def test_a_counter_that_went_back_gives_no_number_taken_before():
    c = Counted()
    c.counter.saw(100)
    c.store.set(KEY, b"3")  # a reset store, or anyone's number
    assert run(c.counter.take()) == 101
    assert run(c.counter.take()) == 102
    assert run(c.counter.read()) == 102 and not c.refused  # a count is no refusal


def test_at_least_moves_the_counter_up_never_down():
    c = Counted()
    c.store.set(KEY, b"junk")
    run(c.counter.at_least(7))
    assert run(c.counter.read()) == 7 + 5  # the junk written back past 7 first
    run(c.counter.at_least(3))
    assert run(c.counter.read()) == 12


# -- the board's counters -------------------------------------------------------------------


def spec(job_id: str) -> JobSpec:
    return JobSpec(
        id=job_id,
        argv=("train.py",),
        python="/usr/bin/python3",
        workdir="/",
        uid=1000,
        gid=1000,
        user="alice",
        created=1.0,
    )


def boards(n: int = 2) -> tuple[MemoryStore, list[JobBoard], list[tuple[str, str]]]:
    """``n`` daemons' boards on one store, with the refusals they report."""
    store, refused = MemoryStore(), []
    made = [
        JobBoard(
            AsyncMemoryStore(store),
            SIGNER,
            "c",
            on_refused=lambda key, why: refused.append((key, why)),
        )
        for _ in range(n)
    ]
    return store, made, refused


@pytest.mark.parametrize("junk", [b"junk", b"9" * 5000, DEEP])
def test_a_seq_that_is_junk_is_written_back_past_every_seq_seen(junk):
    store, (a, b), refused = boards()

    async def scenario() -> list[int]:
        seqs = [await a.publish_spec(spec(f"j-00000{i}")) for i in range(1, 4)]
        await b.snapshot()  # b has read jobs 1..3
        store.set(f"{JOBS}/seq", junk)
        return seqs + [await b.next_seq(), await a.next_seq()]

    seqs = run(scenario())
    assert seqs[:3] == [1, 2, 3] and len(set(seqs)) == 5
    assert min(seqs[3:]) > 3 + 1000  # room for the submits not read yet elsewhere
    assert [key for key, _ in refused] == [f"{JOBS}/seq"]


def test_a_change_log_counter_that_is_junk_is_written_back_where_the_log_ends():
    """a wrote changes 1..3, b read 1 only when junk lands: whoever writes it back, the next
    change is 4 (not a number b's follower or a's entries already had), and b follows on
    without reading the whole board again."""
    store, (a, b), refused = boards()

    async def scenario() -> None:
        await a.publish_spec(spec("j-000001"))
        position, _ = await b.snapshot()
        assert position == 1
        await a.publish_spec(spec("j-000002"))
        await a.publish_spec(spec("j-000003"))
        store.set(f"{JOBS}/log", b"junk")
        assert await b.head() == 3  # b wrote it back: past what it read, up to the last valid entry
        await b.publish_spec(spec("j-000004"))
        position, changes = await b.follow(position, 0.1)  # no BoardReset: no gap, no reuse
        assert (position, [c.job_id for c in changes]) == (4, ["j-000002", "j-000003", "j-000004"])

    run(scenario())
    assert [key for key, _ in refused] == [f"{JOBS}/log"]


def test_a_log_written_back_below_what_a_daemon_saw_gives_it_no_number_taken_before():
    """A daemon that has seen nothing (it just started) writes back only what it finds; a
    daemon that saw further never takes a number it saw again: it moves the counter on."""
    store, (a, _b), _ = boards()

    async def scenario() -> int:
        for i in range(1, 4):
            await a.publish_spec(spec(f"j-00000{i}"))
        store.set(f"{JOBS}/log", b"1")  # as if written back too low
        await a.publish_spec(spec("j-000005"))
        return await a.head()

    assert run(scenario()) == 4
    assert store.get(f"{JOBS}/log/4") is not None


@pytest.mark.parametrize(
    ("amount", "held", "told"),
    [
        (0, b"41", 41),  # a read: applied or not, the count of the call's time
        (0, None, 0),  # missing counts 0 (not written: an add of 0 only reads)
        (1, b"41", AddInDoubt),  # applied, or refused over junk repaired meanwhile
        (1, None, AddInDoubt),
        (0, b"junk", NotACounter),
        (5, b"", NotACounter),  # empty is no count to TCPStore
    ],
)
def test_an_add_whose_connection_was_lost_is_told_by_what_the_key_holds(amount, held, told):
    lost = StoreConnectionError("lost the store")
    if isinstance(told, int):
        assert lost_add(KEY, amount, held, lost) == told
    else:
        with pytest.raises(told) as raised:
            lost_add(KEY, amount, held, lost)
        assert KEY in str(raised.value) and raised.value.__cause__ is lost


def test_an_add_in_doubt_is_made_again_and_a_flapping_one_fails():
    """A counter adds again where an add is in doubt (a number skipped: a gap); an add in
    doubt every time (a connection that keeps dropping) fails after REPAIRS + 1 adds."""

    class Doubting(AsyncMemoryStore):
        def __init__(self, doubts: int) -> None:
            super().__init__(MemoryStore())
            self.doubts, self.adds = doubts, 0

        async def add(self, key: str, amount: int) -> int:
            number = await super().add(key, amount)
            self.adds += 1
            if self.adds <= self.doubts:
                raise AddInDoubt(f"lost the connection of an add to {key}")
            return number

    async def plus_five(seen: int) -> int:
        return seen + 5

    store = Doubting(doubts=2)
    counter = StoreCounter(store, KEY, plus_five, lambda key, why: None)
    assert run(counter.take()) == 3 and store.adds == 3  # 1 and 2 are gaps
    store = Doubting(doubts=REPAIRS + 1)
    counter = StoreCounter(store, KEY, plus_five, lambda key, why: None)
    with pytest.raises(AddInDoubt):
        run(counter.take())
    assert store.adds == REPAIRS + 1
