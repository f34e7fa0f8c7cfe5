"""A node beside a full job (the node core): it offers itself once a member of the job is
judged lost (its part will never say it ended), and the lost node counts again once it
speaks.  Driven by stimuli, as the shell feeds them; the answers are the core's
instructions."""

from __future__ import annotations

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import JobSpec, PartState
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord, Part

SPEC = JobSpec(
    id="j-00000b",
    argv=("t.py",),
    python="/p",
    workdir="/w",
    uid=1,
    gid=1,
    user="u",
    min_nodes=2,
    max_nodes=2,
)


def at(mono: float) -> ev.Now:
    return ev.Now(mono, 1000.0 + mono)


def job(**parts: PartState) -> JobRecord:
    return JobRecord(SPEC, 1, {node: Part(node, state) for node, state in parts.items()})


def starts(out: list[do.Instruction]) -> list[str]:
    return [i.job for i in out if isinstance(i, do.StartPart)]


def test_a_spare_beside_a_full_job_takes_a_lost_members_place_and_not_a_living_ones():
    core = NodeCore(NodeSettings("n3", Resources(4), dead_after=3.0, judge_users=False))
    full = job(n1=PartState.RUNNING, n2=PartState.RUNNING)
    assert starts(core.handle(ev.JobsChanged((full,)), at(0))) == []  # full: it waits
    assert starts(core.handle(ev.JobsChanged((full,)), at(1))) == []
    assert starts(core.handle(ev.NodesLost(("n2",)), at(2))) == [SPEC.id]  # in its place


def test_a_lost_node_that_speaks_again_is_a_member_again():
    core = NodeCore(NodeSettings("n3", Resources(4), dead_after=3.0, judge_users=False))
    core.handle(ev.JobsChanged((job(n1=PartState.RUNNING, n2=PartState.RUNNING),)), at(0))
    core.lost_parts[(SPEC.id, "n2")] = Part("n2", PartState.RUNNING)  # judged lost ...
    core.handle(ev.JobsChanged((job(n1=PartState.RUNNING, n2=PartState.RESTARTING),)), at(1))
    assert core.lost_parts == {}  # ... and back: its newer word counts


def test_nothing_is_kept_of_a_job_that_ended():
    core = NodeCore(NodeSettings("n3", Resources(4), dead_after=3.0, judge_users=False))
    core.handle(ev.JobsChanged((job(n1=PartState.RUNNING, n2=PartState.RUNNING),)), at(0))
    core.handle(ev.NodesLost(("n2",)), at(1))
    assert core.lost_parts  # held while the job runs
    core.handle(ev.JobsChanged(()), at(2))  # gone from the board (retention)
    assert core.lost_parts == {}
