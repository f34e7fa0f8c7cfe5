"""Node states from the observer's membership and the node's record; records; nvidia-smi
parsing (pure).  Liveness itself: test_liveness.py and test_membership.py."""

import pytest

from elasticd.cluster.inventory import parse_nvidia_smi
from elasticd.cluster.registry import NodeRecord, Sighting, node_doc, node_state
from elasticd.core.containment import Containment
from elasticd.core.liveness import KeepAlive
from elasticd.core.membership import Membership
from elasticd.core.model import NodeInfo, NodeState

INFO = NodeInfo("n2", "10.0.0.2", 8, ("0", "1"), {"rack": "a"}, "0.1.0", False, 5.0, cpus=16)
KEEP_ALIVE = KeepAlive(1.0, 3)


def sighting(lost=False, draining=False, jobs=()):
    return Sighting(
        NodeRecord(INFO, draining, 2, 1, jobs, "tcp://x:1", "key"), Membership(1, lost, 50.0)
    )


@pytest.mark.parametrize(
    "lost, draining, jobs, state",
    [
        (False, False, (), "up"),
        (True, False, (), "lost"),
        (True, True, ("j",), "lost"),
        (False, True, ("j",), "draining"),
        (False, True, (), "drained"),
    ],
)
def test_node_state(lost, draining, jobs, state):
    assert node_state(sighting(lost, draining, jobs)) == state


def test_record_round_trip_and_doc():
    record = sighting(jobs=("j-1",)).record
    assert NodeRecord.from_json(record.to_json()) == record
    doc = node_doc(sighting(jobs=("j-1",)), NodeState.UP, seen=99.0)
    assert (doc["slots_free"], doc["gpus_free"], doc["gpus_total"], doc["jobs"]) == (
        6,
        1,
        2,
        ["j-1"],
    )
    assert doc["last_seen"] == 99.0 and doc["cpus_total"] == 16
    assert (
        node_doc(sighting(lost=True), NodeState.LOST, seen=99.0)["last_seen"] == 50.0
    )  # when judged lost


def test_node_info_of_older_and_newer_daemons_reads():
    older = {k: v for k, v in INFO.to_json().items() if k != "cpus"}
    assert NodeInfo.from_json(older).cpus == 0  # not published: unknown
    assert NodeInfo.from_json({**INFO.to_json(), "from_a_later_version": 1}) == INFO


def test_parse_nvidia_smi():
    assert parse_nvidia_smi("0\n1\n\n2\nNo devices were found\n") == ("0", "1", "2")


def test_a_store_error_while_republishing_after_a_reset_is_retried_not_fatal():
    """The heartbeat loop survives a failed republish and tries again on its next duty."""
    import asyncio

    from elasticd.cluster.registry import NodeRegistry
    from elasticd.cluster.service import NodeDuties, NodeService, Watcher
    from elasticd.errors import StoreConnectionError
    from elasticd.shell.publisher import StoreReset
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    store = MemoryStore()
    record = sighting().record
    resets: list[str] = []
    store_states: list[bool] = []

    async def scenario() -> None:
        stop, retried = asyncio.Event(), asyncio.Event()
        registry = NodeRegistry(
            AsyncMemoryStore(store), Signer(b"k" * 32, "c"), "c", "n2", keep_alive=KEEP_ALIVE
        )
        await registry.create_epoch()

        async def on_reset() -> None:
            resets.append("tried")
            if len(resets) == 1:
                raise StoreConnectionError("the first call on a stale connection fails")
            retried.set()

        def on_tick() -> None:  # after the first duty: the store host restarts with a new epoch
            if not resets:
                store.delete(registry.epoch_key)
                store.compare_set(
                    registry.epoch_key,
                    None,
                    Signer(b"k" * 32, "c").seal(
                        registry.epoch_key, {"epoch": "new"}, version=2**62
                    ),
                )

        republishing: set[asyncio.Task[None]] = set()

        async def republish(done: asyncio.Future[None]) -> None:  # the node shell's part
            try:
                await on_reset()
            except Exception as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        def post(event: object) -> None:
            if isinstance(event, StoreReset):
                republishing.add(asyncio.create_task(republish(event.done)))

        service = NodeService(registry, interval=0.01)
        running = asyncio.create_task(
            service.run(
                stop,
                NodeDuties(
                    local_record=lambda: record,
                    post=post,
                    watcher=Watcher(store=lambda ok, why: store_states.append(ok), tick=on_tick),
                ),
            )
        )
        async with asyncio.timeout(10):
            await retried.wait()
        stop.set()
        await running

    asyncio.run(scenario())
    assert resets == ["tried", "tried"]
    assert False in store_states and store_states[-1] is True


def test_a_blacklisted_node_says_so_whatever_else_it_is():
    blacklisted = NodeRecord(INFO, True, 0, 0, (), "", "", blacklisted_until=1e9)
    seen = Sighting(blacklisted, Membership(1))
    assert node_state(seen) == "blacklisted"
    assert node_state(Sighting(blacklisted, Membership(1, lost=True))) == "lost"  # lost comes first
    assert NodeRecord.from_json(blacklisted.to_json()) == blacklisted
    doc = node_doc(seen, NodeState.BLACKLISTED, seen=1.0)
    assert (doc["state"], doc["blacklisted_until"], doc["listed"]) == ("blacklisted", 1e9, True)
    unlisted = Sighting(NodeRecord(INFO, True, listed=False), Membership(1))
    assert node_state(unlisted) == "drained"
    assert node_doc(unlisted, NodeState.DRAINED, seen=1.0)["listed"] is False
    assert node_doc(unlisted, NodeState.DRAINED, seen=1.0)["blacklisted_until"] is None


def test_a_record_of_an_older_daemon_reads_as_listed_and_not_blacklisted():
    doc = sighting().record.to_json()
    del doc["blacklisted_until"], doc["listed"]
    record = NodeRecord.from_json(doc)
    assert (record.blacklisted_until, record.listed) == (0.0, True)


def test_every_drain_request_reaches_the_node_once_the_same_twice_too():
    """An undrain after an undrain is a new request: it lifts a blacklisting that began in
    between.  A request read again (same version) is not delivered again."""
    import asyncio

    from elasticd.cluster.registry import NodeRegistry
    from elasticd.cluster.service import NodeDuties, NodeService, Watcher
    from elasticd.core.events import GpuReadmitted, HoldChanged
    from elasticd.core.node import Hold
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    requests: list[object] = []

    async def scenario() -> None:
        store = AsyncMemoryStore(MemoryStore())
        registry = NodeRegistry(store, Signer(b"k" * 32, "c"), "c", "n2", keep_alive=KEEP_ALIVE)
        await registry.create_epoch()
        service = NodeService(registry, interval=0.01)
        stop = asyncio.Event()
        ticked = asyncio.Event()
        record = sighting().record

        def post(event: object) -> None:  # the node shell's queue: each drain request once
            if isinstance(event, HoldChanged) and event.hold == Hold.DRAINED.value:
                requests.append(event.on)
            elif isinstance(event, GpuReadmitted):
                requests.append(event)

        running = asyncio.create_task(
            service.run(
                stop,
                NodeDuties(
                    local_record=lambda: record, post=post, watcher=Watcher(tick=ticked.set)
                ),
            )
        )

        async def ticks(n: int) -> None:
            for _ in range(n):
                ticked.clear()
                async with asyncio.timeout(5):
                    await ticked.wait()

        await ticks(2)
        for drain in (False, False, True, True, False):
            await registry.request_drain("n2", drain, "root")
            await ticks(3)
        await registry.request_drain(
            "n2", False, "alice", gpu=3
        )  # that GPU only: the node's drain stays
        await ticks(3)
        stop.set()
        await running

    asyncio.run(scenario())
    assert requests == [False, False, True, True, False, GpuReadmitted(3, "alice")]


def test_a_record_carries_its_gpus_out_and_the_node_list_shows_them():
    record = NodeRecord(INFO, gpus_out={3: "xid 79"})
    assert NodeRecord.from_json(record.to_json()) == record
    assert node_doc(Sighting(record, Membership(1)), NodeState.UP, seen=1.0)["gpus_out"] == {
        "3": "xid 79"
    }
    older = record.to_json()
    del older["gpus_out"]
    assert NodeRecord.from_json(older).gpus_out == {}
    with pytest.raises(ValueError):
        NodeRecord.from_json({**older, "gpus_out": {"three": "x"}})  # refused as unreadable


def test_a_record_says_what_bounds_a_job_there():
    """The containment a node publishes reaches `elasticctl nodes` of every node; an older
    daemon's record has none (None, shown as '-'), and a wrong one decodes to 'not known'."""
    contained = Containment(
        cgroup=False,
        pids_per_worker=64,
        pids_by="RLIMIT_NPROC",
        missing=("no cgroups for jobs (off): ...",),
    )
    record = NodeRecord(INFO, containment=contained)
    assert NodeRecord.from_json(record.to_json()) == record
    assert (
        node_doc(Sighting(record, Membership(1)), NodeState.UP, seen=1.0)["containment"]
        == contained.to_json()
    )
    older = record.to_json()
    del older["containment"]
    assert NodeRecord.from_json(older).containment is None
    assert (
        node_doc(Sighting(NodeRecord.from_json(older), Membership(1)), NodeState.UP, seen=1.0)[
            "containment"
        ]
        is None
    )
    assert (
        NodeRecord.from_json({**older, "containment": {"cgroup": "yes", "missing": 3}}).containment
        == Containment()
    )


def test_junk_at_the_feeds_next_entries_costs_a_back_off_not_a_spin():
    """The feed's next entry is what a node's heartbeat loop waits on between duties.  Junk
    written at the next numbers (or, on TCPStore, anyone's read of the missing key) ends that
    wait at once; a duty that found nothing new used to wait again at once: a duty loop as
    fast as the store answers.  Now such a wake backs off, and the feed is still followed."""
    import asyncio
    import time

    from elasticd.cluster.registry import NodeRegistry
    from elasticd.cluster.service import NodeDuties, NodeService, Watcher
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    keep_alive = KeepAlive(0.5, 3)
    backend = MemoryStore()
    duties = {"n1": 0, "n2": 0, "n3": 0}

    def node(name: str) -> tuple[NodeService, NodeDuties]:
        registry = NodeRegistry(
            AsyncMemoryStore(backend), Signer(b"k" * 32, "c"), "c", name, keep_alive=keep_alive
        )
        record = NodeRecord(NodeInfo(name, name, 1))

        def ticked() -> None:
            duties[name] += 1

        return NodeService(registry, interval=keep_alive.interval), NodeDuties(
            local_record=lambda: record, post=lambda event: None, watcher=Watcher(tick=ticked)
        )

    async def scenario() -> None:
        stop = asyncio.Event()
        (s1, d1), (s2, d2), (s3, d3) = node("n1"), node("n2"), node("n3")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(s1.run(stop, d1))
            await asyncio.wait_for(s1.registered.wait(), 5)  # n1 observes
            tasks.create_task(s2.run(stop, d2))
            async with asyncio.timeout(10):
                while set(s2.sightings) != {"n1", "n2"}:
                    await asyncio.sleep(0.05)
            for n in range(1, 400):
                backend.set(f"elasticd/c/nodes/feed/{n}", b"junk")
            before, started = duties["n2"], time.monotonic()
            await asyncio.sleep(3.0)  # the window counted
            spent = duties["n2"] - before
            assert spent <= 3.0 / keep_alive.interval + 8, spent  # a spin: thousands
            assert s2.registry.quiet.pauses >= 1
            tasks.create_task(s3.run(stop, d3))  # news: a new node, seen through the feed
            async with asyncio.timeout(10):
                while "n3" not in s2.sightings:
                    await asyncio.sleep(0.05)
            assert time.monotonic() - started < 13
            stop.set()

    asyncio.run(scenario())
