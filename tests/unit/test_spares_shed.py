"""Hot spares are the first capacity a node gives back (docs/in-place.md; core/part/spares.py): a job that
fits on a node only in the room of another job's spares makes that job stop them (parked
first, never a placed worker), and starts once their processes are reaped.  The node core and
the part driven by stimuli, as the shell feeds them; the answers are the core's instructions."""

from __future__ import annotations

from typing import Any

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import JobSpec, Worker, WorkerGroup, WorkerState
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.part import PartCore, PartSettings, Phase, Pool, SlotState, spares
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord
from elasticd.rendezvous import EventKind, Member, NextRound, Reason, RendezvousInfo, RoundEvent

NODE = "n1"
A, B, C = "j-000001", "j-000002", "j-000003"


def spec(job: str, nproc: int = 1, **kw: Any) -> JobSpec:
    return JobSpec(
        id=job,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1,
        gid=1,
        user="u",
        nproc_per_node=nproc,
        max_restarts=3,
        **kw,
    )


def at(mono: float) -> ev.Now:
    return ev.Now(mono, 1000.0 + mono)


def info(
    job: str, round: int = 0, nproc: int = 1, reason: Reason = Reason.INITIAL
) -> RendezvousInfo:
    return RendezvousInfo(
        job, round, reason, 0, 0, 1, nproc, 0, nproc, "a", 1, (Member(NODE, "a", nproc, 0, 0),)
    )


def of(out: list[do.Instruction], kind: type) -> list[Any]:
    return [i for i in out if isinstance(i, kind)]


def said(out: list[do.Instruction]) -> list[str]:
    return [i.message % i.args for i in of(out, do.Say)]


def workers(part: PartCore, *states: WorkerState) -> ev.WorkersChanged:
    group = part.group
    assert group is not None
    changed = tuple(
        Worker(
            w.local_rank,
            w.rank,
            w.world_size,
            w.node,
            100 + w.local_rank,
            state,
            None if state is WorkerState.HEALTHY else -15,
        )
        for w, state in zip(group.workers, states)
    )
    return ev.WorkersChanged(part.job, WorkerGroup(**{**group.__dict__, "workers": changed}))


# -- the part ----------------------------------------------------------------------------------


def running_part(nproc: int = 2, spare: int = 1) -> PartCore:
    """A part of 2 workers and a spare on GPUs g0..g2, in its first round, every one asked."""
    part = PartCore(
        spec(A, nproc, in_place=True, spares=spare),
        nproc,
        ("g0", "g1", "g2")[: nproc + spare],
        PartSettings(NODE, 3.0),
        pool=Pool(),
        spares=spare,
    )
    out = part.start(at(0))
    part.handle(ev.RoundJoined(A, of(out, do.Join)[-1].op, info(A, nproc=nproc)), at(1))
    part.handle(workers(part, *[WorkerState.HEALTHY] * (nproc + spare)), at(1))
    for slot in range(nproc + spare):
        part.handle(ev.WorkerAsked(A, slot, -1, "start", ""), at(2))
    return part


def published(out: list[do.Instruction]) -> Any:
    return of(out, do.Publish)[-1].part


def own_slots(part: PartCore) -> list[int]:
    assert part.pool is not None
    return part.pool.own(part.nproc + part.spares)


def test_a_parked_spare_is_given_back_and_its_slot_never_warms_again():
    part = running_part()
    assert part.pool.slots[2] is SlotState.READY and spares.sheddable(part) == [2]
    slots, out = spares.shed(part, 5, at(3))
    assert slots == (2,) and of(out, do.ForgetSlots)[0].slots == (2,)
    assert (
        part.spares == 0
        and part.pool.slots[2] is SlotState.EMPTY
        and spares.given_gpus(part) == ("g2",)
    )
    shown = published(out)
    assert (shown.spares, shown.slots, shown.gpus) == (0, 2, 2)
    assert spares.sheddable(part) == []  # nothing more to give
    out = part.handle(
        workers(part, WorkerState.HEALTHY, WorkerState.HEALTHY, WorkerState.STOPPED), at(4)
    )
    assert (
        not of(out, do.StopWorkers) and not of(out, do.RequestRound) and part.phase is Phase.RUNNING
    )
    # a worker fails later: its slot warms up again, the given-back one does not
    part.handle(workers(part, WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.STOPPED), at(5))
    out = part.handle(ev.RoundRequested(A, part.ops["main"], NextRound.OPENED), at(6))
    assert of(out, do.WarmWorkers)[0].slots == (1,) and own_slots(part) == [0, 1]


def test_a_warming_spare_in_a_low_slot_is_given_back_and_the_placed_one_keeps_its_gpu():
    """The spare took slot 1's place when it failed; slot 1 warms up as the new spare: it is
    the one given back, and the placed worker in slot 2 keeps LOCAL_RANK 2 (GPU g2)."""
    part = running_part()
    part.handle(workers(part, WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.HEALTHY), at(3))
    out = part.handle(ev.RoundRequested(A, part.ops["main"], NextRound.OPENED), at(4))
    assert of(out, do.WarmWorkers)[0].slots == (1,)
    out = part.handle(
        ev.RoundJoined(A, of(out, do.Join)[-1].op, info(A, 1, nproc=2, reason=Reason.FAILURE)),
        at(5),
    )
    assert sorted(of(out, do.PlaceWorkers)[0].envs) == [0, 2]
    assert part.pool.slots[1] is SlotState.WARMING and spares.sheddable(part) == [1]
    slots, _ = spares.shed(part, 1, at(6))
    assert slots == (1,) and spares.given_gpus(part) == ("g1",) and own_slots(part) == [0, 2]
    assert part.gpus == ("g0", "g1", "g2")  # one per slot number: LOCAL_RANK 2 is still g2
    part.handle(ev.WorkerAsked(A, 1, -1, "start", ""), at(7))  # a late ask of the stopped spare
    assert part.pool.slots[1] is SlotState.EMPTY and not spares.sheddable(part)
    # slot 2 fails: only slot 2 warms up again, the new world has slots 0 and 2
    part.handle(workers(part, WorkerState.HEALTHY, WorkerState.STOPPED, WorkerState.FAILED), at(8))
    out = part.handle(ev.RoundRequested(A, part.ops["main"], NextRound.OPENED), at(9))
    assert of(out, do.WarmWorkers)[0].slots == (2,)


def test_placed_workers_and_spares_warming_for_a_place_are_never_given_back():
    part = running_part(spare=0)
    assert spares.sheddable(part) == [] and spares.shed(part, 1, at(3)) == ((), [])
    part = running_part()
    part.handle(
        ev.RoundChanged(A, part.ops["watch"], RoundEvent(EventKind.NEXT_ROUND, Reason.SCALE_UP)),
        at(3),
    )
    assert part.phase is not Phase.RUNNING and spares.sheddable(part) == []  # a join may place it


# -- the node ------------------------------------------------------------------------------------


def node(slots: int = 2, gpus: tuple[str, ...] = ()) -> NodeCore:
    return NodeCore(NodeSettings(NODE, Resources(slots, gpus), dead_after=3.0, judge_users=False))


def with_parked_spares(core: NodeCore, records: list[JobRecord]) -> None:
    """The jobs start here and train; each one's spare parks."""
    out = core.handle(ev.JobsChanged(tuple(records)), at(0))
    for join in of(out, do.Join):
        part = core.parts[join.job]
        core.handle(ev.RoundJoined(join.job, join.op, info(join.job, nproc=part.nproc)), at(1))
        core.handle(workers(part, *[WorkerState.HEALTHY] * (part.nproc + part.spares)), at(1))
        for slot in range(part.nproc + part.spares):
            core.handle(ev.WorkerAsked(join.job, slot, -1, "start", ""), at(2))
        assert spares.sheddable(part)


def test_a_job_that_fits_only_in_a_spares_room_starts_once_the_spare_is_reaped():
    core = node(2, ("0", "1"))
    a = JobRecord(spec(A, in_place=True, spares=1), 1)
    with_parked_spares(core, [a])
    assert core.offers[A].slots == 2 and core.offers[A].gpus == ("0", "1")
    out = core.handle(ev.JobsChanged((a, JobRecord(spec(B), 2))), at(3))
    shed = of(out, do.ShedSpares)
    assert len(shed) == 1 and shed[0].job == A and shed[0].slots == (1,) and shed[0].op < 0
    assert not of(out, do.StartPart), "the spare's process still runs"
    assert core.parts[A].spares == 0 and published(out).spares == 0
    out = core.handle(ev.JobsChanged((a, JobRecord(spec(B), 2))), at(4))  # anything else, meanwhile
    assert not of(out, do.ShedSpares) and not of(out, do.StartPart)
    out = core.handle(ev.SparesShed(A, shed[0].op, (1,)), at(5))
    assert f"job {A}: gave back 1 spare slots to job {B}" in said(out)
    start = of(out, do.StartPart)
    assert [s.job for s in start] == [B] and start[0].gpus == ("1",)
    assert core.offers[A].slots == 1 and core.offers[A].gpus == ("0",) and not core.shedding


def test_a_job_that_fits_anyway_or_never_takes_no_spare():
    core = node(3)
    a = JobRecord(spec(A, in_place=True, spares=1), 1)
    with_parked_spares(core, [a])
    out = core.handle(ev.JobsChanged((a, JobRecord(spec(B), 2))), at(3))
    assert [s.job for s in of(out, do.StartPart)] == [B] and not of(out, do.ShedSpares)
    assert core.parts[A].spares == 1
    out = core.handle(ev.JobsChanged((a, JobRecord(spec(B), 2), JobRecord(spec(C, 2), 3))), at(4))
    assert not of(out, do.ShedSpares) and not of(out, do.StartPart)  # C needs 2: only 1 spare here


def test_a_spare_that_could_not_be_stopped_keeps_its_slot():
    core = node(2)
    a = JobRecord(spec(A, in_place=True, spares=1), 1)
    with_parked_spares(core, [a])
    out = core.handle(ev.JobsChanged((a, JobRecord(spec(B), 2))), at(3))
    out = core.handle(ev.SparesShed(A, of(out, do.ShedSpares)[0].op, ()), at(4))
    assert (
        not of(out, do.StartPart)
        and core.offers[A].slots == 2
        and "could not be stopped" in said(out)[0]
    )


def test_the_lowest_priority_newest_jobs_spares_go_first():
    core = node(5)
    a = JobRecord(spec(A, in_place=True, spares=1), 1)
    b = JobRecord(spec(B, in_place=True, spares=1, priority=5), 2)
    with_parked_spares(core, [a, b])
    c = JobRecord(spec(C, 2), 3)
    out = core.handle(ev.JobsChanged((a, b, c)), at(3))  # 1 slot free: one spare must go, A's
    assert [(s.job, s.slots) for s in of(out, do.ShedSpares)] == [(A, (1,))]
    assert core.parts[B].spares == 1
    core = node(5)
    b = JobRecord(spec(B, in_place=True, spares=1), 2)
    with_parked_spares(core, [a, b])
    out = core.handle(ev.JobsChanged((a, b, c)), at(3))  # the same priority: the newest's
    assert [(s.job, s.slots) for s in of(out, do.ShedSpares)] == [(B, (1,))]


def test_a_spare_reaped_after_its_part_closed_changes_nothing():
    core = node(2)
    a = JobRecord(spec(A, in_place=True, spares=1), 1)
    with_parked_spares(core, [a])
    out = core.handle(ev.JobsChanged((a, JobRecord(spec(B), 2))), at(3))
    op = of(out, do.ShedSpares)[0].op
    out = core.handle(ev.PartClosed(A), at(4))  # A's part left meanwhile; a new one of A starts
    assert [(s.job, s.nproc) for s in of(out, do.StartPart)] == [(A, 2)]
    out = core.handle(
        ev.SparesShed(A, op, (1,)), at(5)
    )  # the old part's spare: the new one keeps its room
    assert not said(out) and core.offers[A].slots == 2 and not core.shedding
