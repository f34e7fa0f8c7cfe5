"""The part's policy (pure): what to do about an event in a round."""

import pytest

from elasticd.core.model import Failure, JobSpec, JobState, RunResult, WorkerState
from elasticd.core.policy import (
    Decision as Action,
)
from elasticd.core.policy import (
    JobEnded,
    Leaving,
    RejoinStalled,
    WorkersExited,
    WorkersReady,
    decide,
)
from elasticd.core.records import Outcome
from elasticd.rendezvous import EventKind as K
from elasticd.rendezvous import Member, RendezvousInfo, RoundEvent
from elasticd.rendezvous import Reason as R

SPEC = JobSpec(
    id="j-1",
    argv=("t.py",),
    python="/p",
    workdir="/w",
    uid=1,
    gid=1,
    user="u",
    min_nodes=1,
    max_nodes=3,
    max_restarts=2,
)


def info(restart_count=0, nodes=2, idle=0):
    """A round of ``nodes`` members, the last ``idle`` of them with no workers."""
    members = tuple(
        Member(f"n{i}", "a", int(i < nodes - idle), i, min(i, nodes - idle)) for i in range(nodes)
    )
    return RendezvousInfo(
        run_id="j-1",
        round=4,
        reason=R.INITIAL,
        restart_count=restart_count,
        group_rank=0,
        group_world_size=nodes - idle,
        nproc=1,
        rank_base=0,
        world_size=nodes - idle,
        master_addr="a",
        master_port=1,
        members=members,
    )


FAILED = RunResult(WorkerState.FAILED, (Failure(1, 0, "n2", 1, "boom"),))
OK = RunResult(WorkerState.SUCCEEDED)


@pytest.mark.parametrize(
    "event, round_info, action",
    [
        (WorkersExited(OK), info(), Action.BARRIER),
        (WorkersExited(FAILED), info(restart_count=0), Action.RESTART),
        (WorkersExited(FAILED), info(restart_count=1), Action.RESTART),
        (WorkersExited(FAILED), info(restart_count=2), Action.FAIL),
        (WorkersExited(FAILED, lost=("n3",)), info(restart_count=2), Action.NODE_LOST),
        (WorkersExited(FAILED, lost=("n3",)), info(restart_count=0), Action.NODE_LOST),
        (RoundEvent(K.NEXT_ROUND, R.FAILURE), info(), Action.REJOIN),
        (RoundEvent(K.NEXT_ROUND, R.NODE_LOST), info(), Action.REJOIN),
        (RoundEvent(K.CLOSED), info(), Action.STOP),
        (RoundEvent(K.WAITING, waiting=1), info(nodes=2), Action.SCALE_UP),
        (RoundEvent(K.WAITING, waiting=1), info(nodes=3), Action.WATCH),
        (JobEnded("j", Outcome(JobState.CANCELLED, 1.0)), info(), Action.STOP),
        (Leaving("j", R.DRAIN), info(), Action.LEAVE),
        (Leaving("j", R.SHUTDOWN), info(), Action.LEAVE),
        (
            WorkersReady((1,)),
            info(nodes=3),
            Action.SCALE_UP,
        ),  # in place: more workers, not more nodes
        (RejoinStalled((0,)), info(), Action.STALL),
    ],
)
def test_decide(event, round_info, action):
    assert decide(event, round_info, SPEC) is action
