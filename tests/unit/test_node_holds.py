"""Why a node takes no new job (the node core): an operator's drain, the discovery script,
the blacklist (a user's failures keep only that user's jobs off; several users' blacklist
the node).  Each is its own reason: undrain lifts a drain and a blacklisting, never what the
discovery script says; the node's jobs are told to leave once, when the first reason comes.
Driven by stimuli, as the shell feeds them; the answers are the core's instructions."""

from __future__ import annotations

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.blacklist import Blacklist, BlacklistPolicy
from elasticd.core.model import JobSpec, Worker, WorkerState, assign_workers
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord
from elasticd.rendezvous import Member, Reason, RendezvousInfo

USERS = {"j-000001": (1001, "alice"), "j-000002": (1002, "bob")}
NODE = "n2"


def spec(job: str) -> JobSpec:
    uid, user = USERS[job]
    return JobSpec(id=job, argv=("t.py",), python="/p", workdir="/w", uid=uid, gid=uid, user=user)


def at(mono: float, wall: float | None = None) -> ev.Now:
    return ev.Now(mono, 1000.0 + mono if wall is None else wall)


def node(blacklist: Blacklist | None = None) -> tuple[NodeCore, list[do.Instruction]]:
    """A node core running j-000001 (alice's) and j-000002 (bob's), each in a round."""
    core = NodeCore(
        NodeSettings(NODE, Resources(4, ("0", "1")), dead_after=3.0, judge_users=False),
        blacklist=blacklist,
    )
    records = tuple(JobRecord(spec(job), seq) for seq, job in enumerate(USERS, 1))
    out = core.handle(ev.JobsChanged(records), at(0))
    for job in USERS:
        join = next(i for i in out if isinstance(i, do.Join) and i.job == job)
        info = RendezvousInfo(
            job, 0, Reason.INITIAL, 0, 0, 1, 1, 0, 1, "a", 1, (Member(NODE, "a", 1, 0, 0),)
        )
        out += core.handle(ev.RoundJoined(job, join.op, info), at(0))
    return core, out


def fail(core: NodeCore, job: str, round: int, pid: int, now: ev.Now) -> list[do.Instruction]:
    """A worker of ``job`` here failed (the part publishes it; the node counts it)."""
    group = assign_workers(
        job,
        NODE,
        round=round,
        restart_count=0,
        group_rank=0,
        group_world_size=1,
        rank_base=0,
        world_size=1,
        nproc=1,
        master_addr="a",
        master_port=1,
    )
    failed = Worker(0, 0, 1, NODE, pid=pid, state=WorkerState.FAILED, exit_code=1)
    return core.handle(ev.WorkersChanged(job, group.with_worker(failed)), now)


def left(core: NodeCore, job: str) -> Reason | None:
    """Why the part of ``job`` here was told to leave (it is told once), if it was."""
    return core.parts[job].leaving


def blacklisted(out: list[do.Instruction]) -> list[bool]:
    return [bool(i.value) for i in out if isinstance(i, do.Count) and i.what == "blacklisted"]


def test_discovery_and_the_operator_are_separate_reasons():
    core, _ = node()
    job = "j-000001"
    assert not core.draining and core.listed
    core.handle(ev.Listed(False), at(1))
    assert core.draining and not core.listed and left(core, job) is Reason.DRAIN
    core.handle(ev.HoldChanged("drained by an operator", True), at(2))
    core.handle(ev.HoldChanged("drained by an operator", False), at(3))  # no override of the script
    assert core.draining
    core.handle(ev.Listed(True, 2), at(4))
    assert not core.draining and core.resources == Resources(2, ("0", "1"))
    core.handle(ev.Listed(True), at(5))
    assert core.resources == Resources(4, ("0", "1"))


def test_one_users_failures_keep_their_jobs_off_and_leave_the_others_running():
    core, _ = node(Blacklist(BlacklistPolicy(2, 60.0, 30.0, 30.0), rand=lambda: 0.0))
    out = fail(core, "j-000001", 0, 10, at(100))
    out += fail(core, "j-000001", 0, 10, at(100))  # the same failure again
    assert left(core, "j-000001") is None and core.blacklist.kept_off() == set()
    out = fail(core, "j-000001", 1, 11, at(100))
    assert (
        left(core, "j-000001") is Reason.DRAIN and left(core, "j-000002") is None
    )  # bob's job stays
    assert core.blacklist.kept_off() == {1001} and not core.draining and blacklisted(out) == []
    assert 1001 in core.cooling_users
    assert do.SetTimer("user-cooldown", 130.0, key=1001) in out
    out = core.handle(
        ev.HoldChanged("drained by an operator", False), at(101)
    )  # an undrain lifts it too
    assert core.blacklist.kept_off() == set() and not core.cooling_users
    assert do.ClearTimer("user-cooldown", key=1001) in out


def test_failures_of_two_users_blacklist_the_node_and_undrain_lifts_it():
    core, _ = node(Blacklist(BlacklistPolicy(2, 60.0, 30.0, 30.0), rand=lambda: 0.0))
    out = core.handle(ev.HoldChanged("drained by an operator", True), at(100))
    assert left(core, "j-000002") is Reason.DRAIN
    for pid in (10, 11):
        out += fail(core, "j-000001", pid, pid, at(100))
    assert blacklisted(out) == [] and core.blacklisted_until == 0.0
    out = fail(core, "j-000002", 0, 20, at(100))
    out += fail(core, "j-000002", 1, 21, at(100))
    assert blacklisted(out) == [True] and core.blacklisted_until == 1130.0 and core.draining
    assert left(core, "j-000002") is Reason.DRAIN  # drained already: told to leave once
    out = core.handle(ev.HoldChanged("drained by an operator", False), at(101))  # lifts both
    assert blacklisted(out) == [False] and core.blacklisted_until == 0.0 and not core.draining
    assert do.ClearTimer("cooldown") in out and core.blacklist.kept_off() == set()


def test_the_node_is_readmitted_when_its_cooldown_ends_and_a_user_when_theirs_does():
    core, _ = node(Blacklist(BlacklistPolicy(1, 60.0, 5.0, 5.0), rand=lambda: 0.0))
    out = fail(core, "j-000001", 0, 10, at(100))
    assert not core.draining and core.blacklist.kept_off() == {1001}
    out += fail(core, "j-000002", 0, 20, at(100))
    assert core.draining and core.blacklisted_until > 0 and left(core, "j-000002") is Reason.DRAIN
    timers = [i for i in out if isinstance(i, do.SetTimer)]
    assert {(t.name, t.key, t.at) for t in timers} == {
        ("user-cooldown", 1001, 105.0),
        ("user-cooldown", 1002, 105.0),
        ("cooldown", None, 105.0),
    }
    early = core.handle(ev.NodeTimerFired("cooldown"), at(104.9))  # a moment early: again
    assert early == [do.SetTimer("cooldown", 105.0)] and core.draining
    out = core.handle(ev.NodeTimerFired("cooldown"), at(105))
    assert blacklisted(out) == [False] and not core.draining and core.blacklisted_until == 0.0
    for uid in (1001, 1002):
        core.handle(ev.NodeTimerFired("user-cooldown", uid), at(105))
    assert core.blacklist.kept_off() == set() and not core.cooling_users


def test_no_blacklist_when_it_is_off():
    core, _ = node()
    out = []
    for pid in range(10):
        out += fail(core, "j-000001", pid, pid, at(100))
    assert not core.draining and left(core, "j-000001") is None


def test_the_node_story_ties_each_instruction_to_its_stimulus():
    """dask's stimulus_id: the node's own story names every stimulus it heard and marks
    each instruction with the stimulus that caused it; the parts' stories hear what the
    node taught them (a drain: Leaving) under the same id."""
    core, _ = node()
    out = core.handle(ev.HoldChanged("drained by an operator", True, stimulus_id="drain-7"), at(1))
    assert sum(isinstance(i, do.StopWorkers) for i in out) == 2  # both parts leave their round
    lines = core.node_story()
    heard = [line for line in lines if " heard " in line and "HoldChanged" in line]
    assert heard and heard[-1].endswith("[drain-7]")
    told = [line for line in lines if " told " in line and "[drain-7]" in line]
    assert any("Say(" in line for line in told), lines
    part = core.job_story("j-000001")
    assert any("Leaving(reason=" in line and line.endswith("[drain-7]") for line in part), part
    assert any(" told " in line and "Leaving [drain-7]: StopWorkers(" in line for line in part), (
        part
    )
