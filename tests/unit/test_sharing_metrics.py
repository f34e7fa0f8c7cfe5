"""The scheduler's metrics (docs/scheduler.md, "Metrics"), pure parts: what a plan moved, the waiting jobs and
their waits, the usage counters per account (this node's parts only, from the daemon's
start, never taken back), the wait histogram (once per job, on the node it was submitted
on), and the node core's count of a reclaim (once per part)."""

from __future__ import annotations

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.allocation import Waiting
from elasticd.core.allocation import WaitReason as Why
from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord, Outcome, Part
from elasticd.core.schedule import Schedule
from elasticd.metrics import (
    MAX_ACCOUNTS,
    NO_REASON,
    OTHER,
    Metrics,
    SharingCollector,
    moves,
    waiting,
    waiting_since,
)
from elasticd.rendezvous import Member, Reason, RendezvousInfo


def spec(job: str, *, node: str = "n1", created: float = 100.0, **kw: object) -> JobSpec:
    return JobSpec(
        id=job,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1000,
        gid=1000,
        user="u",
        submitted_on=node,
        created=created,
        **kw,
    )


def record(
    job: str, parts: dict[str, Part] | None = None, outcome: Outcome | None = None, **kw: object
) -> JobRecord:
    return JobRecord(spec(job, **kw), int(job.rsplit("-", 1)[1]), parts or {}, outcome)


def ran(
    node: str,
    since: float,
    *,
    slots: int = 1,
    gpus: int = 0,
    state: PartState = PartState.RUNNING,
    updated: float = 0.0,
) -> Part:
    return Part(
        node, state, round=0, started=since, ran=since, slots=slots, gpus=gpus, updated=updated
    )


def value(metrics: Metrics | SharingCollector, name: str, **labels: str) -> float | None:
    families = metrics.registry.collect() if isinstance(metrics, Metrics) else metrics.collect()
    for family in families:
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


# -- what a plan moved ----------------------------------------------------------------------


def test_a_plan_counts_nodes_given_to_running_jobs_and_new_preemptions() -> None:
    before = Schedule(
        1, 1, {"j-1": frozenset("a"), "j-2": frozenset("bc")}, preempted=frozenset({"j-9"})
    )
    after = Schedule(
        1, 2, {"j-1": frozenset("ab"), "j-3": frozenset("c")}, preempted=frozenset({"j-2", "j-9"})
    )
    assert moves(before, after) == (1, 1)  # j-3 started (not grown); j-9 was preempted already
    assert moves(None, after) == (0, 2)
    assert moves(after, after) == (0, 0)


# -- the waiting jobs -------------------------------------------------------------------------


def test_the_waiting_jobs_are_the_schedules_or_without_one_those_no_node_runs() -> None:
    runs = record("j-1", {"a": ran("a", 110.0)})
    waits = record("j-2")
    ended = record("j-3", outcome=Outcome(JobState.CANCELLED, 120.0))
    schedule = Schedule(
        1,
        1,
        {"j-1": frozenset("a")},
        (Waiting("j-3", Why.PRIORITY), Waiting("j-2", Why.QUOTA_USER), Waiting("j-8", Why.SIZE)),
    )
    jobs = [runs, waits, ended]
    assert [(r.id, why) for r, why in waiting(jobs, schedule)] == [("j-2", "QuotaUser")]
    assert [(r.id, why) for r, why in waiting(jobs, None)] == [("j-2", NO_REASON)]


def test_a_job_waits_since_its_submit_or_since_its_parts_left() -> None:
    assert waiting_since(record("j-1", created=50.0)) == 50.0
    stopped = record(
        "j-2",
        {
            "a": ran("a", 60.0, state=PartState.LEFT, updated=90.0),
            "b": ran("b", 60.0, state=PartState.LEFT, updated=95.0),
        },
        created=50.0,
    )
    assert waiting_since(stopped) == 95.0


def test_the_collector_gives_waiting_jobs_and_the_longest_wait_by_reason() -> None:
    clock = [1000.0]
    collector = SharingCollector(clock=lambda: clock[0])
    jobs = [
        record("j-1", created=400.0),
        record("j-2", created=900.0),
        record("j-3", created=990.0),
    ]
    schedule = Schedule(
        3,
        7,
        {},
        (Waiting("j-1", Why.RESOURCES), Waiting("j-2", Why.RESOURCES), Waiting("j-3", Why.SIZE)),
    )
    collector.watch("n1", lambda: jobs, lambda: schedule, lambda: None)
    assert value(collector, "elasticd_jobs_waiting", reason="Resources") == 2
    assert value(collector, "elasticd_longest_wait_seconds", reason="Resources") == 600.0
    assert value(collector, "elasticd_longest_wait_seconds", reason="Size") == 10.0
    assert (
        value(collector, "elasticd_jobs_waiting", reason="Held") == 0
    )  # every reason, 0 where none
    assert value(collector, "elasticd_jobs_waiting", reason=NO_REASON) == 0
    assert (
        value(collector, "elasticd_schedule_term"),
        value(collector, "elasticd_schedule_number"),
    ) == (3, 7)
    assert value(collector, "elasticd_allocator_term") == 0  # this node does not allocate
    clock[0] = 400.0 - 5  # a submitter's clock ahead of this one: no negative wait
    assert value(collector, "elasticd_longest_wait_seconds", reason="Resources") == 0.0


# -- usage per account -------------------------------------------------------------------------


def test_usage_counts_this_nodes_parts_from_the_start_and_never_takes_any_back() -> None:
    clock = [1000.0]
    before = record("j-1", {"n1": ran("n1", 900.0, slots=2, gpus=1)}, account="ml")
    jobs = [before]
    collector = SharingCollector(clock=lambda: clock[0])
    collector.watch("n1", lambda: jobs, lambda: None, lambda: None)
    assert value(collector, "elasticd_usage_node_seconds_total", account="ml") is None, (
        "what ran before the daemon started is elasticctl usage's, not counted now"
    )
    clock[0] = 1010.0
    jobs.append(record("j-2", {"n1": ran("n1", 1004.0), "n2": ran("n2", 1000.0)}, account="ml"))
    assert value(collector, "elasticd_usage_node_seconds_total", account="ml") == 10.0 + 6.0
    assert value(collector, "elasticd_usage_slot_seconds_total", account="ml") == 20.0 + 6.0
    assert value(collector, "elasticd_usage_gpu_seconds_total", account="ml") == 10.0
    jobs.remove(before)  # pruned from the registry: what it used stays counted
    clock[0] = 1005.0  # the clock stepped back
    assert value(collector, "elasticd_usage_node_seconds_total", account="ml") == 16.0
    clock[0] = 1020.0
    assert value(collector, "elasticd_usage_node_seconds_total", account="ml") == 26.0


def test_accounts_beyond_the_cap_are_summed_as_one() -> None:
    clock = [1000.0]
    jobs = [
        record(f"j-{i}", {"n1": ran("n1", 1000.0)}, account=f"a{i:03d}")
        for i in range(1, MAX_ACCOUNTS + 3)
    ]
    collector = SharingCollector(clock=lambda: clock[0])
    collector.watch("n1", lambda: jobs, lambda: None, lambda: None)
    clock[0] = 1001.0
    families = {f.name: f for f in collector.collect()}
    accounts = {
        s.labels["account"]: s.value for s in families["elasticd_usage_node_seconds"].samples
    }
    assert len(accounts) == MAX_ACCOUNTS + 1 and accounts[OTHER] == 2.0
    assert sum(accounts.values()) == MAX_ACCOUNTS + 2


# -- the wait histogram and the allocator's counters --------------------------------------------


def test_a_jobs_wait_is_observed_once_on_the_node_it_was_submitted_on() -> None:
    metrics = Metrics()
    restored = record("j-1", {"n2": ran("n2", 150.0)})  # started before this daemon did
    metrics.known_finished([restored])
    waits = record("j-2", created=100.0)
    elsewhere = record("j-3", {"n1": ran("n1", 130.0)}, node="n2")
    metrics.count_jobs([restored, waits, elsewhere], "n1")
    assert value(metrics, "elasticd_job_wait_seconds_count") == 0
    started = record("j-2", {"n2": ran("n2", 130.0)}, created=100.0)
    for _ in range(3):
        metrics.count_jobs([restored, started, elsewhere], "n1")
    assert value(metrics, "elasticd_job_wait_seconds_count") == 1
    assert value(metrics, "elasticd_job_wait_seconds_sum") == 30.0
    assert value(metrics, "elasticd_job_wait_seconds_bucket", le="30.0") == 1


def test_a_finished_job_is_counted_once_and_forgotten_once_the_registry_drops_it() -> None:
    """A daemon that runs for months sees millions of jobs end: what it remembers of them is
    only what its registry still holds."""
    metrics = Metrics()
    done = record("j-1", outcome=Outcome(JobState.SUCCEEDED, 10.0))
    for _ in range(3):
        metrics.count_jobs([done], "n1")
    assert value(metrics, "elasticd_jobs_finished_total", state="SUCCEEDED") == 1
    metrics.count_jobs([], "n1")  # retention pruned it
    assert not metrics._finished
    assert value(metrics, "elasticd_jobs_finished_total", state="SUCCEEDED") == 1


def test_every_plan_is_timed_and_a_new_schedule_counts_its_moves() -> None:
    metrics = Metrics()
    first = Schedule(1, 1, {"j-1": frozenset("a")})
    second = Schedule(1, 2, {"j-1": frozenset("ab")}, preempted=frozenset({"j-2"}))
    metrics.planned(None, first, 0.001)
    metrics.planned(first, second, 0.002)
    metrics.planned(second, second, 0.003)  # nothing moved
    assert value(metrics, "elasticd_scheduler_plan_seconds_count") == 3
    assert value(metrics, "elasticd_scheduler_grown_nodes_total") == 1
    assert value(metrics, "elasticd_scheduler_preemptions_total") == 1


# -- the node core counts a reclaim once --------------------------------------------------------


def test_a_reclaimed_part_is_counted_once() -> None:
    core = NodeCore(NodeSettings("c", Resources(2), dead_after=3.0, judge_users=False))
    job = JobRecord(
        JobSpec(
            id="j-1",
            argv=("t.py",),
            python="/p",
            workdir="/w",
            uid=1000,
            gid=1000,
            user="u",
            min_nodes=1,
            max_nodes=3,
        ),
        1,
    )
    out = core.handle(
        ev.ScheduleChanged(Schedule(1, 1, {"j-1": frozenset("abc")})), ev.Now(0, 1000.0)
    )
    out += core.handle(ev.JobsChanged((job,)), ev.Now(0, 1000.0))
    join = next(i for i in out if isinstance(i, do.Join))
    info = RendezvousInfo(
        "j-1", 0, Reason.INITIAL, 0, 0, 1, 1, 0, 1, "c", 1, (Member("c", "c", 1, 0, 0),)
    )
    core.handle(ev.RoundJoined("j-1", join.op, info), ev.Now(1, 1001.0))
    out = core.handle(
        ev.ScheduleChanged(Schedule(1, 2, {"j-1": frozenset("ab")})), ev.Now(2, 1002.0)
    )
    out += core.handle(ev.JobsChanged((job,)), ev.Now(3, 1003.0))  # told again while it leaves
    out += core.handle(
        ev.ScheduleChanged(Schedule(1, 3, {"j-1": frozenset("a")})), ev.Now(4, 1004.0)
    )
    assert [i.what for i in out if isinstance(i, do.Count)] == ["reclaimed"]
