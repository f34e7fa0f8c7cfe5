"""The rendezvous executor on the in-memory store: event-driven waits, batched joins, and
recovery when the store loses the state."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from blocking_rendezvous import BlockingRendezvous

from elasticd.errors import AddInDoubt, RendezvousClosedError, RendezvousTimeoutError
from elasticd.faults import Faults
from elasticd.rendezvous import NextRound, RendezvousSettings
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous.keys import Keys
from elasticd.rendezvous.state import Announcement, Participant, decode, encode_announcement
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
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
        made.extend(
            BlockingRendezvous(store, SIGNER, settings, n, f"{n}.addr", prefix=PREFIX)
            for n in nodes
        )
        return made[-len(nodes) :]

    yield make
    for handler in made:
        handler.shutdown()
    for handler in made:
        handler.shutdown(wait=True)


def form(handlers, nproc=1):
    with ThreadPoolExecutor(len(handlers)) as pool:
        return [
            f.result(timeout=30)
            for f in [pool.submit(h.next_rendezvous, nproc, 1) for h in handlers]
        ]


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
    a, _b = handlers(["a", "b"], settings)
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
    a, b = handlers(
        ["a", "b"], RendezvousSettings("job", 1, 1, join_timeout=0.3, keep_alive_interval=0.1)
    )
    a.next_rendezvous(1, 1)
    with pytest.raises(
        RendezvousTimeoutError, match=r"wait list of round 0 .1 members, max_nodes is 1"
    ):
        b.next_rendezvous(1, 1)
    state = decode(SIGNER.open(Keys(PREFIX).state, store.get(Keys(PREFIX).state)).body)
    assert state.complete and not state.wait_list


# -- the join log and the reads (docs/store.md), on one event loop ------------------------------


class Recording(AsyncMemoryStore):
    """Counts the bytes of join log read; may hold the answer of the next state read."""

    def __init__(self, backend: MemoryStore) -> None:
        super().__init__(backend)
        self.log_bytes = 0
        self.hold: asyncio.Event | None = None

    async def get(self, key: str) -> bytes | None:
        value = await super().get(key)
        self.log_bytes += len(value or b"") if "/round/" in key else 0
        return value

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        values = await super().get_many(keys)
        self.log_bytes += sum(len(v or b"") for k, v in zip(keys, values) if "/round/" in k)
        if self.hold is not None and keys[0].endswith("/state"):
            hold, self.hold = self.hold, None
            await hold.wait()  # answered late: another read of this node's returns first
        return values


def handler(store, node: str, settings: RendezvousSettings, **kwargs) -> RendezvousHandler:
    return RendezvousHandler(store, SIGNER, settings, node, f"{node}.addr", prefix=PREFIX, **kwargs)


async def formed(handlers: list[RendezvousHandler]) -> list:
    keepers = [asyncio.create_task(h.keep()) for h in handlers]
    try:
        return await asyncio.wait_for(
            asyncio.gather(*(h.next_rendezvous(1, 1) for h in handlers)), 30
        )
    finally:
        for h in handlers:
            h.shutdown()
        for k in keepers:
            k.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)


def test_joiners_read_each_entry_about_once_in_all_not_each_the_whole_log(store):
    """N joiners at once: the newest reads the entries (each node writes one and reads the
    state and the counter); before, every read of every node carried the whole log."""
    n = 64
    stores = [Recording(store) for _ in range(n)]
    settings = RendezvousSettings("job", n, n, keep_alive_interval=5.0)
    infos = asyncio.run(formed([handler(s, f"n{i:02d}", settings) for i, s in enumerate(stores)]))
    assert sorted(i.group_rank for i in infos) == list(range(n))
    record = encode_announcement(Announcement("n10", Participant("n10.addr", 1, 1)))
    entry = len(SIGNER.seal(f"{PREFIX}/round/0/join/10", record))  # before: 680 kB in all at 64
    assert sum(s.log_bytes for s in stores) <= 3 * n * entry


def test_a_number_taken_but_not_written_yet_is_read_again_once_written(store):
    """The hole is waited on (its key), not skipped: the round completes when it is written."""
    keys, settings = Keys(PREFIX), RendezvousSettings("job", 2, 2, keep_alive_interval=5.0)
    store.add(keys.joins(0), 1)  # "b" took number 1 and is slow to write it

    async def run() -> list:
        a = handler(AsyncMemoryStore(store), "a", settings)
        joining = asyncio.create_task(formed([a]))
        await asyncio.sleep(0.2)
        assert not joining.done()
        late = keys.join(0, 1)
        store.set(
            late,
            SIGNER.seal(late, encode_announcement(Announcement("b", Participant("b.addr", 1, 1)))),
        )
        return await joining

    started = time.monotonic()
    (info,) = asyncio.run(run())
    assert [m.node for m in info.members] == ["a", "b"] and time.monotonic() - started < 2.0


def test_a_read_that_crossed_a_newer_one_of_this_node_is_not_tampering(store):
    """Two reads of one node in flight (its keeper and its join, say): the one answered
    last may carry the older state.  That is no write-back: nothing is refused, nothing
    restored.  (A state really written back stays refused: test_rendezvous_threads.)"""
    refused: list[str] = []
    settings = RendezvousSettings(
        "job", 1, 2, keep_alive_interval=5.0, last_call_timeout=0.0, max_restarts=2
    )

    async def run() -> NextRound:
        slow = Recording(store)
        a = handler(slow, "a", settings, on_refused=lambda key, why: refused.append(why))
        b = handler(AsyncMemoryStore(store), "b", settings)
        await a.next_rendezvous(1, 1)  # round 0 complete: version 1
        slow.hold = hold = asyncio.Event()
        held = asyncio.create_task(
            a.request_next_round(0, "scale_up")
        )  # its read of version 1 is held
        await asyncio.sleep(0.05)
        assert await b.request_next_round(0, "failure") is NextRound.OPENED  # version 2
        assert await a.request_next_round(0, "failure") is NextRound.ALREADY  # a read version 2
        hold.set()
        return await held

    assert asyncio.run(run()) is NextRound.ALREADY and refused == []
    state = decode(SIGNER.open(Keys(PREFIX).state, store.get(Keys(PREFIX).state)).body)
    assert (state.version, state.round, state.restarts_used) == (2, 1, 1)  # nothing written over it


def test_the_writer_that_completes_a_round_deletes_its_join_log(store):
    settings = RendezvousSettings("job", 3, 3, keep_alive_interval=5.0)

    async def run() -> None:
        handlers = [handler(AsyncMemoryStore(store), n, settings) for n in "abc"]
        keepers = [asyncio.create_task(h.keep()) for h in handlers]
        await asyncio.gather(*(h.next_rendezvous(1, 1) for h in handlers))
        for _ in range(100):
            if not store.keys(f"{PREFIX}/round/"):
                break
            await asyncio.sleep(0.01)
        for k in keepers:
            k.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)

    asyncio.run(run())
    assert store.keys(f"{PREFIX}/round/") == []


def test_a_join_counter_that_turns_to_junk_before_the_add_costs_a_claimed_number(store):
    """Read as a count, junk by the time of the add (NotACounter; on c10d the server drops
    the connection): the entry goes under a number claimed without the counter, and the
    round forms."""
    keys, settings = Keys(PREFIX), RendezvousSettings("job", 2, 2, keep_alive_interval=0.2)
    added: list[str] = []

    class Junked(AsyncMemoryStore):
        async def add(self, key: str, amount: int) -> int:
            if key == keys.joins(0) and amount and not added:
                added.append(key)
                self.backend.set(key, b"junk")
            return await super().add(key, amount)

    async def run() -> list:
        return await formed([handler(Junked(store), node, settings) for node in ("a", "b")])

    infos = asyncio.run(run())
    assert added and [m.node for m in infos[0].members] == ["a", "b"]


@pytest.mark.parametrize("doubted", [1, 2, 3])
def test_a_join_add_in_doubt_is_made_again(store, doubted):
    """An add whose connection was lost, a count there after (AddInDoubt: applied, or junk
    that someone repaired meanwhile): the joiner adds again and writes its entry under the
    second number, the first left a hole; the round forms with no step failed and nothing
    announced twice (each joiner's add, and the one made again)."""
    keys, settings = Keys(PREFIX), RendezvousSettings("job", 3, 3, keep_alive_interval=0.2)
    taken: list[int] = []

    class Doubted(AsyncMemoryStore):
        async def add(self, key: str, amount: int) -> int:
            number = await super().add(key, amount)
            if key == keys.joins(0) and amount:
                taken.append(number)
                if len(taken) == doubted:  # applied, and its answer lost
                    raise AddInDoubt(f"lost the connection of an add to {key}")
            return number

    async def run() -> list:
        nodes = ("a", "b", "c")
        return await formed([handler(Doubted(store), node, settings) for node in nodes])

    infos = asyncio.run(run())
    assert [m.node for m in infos[0].members] == ["a", "b", "c"]
    assert taken == [1, 2, 3, 4]


def test_a_joiner_that_reads_its_own_entry_swept_wakes_on_the_revision(store):
    """CI once saw the first of two joiners return 5 s (its keep-alive) after the second.
    Played here in that order: "a" announces (number 1) and reads the counter at 1; before
    it reads its entry, "b" announces (2), folds the round (2 of 2) and sweeps the round's
    entries.  "a" then reads its own entry as missing: a hole, "its writer on its way", so
    it waited for that entry, which nobody writes again, until its next duty (60 s here,
    past the test's 30 s bound).  It now wakes on the revision "b" wrote as well."""
    keys = Keys(PREFIX)
    settings = RendezvousSettings("job", 2, 2, keep_alive_interval=60.0, last_call_timeout=60.0)
    counter, own = keys.joins(0), keys.join(0, 1)

    async def run() -> list:
        a_read_one, b_swept = asyncio.Event(), asyncio.Event()
        waited: list[str] = []

        class ForA(AsyncMemoryStore):
            announced = False

            async def compare_set(self, key, expected, desired):
                swapped = await super().compare_set(key, expected, desired)
                self.announced |= key == own
                return swapped

            async def get_many(self, wanted: list[str]) -> list:
                values = await super().get_many(wanted)
                if wanted == [keys.state, counter] and self.announced and values[1] == b"1":
                    a_read_one.set()
                    await b_swept.wait()  # this node's loop held up between its two reads
                return values

            async def wait_for(self, key: str, timeout: float) -> bool:
                waited.append(key)
                return await super().wait_for(key, timeout)

        class ForB(AsyncMemoryStore):
            async def add(self, key: str, amount: int) -> int:
                if key == counter and amount:
                    await a_read_one.wait()
                return await super().add(key, amount)

            async def delete(self, key: str) -> bool:
                deleted = await super().delete(key)
                if key == own:
                    b_swept.set()
                return deleted

        infos = await formed(
            [handler(ForA(store), "a", settings), handler(ForB(store), "b", settings)]
        )
        assert own in waited, f"a never took its swept entry for a hole: {waited}"
        return infos

    infos = asyncio.run(run())
    assert [m.node for m in infos[0].members] == ["a", "b"]


def test_a_joiner_whose_entry_was_deleted_announces_again_and_keeps_it(store):
    """Anyone who reaches the store deletes "a"'s join entry as it lands: "a" reads it as
    missing and, a keep-alive later, announces again under a number read as missing: the
    same one here.  It then deleted the entry it had just written, as its stranded one,
    again at every interval, and the join timed out (15 s) with all three nodes there."""
    keys = Keys(PREFIX)
    settings = RendezvousSettings("job", 3, 3, keep_alive_interval=0.2, join_timeout=15.0)
    deleted: list[str] = []

    class Slow(AsyncMemoryStore):  # reads take 2 ms, as over a network
        async def get_many(self, wanted: list[str]) -> list:
            await asyncio.sleep(0.002)
            return await super().get_many(wanted)

    class Deleting(Slow):
        async def compare_set(self, key, expected, desired):
            swapped = await super().compare_set(key, expected, desired)
            if key == keys.join(0, 1) and swapped[0] and not deleted:
                self.backend.delete(key)  # before anyone could read it
                deleted.append(key)
            return swapped

    async def run() -> list:
        a, b, c = (
            handler(Deleting(store), "a", settings),
            *(handler(Slow(store), n, settings) for n in "bc"),
        )
        keepers = [asyncio.create_task(h.keep()) for h in (a, b, c)]
        try:
            joins = [asyncio.create_task(a.next_rendezvous(1, 1))]
            while not deleted:
                await asyncio.sleep(0.01)
            joins.append(asyncio.create_task(b.next_rendezvous(1, 1)))
            while store.get(keys.join(0, 2)) is None:
                await asyncio.sleep(0.01)
            joins.append(asyncio.create_task(c.next_rendezvous(1, 1)))
            return await asyncio.wait_for(asyncio.gather(*joins), 30)
        finally:
            for h in (a, b, c):
                h.shutdown()
            for k in keepers:
                k.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)

    infos = asyncio.run(run())
    assert all([m.node for m in i.members] == ["a", "b", "c"] for i in infos)


def keeper_runs(store, settings: RendezvousSettings, seconds: float, **kwargs) -> None:
    """Run a handler's keeper for ``seconds``; it must still run, and end when cancelled."""

    async def run() -> None:
        keeper = asyncio.create_task(handler(store, "a", settings, **kwargs).keep())
        await asyncio.sleep(seconds)
        assert not keeper.done(), keeper
        keeper.cancel()
        done, _ = await asyncio.wait([keeper], timeout=5.0)
        assert keeper in done and keeper.cancelled()

    asyncio.run(run())


def test_an_unexpected_error_of_the_keeper_is_a_counted_fault_logged_once_per_interval(
    store, caplog
):
    """Not a traceback at every duty: counted (elasticd_loop_faults_total), logged with its
    traceback once per interval, and the keeper goes on."""

    class Broken(AsyncMemoryStore):
        async def get_many(self, keys):
            raise KeyError("a bug one record brought out")

    counted: list[str] = []
    settings = RendezvousSettings("job", 1, 1, keep_alive_interval=0.02)
    with caplog.at_level(logging.WARNING, logger="elasticd"):
        keeper_runs(Broken(store), settings, 0.5, faults=Faults(counted.append))
    assert len(counted) >= 3 and set(counted) == {"rendezvous_keeper"}
    lines = [r for r in caplog.records if "rendezvous_keeper" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info and "(job job)" in lines[0].getMessage()


def test_a_keeper_whose_job_state_is_gone_warns_once_without_a_traceback(store, caplog):
    """A job that ran, whose state is gone, on a node that never saw it (may_create False):
    RendezvousGone at every duty is an expected condition, not a fault."""
    counted: list[str] = []
    settings = RendezvousSettings("job", 1, 1, keep_alive_interval=0.02)
    with caplog.at_level(logging.WARNING, logger="elasticd"):
        keeper_runs(
            AsyncMemoryStore(store), settings, 0.5, may_create=False, faults=Faults(counted.append)
        )
    lines = [r for r in caplog.records if r.name.startswith("elasticd")]
    assert counted == [] and len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING and not lines[0].exc_info
    assert "its state is gone or refused" in lines[0].getMessage()


# -- the keeper's reads at scale (docs/store.md) -----------------------------------------------


class StateReads(AsyncMemoryStore):
    """Counts the reads of the state key."""

    def __init__(self, backend: MemoryStore) -> None:
        super().__init__(backend)
        self.state_reads = 0

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        self.state_reads += keys.count(Keys(PREFIX).state)
        return await super().get_many(keys)


def test_keepers_read_the_signed_head_and_the_state_only_when_it_moved(store):
    """Once formed, a keeper's duty reads the head (and its neighbours' heartbeats), the state
    at most every FULL_EVERY duties; a head that names a newer state makes it read that one."""
    from elasticd.rendezvous.head import FULL_EVERY, head_version

    settings = RendezvousSettings("job", 3, 3, keep_alive_interval=0.02)
    stores = [StateReads(store) for _ in range(3)]
    nodes = [handler(s, n, settings) for s, n in zip(stores, "abc")]

    async def run() -> None:
        keepers = [asyncio.create_task(h.keep()) for h in nodes]
        await asyncio.gather(*(h.next_rendezvous(1, 1) for h in nodes))
        for s in stores:
            s.state_reads = 0
        await asyncio.sleep(0.3)  # about 15 duties each
        assert all(s.state_reads <= 15 // FULL_EVERY + 3 for s in stores), [
            s.state_reads for s in stores
        ]
        watching = nodes[0].watch(0, waiting=False)
        assert await nodes[1].request_next_round(0, "scale_up") is NextRound.OPENED
        assert (await asyncio.wait_for(watching, 5)).kind == "next_round"
        for h in nodes:
            h.shutdown()
        for k in keepers:
            k.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)

    asyncio.run(run())
    keys = Keys(PREFIX)
    assert (
        head_version(SIGNER, keys.head, store.get(keys.head), lambda k, why: None) == 2
    )  # formed, then superseded


def test_handlers_that_share_a_decoded_cache_open_each_state_once(store):
    """The simulated nodes of one process (a bench's crowd) open a state once per change."""
    from elasticd.rendezvous.state import Decoded

    opened = []

    class Counting(Signer):
        def open(self, key, raw):
            opened.append(key) if key.endswith("/state") else None
            return super().open(key, raw)

    signer, decoded = Counting(b"k" * 32, "c"), Decoded()
    settings = RendezvousSettings("job", 8, 8, keep_alive_interval=5.0)
    nodes = [
        RendezvousHandler(
            AsyncMemoryStore(store),
            signer,
            settings,
            f"n{i}",
            f"n{i}.addr",
            prefix=PREFIX,
            decoded=decoded,
        )
        for i in range(8)
    ]
    infos = asyncio.run(formed(nodes))
    assert sorted(i.group_rank for i in infos) == list(range(8))
    assert infos[0].members is infos[1].members  # built once for the state
    assert len(opened) <= 3  # a state per write, not one per node


class Counted(AsyncMemoryStore):
    """The in-memory store, counting the reads of its user."""

    def __init__(self, backend: MemoryStore) -> None:
        super().__init__(backend)
        self.reads = 0

    async def get_many(self, keys):
        self.reads += 1
        return await super().get_many(keys)

    async def get(self, key):
        self.reads += 1
        return await super().get(key)


@pytest.mark.parametrize("waiting_on", ["revision", "exit barrier"])
def test_forged_wake_keys_cost_a_back_off_and_news_still_gets_through(store, waiting_on):
    """Unsigned keys anyone can write end a wait at once: the next revision's key (a joiner,
    a keeper that watches its round), a member's exit-barrier key.  A wake with nothing new
    behind it backs off (doubling up to a keep-alive interval), so a handler reads a few
    times a second, not as fast as the store answers; and real news still arrives."""
    settings = RendezvousSettings(
        "job", 2, 2, keep_alive_interval=0.5, last_call_timeout=30.0, join_timeout=60.0
    )
    keys = Keys(PREFIX)

    async def scenario() -> None:
        a_store, b_store = Counted(store), AsyncMemoryStore(store)
        a = RendezvousHandler(a_store, SIGNER, settings, "a", "a.addr", prefix=PREFIX)
        b = RendezvousHandler(b_store, SIGNER, settings, "b", "b.addr", prefix=PREFIX)
        async with asyncio.TaskGroup() as tasks:
            keepers = [tasks.create_task(a.keep()), tasks.create_task(b.keep())]
            if waiting_on == "revision":
                joining = tasks.create_task(a.next_rendezvous(1, 1))
                async with asyncio.timeout(5):
                    while not store.keys(keys.join(0, 1)):
                        await asyncio.sleep(0.01)
                for v in range(0, 300):
                    store.set(keys.rev(v), b"1")
            else:
                info, _ = await asyncio.gather(a.next_rendezvous(1, 1), b.next_rendezvous(1, 1))
                await a.exit_barrier_arrive(info)
                store.set(keys.exit_arrived(info.round, "b"), b"forged")
                waiting = tasks.create_task(a.exit_barrier_wait(info, 60.0))
            before, started = a_store.reads, time.monotonic()
            await asyncio.sleep(2.0)
            reads = a_store.reads - before
            assert reads <= 2.0 / settings.keep_alive_interval * 4 + 12, reads  # a spin: 1000s
            if waiting_on == "revision":
                assert not joining.done()
                await b.next_rendezvous(1, 1)  # news: the round forms
                async with asyncio.timeout(2 * settings.keep_alive_interval + 1):
                    info = await joining
                assert info.group_world_size == 2
            else:
                assert not waiting.done()
                await b.exit_barrier_arrive(info)  # news: b arrives
                async with asyncio.timeout(2 * settings.keep_alive_interval + 1):
                    assert await waiting
            assert time.monotonic() - started < 10
            for keeper in keepers:
                keeper.cancel()
        a.shutdown()
        b.shutdown()

    asyncio.run(scenario())
