"""One node's job service in-process: its registry, its board over a store shared with the
other nodes of the test, its board follower and its NodeShell, with no effectors (nothing
is started: what the shell does with the board and the registry)."""

from __future__ import annotations

from typing import Any

from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.jobs.board import BoardFollower, JobBoard
from elasticd.jobs.history import History
from elasticd.jobs.registry import JobRegistry
from elasticd.shell.node import NodeShell
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer


class ShellNode:
    def __init__(
        self, name: str, store: MemoryStore, tmp_path: Any, signer: Signer, **registry: Any
    ) -> None:
        self.registry = JobRegistry(History(str(tmp_path / f"{name}.sqlite")), **registry)
        self.board = JobBoard(AsyncMemoryStore(store), signer, "c")
        self.follower = BoardFollower(self.board, self.registry, name)
        core = NodeCore(NodeSettings(name, Resources(2, ()), dead_after=3.0, judge_users=False))
        self.service = NodeShell(
            core,
            effectors=None,
            board=self.board,
            follower=self.follower,
            registry=self.registry,
            metrics=None,
        )
