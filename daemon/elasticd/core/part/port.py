"""The part's port: what the in-place policy (inplace.py) and the spares (spares.py) may
read and do of a part.  ``PartCore`` (machine.py) is the one implementation; the policies
import this protocol, never the machine, so no import goes in a circle."""

from __future__ import annotations

from typing import Any, Protocol

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import Failure, JobSpec, PartState, WorkerGroup
from elasticd.core.part.phases import Phase
from elasticd.core.part.pool import Pool
from elasticd.core.policy import Decision, Observed
from elasticd.core.records import Outcome
from elasticd.core.story import Story
from elasticd.rendezvous import Reason, RendezvousInfo

Instructions = list[do.Instruction]


class PartSettingsView(Protocol):
    @property
    def node(self) -> str: ...

    @property
    def dead_after(self) -> float: ...


class PartPort(Protocol):
    """A part as its policies see it."""

    # what the part is and holds (read; changed only through the methods below)
    spec: JobSpec
    nproc: int
    spares: int
    gpus: tuple[str, ...]
    started: float | None
    info: RendezvousInfo | None
    group: WorkerGroup | None
    failures: tuple[Failure, ...]
    phase: Phase
    ended: Outcome | None
    leaving: Reason | None
    report_state: PartState
    pool: Pool | None
    story: Story

    @property
    def job(self) -> str: ...

    @property
    def settings(self) -> PartSettingsView: ...

    # operations and timers
    def new_op(self, role: str) -> int: ...
    def forget_op(self, role: str) -> None: ...
    def done(self, event: Any) -> None: ...
    def drop(self, *roles: str) -> Instructions: ...

    # moves of the machine
    def move_to(self, phase: Phase) -> None: ...
    def told(self, why: str, now: ev.Now, out: Instructions) -> Instructions: ...
    def workers_run(self, now: ev.Now) -> Instructions: ...
    def regroup(self, group: WorkerGroup) -> None: ...
    def give_back_spares(self, n: int) -> None: ...
    def report(
        self,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
        barrier: dict[str, Any] | None = None,
    ) -> Instructions: ...
    def end(
        self,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
    ) -> Instructions: ...
    def join(self, now: ev.Now, nproc: int | None = None) -> Instructions: ...
    def enter_round(
        self, info: RendezvousInfo, group: WorkerGroup, now: ev.Now
    ) -> Instructions: ...
    def watch(self, now: ev.Now, notice_waiting: bool | None = None) -> Instructions: ...
    def observe(self, seen: Observed, now: ev.Now) -> Instructions: ...
    def stop_then(
        self,
        decision: Decision,
        seen: Observed,
        reason: Reason | None = None,
        new_pool: bool = False,
    ) -> Instructions: ...
    def request(
        self,
        reason: Reason,
        seen: Observed | None,
        now: ev.Now,
        lost: tuple[str, ...] = (),
        current: bool = False,
    ) -> Instructions: ...
    def rejoin(self, now: ev.Now) -> Instructions: ...
    def finish(
        self,
        outcome: Outcome,
        state: PartState,
        now: ev.Now,
        info: RendezvousInfo | None = None,
        group: WorkerGroup | None = None,
        on_store_failure: PartState = PartState.LEFT,
    ) -> Instructions: ...
    def depart(
        self, now: ev.Now, info: RendezvousInfo | None, group: WorkerGroup | None
    ) -> Instructions: ...
