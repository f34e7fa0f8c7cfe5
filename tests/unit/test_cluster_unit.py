"""Node liveness on the observer's own clock, node records, nvidia-smi parsing (pure)."""

import pytest

from elasticd.cluster import NodeRecord, Sighting, node_doc, node_state, parse_nvidia_smi, sight
from elasticd.liveness import Beat, KeepAlive
from elasticd.model import NodeInfo, NodeState

INFO = NodeInfo("n2", "10.0.0.2", 8, ("0", "1"), {"rack": "a"}, "0.1.0", False, 5.0)
KEEP_ALIVE = KeepAlive(1.0, 3)


def sighting(moved, draining=False, jobs=(), reads=3):
    return Sighting(NodeRecord(INFO, draining, 2, 1, jobs, "tcp://x:1", "key"),
                    Beat(7, moved, reads), 100.0)


@pytest.mark.parametrize("moved, reads, draining, jobs, state", [
    (9.0, 3, False, (), "up"), (7.1, 3, False, (), "up"), (7.0, 3, False, (), "lost"),
    (6.9, 3, True, ("j",), "lost"), (9.0, 3, True, ("j",), "draining"), (9.0, 3, True, (), "drained"),
    (0.0, 2, False, (), "up"),  # still for long, but read fewer times: a stalled store kills nobody
])
def test_node_state(moved, reads, draining, jobs, state):
    assert node_state(sighting(moved, draining, jobs, reads), now=10.0, keep_alive=KEEP_ALIVE) == state


def test_a_changed_counter_is_life_either_way():
    record = sighting(0).record
    first = sight(None, record, 5, now=1.0, wall=11.0)
    assert (first.beat.count, first.beat.since, first.moved_wall) == (5, 1.0, 11.0)
    same = sight(first, record, 5, now=2.0, wall=12.0)
    assert (same.beat.since, same.beat.reads, same.moved_wall) == (1.0, 1, 11.0)
    assert sight(same, record, 6, now=3.0, wall=13.0).beat.since == 3.0
    assert sight(same, record, 1, now=3.0, wall=13.0).beat.since == 3.0  # a reset store restarts it


def test_wall_clock_never_decides_liveness():
    """A node whose clock is an hour off is judged only by its counter moving."""
    record = sighting(0).record
    seen = sight(None, record, 1, now=1.0, wall=1.0 + 3600)
    assert node_state(seen, now=2.0, keep_alive=KEEP_ALIVE) == "up"


def test_record_round_trip_and_doc():
    record = sighting(0, jobs=("j-1",)).record
    assert NodeRecord.from_json(record.to_json()) == record
    doc = node_doc(sighting(9.0, jobs=("j-1",)), NodeState.UP)
    assert (doc["slots_free"], doc["gpus_free"], doc["gpus_total"], doc["jobs"]) == (6, 1, 2, ["j-1"])


def test_parse_nvidia_smi():
    assert parse_nvidia_smi("0\n1\n\n2\nNo devices were found\n") == ("0", "1", "2")


def test_a_store_error_while_republishing_after_a_reset_is_retried_not_fatal():
    """The heartbeat loop survives a failed republish and tries again on its next duty."""
    import asyncio

    from elasticd.cluster import NodeDuties, NodeRegistry, NodeService
    from elasticd.errors import StoreConnectionError
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    store = MemoryStore()
    record = sighting(0).record
    resets: list[str] = []
    store_states: list[bool] = []

    async def scenario() -> None:
        stop, retried = asyncio.Event(), asyncio.Event()
        registry = NodeRegistry(AsyncMemoryStore(store), Signer(b"k" * 32, "c"), "c", "n2", keep_alive=KEEP_ALIVE)
        await registry.create_epoch()

        async def on_reset() -> None:
            resets.append("tried")
            if len(resets) == 1:
                raise StoreConnectionError("the first call on a stale connection fails")
            retried.set()

        def on_tick() -> None:  # after the first duty: the store host restarts with a new epoch
            if not resets:
                store.delete(registry.epoch_key)
                store.compare_set(registry.epoch_key, None, Signer(b"k" * 32, "c").seal(
                    registry.epoch_key, {"epoch": "new"}, version=2**62))

        service = NodeService(registry, interval=0.01)
        running = asyncio.create_task(service.run(stop, NodeDuties(
            local_record=lambda: record, on_drain=lambda drain: None, on_reset=on_reset,
            on_store=lambda ok, why: store_states.append(ok), on_tick=on_tick)))
        async with asyncio.timeout(10):
            await retried.wait()
        stop.set()
        await running

    asyncio.run(scenario())
    assert resets == ["tried", "tried"]
    assert False in store_states and store_states[-1] is True


def test_a_blacklisted_node_says_so_whatever_else_it_is():
    blacklisted = NodeRecord(INFO, True, 0, 0, (), "", "", blacklisted_until=1e9)
    seen = Sighting(blacklisted, Beat(7, 9.0, 3), 100.0)
    assert node_state(seen, now=10.0, keep_alive=KEEP_ALIVE) == "blacklisted"
    assert node_state(seen, now=20.0, keep_alive=KEEP_ALIVE) == "lost"  # lost comes first
    assert NodeRecord.from_json(blacklisted.to_json()) == blacklisted
    doc = node_doc(seen, NodeState.BLACKLISTED)
    assert (doc["state"], doc["blacklisted_until"], doc["listed"]) == ("blacklisted", 1e9, True)
    unlisted = Sighting(NodeRecord(INFO, True, listed=False), Beat(7, 9.0, 3), 100.0)
    assert node_state(unlisted, now=10.0, keep_alive=KEEP_ALIVE) == "drained"
    assert node_doc(unlisted, NodeState.DRAINED)["listed"] is False
    assert node_doc(unlisted, NodeState.DRAINED)["blacklisted_until"] is None


def test_a_record_of_an_older_daemon_reads_as_listed_and_not_blacklisted():
    doc = sighting(0).record.to_json()
    del doc["blacklisted_until"], doc["listed"]
    record = NodeRecord.from_json(doc)
    assert (record.blacklisted_until, record.listed) == (0.0, True)


def test_every_drain_request_reaches_the_node_once_the_same_twice_too():
    """An undrain after an undrain is a new request: it lifts a blacklisting that began in
    between.  A request read again (same version) is not delivered again."""
    import asyncio

    from elasticd.cluster import NodeDuties, NodeRegistry, NodeService
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    requests: list[bool] = []

    async def scenario() -> None:
        store = AsyncMemoryStore(MemoryStore())
        registry = NodeRegistry(store, Signer(b"k" * 32, "c"), "c", "n2", keep_alive=KEEP_ALIVE)
        await registry.create_epoch()
        service = NodeService(registry, interval=0.01)
        stop = asyncio.Event()
        ticked = asyncio.Event()
        record = sighting(0).record
        running = asyncio.create_task(service.run(stop, NodeDuties(
            local_record=lambda: record, on_drain=requests.append,
            on_reset=lambda: asyncio.sleep(0), on_tick=ticked.set)))

        async def ticks(n: int) -> None:
            for _ in range(n):
                ticked.clear()
                async with asyncio.timeout(5):
                    await ticked.wait()

        await ticks(2)
        for drain in (False, False, True, True, False):
            await registry.request_drain("n2", drain, "root")
            await ticks(3)
        stop.set()
        await running

    asyncio.run(scenario())
    assert requests == [False, False, True, True, False]
