"""The part's machine (core/part/machine.py, core/part/inplace.py) driven by stimulus tables, as dask's
tests drive WorkerState.handle_stimulus: every path of a job on a node, each stimulus
answered by the instructions asserted here.  No process, no store, no clock."""

from __future__ import annotations

from typing import Any

import pytest

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import (
    Failure,
    IllegalTransition,
    JobSpec,
    JobState,
    Worker,
    WorkerGroup,
    WorkerState,
)
from elasticd.core.part import PartCore, PartSettings, Phase, Pool
from elasticd.core.policy import GIVEN_UP_EXIT
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

ME, OTHER = "n1", "n2"
JOB = "j-000001"


def spec(**kw: Any) -> JobSpec:
    fields = dict(
        id=JOB,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1,
        gid=1,
        user="u",
        min_nodes=1,
        max_nodes=2,
        max_restarts=1,
        rejoin_timeout=10.0,
    )
    return JobSpec(**{**fields, **kw})


def info(
    round: int = 0,
    nodes: tuple[str, ...] = (ME, OTHER),
    nproc: int = 2,
    restarts: int = 0,
    reason: Reason = Reason.INITIAL,
) -> RendezvousInfo:
    members = tuple(Member(n, f"{n}.host", nproc, i, i * nproc) for i, n in enumerate(nodes))
    me = next(m for m in members if m.node == ME)
    return RendezvousInfo(
        JOB,
        round,
        reason,
        restarts,
        me.group_rank,
        len(members),
        nproc,
        me.rank_base,
        nproc * len(members),
        members[0].addr,
        1234,
        members,
    )


class Drive:
    """A part and the time: feed stimuli, keep what it said."""

    def __init__(self, in_place: bool = False, started: float | None = None, **kw: Any) -> None:
        self.part = PartCore(
            spec(in_place=in_place, **kw),
            2,
            (),
            PartSettings(ME, 3.0),
            started=started,
            pool=Pool() if in_place else None,
        )
        self.mono = 100.0
        self.said: list[do.Instruction] = []

    def now(self) -> ev.Now:
        return ev.Now(self.mono, 1000.0 + self.mono)

    def start(self) -> list[do.Instruction]:
        return self._keep(self.part.start(self.now()))

    def __call__(self, event: ev.PartEvent) -> list[do.Instruction]:
        return self._keep(self.part.handle(event, self.now()))

    def ended(self, state: JobState = JobState.CANCELLED) -> list[do.Instruction]:
        return self(ev.JobEnded(JOB, Outcome(state, 1.0)))

    def leave(self, reason: Reason) -> list[do.Instruction]:
        return self(ev.Leaving(JOB, reason))

    def _keep(self, out: list[do.Instruction]) -> list[do.Instruction]:
        self.said += out
        return out

    def op(self, kind: type) -> int:
        """The operation of the newest instruction of ``kind``."""
        return next(i.op for i in reversed(self.said) if isinstance(i, kind))

    def workers(
        self, *states: WorkerState, round: int = 0, failed_code: int = 1
    ) -> list[do.Instruction]:
        group = self.part.group
        assert group is not None
        workers = tuple(
            Worker(
                w.local_rank,
                w.rank,
                w.world_size,
                w.node,
                100 + w.local_rank,
                state,
                None
                if state in (WorkerState.INIT, WorkerState.HEALTHY)
                else 0
                if state is WorkerState.SUCCEEDED
                else failed_code,
            )
            for w, state in zip(group.workers, states)
        )
        return self(ev.WorkersChanged(JOB, WorkerGroup(**{**group.__dict__, "workers": workers})))

    def joined(self, round_info: RendezvousInfo) -> list[do.Instruction]:
        return self(ev.RoundJoined(JOB, self.op(do.Join), round_info))


def acts(out: list[do.Instruction]) -> list[do.Instruction]:
    """What is done (what is said and counted left out)."""
    return [i for i in out if not isinstance(i, (do.Say, do.Count))]


def kinds(out: list[do.Instruction]) -> list[str]:
    return [type(i).__name__ for i in acts(out)]


def states(out: list[do.Instruction]) -> list[str]:
    return [i.part.state.value for i in out if isinstance(i, do.Publish)]


def running(drive: Drive, round_info: RendezvousInfo | None = None) -> None:
    drive.start()
    drive.joined(round_info or info())
    drive.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    assert drive.part.phase is Phase.RUNNING


# -- classic jobs -----------------------------------------------------------------------------------


def test_a_round_runs_to_the_exit_barrier_and_succeeds():
    d = Drive()
    assert kinds(d.start()) == ["Publish", "Join"] and states(d.said) == ["RENDEZVOUS"]
    out = d.joined(info())
    assert kinds(out) == ["Publish", "StartWorkers", "Watch"] and states(out) == ["RUNNING"]
    assert [i.what for i in out if isinstance(i, do.Count)] == ["round_joined"]
    out = d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    assert kinds(out) == ["Publish"]
    out = d.workers(WorkerState.SUCCEEDED, WorkerState.SUCCEEDED)
    assert kinds(out) == ["Publish", "Cancel", "StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert kinds(out) == ["ArriveAtBarrier", "Watch"]
    out = d(ev.BarrierProgress(JOB, d.op(do.ArriveAtBarrier), 1, 2))
    assert states(out) == ["BARRIER"] and out[0].part.barrier["done"] == 1
    out = d(ev.BarrierDone(JOB, d.op(do.ArriveAtBarrier), 2, 2))
    assert kinds(out) == ["Cancel", "Finish"] and out[-1].outcome.state is JobState.SUCCEEDED
    out = d(ev.Finished(JOB, d.op(do.Finish), out[-1].outcome))
    assert kinds(out) == ["Publish", "ClosePart"] and states(out) == ["SUCCEEDED"]
    assert d.part.phase is Phase.CLOSING


@pytest.mark.parametrize(
    "restarts, lost, asked_for, counted",
    [
        (0, (), Reason.FAILURE, ["restarted"]),  # a failure, a restart left: everyone re-forms
        (1, (OTHER,), Reason.NODE_LOST, []),  # the peer's daemon is gone: no restart spent
    ],
)
def test_a_worker_failure_re_forms_the_round(restarts, lost, asked_for, counted):
    d = Drive()
    running(d, info(restarts=restarts))
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert kinds(out) == ["Publish", "Cancel", "Probe"] and out[-1].nodes == (OTHER,)
    out = d(ev.PeersProbed(JOB, d.op(do.Probe), lost))
    assert kinds(out) == ["Publish", "StopWorkers"] and states(out) == ["RESTARTING"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert kinds(out) == ["RequestRound"] and (out[0].reason, out[0].lost) == (asked_for, lost)
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    assert kinds(out) == ["Publish", "Join"] and states(out) == ["RESTARTING"]
    assert [i.what for i in out if isinstance(i, do.Count)] == counted


def test_a_failure_without_restarts_left_fails_the_job_with_its_root_cause():
    d = Drive()
    running(d, info(restarts=1))
    d.workers(WorkerState.FAILED, WorkerState.HEALTHY, failed_code=7)
    out = d(ev.PeersProbed(JOB, d.op(do.Probe), ()))
    assert kinds(out) == ["StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    finish = out[-1]
    assert isinstance(finish, do.Finish) and finish.outcome.state is JobState.FAILED
    assert finish.outcome.exit_code == 7 and "max restarts 1 exhausted" in finish.outcome.message
    out = d(ev.Finished(JOB, finish.op, finish.outcome))
    assert states(out) == ["FAILED"] and kinds(out)[-1] == "ClosePart"


def test_a_restart_the_rendezvous_refuses_as_exhausted_fails_the_job():
    d = Drive()
    running(d)
    d.workers(WorkerState.FAILED, WorkerState.HEALTHY)
    d(ev.PeersProbed(JOB, d.op(do.Probe), ()))
    d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.EXHAUSTED))
    assert kinds(out) == ["Finish"] and out[0].outcome.state is JobState.FAILED


def test_a_lost_node_re_forms_a_running_round_at_once():
    d = Drive()
    running(d)
    out = d(ev.NodesLost((OTHER, "n9")))
    assert kinds(out) == ["Cancel", "Publish", "StopWorkers"] and states(out) == ["RESTARTING"]
    out = acts(d(ev.WorkersStopped(JOB, d.op(do.StopWorkers))))
    assert out[0] == do.RequestRound(JOB, d.op(do.RequestRound), 0, Reason.NODE_LOST, (OTHER,))
    assert d(ev.NodesLost(("n9",))) == []  # not a member: nothing to do


@pytest.mark.parametrize("members, decision", [((ME,), "SCALE_UP"), ((ME, OTHER), "WATCH")])
def test_waiting_nodes_scale_the_job_up_below_its_max(members, decision):
    d = Drive()
    running(d, info(nodes=members))
    out = acts(d(ev.RoundChanged(JOB, d.op(do.Watch), RoundEvent(EventKind.WAITING, waiting=1))))
    if decision == "WATCH":
        assert kinds(out) == ["Watch"] and out[0].waiting is False  # at max: stop listening
        return
    assert kinds(out) == ["Publish", "StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert out[0].reason is Reason.SCALE_UP


def test_a_superseded_round_is_left_for_the_next_one():
    d = Drive()
    running(d)
    out = d(ev.RoundChanged(JOB, d.op(do.Watch), RoundEvent(EventKind.NEXT_ROUND, Reason.FAILURE)))
    assert kinds(out) == ["Publish", "StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert kinds(out) == ["Publish", "Join"]


@pytest.mark.parametrize("reason", [Reason.DRAIN, Reason.SHUTDOWN])
def test_a_node_that_leaves_stops_its_workers_then_tells_the_rendezvous(reason):
    d = Drive()
    running(d)
    out = d.leave(reason)
    assert kinds(out) == ["Cancel", "StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert out == [do.Leave(JOB, d.op(do.Leave), reason)]
    out = d(ev.Left(JOB, d.op(do.Leave)))
    assert states(out) == ["LEFT"] and kinds(out)[-1] == "ClosePart"
    assert d.leave(reason) == []  # once


def test_leaving_while_joining_gives_the_join_up():
    d = Drive()
    d.start()
    join = d.op(do.Join)
    out = d.leave(Reason.SHUTDOWN)
    assert out[0] == do.Cancel(JOB, join) and isinstance(out[1], do.Leave)
    assert d(ev.RoundJoined(JOB, join, info())) == []  # the join came anyway: stale, dropped


def test_a_job_that_ends_while_joining_stops():
    d = Drive()
    d.start()
    out = d.ended()
    assert kinds(out) == ["Cancel", "Publish", "ClosePart"] and states(out) == ["STOPPED"]


def test_a_job_that_ends_while_running_stops_its_workers():
    d = Drive()
    running(d)
    out = d.ended()
    assert kinds(out) == ["Cancel", "StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert states(out) == ["STOPPED"]


def test_an_ending_heard_while_stopping_waits_for_the_next_look():
    d = Drive()
    running(d)
    d.workers(WorkerState.FAILED, WorkerState.HEALTHY)
    assert d.ended() == [] and d.part.phase is Phase.PROBING
    d(ev.PeersProbed(JOB, d.op(do.Probe), ()))
    d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    assert states(out) == ["RESTARTING", "STOPPED"] and kinds(out)[-1] == "ClosePart"


def test_a_new_round_while_at_the_barrier_sends_the_node_back_to_work():
    d = Drive()
    running(d)
    d.workers(WorkerState.SUCCEEDED, WorkerState.SUCCEEDED)
    d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    barrier = d.op(do.ArriveAtBarrier)
    out = d(ev.RoundChanged(JOB, d.op(do.Watch), RoundEvent(EventKind.NEXT_ROUND, Reason.FAILURE)))
    assert do.Cancel(JOB, barrier) in out and kinds(out)[-1] == "Join"


@pytest.mark.parametrize(
    "outcome, state", [(JobState.SUCCEEDED, "SUCCEEDED"), (JobState.CANCELLED, "STOPPED")]
)
def test_a_job_that_ends_at_the_barrier(outcome, state):
    d = Drive()
    running(d)
    d.workers(WorkerState.SUCCEEDED, WorkerState.SUCCEEDED)
    d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert states(d.ended(outcome)) == [state]


def test_the_exit_barrier_times_out():
    d = Drive()
    running(d)
    d.workers(WorkerState.SUCCEEDED, WorkerState.SUCCEEDED)
    d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    out = d(ev.BarrierDone(JOB, d.op(do.ArriveAtBarrier), 1, 2))
    assert (
        out[-1].outcome.state is JobState.FAILED and "1/2 nodes finished" in out[-1].outcome.message
    )


@pytest.mark.parametrize(
    "kind, state, held",
    [
        (ev.JoinFailure.CLOSED, "STOPPED", ""),
        (ev.JoinFailure.GONE, "LEFT", "its rendezvous state is gone"),
    ],
)
def test_a_join_that_fails(kind, state, held):
    d = Drive()
    d.start()
    out = d(ev.JoinFailed(JOB, d.op(do.Join), kind, "why"))
    assert states(out) == [state] and out[-1] == do.ClosePart(JOB)
    assert d.part.held.startswith(held) and any(isinstance(i, do.HoldJob) for i in out) == bool(
        held
    )


def test_a_join_timeout_fails_the_job():
    d = Drive()
    d.start()
    out = d(ev.JoinFailed(JOB, d.op(do.Join), ev.JoinFailure.TIMEOUT, "waited 600s"))
    assert kinds(out) == ["Finish"] and out[0].outcome.message == "waited 600s"


def test_a_store_that_does_not_answer_ends_this_nodes_share():
    d = Drive()
    running(d)
    out = d(ev.OpFailed(JOB, d.op(do.Watch), True, "connection refused"))
    assert states(out) == ["LEFT"] and d.part.declined == "connection refused"


def test_a_bug_in_an_operation_fails_the_job_saying_so():
    d = Drive()
    running(d)
    out = d(ev.OpFailed(JOB, d.op(do.Watch), False, "KeyError('x')"))
    assert out[-1].outcome.message == "elasticd agent on n1 failed"
    out = d(ev.OpFailed(JOB, d.op(do.Finish), True, "store gone"))  # and that cannot be recorded
    assert states(out) == ["FAILED"]


def test_an_event_a_phase_does_not_take_raises_and_changes_nothing():
    d = Drive()
    d.start()
    before = (d.part.phase, dict(d.part.ops), d.part.reported)
    with pytest.raises(IllegalTransition):
        d(ev.BarrierProgress(JOB, d.op(do.Join), 1, 2))  # a join is no barrier
    assert (d.part.phase, dict(d.part.ops), d.part.reported) == before


# -- in place -------------------------------------------------------------------------------------


def ask(
    d: Drive, slot: int, after: int = -1, why: str = "start", error: str = ""
) -> list[do.Instruction]:
    return d(ev.WorkerAsked(JOB, slot, after, why, error))


def test_in_place_a_first_round_is_formed_before_its_workers_start():
    d = Drive(in_place=True)
    out = d.start()
    assert kinds(out) == ["NewPool", "Publish", "Join"] and out[-1].nproc == 2
    out = acts(d.joined(info()))
    assert kinds(out) == ["PlaceWorkers", "Notify", "Publish", "StartWorkers", "Watch"]
    assert out[0].envs[1]["RANK"] == "1" and out[0].envs[1]["ELASTICD_ROUND"] == "0"
    assert out[3].pool


def in_place_running(d: Drive) -> None:
    d.start()
    d.joined(info())
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    ask(d, 0)
    ask(d, 1)


def fail_and_reopen(d: Drive, *states: WorkerState) -> list[do.Instruction]:
    """Workers end in ``states``; no peer is lost; the new round opens: the part's answer."""
    d.workers(*states)
    d(ev.PeersProbed(JOB, d.op(do.Probe), ()))
    return d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))


def test_in_place_a_failed_worker_is_replaced_while_the_survivor_trains_on():
    d = Drive(in_place=True)
    in_place_running(d)
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    out = acts(d(ev.PeersProbed(JOB, d.op(do.Probe), ())))
    assert kinds(out) == ["Publish", "Notify", "RequestRound"] and out[1].abort  # no StopWorkers
    out = acts(d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED)))
    # the replacement warms up (with a deadline to ask by); the survivor joins alone
    assert kinds(out) == ["Publish", "ForgetSlots", "WarmWorkers", "SetTimer", "Join"]
    assert out[1].slots == (1,) and out[-1].nproc == 1
    out = d.joined(info(round=1, nproc=1, restarts=1))
    assert kinds(out) == ["PlaceWorkers", "Notify", "SetTimer", "Publish", "Watch"]
    ask(d, 0, after=0, why="interrupt")  # the survivor rejoined
    out = ask(d, 1)  # the replacement warmed up: a scale-up round adds it
    assert (
        kinds(out) == ["Cancel", "ClearTimer", "Publish", "RequestRound"]
        and out[-1].reason is Reason.SCALE_UP
    )


def test_in_place_a_node_whose_every_worker_failed_stays_a_member_with_none():
    """--nnodes 2:2: stepping aside would leave the round below min, and stop its peer."""
    d = Drive(in_place=True)
    in_place_running(d)
    out = acts(fail_and_reopen(d, WorkerState.FAILED, WorkerState.FAILED))
    assert kinds(out) == ["Publish", "ForgetSlots", "WarmWorkers", "SetTimer", "Join"]
    assert out[-1].nproc == 0
    out = acts(d.joined(info(round=1, nproc=0, restarts=1)))
    assert kinds(out) == ["PlaceWorkers", "Notify", "Publish", "Watch"] and not out[0].group.workers
    assert d.part.phase is Phase.RUNNING
    ask(d, 0)
    out = ask(d, 1)  # both warmed up: a scale-up round takes them in
    assert kinds(out) == ["Cancel", "Publish", "RequestRound"] and out[-1].reason is Reason.SCALE_UP


def test_in_place_workers_that_asked_while_their_node_joined_with_none_are_taken_in_after():
    """bench_recovery: a third node's scale-up round came while the first round's workers
    warmed up; the node joined it with none, its workers asked while it joined, and nothing
    asked again: the round formed without them and the job never grew to 3."""
    d = Drive(in_place=True, max_nodes=3)
    d.start()
    d.joined(info())
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    d(ev.RoundChanged(JOB, d.op(do.Watch), RoundEvent(EventKind.WAITING, waiting=1)))
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    assert out[-1].nproc == 0  # nobody asked yet: a member with none
    assert kinds(ask(d, 0)) == kinds(ask(d, 1)) == []  # heard while joining
    out = acts(d.joined(info(round=1, nodes=(ME, OTHER, "n3"), nproc=0, reason=Reason.SCALE_UP)))
    assert kinds(out)[-2:] == ["Publish", "RequestRound"] and out[-1].reason is Reason.SCALE_UP


def test_in_place_a_node_whose_placed_workers_succeeded_goes_to_the_barrier_while_one_warms():
    """A worker still warming up has no place to finish: the placed ones' success is the node's."""
    d = Drive(in_place=True)
    in_place_running(d)
    fail_and_reopen(d, WorkerState.HEALTHY, WorkerState.FAILED)
    d.joined(info(round=1, nproc=1, restarts=1))
    out = d.workers(WorkerState.SUCCEEDED, WorkerState.HEALTHY)
    assert kinds(out)[-1] == "StopWorkers"  # the one warming up goes: the barrier is next
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert kinds(out)[0] == "ArriveAtBarrier" and d.part.phase is Phase.BARRIER


def test_in_place_a_spare_takes_a_failed_workers_place_at_once_and_a_new_one_warms():
    """--spares 1 (docs/in-place.md, "Hot spares"): slot 2 starts with the others, unplaced; it asks and stays
    parked.  When slot 1 fails, the next round takes the spare at once (no warm-up to wait
    for), and slot 1 warms up as the new spare."""
    d = Drive(in_place=True)
    d.part.spares = 1
    out = d.start()
    assert out[0].group.workers[-1].local_rank == 2 and out[-1].nproc == 2  # a pool of 3, 2 placed
    d.joined(info())
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY, WorkerState.HEALTHY)
    ask(d, 0)
    ask(d, 1)
    assert (
        kinds(ask(d, 2)) == ["Publish"] and inplace_parked(d) == 1
    )  # a spare asks and waits: no scale-up
    out = acts(fail_and_reopen(d, WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.HEALTHY))
    assert kinds(out) == ["Publish", "ForgetSlots", "WarmWorkers", "Join"]
    assert out[1].slots == (1,) and out[-1].nproc == 2  # the spare joins in the failed one's place
    out = acts(d.joined(info(round=1, restarts=1)))
    assert sorted(out[0].envs) == [0, 2] and out[0].envs[2]["RANK"] == "1"
    assert inplace_parked(d) == 0
    assert (
        kinds(ask(d, 1)) == ["Publish"] and inplace_parked(d) == 1
    )  # the new spare parks: the round is full


def running_with_a_parked_spare() -> Drive:
    """--spares 1, --nnodes up to 3: two nodes of 2 workers train (world 4), and this
    node's spare (slot 2) asked and is parked."""
    d = Drive(in_place=True, max_nodes=3)
    d.part.spares = 1
    d.start()
    d.joined(info())
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY, WorkerState.HEALTHY)
    for slot in (0, 1, 2):
        ask(d, slot)
    return d


def test_in_place_after_a_node_loss_a_spare_fills_in_until_a_node_comes_back():
    """Hot spares: the survivors re-form without the lost node, then the first member places
    its spare (a scale-up round) so that the job is back at its size; when a node comes,
    the spare steps back and parks again."""
    d = running_with_a_parked_spare()
    out = d(
        ev.RoundChanged(JOB, d.op(do.Watch), RoundEvent(EventKind.NEXT_ROUND, Reason.NODE_LOST))
    )
    assert kinds(out)[-1] == "Join" and out[-1].nproc == 2  # the survivors first, the spare parked
    out = acts(d.joined(info(round=1, nodes=(ME,), reason=Reason.NODE_LOST)))
    assert kinds(out)[-1] == "RequestRound" and out[-1].reason is Reason.SCALE_UP  # 2 < 4: fill in
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    assert kinds(out)[-1] == "Join" and out[-1].nproc == 3
    fill = info(round=2, nodes=(ME,), nproc=3, reason=Reason.SCALE_UP)
    out = acts(d.joined(fill))
    assert sorted(out[0].envs) == [0, 1, 2] and inplace_parked(d) == 0 and kinds(out)[-1] == "Watch"
    out = d(ev.RoundChanged(JOB, d.op(do.Watch), RoundEvent(EventKind.NEXT_ROUND, Reason.SCALE_UP)))
    assert kinds(out)[-1] == "Join" and out[-1].nproc == 2  # a node comes: the spare steps back
    out = acts(d.joined(info(round=3, nodes=(ME, OTHER), reason=Reason.SCALE_UP)))
    assert sorted(out[0].envs) == [0, 1] and inplace_parked(d) == 1 and kinds(out)[-1] == "Watch"
    assert [w.rank for w in d.part.group.workers] == [0, 1, -1]


def test_in_place_a_spare_fills_in_for_a_lost_node_in_the_survivors_round_itself():
    """Hot spares: when the round event names the nodes kept, the survivors' own round takes
    the spare (one re-form, not two): back at full size without a scale-up round."""
    d = running_with_a_parked_spare()
    lost = RoundEvent(EventKind.NEXT_ROUND, Reason.NODE_LOST, nodes=(ME,))
    out = d(ev.RoundChanged(JOB, d.op(do.Watch), lost))
    assert kinds(out)[-1] == "Join" and out[-1].nproc == 3  # 2 lost, 1 spare to fill with
    out = acts(d.joined(info(round=1, nodes=(ME,), nproc=3, reason=Reason.NODE_LOST)))
    assert sorted(out[0].envs) == [0, 1, 2] and inplace_parked(d) == 0
    assert kinds(out)[-1] == "Watch"  # no second round: nothing more to fill with


def inplace_parked(d: Drive) -> int:
    assert d.part.pool is not None
    return len(d.part.pool.parked())


def test_in_place_a_survivor_that_does_not_rejoin_restarts_every_worker():
    d = Drive(in_place=True)
    in_place_running(d)
    fail_and_reopen(d, WorkerState.HEALTHY, WorkerState.FAILED)
    out = d.joined(info(round=1, nproc=1, restarts=1))
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    d.mono += 10.0
    out = d(ev.TimerFired(JOB, timer.name))
    assert kinds(out) == ["Cancel", "Publish", "StopWorkers"]
    out = d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    assert kinds(out) == ["NewPool", "RequestRound"] and out[-1].reason is Reason.STALLED
    out = acts(d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED)))
    assert (
        kinds(out)[-2:] == ["ForgetSlots", "WarmWorkers"] and d.part.phase is Phase.WARMING
    )  # no round of none


def test_in_place_a_node_told_to_abort_that_joins_a_later_round_watches_its_survivor():
    """A paused node came back (test_detector): told to abort for round 1, it joined round 2;
    no rejoin timer was set, and its worker, which never asked, held the round of three."""
    d = Drive(in_place=True)
    in_place_running(d)
    lost = RoundEvent(EventKind.NEXT_ROUND, Reason.NODE_LOST)
    out = d(ev.RoundChanged(JOB, d.op(do.Watch), lost))
    assert any(isinstance(i, do.Notify) and i.abort and i.round == 1 for i in out)
    out = d.joined(info(round=2, reason=Reason.SCALE_UP))
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    assert timer.name.startswith("rejoin/")
    ask(d, 0, after=0, why="interrupt")
    d.mono += 10.0
    out = d(ev.TimerFired(JOB, timer.name))
    assert kinds(out) == ["Cancel", "Publish", "StopWorkers"]  # slot 1 never asked: stalled


def test_in_place_a_survivor_that_asks_while_the_next_round_is_joined_is_not_late():
    """A fresh CI run: the survivor asked while its node joined the next round; the ask was
    dropped, and the rejoin timer stalled a job that trained on."""
    d = Drive(in_place=True)
    in_place_running(d)
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    d(ev.PeersProbed(JOB, d.op(do.Probe), ()))
    d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    assert d.part.phase is Phase.JOINING
    assert ask(d, 0, after=0, why="failure", error="connection closed by peer") == []
    out = d.joined(info(round=1, nproc=1, restarts=1))
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    d.mono += 10.0
    assert d(ev.TimerFired(JOB, timer.name)) == []
    assert d.part.phase is Phase.RUNNING


def late_exit_after_a_failure_round(asked_first: bool) -> list[do.Instruction]:
    """Another node's failure opens round 1 (spending the job's one restart) while this
    node's worker in slot 1 is dying (it raised; its exit takes seconds): both workers are
    carried in, slot 1's then fails (after asking for its place in round 1 first, if
    ``asked_first``).  What the part does then."""
    d = Drive(in_place=True)
    in_place_running(d)
    failure = RoundEvent(EventKind.NEXT_ROUND, Reason.FAILURE)
    d(ev.RoundChanged(JOB, d.op(do.Watch), failure))
    d.joined(info(round=1, restarts=1, reason=Reason.FAILURE))
    ask(d, 0, after=0, why="interrupt")
    if asked_first:
        ask(d, 1, after=0, why="interrupt")
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED, round=1)
    return acts(d(ev.PeersProbed(JOB, d.op(do.Probe), ())))


def test_in_place_a_worker_that_dies_before_taking_its_place_is_the_failure_already_charged():
    """A fresh CI run: rank 1 raised; its peers' collective broke and the suspect timer
    opened a failure round (a restart spent) before rank 1's process had exited; its exit in
    that round spent a second restart for the same failure."""
    out = late_exit_after_a_failure_round(asked_first=False)
    assert kinds(out) == ["ClearTimer", "Publish", "Notify", "RequestRound"] and out[2].abort
    assert out[-1].reason is Reason.LATE_EXIT and Reason.LATE_EXIT not in CHARGED
    # one that took its place in round 1 first failed anew: with no restart left, the job fails
    assert kinds(late_exit_after_a_failure_round(asked_first=True)) == ["StopWorkers"]


def carried_exit_after_a_node_loss(code: int) -> list[do.Instruction]:
    """A member's loss opens round 1 (no restart spent); this node's worker in slot 1 is
    carried in and, before it takes its place there, exits with ``code``.  What the part
    does then."""
    d = Drive(in_place=True)
    in_place_running(d)
    lost = RoundEvent(EventKind.NEXT_ROUND, Reason.NODE_LOST)
    d(ev.RoundChanged(JOB, d.op(do.Watch), lost))
    d.joined(info(round=1, reason=Reason.NODE_LOST))
    ask(d, 0, after=0, why="interrupt")
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED, round=1, failed_code=code)
    return acts(d(ev.PeersProbed(JOB, d.op(do.Probe), ())))


def test_in_place_a_worker_its_old_rounds_abort_left_stuck_costs_no_restart():
    """A paused node came back (test_detector): its worker, stuck in a collective that the
    abort of its round did not end, gave that round up (status 75) before it took its place
    in the next one; the job spent a restart on it."""
    out = carried_exit_after_a_node_loss(GIVEN_UP_EXIT)
    assert kinds(out)[-1] == "RequestRound" and out[-1].reason is Reason.LATE_EXIT
    # any other exit there is a failure of its own, and is charged
    out = carried_exit_after_a_node_loss(1)
    assert kinds(out)[-1] == "RequestRound" and out[-1].reason is Reason.FAILURE


def test_in_place_a_collective_failure_with_no_dead_peer_fails_after_dead_after():
    d = Drive(in_place=True)
    d.start()
    d.joined(info(nodes=(ME,)))
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    out = ask(d, 0, after=0, why="failure", error="gloo timeout")
    assert kinds(out) == ["SetTimer"] and out[0].at == d.mono + 3.0
    out = d(ev.TimerFired(JOB, out[0].name))
    assert (
        kinds(out) == ["Cancel", "Publish", "Notify", "RequestRound"]
        and out[-1].reason is Reason.FAILURE
    )


def test_in_place_a_collective_failure_and_a_dead_peer_re_form_without_it():
    d = Drive(in_place=True)
    in_place_running(d)
    out = ask(d, 0, after=0, why="failure", error="connection reset")
    assert kinds(out) == ["Probe"]
    out = d(ev.PeersProbed(JOB, d.op(do.Probe), (OTHER,)))
    assert out[-1] == do.RequestRound(JOB, d.op(do.RequestRound), 0, Reason.NODE_LOST, (OTHER,))


def test_in_place_a_node_rejoining_a_job_warms_up_before_it_joins():
    d = Drive(in_place=True, started=5.0)
    out = d.start()
    # warming up is charged: the part says it ran from now on (its second Publish)
    assert kinds(out) == ["NewPool", "Publish", "ForgetSlots", "WarmWorkers", "SetTimer", "Publish"]
    assert d.part.phase is Phase.WARMING and out[-1].part.ran == d.now().wall
    assert ask(d, 0) == []
    out = ask(d, 1)
    assert kinds(out) == ["Join"] and out[0].nproc == 2


def test_in_place_a_worker_that_fails_while_warming_up_spends_a_restart_and_warms_again():
    d = Drive(in_place=True, started=5.0)
    d.start()
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert kinds(out) == ["Publish", "RequestRound"]
    assert (
        out[-1].round is None and out[-1].reason is Reason.FAILURE
    )  # after the current round: it is outside
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    assert kinds(out) == ["ForgetSlots", "WarmWorkers"] and acts(out)[0].slots == (1,)
    assert (
        d.part.phase is Phase.WARMING
        and [i.what for i in d.said if isinstance(i, do.Count)][-1] == "restarted"
    )


def test_in_place_a_script_without_elastic_run_fails_the_job_once_its_restarts_are_spent():
    """Such a job once left and rejoined 360 times in 3.7 minutes, spending nothing."""
    d = Drive(in_place=True, started=5.0)
    d.start()
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    out = d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.EXHAUSTED))
    assert kinds(out) == ["Finish"] and out[0].outcome.state is JobState.FAILED
    assert "must call elasticd.elastic.run" in out[0].outcome.message
    assert "exhausted" in out[0].outcome.message


def test_in_place_warm_up_failures_in_a_row_past_the_budget_fail_the_job_where_no_round_can_be_charged():
    """A round still forming cannot be charged (ALREADY): the part's own count bounds the loop."""
    d = Drive(in_place=True, started=5.0, max_restarts=1)
    d.start()
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.ALREADY))
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert kinds(out) == ["Publish", "Finish"] and "elasticd.elastic.run" in out[-1].outcome.message


def test_in_place_a_worker_that_reaches_elastic_run_clears_the_count_of_warm_up_failures():
    d = Drive(in_place=True, started=5.0, max_restarts=1)
    d.start()
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.ALREADY))
    ask(d, 0)
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert kinds(out)[-1] == "RequestRound"


def test_in_place_a_warm_up_failure_while_the_job_ends_or_the_node_leaves_spends_nothing():
    d = Drive(in_place=True, started=5.0)
    d.start()
    d.ended()
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert "RequestRound" not in kinds(out)
    d = Drive(in_place=True, started=5.0)
    d.start()
    d.leave(Reason.DRAIN)
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert "RequestRound" not in kinds(out)


def test_in_place_a_late_ask_of_a_dead_worker_changes_nothing():
    d = Drive(in_place=True, started=5.0)
    d.start()
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert ask(d, 1) == []  # the part is closing


# -- a warm-up that never asks for its place -------------------------------------------------


def test_in_place_a_newcomer_that_never_asks_is_failed_at_its_join_timeout():
    """A script that never calls elastic.run and just computes would warm up for good,
    holding its node: at the job's join timeout its workers are stopped as failed, and the
    failure spends a restart like any other (the job fails once none is left)."""
    d = Drive(in_place=True, started=5.0, join_timeout=30.0, max_restarts=0)
    out = d.start()
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    assert timer.at == d.mono + 30.0
    ask(d, 0)  # one of the two asked; slot 1 computes and never asks
    d.mono += 30.0
    out = d(ev.TimerFired(JOB, timer.name))
    assert kinds(out) == ["FailSlots"] and out[-1].slots == (1,)
    assert "did not ask for its place within 30 s" in out[-1].why
    group = d.part.group
    assert group is not None
    failed = Worker(1, -1, 0, ME, 101, WorkerState.FAILED, -15)
    cause = ev.WorkersChanged(
        JOB,
        WorkerGroup(**{**group.__dict__, "workers": (group.workers[0], failed)}),
        (Failure(-1, 1, ME, -15, out[-1].why),),
    )
    out = d(cause)
    assert kinds(out) == ["Publish", "Finish"]  # no restart left: the job fails, saying why
    assert "did not ask for its place within 30 s" in out[-1].outcome.message
    assert "must call elasticd.elastic.run" in out[-1].outcome.message


def test_in_place_a_warm_up_that_asked_in_time_is_not_failed():
    d = Drive(in_place=True, started=5.0, join_timeout=30.0)
    out = d.start()
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    ask(d, 0)
    ask(d, 1)
    d.mono += 30.0
    assert acts(d(ev.TimerFired(JOB, timer.name))) == []


def test_in_place_a_replacement_that_never_asks_is_failed_while_the_others_train():
    d = Drive(in_place=True, join_timeout=30.0)
    in_place_running(d)
    out = acts(fail_and_reopen(d, WorkerState.HEALTHY, WorkerState.FAILED))
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    d.joined(info(round=1, nproc=1, restarts=1))
    ask(d, 0, after=0, why="interrupt")  # the survivor rejoined and trains
    d.mono += 30.0
    out = d(ev.TimerFired(JOB, timer.name))
    assert kinds(out) == ["FailSlots"] and out[-1].slots == (1,)
    assert d.part.phase is Phase.RUNNING


# -- the checkpoint a restarted round reads ---------------------------------------------------


def test_a_restarted_round_starts_its_workers_once_the_checkpoint_is_in_place():
    """A job that ran before (on any node): before its workers start, this node puts the
    newest complete checkpoint in place (and deletes saves that were cut off)."""
    d = Drive(started=5.0)
    d.start()
    out = acts(d.joined(info()))
    assert kinds(out) == ["PrepareRestore"] and d.part.phase is Phase.PREPARING
    out = acts(d(ev.RestorePrepared(JOB, d.op(do.PrepareRestore))))
    assert kinds(out) == ["Publish", "StartWorkers", "Watch"] and states(out) == ["RUNNING"]


def test_a_round_whose_checkpoint_is_lost_fails_the_job_saying_why():
    d = Drive(started=5.0)
    d.start()
    d.joined(info())
    why = "checkpoint step_40 is lost: n2 and the node keeping its copy, n3, are gone"
    out = acts(d(ev.RestorePrepared(JOB, d.op(do.PrepareRestore), why)))
    assert kinds(out) == ["Finish"] and out[0].outcome.message == why


def test_a_first_round_has_nothing_to_restore():
    d = Drive()
    d.start()
    assert kinds(d.joined(info())) == ["Publish", "StartWorkers", "Watch"]


def test_checkpoint_manifests_travel_in_the_part_record():
    d = Drive()
    running(d)
    manifest = {"id": "step_5", "node": ME}
    out = d(ev.CheckpointsChanged(JOB, (manifest,)))
    assert kinds(out) == ["Publish"] and out[0].part.checkpoints == (manifest,)
