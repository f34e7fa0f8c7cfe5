"""reap_leftovers: what a dead daemon's workers left in their process groups is killed, and
nothing else, though pids are reused (real processes; the groups are made here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from harness import alive

from elasticd.core.records import WorkerGroupLeft
from elasticd.shell.workers import JOB_ENV, reap_leftovers

JOB = "j-abc123"
# a group leader that starts a child in its own group, prints both pids once the child runs
# (a process in the middle of its exec shows no environment yet), then sleeps
LEADER = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import time; print(flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
    "child.stdout.readline()\n"
    "print(os.getpid(), child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def group():
    """Start a process group (leader and child) with ``env``; kill what is left after."""
    started: list[subprocess.Popen[str]] = []

    def start(env: dict[str, str]) -> tuple[int, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", LEADER],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        started.append(proc)
        leader, child = map(int, proc.stdout.readline().split())
        return leader, child

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def gone(*pids: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def left(leader: int, *, job: str = JOB, uid: int | None = None, started: float | None = None):
    return {
        leader: WorkerGroupLeft(
            job,
            os.getuid() if uid is None else uid,
            time.time() - 30 if started is None else started,
        )
    }


@pytest.mark.parametrize(
    "env",
    [
        {JOB_ENV: JOB, "TORCHELASTIC_RUN_ID": JOB},
        # elasticrun's private daemon: TORCHELASTIC_RUN_ID is the rendezvous id, as torchrun's
        {JOB_ENV: JOB, "TORCHELASTIC_RUN_ID": "run7"},
    ],
)
def test_the_jobs_processes_are_killed(group, env):
    leader, child = group(env)
    assert reap_leftovers(left(leader)) == 2
    assert gone(leader, child)


@pytest.mark.parametrize(
    "env, whose, why",
    [
        ({}, {}, "no job id in its environment (a user's shell that got a dead worker's pid)"),
        ({JOB_ENV: "j-999999"}, {}, "another job's id"),
        ({"TORCHELASTIC_RUN_ID": JOB}, {}, "torch's run id only (elasticrun's is the rdzv id)"),
        ({JOB_ENV: JOB}, {"uid": 65534}, "another user's process"),
        ({JOB_ENV: JOB}, {"started": time.time() + 3600}, "it started before the job"),
    ],
)
def test_a_process_that_is_not_the_jobs_is_left_alone(group, env, whose, why):
    leader, child = group(env)
    assert reap_leftovers(left(leader, **whose)) == 0, why
    assert psutil.pid_exists(leader) and psutil.pid_exists(child)


def test_nothing_is_killed_after_a_reboot(group):
    """Every pid is new after a reboot: the groups of a job that started before it are not
    that job's."""
    leader, child = group({JOB_ENV: JOB})
    started = time.time() - 30
    assert reap_leftovers(left(leader, started=started), boot_time=started + 1) == 0
    assert psutil.pid_exists(leader) and psutil.pid_exists(child)
