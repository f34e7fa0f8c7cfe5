"""Properties of the part's machine over random runs (hypothesis): a simulated world answers
each operation the part starts, in any order and with any plausible result, and throws in
what may happen meanwhile (a worker exits, the job ends, the node is drained, a member is
lost, a timer fires, a stale completion arrives).  Whatever happens:

- no stimulus a part may meet raises (no illegal transition, of phase, part state or slot);
- restarts never exceed the job's budget, and the job fails once it is spent;
- a part asks to write its job's outcome at most once, and ends exactly once: after its
  ClosePart it says nothing more; once the job has ended and the world stops throwing things
  in, the part ends.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import JobSpec, JobState, Worker, WorkerGroup, WorkerState
from elasticd.core.part import PartCore, PartSettings, Phase, Pool
from elasticd.core.records import Outcome
from elasticd.rendezvous import (
    CHARGED,
    EventKind,
    Member,
    NextRound,
    Reason,
    RendezvousInfo,
    RoundEvent,
)

ME = "n1"
JOB = "j-000001"
PEERS = ("n2", "n3")


class World:
    """The rendezvous, the workers, the store and the clock around one part."""

    def __init__(self, data: Any, in_place: bool, max_restarts: int) -> None:
        self.data = data
        self.spec = JobSpec(
            id=JOB,
            argv=("t.py",),
            python="/p",
            workdir="/w",
            uid=1,
            gid=1,
            user="u",
            min_nodes=1,
            max_nodes=3,
            max_restarts=max_restarts,
            in_place=in_place,
        )
        self.part = PartCore(
            self.spec,
            2,
            (),
            PartSettings(ME, 3.0),
            started=data.draw(st.sampled_from([None, 5.0])),
            pool=Pool() if in_place else None,
        )
        self.mono = 0.0
        self.round = 0
        self.restarts = 0  # charged rounds the rendezvous granted
        self.counted = 0  # Count("restarted") the part gave
        self.finishes = 0
        self.closed = False
        self.ended = False
        self.pending: dict[int, do.Instruction] = {}
        self.timers: set[str] = set()
        self.group: WorkerGroup | None = None
        self.said: list[do.Instruction] = []

    def now(self) -> ev.Now:
        self.mono += 0.5
        return ev.Now(self.mono, 1000.0 + self.mono)

    # -- the part's answers, taken in --------------------------------------------------------

    def take(self, out: list[do.Instruction]) -> None:
        assert not (self.closed and out), f"a closed part spoke: {out}"
        self.said += out
        for i in out:
            op = getattr(i, "op", None)
            if isinstance(i, do.Cancel):
                self.pending.pop(i.op, None)
            elif op is not None:
                self.pending[op] = i
            if isinstance(i, do.Finish):
                self.finishes += 1
                assert self.finishes == 1, "a part wrote its job's outcome twice"
            elif isinstance(i, do.ClosePart):
                self.closed = True
            elif isinstance(i, do.SetTimer):
                self.timers.add(i.name)
            elif isinstance(i, do.ClearTimer):
                self.timers.discard(i.name)
            elif isinstance(i, do.Count) and i.what == "restarted":
                self.counted += 1
            elif isinstance(i, (do.StartWorkers, do.NewPool)):
                self.group = i.group if isinstance(i, do.NewPool) or not i.pool else self.group
            elif isinstance(i, do.WarmWorkers) and self.group is not None:
                self.group = _with(self.group, {s: Worker(s, -1, 0, ME) for s in i.slots})

    def feed(self, event: ev.PartEvent) -> None:
        self.take(self.part.handle(event, self.now()))

    # -- what the world does ------------------------------------------------------------------

    def step(self) -> None:
        moves = ["answer"] * 4 + [
            "worker",
            "stale",
            "ask",
            "timer",
            "lost",
            "leave",
            "end",
            "saved",
        ]
        move = self.data.draw(st.sampled_from(moves))
        if move == "answer" and self.pending:
            self.answer(self.data.draw(st.sampled_from(sorted(self.pending))))
        elif move == "worker" and self.group is not None:
            self.worker()
        elif move == "saved":
            self.feed(ev.CheckpointsChanged(JOB, ({"id": f"step_{self.mono}"},)))
        elif move == "stale":
            self.feed(
                ev.RoundChanged(JOB, 10_000, RoundEvent(EventKind.NEXT_ROUND, Reason.FAILURE))
            )
        elif move == "ask" and self.part.in_place:  # only in-place workers have a channel
            slot = self.data.draw(st.sampled_from([0, 1]))
            why = self.data.draw(st.sampled_from(["start", "interrupt", "failure"]))
            self.feed(
                ev.WorkerAsked(
                    JOB, slot, self.data.draw(st.sampled_from([-1, self.round])), why, "x"
                )
            )
        elif move == "timer" and self.timers:
            name = self.data.draw(st.sampled_from(sorted(self.timers)))
            self.timers.discard(name)
            self.feed(ev.TimerFired(JOB, name))
        elif move == "lost":
            self.take(
                self.part.handle(
                    ev.NodesLost((self.data.draw(st.sampled_from(PEERS)),)), self.now()
                )
            )
        elif move == "leave":
            reason = self.data.draw(st.sampled_from([Reason.DRAIN, Reason.SHUTDOWN]))
            self.take(self.part.handle(ev.Leaving(JOB, reason), self.now()))
        elif move == "end" and not self.ended:
            self.end(
                self.data.draw(
                    st.sampled_from([JobState.CANCELLED, JobState.FAILED, JobState.SUCCEEDED])
                )
            )

    def end(self, state: JobState) -> None:
        self.ended = True
        self.take(self.part.handle(ev.JobEnded(JOB, Outcome(state, 1.0)), self.now()))

    def worker(self) -> None:
        assert self.group is not None
        slot = self.data.draw(st.sampled_from([w.local_rank for w in self.group.workers]))
        state = self.data.draw(
            st.sampled_from([WorkerState.HEALTHY, WorkerState.SUCCEEDED, WorkerState.FAILED])
        )
        old = self.group.workers[slot]
        if old.state not in (WorkerState.INIT, WorkerState.HEALTHY):
            return  # an ended worker stays ended
        code = (
            None if state is WorkerState.HEALTHY else (0 if state is WorkerState.SUCCEEDED else 1)
        )
        self.group = _with(
            self.group, {slot: replace(old, state=state, exit_code=code, pid=10 + slot)}
        )
        self.feed(ev.WorkersChanged(JOB, self.group))

    def answer(self, op: int, benign: bool = False) -> None:
        i = self.pending.pop(op)
        if not benign and self.data.draw(st.integers(0, 9)) == 0:
            self.feed(ev.OpFailed(JOB, op, self.data.draw(st.booleans()), "injected"))
            return
        self.feed(self.result(i, op, benign))

    def result(self, i: do.Instruction, op: int, benign: bool) -> ev.PartEvent:
        draw = (lambda s: s.example() if False else self.data.draw(s)) if not benign else None
        if isinstance(i, do.Join):
            if draw and draw(st.integers(0, 5)) == 0:
                return ev.JoinFailed(
                    JOB, op, draw(st.sampled_from(["closed", "gone", "timeout"])), "x"
                )
            members = (ME,) + (tuple(draw(st.sets(st.sampled_from(PEERS)))) if draw else ())
            return ev.RoundJoined(JOB, op, self.info(members, i.nproc))
        if isinstance(i, do.Watch):
            kind = draw(st.sampled_from(list(EventKind))) if draw else EventKind.CLOSED
            return ev.RoundChanged(
                JOB,
                op,
                RoundEvent(kind, Reason.FAILURE if kind is EventKind.NEXT_ROUND else None, 1),
            )
        if isinstance(i, do.RequestRound):
            return ev.RoundRequested(JOB, op, self.grant(i, draw))
        if isinstance(i, do.StopWorkers):
            if self.group is not None:
                self.group = _with(
                    self.group,
                    {
                        w.local_rank: replace(w, state=WorkerState.STOPPED, exit_code=-15)
                        for w in self.group.workers
                        if w.state in (WorkerState.INIT, WorkerState.HEALTHY)
                    },
                )
            return ev.WorkersStopped(JOB, op)
        if isinstance(i, do.Probe):
            return ev.PeersProbed(
                JOB, op, tuple(draw(st.sets(st.sampled_from(i.nodes)))) if draw else ()
            )
        if isinstance(i, do.ArriveAtBarrier):
            arrived = (
                draw(st.integers(0, i.info.group_world_size)) if draw else i.info.group_world_size
            )
            return ev.BarrierDone(JOB, op, arrived, i.info.group_world_size)
        if isinstance(i, do.Finish):
            return ev.Finished(JOB, op, i.outcome)
        if isinstance(i, do.PrepareRestore):
            lost = bool(draw and draw(st.integers(0, 5)) == 0)
            return ev.RestorePrepared(JOB, op, "the checkpoint is lost" if lost else "")
        assert isinstance(i, do.Leave), i
        return ev.Left(JOB, op)

    def grant(self, i: do.RequestRound, draw: Any) -> NextRound:
        """As the rendezvous decides (ops.decide_next_round): a charged round only while the
        job-wide budget lasts."""
        if draw and draw(st.integers(0, 6)) == 0:
            return draw(st.sampled_from([NextRound.ALREADY, NextRound.CLOSED]))
        if i.reason in CHARGED:
            if self.restarts >= self.spec.max_restarts:
                return NextRound.EXHAUSTED
            self.restarts += 1
        self.round += 1
        return NextRound.OPENED

    def info(self, members: tuple[str, ...], nproc: int) -> RendezvousInfo:
        people = tuple(Member(n, n, nproc, r, r * nproc) for r, n in enumerate(sorted(members)))
        me = next(m for m in people if m.node == ME)
        return RendezvousInfo(
            JOB,
            self.round,
            Reason.INITIAL,
            self.restarts,
            me.group_rank,
            len(people),
            nproc,
            me.rank_base,
            nproc * len(people),
            people[0].addr,
            1,
            people,
        )


def _with(group: WorkerGroup, changed: dict[int, Worker]) -> WorkerGroup:
    return replace(group, workers=tuple(changed.get(w.local_rank, w) for w in group.workers))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans(), st.integers(0, 2), st.integers(1, 60))
def test_any_run_of_a_part_keeps_its_promises(data, in_place, max_restarts, steps):
    world = World(data, in_place, max_restarts)
    world.take(world.part.start(world.now()))
    for _ in range(steps):
        if world.closed:
            break
        world.step()
    assert world.restarts <= max_restarts and world.counted <= world.restarts + world.said.count(
        do.Count("restarted")
    )  # granted or answered ALREADY: never past what was asked
    # the world stops throwing things in: the job ends, every operation is answered
    if not world.ended:
        world.end(JobState.CANCELLED)
    for _ in range(200):
        if world.closed or not world.pending:
            break
        world.answer(min(world.pending), benign=True)
    assert world.closed, f"the part did not end: phase {world.part.phase}, story:\n" + "\n".join(
        world.part.story.lines()[-25:]
    )
    assert world.part.phase is Phase.CLOSING
    # nothing it hears after its end makes it speak again
    world.feed(ev.WorkersChanged(JOB, world.group or WorkerGroup(JOB, 0, 0, 0, 1, 0, 1, "", 0, ())))
    world.feed(ev.TimerFired(JOB, "rejoin/1"))


@settings(max_examples=100, deadline=None)
@given(st.data(), st.integers(0, 3))
def test_worker_failures_never_restart_past_the_budget(data, max_restarts):
    """Only failures: every one of them is a charged round, until the job fails."""
    world = World(data, False, max_restarts)
    world.take(world.part.start(world.now()))
    for _ in range(8 * (max_restarts + 2)):
        if world.closed:
            break
        if world.pending:
            op = min(world.pending)
            i = world.pending.pop(op)
            if isinstance(i, do.Probe):
                world.feed(ev.PeersProbed(JOB, op, ()))
            elif isinstance(i, do.Watch):
                world.pending[op] = i  # the round goes on until a worker fails
                world.worker_fails()
            else:
                world.feed(world.result(i, op, benign=True))
    assert world.restarts <= max_restarts
    finish = next(i for i in world.said if isinstance(i, do.Finish))
    assert finish.outcome.state is JobState.FAILED and world.restarts == max_restarts


def _worker_fails(self: World) -> None:
    assert self.group is not None
    failed = replace(self.group.workers[0], state=WorkerState.FAILED, exit_code=1, pid=7)
    self.group = _with(self.group, {0: failed})
    self.feed(ev.WorkersChanged(JOB, self.group))


World.worker_fails = _worker_fails  # type: ignore[attr-defined]
