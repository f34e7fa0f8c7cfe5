"""Hung ranks: the pure rules (core/hang.py) and the part's answers (core/part/machine.py),
table by table: progress arms the hang timer, a silent round's stacks are dumped, the rank
not inside a collective is failed as the root cause, a node whose ranks all wait waits one
more timeout, then fails its own; and the worker channel's new lines (shell/workerlink.py)."""

from __future__ import annotations

import json

import pytest
from test_core_part import JOB, Drive, acts, info, kinds, running

from elasticd.core import events as ev
from elasticd.core import hang
from elasticd.core import instructions as do
from elasticd.core.hang import HungRank
from elasticd.core.model import WorkerState
from elasticd.shell.workerlink import Hello, Malformed, Progress, decode

FAULTHANDLER = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/venv/elasticd/elastic/runtime.py", line 100 in _read

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/job/train.py", line 40 in train
  File "/job/train.py", line 60 in <module>
"""
SLEEPING = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 31 in step
  File "/job/train.py", line 40 in train
  File "/job/train.py", line 60 in <module>

Thread 0x00007f0000000002 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 10 in _watchdog
"""
PYSPY = """\
Process 4242: python train.py
Thread 4242 (idle): "MainThread"
    sleep (time)
    step (train.py:31)
    <module> (train.py:60)
Thread 4250 (idle): "elasticd-agent"
    all_reduce (torch/distributed/distributed_c10d.py:2800)
"""


@pytest.mark.parametrize(
    ("text", "inside", "frame"),
    [
        (
            FAULTHANDLER,
            True,
            'File "/venv/torch/distributed/distributed_c10d.py", line 2800 in all_reduce',
        ),
        (SLEEPING, False, 'File "/job/train.py", line 31 in step'),
        (PYSPY, False, "sleep (time)"),
        ("", None, ""),
        ("a line that is no stack\n", None, ""),
    ],
)
def test_where_reads_the_main_threads_stack(text, inside, frame):
    assert hang.where(text) == (inside, frame)


@pytest.mark.parametrize(
    ("progress", "now", "hung"),
    [
        ({}, 100.0, ()),  # nobody reports: never hung
        ({0: 80.0, 1: 85.0}, 100.0, (0, 1)),
        ({0: 80.0, 1: 95.0}, 100.0, ()),  # one progresses: the job does
        ({0: 80.0}, 100.0, (0,)),  # slot 1 never reported: not judged
    ],
)
def test_a_round_is_hung_when_no_reporting_rank_progressed_for_the_timeout(progress, now, hung):
    assert hang.hung_slots(progress, (0, 1), 10.0, now) == hung


def test_the_culprit_is_the_rank_outside_any_collective():
    ranks = (HungRank(0, 0, True), HungRank(1, 1, False, "step"), HungRank(2, 2, None))
    assert hang.culprits(ranks) == (HungRank(1, 1, False, "step"),)
    assert "rank 1 on n1" in hang.cause(ranks[1], "n1", 10) and "at step" in hang.cause(
        ranks[1], "n1", 10
    )


def hung_round(d: Drive, timeout: float = 10.0) -> list[do.Instruction]:
    running(d)
    out = d(ev.Progressed(JOB, 0)) + d(ev.Progressed(JOB, 1))
    timers = [i for i in out if isinstance(i, do.SetTimer)]
    assert len(timers) == 1 and timers[0].at == d.mono + timeout  # armed once
    d.mono += timeout + 1
    return d(ev.TimerFired(JOB, timers[0].name))


def test_no_progress_for_the_timeout_dumps_the_ranks_stacks():
    d = Drive(hang_timeout=10.0)
    out = hung_round(d)
    dump = [i for i in out if isinstance(i, do.DumpStacks)]
    assert dump and dump[0].slots == (0, 1)
    assert d.part.phase.value == "running"


def test_the_rank_outside_a_collective_is_failed_as_the_root_cause():
    d = Drive(hang_timeout=10.0)
    hung_round(d)
    ranks = (HungRank(0, 0, True, "all_reduce"), HungRank(1, 1, False, "step"))
    out = acts(d(ev.RanksHung(JOB, d.op(do.DumpStacks), ranks)))
    assert kinds(out) == ["FailSlots", "Publish"] and out[0].slots == (1,)
    assert out[1].part.hung == out[0].why  # status names it
    assert "made no progress for 10 s and was not inside a collective at step" in out[0].why


def test_ranks_that_all_wait_in_a_collective_wait_one_more_timeout_then_fail():
    d = Drive(hang_timeout=10.0)
    hung_round(d)
    ranks = (HungRank(0, 0, True), HungRank(1, 1, True))
    out = acts(d(ev.RanksHung(JOB, d.op(do.DumpStacks), ranks)))
    assert kinds(out) == ["SetTimer"]
    d.mono += 11
    out = acts(d(ev.TimerFired(JOB, out[0].name)))
    assert kinds(out) == ["FailSlots", "FailSlots", "Publish"]
    assert "no node found the rank it waited for" in out[0].why


def test_progress_after_the_dump_clears_the_suspicion():
    d = Drive(hang_timeout=10.0)
    hung_round(d)
    d(ev.RanksHung(JOB, d.op(do.DumpStacks), (HungRank(0, 0, True), HungRank(1, 1, True))))
    d(ev.Progressed(JOB, 0))
    timer = next(i for i in reversed(d.said) if isinstance(i, do.SetTimer))
    d.mono += 5
    assert [i for i in acts(d(ev.TimerFired(JOB, timer.name))) if isinstance(i, do.FailSlots)] == []


def test_a_job_without_a_hang_timeout_ignores_progress():
    d = Drive()
    running(d)
    assert d(ev.Progressed(JOB, 0)) == []


def test_a_hang_timer_outside_a_running_round_does_nothing():
    d = Drive(hang_timeout=10.0)
    running(d)
    out = d(ev.Progressed(JOB, 0))
    timer = next(i for i in out if isinstance(i, do.SetTimer))
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)  # the round ends: probing, then more
    assert d.part.phase.value != "running"
    assert acts(d(ev.TimerFired(JOB, timer.name))) == []


def test_a_classic_hung_rank_failed_restarts_the_round():
    d = Drive(hang_timeout=10.0)
    hung_round(d)
    d(ev.RanksHung(JOB, d.op(do.DumpStacks), (HungRank(1, 1, False, "step"),)))
    out = d.workers(WorkerState.HEALTHY, WorkerState.FAILED)
    assert "Probe" in kinds(out)  # a failure: is a member gone?  then the round restarts


def test_in_place_a_hung_rank_is_dumped_and_failed_like_a_classic_one():
    d = Drive(in_place=True, hang_timeout=10.0)
    d.start()
    d.joined(info())
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    d(ev.Progressed(JOB, 0))
    d(ev.Progressed(JOB, 1))
    timer = next(i for i in reversed(d.said) if isinstance(i, do.SetTimer) and "hang" in i.name)
    d.mono += 11
    assert "DumpStacks" in kinds(d(ev.TimerFired(JOB, timer.name)))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"op": "hello", "slot": 1, "stacks": 12}\n', Hello(1, 12)),
        (b'{"op": "hello", "slot": 1}\n', Hello(1, 0)),
        (b'{"op": "progress"}\n', Progress()),
    ],
)
def test_the_worker_channel_reads_hello_with_its_stack_signal_and_progress(line, message):
    assert decode(line) == message


@pytest.mark.parametrize("stacks", [9, 19, 65, -1, "12", 1.5, True])
def test_a_hello_naming_no_usable_signal_is_malformed(stacks):
    with pytest.raises(Malformed):
        decode(b'{"op": "hello", "slot": 0, "stacks": %s}\n' % json.dumps(stacks).encode())
