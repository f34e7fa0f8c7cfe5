"""A GPU found bad (core/gpuhealth.py, and the node core that follows it): what takes a GPU
out of the offer and what does not, once and said once; the job that holds it leaves while
the others stay; it comes back by an operator or after reading healthy ``readmit_after``."""

from __future__ import annotations

import pytest

from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.gpuhealth import GpuPolicy, GpuReading, GpuWatch, faults
from elasticd.core.model import JobSpec
from elasticd.core.node import NodeCore, NodeSettings
from elasticd.core.placement import Resources
from elasticd.core.records import JobRecord
from elasticd.rendezvous import Member, Reason, RendezvousInfo

NODE = "g1"
GPUS = ("GPU-aaaa", "GPU-bbbb")


def ok(index: int, **kw) -> GpuReading:
    return GpuReading(index, GPUS[index], **kw)


def at(mono: float) -> ev.Now:
    return ev.Now(mono, 1000.0 + mono)


def said(out: list[do.Instruction], level: str = "warning") -> list[str]:
    return [i.message % i.args for i in out if isinstance(i, do.Say) and i.level == level]


@pytest.mark.parametrize(
    "reading, before, why",
    [
        (ok(0, lost=True), None, ["lost (NVML: GPU is lost)"]),
        (ok(0, xids=(79,)), None, ["xid 79"]),
        (ok(0, xids=(13, 43)), None, []),  # a program's fault, not the GPU's
        (ok(0, ecc_uncorrected=3), None, []),  # the first read is the baseline
        (ok(0, ecc_uncorrected=3), ok(0, ecc_uncorrected=3), []),
        (
            ok(0, ecc_uncorrected=5),
            ok(0, ecc_uncorrected=3),
            ["ecc: 2 new uncorrectable errors (5 in all)"],
        ),
        (ok(0, rows_pending=True), None, ["rows pending remap"]),
        (ok(0, remap_failed=True), None, ["row remapping failed"]),
        (ok(0, slowdown=("hw thermal",)), None, []),  # a warning, never a drain
    ],
)
def test_what_takes_a_gpu_out(reading, before, why):
    assert faults(reading, before, GpuPolicy()) == why


def test_a_gpu_is_taken_out_once_and_said_once():
    watch = GpuWatch()
    out, changed = watch.read((ok(0), ok(1, xids=(79,))), 1.0, 1001.0)
    assert changed and watch.why_out() == {1: "xid 79"}
    assert said(out) == ["gpu 1 (GPU-bbbb) taken out of this node's offer: xid 79"]
    assert [i.label for i in out if isinstance(i, do.Count) and i.what == "gpu_fault"] == ["xid 79"]
    out, changed = watch.read((ok(0), ok(1, lost=True)), 2.0, 1002.0)
    assert not changed and not said(out) and watch.why_out() == {1: "xid 79"}


def test_slowdown_and_an_application_xid_are_said_as_they_change_and_drain_nothing():
    watch = GpuWatch()
    out, changed = watch.read((ok(0, slowdown=("hw thermal",), xids=(13,)),), 1.0, 1001.0)
    assert not changed and not watch.out
    assert said(out) == [
        "gpu 0: xid 13 (an application or driver error: the GPU stays in)",
        "gpu 0 slowed down: hw thermal",
    ]
    assert not said(watch.read((ok(0, slowdown=("hw thermal",)),), 2.0, 1002.0)[0])
    assert said(watch.read((ok(0),), 3.0, 1003.0)[0], "info") == ["gpu 0 runs at full clocks again"]


def test_readmitted_by_an_operator_only_unless_readmit_after_is_set():
    watch = GpuWatch()
    watch.read((ok(0, xids=(79,)),), 1.0, 1001.0)
    assert not watch.read((ok(0),), 10_000.0, 11_000.0)[1]  # healthy for hours: still out
    assert watch.readmit(1, "x") == [] and watch.readmit(0, "readmitted by root")
    assert not watch.out
    healing = GpuWatch(GpuPolicy(readmit_after=60.0))
    healing.read((ok(0, rows_pending=True),), 1.0, 1001.0)
    assert not healing.read((ok(0, rows_pending=True),), 50.0, 1050.0)[
        1
    ]  # bad again: the clock restarts
    assert not healing.read((ok(0),), 100.0, 1100.0)[1]
    out, changed = healing.read((ok(0),), 110.0, 1110.0)
    assert (
        changed
        and not healing.out
        and said(out, "info") == ["gpu 0 (GPU-aaaa) back in the offer: healthy for 60 s"]
    )


def spec(job: str) -> JobSpec:
    return JobSpec(
        id=job,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1001,
        gid=1001,
        user="alice",
        nproc_per_node=1,
    )


def node() -> NodeCore:
    """A node with two GPUs running two one-GPU jobs, one on each GPU."""
    core = NodeCore(
        NodeSettings(NODE, Resources(4, GPUS), dead_after=3.0, judge_users=False),
        gpu_watch=GpuWatch(),
    )
    jobs = ("j-000001", "j-000002")
    out = core.handle(
        ev.JobsChanged(tuple(JobRecord(spec(job), seq) for seq, job in enumerate(jobs, 1))), at(0)
    )
    for job in jobs:
        join = next(i for i in out if isinstance(i, do.Join) and i.job == job)
        info = RendezvousInfo(
            job, 0, Reason.INITIAL, 0, 0, 1, 1, 0, 1, "a", 1, (Member(NODE, "a", 1, 0, 0),)
        )
        out += core.handle(ev.RoundJoined(job, join.op, info), at(0))
    assert {job: core.offers[job].gpus for job in jobs} == {
        "j-000001": GPUS[:1],
        "j-000002": GPUS[1:],
    }
    return core


def test_the_job_on_a_bad_gpu_leaves_the_others_stay_and_the_node_offers_what_is_left():
    core = node()
    core.handle(ev.GpusRead((ok(0), ok(1, xids=(79,)))), at(1))
    assert core.parts["j-000002"].leaving is Reason.DRAIN and core.parts["j-000001"].leaving is None
    assert core.resources.gpus == GPUS[:1] and not core.draining
    core.handle(ev.GpusRead((ok(0), ok(1))), at(2))
    assert core.resources.gpus == GPUS[:1]
    out = core.handle(ev.GpuReadmitted(1, "root"), at(3))
    assert core.resources.gpus == GPUS and said(out, "info") == [
        "gpu 1 (GPU-bbbb) back in the offer: readmitted by root"
    ]


def test_a_node_without_nvml_says_it_cannot_readmit_and_ignores_readings():
    core = NodeCore(NodeSettings(NODE, Resources(4, ("0", "1")), dead_after=3.0, judge_users=False))
    assert core.handle(ev.GpusRead((ok(0, lost=True),)), at(1)) == []
    assert said(core.handle(ev.GpuReadmitted(0), at(2))) == [
        "gpu 0 not readmitted: this node does not watch its GPUs (no NVML)"
    ]


def test_a_flood_of_xids_is_one_line_per_code_and_interval():
    """20,000 Xid 13 in one check (a program can cause them at will) were 20,000 warnings
    (2.2 MB in 6 s): now one line per GPU and code with how many came, that line once per
    interval with how many more there were; every Xid is counted."""
    from elasticd.faults import Throttle

    watch = GpuWatch(told=Throttle(60.0))
    out, changed = watch.read((ok(0, xids=(13,) * 20000 + (43,) * 3), ok(1)), 1.0, 1001.0)
    assert not changed
    assert said(out) == [
        "gpu 0: xid 13 (an application or driver error: the GPU stays in), 20000 in this check",
        "gpu 0: xid 43 (an application or driver error: the GPU stays in), 3 in this check",
    ]
    counts = {i.label: i.value for i in out if isinstance(i, do.Count) and i.what == "xid"}
    assert counts == {"13": 20000, "43": 3}
    for mono in (2.0, 30.0, 60.9):  # within the interval: counted, not said
        out, _ = watch.read((ok(0, xids=(13,) * 500), ok(1)), mono, 1000.0 + mono)
        assert said(out) == [] and [i.value for i in out if isinstance(i, do.Count)] == [500]
    out, _ = watch.read((ok(0, xids=(13,) * 7), ok(1)), 61.0, 1061.0)
    assert said(out) == [
        "gpu 0: xid 13 (an application or driver error: the GPU stays in), 7 in this check"
        " (1500 more since the last such line)"
    ]


def test_a_flood_of_a_hardware_xid_takes_the_gpu_out_with_one_reason():
    watch = GpuWatch()
    out, changed = watch.read((ok(0, xids=(79,) * 5000), ok(1)), 1.0, 1001.0)
    assert changed and watch.why_out() == {0: "xid 79 (x5000)"}
    assert said(out) == ["gpu 0 (GPU-aaaa) taken out of this node's offer: xid 79 (x5000)"]
    out, changed = watch.read((ok(0, xids=(79,) * 5000), ok(1)), 2.0, 1002.0)
    assert not changed and said(out) == []
