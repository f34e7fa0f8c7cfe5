"""The schedule (docs/scheduler.md), pure: records and nodes as the allocator's input, the plan a
change makes (and none when nothing moved), its record's round trip and refusals, and a
node core following it (it leaves what the schedule gave other nodes, spending no restart,
and takes only what it gives this node)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.allocation import Policy, Waiting
from elasticd.core.allocation import WaitReason as Why
from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord, Outcome, Part
from elasticd.core.schedule import (
    NodeSize,
    Planner,
    Schedule,
    demand,
    follows,
    leaves,
    next_due,
    next_growth,
    plan,
    waiting_jobs,
    waiting_since,
)
from elasticd.rendezvous import Member, Reason, RendezvousInfo

NODES = {"a": NodeSize(2), "b": NodeSize(2), "c": NodeSize(2)}


def spec(job: str, nnodes: tuple[int, int] = (1, 1), nproc: int = 1, **kw: object) -> JobSpec:
    return JobSpec(
        id=job,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1000,
        gid=1000,
        user="u",
        min_nodes=nnodes[0],
        max_nodes=nnodes[1],
        nproc_per_node=nproc,
        **kw,
    )


def record(
    job: str, seq: int, *, parts: dict[str, PartState] | None = None, **kw: object
) -> JobRecord:
    return JobRecord(spec(job, **kw), seq, {n: Part(n, s) for n, s in (parts or {}).items()})


def test_a_waiting_job_gets_a_node_lent_by_an_elastic_one() -> None:
    big = record("j-1", 1, nnodes=(1, 3), parts=dict.fromkeys("abc", PartState.RUNNING))
    first = plan([big], NODES, None, Policy(), {}, term=1, now=0.0)
    assert first.nodes == {"j-1": frozenset("abc")} and first.number == 1
    small = record("j-2", 2, nproc=2)
    second = plan([big, small], NODES, first, Policy(), {}, term=1, now=1.0)
    assert len(second.nodes["j-1"]) == 2 and len(second.nodes["j-2"]) == 1
    assert second.nodes["j-1"] | second.nodes["j-2"] == frozenset("abc") and second.number == 2


def test_nothing_moved_is_the_same_schedule_and_a_new_term_numbers_afresh() -> None:
    jobs = [record("j-1", 1, nnodes=(1, 3))]
    first = plan(jobs, NODES, None, Policy(), {}, term=1, now=0.0)
    assert plan(jobs, NODES, first, Policy(), {}, term=1, now=5.0) is first
    taken_over = plan(jobs, NODES, first, Policy(), {}, term=2, now=5.0)
    assert (taken_over.term, taken_over.number) == (2, 1) and taken_over.version > first.version
    assert taken_over.nodes == first.nodes


def test_a_node_told_to_leave_is_not_the_jobs_while_it_leaves() -> None:
    """The part on the reclaimed node still runs; the next plan must not count it as the
    elastic job's own (it would take it back, or take another node)."""
    big = record("j-1", 1, nnodes=(1, 3), parts=dict.fromkeys("abc", PartState.RUNNING))
    small = record("j-2", 2, nproc=2)
    given = plan(
        [big, small],
        NODES,
        plan([big], NODES, None, Policy(), {}, term=1, now=0.0),
        Policy(),
        {},
        term=1,
        now=1.0,
    )
    again = plan([big, small], NODES, given, Policy(), {}, term=1, now=2.0)
    assert again is given


def test_a_node_where_the_jobs_part_ended_gives_it_nothing() -> None:
    job = record("j-1", 1, nnodes=(1, 3), parts={"a": PartState.FAILED, "b": PartState.RUNNING})
    assert set(demand(job, NODES, None).shares) == {"b", "c"}
    assert demand(job, NODES, None).current == frozenset("b")


def test_an_unusable_node_is_dropped_and_a_lost_min_topped_up() -> None:
    job = record("j-1", 1, nnodes=(2, 2), parts=dict.fromkeys("ab", PartState.RUNNING))
    first = plan([job], NODES, None, Policy(), {}, term=1, now=0.0)
    lost = {**NODES, first.nodes["j-1"].__iter__().__next__(): NodeSize(2, usable=False)}
    second = plan([job], lost, first, Policy(), {}, term=1, now=1.0)
    assert len(second.nodes["j-1"]) == 2 and all(lost[n].usable for n in second.nodes["j-1"])


def test_a_preempted_job_stays_preempted_until_it_runs_again() -> None:
    low = record(
        "j-1",
        1,
        nnodes=(3, 3),
        nproc=2,
        preemptible=True,
        parts=dict.fromkeys("abc", PartState.RUNNING),
    )
    high = record("j-2", 2, nnodes=(2, 2), nproc=2, priority=5)
    first = plan([low], NODES, None, Policy(), {}, term=1, now=0.0)
    second = plan([low, high], NODES, first, Policy(), {}, term=1, now=1.0)
    assert second.preempted == {"j-1"} and "j-1" not in second.nodes
    assert second.reason("j-1") is not None
    third = plan([low], NODES, second, Policy(), {}, term=1, now=2.0)
    assert "j-1" in third.nodes and not third.preempted


def test_growth_is_due_once_per_resize_interval() -> None:
    policy = Policy(resize_interval=30.0)
    schedule = plan([record("j-1", 1, nnodes=(1, 3))], NODES, None, policy, {}, term=1, now=100.0)
    assert schedule.grown == {"j-1": 100.0}
    assert (
        next_growth(schedule, policy, 100.0) == 130.0
        and next_growth(schedule, policy, 131.0) is None
    )


def test_the_record_round_trips_and_anything_else_is_refused() -> None:
    schedule = Schedule(
        3,
        7,
        {"j-1": frozenset("ab")},
        (Waiting("j-2", Why.RESOURCES),),
        {"j-1": 5.0},
        frozenset({"j-3"}),
        9.0,
        moved={"j-1": 4.0},
        charged={"ml": 120.0},
        later=40,
        last_seq=77,
        factors={"ml": 0.25, "physics": 1.0},
    )
    assert Schedule.from_json(schedule.to_json()) == schedule
    older = {
        k: v for k, v in schedule.to_json().items() if k in ("term", "number", "nodes", "waiting")
    }
    assert Schedule.from_json(older) == Schedule(3, 7, schedule.nodes, schedule.waiting)
    for bad in (
        None,
        [],
        {"term": 1},
        {"term": -1, "number": 1, "nodes": {}, "waiting": []},
        {"term": 1, "number": 1, "nodes": {"j": "ab"}, "waiting": []},
        {"term": 1, "number": 1, "nodes": {}, "waiting": [["j", "Nope"]]},
        {"term": True, "number": 1, "nodes": {}, "waiting": []},
        {"term": 1, "number": 1, "nodes": {}, "waiting": [], "later": -1},
        {"term": 1, "number": 1, "nodes": {}, "waiting": [], "moved": {"j": "soon"}},
        {"term": 1, "number": 1, "nodes": {}, "waiting": [], "charged": {"ml": float("nan")}},
    ):
        with pytest.raises(ValueError):
            Schedule.from_json(bad)


def test_a_node_follows_and_leaves_by_the_schedule() -> None:
    schedule = Schedule(1, 1, {"j-1": frozenset("ab")}, (Waiting("j-2", Why.PRIORITY),))
    assert follows(schedule, "j-1", "a") and not follows(schedule, "j-1", "c")
    assert leaves(schedule, "j-1", "c") and leaves(schedule, "j-2", "a")
    assert not leaves(schedule, "j-9", "a")  # newer than the schedule: left alone
    preempted = Schedule(1, 2, preempted=frozenset({"j-1"}))
    assert leaves(preempted, "j-1", "a"), "a preempted job's nodes leave, listed or not"


# -- a node core following it -------------------------------------------------------------------


def at(mono: float) -> ev.Now:
    return ev.Now(mono, 1000.0 + mono)


def joins(out: list[do.Instruction]) -> set[str]:
    return {i.job for i in out if isinstance(i, do.Join)}


def test_a_node_core_takes_only_what_the_schedule_gives_it_and_leaves_the_rest() -> None:
    core = NodeCore(NodeSettings("c", Resources(2), dead_after=3.0, judge_users=False))
    records = (record("j-1", 1, nnodes=(1, 3)), record("j-2", 2, nproc=2))
    out = core.handle(
        ev.ScheduleChanged(
            Schedule(1, 1, {"j-1": frozenset("abc")}, (Waiting("j-2", Why.RESOURCES),))
        ),
        at(0),
    )
    out += core.handle(ev.JobsChanged(records), at(0))
    assert joins(out) == {"j-1"}, (
        "first come would offer c to j-1 as well, but not to j-2 (no room)"
    )
    join = next(i for i in out if isinstance(i, do.Join))
    info = RendezvousInfo(
        "j-1", 0, Reason.INITIAL, 0, 0, 1, 1, 0, 1, "c", 1, (Member("c", "c", 1, 0, 0),)
    )
    core.handle(ev.RoundJoined("j-1", join.op, info), at(1))
    reclaim = Schedule(1, 2, {"j-1": frozenset("ab"), "j-2": frozenset("c")})
    core.handle(ev.ScheduleChanged(reclaim), at(2))
    assert core.parts["j-1"].leaving is Reason.RECLAIM
    core.handle(ev.ScheduleChanged(None), at(3))  # no schedule: first come again (it leaves anyway)
    assert core.parts["j-1"].leaving is Reason.RECLAIM


def test_without_a_schedule_a_node_places_first_come() -> None:
    core = NodeCore(NodeSettings("c", Resources(2), dead_after=3.0, judge_users=False))
    out = core.handle(ev.JobsChanged((record("j-1", 1), record("j-2", 2))), at(0))
    assert joins(out) == {"j-1", "j-2"}


def test_a_held_job_runs_on_where_it_runs_and_takes_no_new_node() -> None:
    """Its outcome record was refused (forged, garbled): every node that holds it says so
    in its part, and the job must run on (chaos C2/C3), not be moved off its nodes."""
    parts = {n: Part(n, PartState.RUNNING, held="its outcome record was refused") for n in "ab"}
    job = JobRecord(spec("j-1", nnodes=(1, 3)), 1, parts, held="its outcome record was refused")
    first = plan([job], NODES, None, Policy(), {}, term=1, now=0.0)
    assert first.nodes == {"j-1": frozenset("ab")}
    assert plan([job], NODES, first, Policy(), {}, term=1, now=1.0) is first


def test_an_allocator_past_its_term_does_not_write_over_its_successor() -> None:
    import asyncio

    from elasticd.cluster.scheduler import ScheduleBoard
    from elasticd.store.keyspace import Keyspace
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    async def play() -> tuple[bool, bool, int | None]:
        board = ScheduleBoard(
            AsyncMemoryStore(MemoryStore()),
            Signer(b"k" * 32, "c"),
            Keyspace("c"),
            lambda key, why: None,
        )
        newer = await board.publish(Schedule(2, 1))
        older = await board.publish(Schedule(1, 9))
        return newer, older, await board.head()

    assert asyncio.run(play()) == (True, False, Schedule(2, 1).version)


def test_an_allocator_does_not_plan_until_the_nodes_republished_into_a_reset_store() -> None:
    """A fresh CI run (test_deb): the store host restarted; the observer planned from the
    nodes that had republished so far, took the missing one's share from a running job
    ("reclaim"), and its workers were restarted."""
    import asyncio
    import time
    from types import SimpleNamespace

    from elasticd.cluster.scheduler import Allocator, ScheduleBoard
    from elasticd.store.keyspace import Keyspace
    from elasticd.store.memory import AsyncMemoryStore, MemoryStore
    from elasticd.store.signing import Signer

    registry = SimpleNamespace(observing=True, observer_term=2, name="n2")
    nodes = SimpleNamespace(registry=registry, sightings={}, reset_at=time.monotonic())

    async def play() -> tuple[int | None, int | None]:
        board = ScheduleBoard(
            AsyncMemoryStore(MemoryStore()),
            Signer(b"k" * 32, "c"),
            Keyspace("c"),
            lambda key, why: None,
        )
        allocator = Allocator(board, nodes, [], Policy(), settle=60.0)  # type: ignore[arg-type]
        await allocator.allocate()
        settling = await board.head()
        nodes.reset_at -= 61.0  # a heartbeat's dead_after later
        await allocator.allocate()
        return settling, await board.head()

    settling, settled = asyncio.run(play())
    assert settling is None and settled is not None


# -- a plan at the cost of what changed -------------------------------------------------------


def many(count: int, first_seq: int = 10, **kw: object) -> list[JobRecord]:
    return [record(f"w-{i:04d}", first_seq + i, **kw) for i in range(count)]


def test_a_planner_plans_what_plan_plans_keeping_what_did_not_change() -> None:
    """Schedule after schedule, a Planner handed only the records that changed plans what
    plan() plans from all of them: jobs come, run, end; a node is lost and comes back."""
    planner = Planner()
    jobs = {r.id: r for r in [record("j-1", 1, nnodes=(1, 3)), *many(30, nproc=2)]}
    changed = list(jobs.values())
    nodes = dict(NODES)
    previous: Schedule | None = None
    for step in range(6):
        now = float(step)
        if step == 2:
            nodes["a"] = NodeSize(2, usable=False)
        if step == 3:  # three jobs end
            ended = Outcome(JobState.CANCELLED, now)
            changed = [replace(jobs.pop(j), outcome=ended) for j in list(jobs)[5:8]]
        if step == 4:
            nodes["a"] = NodeSize(2)
            jobs["j-9"] = record("j-9", 99, priority=3)
            changed = [jobs["j-9"]]
        planner.take(changed)
        changed = []
        mine = planner.plan(nodes, previous, Policy(), {}, term=1, now=now, look_ahead=4)
        theirs = plan(jobs.values(), nodes, previous, Policy(), {}, term=1, now=now, look_ahead=4)
        assert mine == theirs or (mine is previous and theirs is previous), step
        previous = mine


def test_a_long_queue_is_listed_as_far_as_the_look_ahead_and_counted_after() -> None:
    """30 jobs wait for 3 nodes: the schedule lists the first 4 (the look-ahead) and counts
    the others; every node lists them all from its records, in the allocator's order."""
    full = record("j-1", 1, nnodes=(3, 3), nproc=2, parts=dict.fromkeys("abc", PartState.RUNNING))
    waiting = many(30, nproc=2)
    schedule = plan([full, *waiting], NODES, None, Policy(), {}, term=1, now=0.0, look_ahead=4)
    assert [w.job for w in schedule.waiting] == [r.id for r in waiting[:4]]
    assert schedule.later == 26 and schedule.last_seq == waiting[-1].seq
    shown = waiting_jobs([full, *waiting], schedule)
    assert [(r.id, why) for r, why in shown] == [
        *((r.id, "Resources") for r in waiting[:4]),
        *((r.id, "Priority") for r in waiting[4:]),  # they wait behind the four
    ]
    newer = record("w-new", 500, nproc=2)  # submitted after the schedule: not shown yet
    assert newer.id not in {r.id for r, _ in waiting_jobs([full, *waiting, newer], schedule)}


def test_the_jobs_counted_after_the_list_are_ordered_by_the_schedules_fair_share() -> None:
    schedule = Schedule(1, 1, later=2, last_seq=9, factors={"ml": 0.2, "physics": 0.9})
    first = JobRecord(spec("j-1", account="ml"), 1)
    second = JobRecord(spec("j-2", account="physics"), 2)
    assert [r.id for r, _ in waiting_jobs([first, second], schedule)] == ["j-2", "j-1"]


def test_a_job_that_forced_nodes_from_running_jobs_is_charged_min_run_time_for_each() -> None:
    """The cost of submitting and cancelling: each node taken from a running job is charged
    to the taker's account as min_run_time node-seconds, decayed like any use, and it
    orders its account's next jobs after others'."""
    policy = Policy(min_run_time=30.0, half_life=100.0)
    big = record("j-1", 1, nnodes=(1, 3), parts=dict.fromkeys("abc", PartState.RUNNING))
    first = plan([big], NODES, None, policy, {}, term=1, now=0.0)
    small = record("j-2", 2, nproc=2, account="ml")
    second = plan([big, small], NODES, first, policy, {}, term=1, now=100.0)
    assert len(second.nodes["j-2"]) == 1 and second.charged == {"ml": 30.0}
    assert second.moved == {"j-1": 100.0, "j-2": 100.0}
    later = plan([big], NODES, second, policy, {}, term=1, now=200.0)  # j-2 was cancelled
    assert later.charged == {"ml": pytest.approx(15.0)}  # a half-life later
    assert later.nodes == {"j-1": frozenset("abc")} and later.moved == {"j-1": 200.0}


def test_a_plan_is_due_when_a_running_jobs_min_run_time_ends_while_jobs_wait() -> None:
    policy = Policy(min_run_time=60.0, resize_interval=30.0)
    schedule = Schedule(1, 1, {"j-1": frozenset("a")}, moved={"j-1": 100.0})
    assert next_due(schedule, policy, 110.0) is None  # nothing waits
    waiting = Schedule(
        1, 1, {"j-1": frozenset("a")}, (Waiting("j-2", Why.RESOURCES),), moved={"j-1": 100.0}
    )
    assert next_due(waiting, policy, 110.0) == 160.0 and next_due(waiting, policy, 161.0) is None
    grown = Schedule(1, 1, {"j-1": frozenset("a")}, grown={"j-1": 100.0})
    assert next_due(grown, policy, 110.0) == 130.0


def test_a_job_waits_since_it_was_submitted_or_since_it_last_stopped() -> None:
    fresh = JobRecord(spec("j-1", created=50.0), 1)
    assert waiting_since(fresh) == 50.0
    stopped = JobRecord(
        spec("j-1", created=50.0),
        1,
        {
            "a": Part("a", PartState.LEFT, started=60.0, updated=400.0),
            "b": Part("b", PartState.LEFT, started=60.0, updated=420.0),
        },
    )
    assert waiting_since(stopped) == 420.0
