"""Pieces of the worker and control layers that are pure: exit text, peers."""

import os
import socket

import pytest

from elasticd.control.server import Admission, ConnectionLimits, peer_credentials
from elasticd.shell.workers import describe_exit


@pytest.mark.parametrize(
    "code, text",
    [
        (1, "exited with code 1"),
        (-9, "killed by SIGKILL"),
        (-15, "killed by SIGTERM"),
        (-99, "killed by signal 99"),
    ],
)
def test_describe_exit(code, text):
    assert describe_exit(code) == text


def test_peer_credentials_come_from_the_kernel():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        caller = peer_credentials(ours)
    assert (caller.uid, caller.gid, caller.pid) == (os.getuid(), os.getgid(), os.getpid())


def test_admission_limits_connections_per_user_and_in_all():
    admission = Admission(ConnectionLimits(connections=3, connections_per_user=2))
    for uid in (1000, 1000):
        assert admission.refusal(uid) is None
        admission.opened(uid)
    assert "uid 1000" in admission.refusal(
        1000
    ) and "max_connections_per_user = 2" in admission.refusal(1000)
    assert admission.refusal(65534) is None
    admission.opened(65534)
    assert "control.max_connections = 3" in admission.refusal(0)
    admission.closed(1000)
    assert admission.refusal(1000) is None and admission.open == {1000: 1, 65534: 1}
    admission.closed(1000)
    assert 1000 not in admission.open


def test_a_worker_a_round_does_not_hold_loses_its_rank_in_the_shells_view_too():
    """In place: a spare that steps back, or a member's worker placed in no round (it joined
    with none), has rank -1 in the shell's group as in the core's.  The shell kept the old
    rank, and the core, refreshed from it, took the worker for a placed one: it never asked
    for the scale-up round that would take it in (a 3-node job hung at its first rounds)."""
    import asyncio
    import tempfile

    from elasticd.core.model import JobSpec
    from elasticd.core.part.pool import round_group, standby
    from elasticd.rendezvous import Member, Reason, RendezvousInfo
    from elasticd.shell.workers import LocalWorkers

    spec = JobSpec(
        id="j-1",
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=0,
        gid=0,
        user="root",
        in_place=True,
    )

    def round_of(number: int, nproc: int) -> RendezvousInfo:
        member = Member("n1", "h", nproc, 0, 0)
        return RendezvousInfo(
            "j-1", number, Reason.SCALE_UP, 0, 0, 1, nproc, 0, nproc, "h", 1, (member,)
        )

    async def placed_twice() -> list[tuple[int, int]]:
        with tempfile.TemporaryDirectory() as logs:
            workers = LocalWorkers(spec, standby("j-1", "n1", 2), logs)
            workers.place(round_group(round_of(0, 2), "n1", "j-1", (0, 1)), logs)
            workers.place(round_group(round_of(1, 1), "n1", "j-1", (1,)), logs)
            return [(w.rank, w.world_size) for w in workers.group.workers]

    assert asyncio.run(placed_twice()) == [(-1, 0), (0, 1)]


def test_every_worker_carries_its_jobs_id_whatever_torchs_run_id_is():
    """JOB_ENV is what the reaping of a dead daemon's leftovers knows the job's processes by:
    it is the job's id under elasticrun too (whose TORCHELASTIC_RUN_ID is the rendezvous id),
    and in a job started from another job's worker (which inherited that job's)."""
    import asyncio
    import tempfile

    from elasticd.core.model import JobSpec
    from elasticd.core.part.pool import standby
    from elasticd.shell.workers import JOB_ENV, LocalWorkers

    spec = JobSpec(
        id="j-1",
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=0,
        gid=0,
        user="root",
        env={JOB_ENV: "j-outer"},
    )

    async def env() -> dict[str, str]:
        with tempfile.TemporaryDirectory() as logs:
            workers = LocalWorkers(
                spec, standby("j-1", "n1", 1), logs, extra_env={"TORCHELASTIC_RUN_ID": "run7"}
            )
            return workers._env(workers.group.workers[0])

    got = asyncio.run(env())
    assert (got[JOB_ENV], got["TORCHELASTIC_RUN_ID"]) == ("j-1", "run7")
