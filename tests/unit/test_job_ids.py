"""A submit's job id is one that no job ever had, in this node's registry or in the store:
ids are short, and the store keeps the outcome of every job that retention forgot."""

import asyncio

import pytest
from shell_node import ShellNode

from elasticd.core.model import JobSpec, JobState
from elasticd.core.records import Outcome
from elasticd.errors import LimitExceeded
from elasticd.faults import Throttle
from elasticd.jobs import board as board_module
from elasticd.jobs.board import JOB_ID, JobBoard, new_job_id
from elasticd.jobs.retention import BoardSweeper
from elasticd.shell import node as node_module
from elasticd.store.memory import MemoryStore
from elasticd.store.signing import Signer

SIGNER = Signer(b"k" * 32, "c")
NOW = 100_000.0
RETENTION = 100.0


def spec(job_id: str, created: float) -> JobSpec:
    return JobSpec(
        id=job_id, argv=("t.py",), python="/p", workdir="/w", uid=1, gid=1, user="u",
        created=created,
    )  # fmt: skip


def node(name: str, store: MemoryStore, tmp_path) -> ShellNode:
    return ShellNode(name, store, tmp_path, SIGNER, retention=RETENTION, clock=lambda: NOW)


async def forgotten_job(board: JobBoard, job_id: str) -> None:
    """A job that ran and ended long ago, swept from the store by retention."""
    seq = await board.publish_spec(spec(job_id, 1.0))
    outcome = Outcome(JobState.FAILED, NOW - 10 * RETENTION, message="it failed then")
    await board.publish_outcome(job_id, outcome)
    await board.publish_ended(spec(job_id, 1.0), seq, outcome)
    sweeper = BoardSweeper(board, lambda: True, RETENTION, told=Throttle(), clock=lambda: NOW)
    assert await sweeper.sweep() == [job_id]


def test_a_job_under_a_forgotten_job_s_id_would_end_before_it_ran(tmp_path):
    """Why ids are checked against the store: the forgotten job's outcome stays (a spec
    record written back must read as ended), so a new spec under its id reads as ended."""
    store = MemoryStore()
    n1 = node("n1", store, tmp_path)

    async def scenario() -> None:
        await forgotten_job(n1.board, "j-01d01d")
        position = await n1.board.head()
        await n1.board.publish_spec(spec("j-01d01d", NOW))  # a new job that drew the id
        _, changes = await n1.board.follow(position, 1.0)
        n1.follower.apply(changes)
        record = n1.registry.get("j-01d01d")
        assert record.spec.created == NOW
        assert record.outcome is not None and record.outcome.state is JobState.FAILED

    asyncio.run(scenario())


def test_a_new_id_is_none_a_job_in_the_registry_or_the_store_ever_had(tmp_path, monkeypatch):
    store = MemoryStore()
    n1, n2 = node("n1", store, tmp_path), node("n2", store, tmp_path)

    async def scenario() -> None:
        await forgotten_job(n1.board, "j-01d01d")  # only its outcome is left
        await n2.service.submit(spec("j-5ab017", NOW))  # submitted at n2; n1 has not read it
        n1.registry.add(spec("j-10ca11", NOW), 1)  # known here only (not yet on the board)
        assert n1.registry.find("j-01d01d") is None and n1.registry.find("j-5ab017") is None
        drawn = iter(["j-01d01d", "j-5ab017", "j-10ca11", "j-f4e5a1"])
        monkeypatch.setattr(node_module, "new_job_id", lambda length: next(drawn))
        assert await n1.service.unused_job_id() == "j-f4e5a1"
        # where the short ids are mostly taken, longer ones are drawn
        lengths: list[int] = []

        def taken_unless_long(length: int) -> str:
            lengths.append(length)
            return "j-01d01d" if length < 10 else new_job_id(length)

        monkeypatch.setattr(node_module, "new_job_id", taken_unless_long)
        assert len(await n1.service.unused_job_id()) == 2 + 10
        assert lengths == [6] * 8 + [8] * 8 + [10]
        # a store that holds every id it is asked about: a bounded search, then a refusal
        monkeypatch.setattr(node_module, "new_job_id", lambda length: "j-01d01d")
        with pytest.raises(LimitExceeded, match="no unused job id in 64 draws"):
            await n1.service.unused_job_id()

    asyncio.run(scenario())


def test_a_submit_that_lost_its_id_to_another_node_s_draws_again(tmp_path, monkeypatch):
    """The check before the draw is a read: two nodes may draw one id and both find it
    unused.  The first to publish keeps it; the other draws again, overwriting nothing."""
    store = MemoryStore()
    n1, n2 = node("n1", store, tmp_path), node("n2", store, tmp_path)

    async def scenario() -> None:
        checked = n1.board.ever_had

        async def raced(job_id: str) -> bool:
            had = await checked(job_id)
            if job_id == "j-5a3e1d" and n2.registry.find(job_id) is None:
                await n2.service.submit(spec(job_id, NOW - 1))  # n2 publishes it now
            return had

        monkeypatch.setattr(n1.board, "ever_had", raced)
        drawn = iter(["j-5a3e1d", "j-0f1e2d"])
        monkeypatch.setattr(node_module, "new_job_id", lambda length: next(drawn))
        record = await n1.service.submit_new(spec("j-000000", NOW))
        assert record.id == "j-0f1e2d" and n1.registry.find("j-5a3e1d") is None
        await n2.follower.resync()
        assert n2.registry.get("j-5a3e1d").spec.created == NOW - 1  # n2's job, untouched
        assert n2.registry.get("j-0f1e2d").spec.created == NOW
        # a store where every drawn id is published by another node first: a refusal
        monkeypatch.setattr(node_module, "new_job_id", lambda length: "j-5a3e1d")
        monkeypatch.setattr(n1.board, "ever_had", lambda job_id: asyncio.sleep(0, False))
        with pytest.raises(LimitExceeded, match="8 draws in a row lost their job id"):
            await n1.service.submit_new(spec("j-000000", NOW))
        assert n1.registry.find("j-5a3e1d") is None

    asyncio.run(scenario())


def test_ids_look_like_the_ones_the_docs_and_the_journal_parse():
    assert all(JOB_ID.match(new_job_id()) and len(new_job_id()) == 8 for _ in range(100))
    assert all(JOB_ID.match(new_job_id(n)) for n in (6, 8, 10, 12))
    assert not JOB_ID.match("j-0123456789abc") and not JOB_ID.match("j-01234")
    assert board_module.new_job_id is new_job_id is node_module.new_job_id
