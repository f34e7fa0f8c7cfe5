"""One job's agent must never take the daemon down: it is contained, and the others run on.

In-process, with the real node core and shell, rendezvous and workers over an in-memory
store that fails every write of one job's outcome: that job's rendezvous state is tampered
with, so its agent takes the path for an unexpected error, which records the job's failure
in the store, which fails.  That StoreError used to escape the agent into the job service's
task group, which then cancelled every other job and ended the daemon."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from harness import WORKER

from elasticd.core.liveness import KeepAlive
from elasticd.core.model import JobSpec, PartState
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.errors import StoreConnectionError
from elasticd.jobs.board import BoardFollower, JobBoard
from elasticd.jobs.history import History
from elasticd.jobs.registry import JobRegistry
from elasticd.metrics import Metrics
from elasticd.shell.effectors import Effectors
from elasticd.shell.logs import LogBus
from elasticd.shell.node import NodeShell
from elasticd.store.keyspace import Keyspace
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer


class FailingWrites(MemoryStore):
    """A memory store whose compare-and-set fails on keys containing ``broken``."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken
        self.failed = 0

    def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        if self.broken in key:
            self.failed += 1
            raise StoreConnectionError(f"injected: cannot write {key}")
        return super().compare_set(key, expected, desired)


class NoPeers:
    async def unreachable(self, nodes: list[str], timeout: float) -> list[str]:
        return []


def spec(job_id: str, workdir: Path) -> JobSpec:
    return JobSpec(
        id=job_id,
        argv=(str(WORKER), "--sleep", "0"),
        python=sys.executable,
        workdir=str(workdir),
        uid=os.getuid(),
        gid=os.getgid(),
        user="tester",
        env={"PATH": os.environ["PATH"]},
        join_timeout=60.0,
        created=1.0,
    )


def test_a_store_error_in_one_agent_leaves_the_others_and_the_service_running(tmp_path):
    store = FailingWrites(broken=f"{Keyspace('default').rendezvous('j-bad000')}/state")
    registry = JobRegistry(History(str(tmp_path / "history.sqlite")))
    os.makedirs(tmp_path / "logs", mode=0o755)

    def job_service(shared: AsyncMemoryStore) -> NodeShell:
        signer = Signer(b"k" * 32, "c")
        board = JobBoard(shared, signer, "default")
        effectors = Effectors(
            node="n1",
            address="127.0.0.1",
            store=shared,
            signer=signer,
            keyspace=Keyspace("default"),
            keep_alive=KeepAlive(),
            log_root=str(tmp_path / "logs"),
            metrics=Metrics(),
            logs=LogBus(),
            probe=NoPeers(),
            refused=lambda key, why: None,
            stop_grace=1.0,
        )
        core = NodeCore(
            NodeSettings(
                "n1",
                Resources(4),
                dead_after=KeepAlive().dead_after,
                allow_root=True,
                judge_users=False,
            )
        )
        return NodeShell(
            core,
            effectors=effectors,
            board=board,
            registry=registry,
            metrics=Metrics(),
            follower=BoardFollower(board, registry, "n1"),
        )

    async def scenario() -> None:
        shared = AsyncMemoryStore(store)
        service = job_service(shared)
        stop = asyncio.Event()
        running = asyncio.create_task(service.run(stop))
        await asyncio.sleep(0)
        await service.submit(spec("j-bad000", tmp_path))
        await service.submit(spec("j-good00", tmp_path))
        good = registry.get("j-good00")
        while not (
            PartState.RUNNING == getattr(good.parts.get("n1"), "state", None)
            and store.failed
            and "j-bad000" not in service.local_jobs()
        ):
            async with asyncio.timeout(30):
                good = await registry.wait_change("j-good00", good.version)
        assert not running.done(), "the node's service ended with the bad job's part"
        assert service.local_jobs() == ["j-good00"]  # the good job runs on
        stop.set()
        async with asyncio.timeout(30):
            await running  # and the service ends normally when told to
        await shared.close()

    asyncio.run(scenario())
