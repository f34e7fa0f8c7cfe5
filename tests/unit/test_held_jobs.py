"""A frozen job is reported, not hidden (docs/security.md, "The store"): a node that refuses a record a job
needs holds the job, says why in its part, and every node shows it held; a restarted node
tells the others what its restart ended; a resync reads what this node knows of even when
the store's indexes were overwritten.  The same against real daemons:
tests/chaos/test_store_forgery.py (C12)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from shell_node import ShellNode

from elasticctl import render
from elasticd.core import instructions as do
from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.records import JobRecord, Outcome, Part, hold_reason, job_doc
from elasticd.metrics import Metrics
from elasticd.store.memory import MemoryStore
from elasticd.store.signing import Signer

SIGNER = Signer(b"k" * 32, "c")
JOBS = "elasticd/c/jobs"
REFUSED = "its outcome record was refused: MAC does not match"


def spec(job_id: str = "j-000001") -> JobSpec:
    return JobSpec(
        id=job_id,
        argv=("train.py",),
        python="/usr/bin/python3",
        workdir="/",
        uid=1000,
        gid=1000,
        user="alice",
        created=1.0,
        min_nodes=2,
        max_nodes=2,
    )


def part(node: str, state: PartState, held: str = "") -> Part:
    ran = state is not PartState.LEFT
    return Part(
        node=node, state=state, round=0 if ran else None, started=1.0 if ran else None, held=held
    )


def test_every_node_that_holds_the_job_is_named_with_its_reason():
    record = JobRecord(
        spec(),
        1,
        {
            "n1": part("n1", PartState.RESTARTING),
            "n2": part("n2", PartState.LEFT, REFUSED),
            "n3": part("n3", PartState.LEFT, "its rendezvous state is gone"),
        },
    )
    assert hold_reason(record) == f"n2: {REFUSED}; n3: its rendezvous state is gone"
    doc = job_doc(record)
    assert doc["held"] == hold_reason(record) and doc["state"] == "RESTARTING"


def test_list_and_status_show_the_hold_and_who_holds_it():
    doc = job_doc(
        JobRecord(
            spec(),
            1,
            {"n1": part("n1", PartState.RESTARTING), "n2": part("n2", PartState.LEFT, REFUSED)},
        )
    )
    assert "HELD (RESTARTING)" in render.jobs_table([doc], now=10.0)
    block = render.status_block(doc, now=10.0)
    assert "HELD (RESTARTING)" in block and f"held:         n2: {REFUSED}" in block


def test_this_nodes_own_hold_shows_until_its_part_says_it_and_an_ended_job_is_not_held():
    record = JobRecord(spec(), 1, {"n1": part("n1", PartState.RUNNING)}, held=REFUSED)
    assert job_doc(record)["held"] == REFUSED
    ended = JobRecord(
        spec(),
        1,
        {"n2": part("n2", PartState.LEFT, REFUSED)},
        outcome=Outcome(JobState.CANCELLED, 2.0, None, "cancelled by alice"),
    )
    assert hold_reason(ended) == "" and job_doc(ended)["held"] is None
    assert job_doc(JobRecord(spec(), 1))["held"] is None


def test_held_jobs_are_counted():
    metrics = Metrics()
    metrics.count_jobs(
        [
            JobRecord(spec("j-000001"), 1, held=REFUSED),
            JobRecord(spec("j-000002"), 2, {"n2": part("n2", PartState.LEFT, REFUSED)}),
            JobRecord(spec("j-000003"), 3),
        ],
        "n1",
    )
    assert metrics.jobs_held._value.get() == 2


class Node(ShellNode):
    """One node's registry, board and job service over a shared in-memory store."""

    def __init__(self, name: str, store: MemoryStore, tmp_path) -> None:
        super().__init__(name, store, tmp_path, SIGNER)

    def settle(self) -> None:
        """What the shell's loop does: every queued event to the core, its instructions done."""
        while not self.service._queue.empty():
            self.service._dispatch(self.service._queue.get_nowait())

    def report(self, job_id: str, part: Part) -> None:
        """A part of this node's, published (the core's Publish instruction, carried out)."""
        self.service._execute(do.Publish(job_id, part))

    async def flush(self) -> bool:
        return await self.service._publisher.flush()


def test_a_node_that_holds_a_job_says_why_in_its_part_and_the_others_show_it(tmp_path):
    store = MemoryStore()
    n1, n2 = Node("n1", store, tmp_path), Node("n2", store, tmp_path)

    async def scenario() -> None:
        await n1.board.publish_spec(spec(), 1)
        await n2.follower.resync()
        await n1.follower.resync()
        n2.registry.hold("j-000001", REFUSED)  # its outcome was refused on n2
        n2.settle()  # the hold reaches n2's part after the change
        own = n2.registry.get("j-000001").parts["n2"]
        assert (own.state, own.held) == (PartState.LEFT, REFUSED)  # it never takes the job
        assert await n2.flush()
        await n1.follower.resync()
        assert job_doc(n1.registry.get("j-000001"))["held"] == f"n2: {REFUSED}"
        assert n1.registry.get("j-000001").held == ""  # n1 refused nothing: it may still place it
        # n2's later parts (an agent's report) keep saying why, while it holds the job
        n2.report("j-000001", part("n2", PartState.RENDEZVOUS))
        assert n2.registry.get("j-000001").parts["n2"].held == REFUSED

    asyncio.run(scenario())


def test_a_restarted_node_republishes_the_parts_its_restart_ended(tmp_path):
    store = MemoryStore()
    n1, n2 = Node("n1", store, tmp_path), Node("n2", store, tmp_path)

    async def scenario() -> None:
        for job_id in ("j-000001", "j-000002"):
            await n2.board.publish_spec(spec(job_id), 1)
        await n2.follower.resync()
        for job_id in ("j-000001", "j-000002"):
            n2.report(job_id, part("n2", PartState.RUNNING))
        assert await n2.flush()
        n2.registry.set_outcome("j-000002", Outcome(JobState.SUCCEEDED, 2.0, 0))
        # n2 was killed and started again: its agents are gone, its parts LEFT (events.Restored)
        ran = n2.registry.get("j-000001").parts["n2"]
        n2.registry.set_part("j-000001", replace(ran, state=PartState.LEFT), own=True)
        n2.service._republish_parts()
        assert list(n2.service._publisher._unpublished) == ["j-000001"]  # not the job that ended
        assert await n2.flush()
        await n1.follower.resync()
        assert n1.registry.get("j-000001").parts["n2"].state is PartState.LEFT
        assert n1.registry.get("j-000001").state is JobState.RESTARTING  # not RUNNING: nothing runs

    asyncio.run(scenario())


def test_a_resync_reads_the_jobs_and_parts_this_node_knows_whatever_the_indexes_say(tmp_path):
    store = MemoryStore()
    n1, n2 = Node("n1", store, tmp_path), Node("n2", store, tmp_path)

    async def scenario() -> None:
        await n1.board.publish_spec(spec(), 1)
        await n1.board.publish_part("j-000001", part("n1", PartState.RUNNING))
        await n2.follower.resync()
        assert n2.registry.get("j-000001").parts["n1"].state is PartState.RUNNING
        await n1.board.publish_part("j-000001", part("n1", PartState.RESTARTING))
        store.set(f"{JOBS}/index", b"garbage\n")  # both indexes overwritten
        store.set(f"{JOBS}/parts/j-000001", b"garbage\n")
        assert await n1.board.snapshot() == (await n1.board.head(), [])  # a node that knows nothing
        await n2.follower.resync()
        assert n2.registry.get("j-000001").parts["n1"].state is PartState.RESTARTING

    asyncio.run(scenario())
