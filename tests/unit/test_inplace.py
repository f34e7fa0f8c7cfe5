"""In-place rounds (pure): who keeps its process, what the survivors hear, who takes which rank."""

import pytest

from elasticd.core.model import JobSpec, worker_env
from elasticd.core.part.pool import Notice, aborts, keeps_workers, notice, round_group, standby
from elasticd.rendezvous import Member, RendezvousInfo
from elasticd.rendezvous import Reason as R


def round_of(round: int, **nproc: int) -> RendezvousInfo:
    members, base = [], 0
    for rank, (node, n) in enumerate(nproc.items()):
        members.append(Member(node, f"{node}.host", n, rank, base))
        base += n
    first = members[0]
    me = members[-1]
    return RendezvousInfo(
        run_id="j",
        round=round,
        reason=R.INITIAL,
        restart_count=0,
        group_rank=me.group_rank,
        group_world_size=len(members),
        nproc=me.nproc,
        rank_base=me.rank_base,
        world_size=base,
        master_addr=first.addr,
        master_port=1234,
        members=tuple(members),
    )


@pytest.mark.parametrize(
    "reason, keeps, abort",
    [
        (R.FAILURE, True, True),
        (R.NODE_LOST, True, True),
        (R.DRAIN, True, True),
        (R.SHUTDOWN, True, True),
        (R.SCALE_UP, True, False),
        (R.STALLED, False, True),
    ],
)
def test_which_rounds_keep_the_workers_and_which_abort_the_old_group(reason, keeps, abort):
    assert keeps_workers(reason) is keeps
    assert aborts(reason) is abort


@pytest.mark.parametrize(
    "before, after, heard",
    [
        (None, {"a": 1, "b": 1}, Notice(False, False)),  # the first round: nothing to hear
        ({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 1}, Notice(True, False)),  # c is gone
        ({"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 1}, Notice(False, True)),  # c came
        ({"a": 2, "b": 2}, {"a": 1, "b": 2}, Notice(True, False)),  # a lost a worker
        ({"a": 1, "b": 2}, {"a": 2, "b": 2}, Notice(False, True)),  # a's replacement is ready
        ({"a": 1, "b": 1}, {"a": 1, "c": 1}, Notice(True, True)),  # one out, one in
        ({"a": 1, "b": 1}, {"b": 1, "a": 1}, Notice(False, False)),  # the same members
    ],
)
def test_what_the_survivors_hear(before, after, heard):
    previous = round_of(3, **before) if before else None
    assert notice(previous, round_of(4, **after)) == heard


def test_kept_workers_take_consecutive_ranks_and_keep_their_slot():
    info = round_of(5, a=2, me=2)  # this node's ranks start at 2
    group = round_group(info, "me", "j", [3, 1])
    assert [(w.local_rank, w.rank) for w in group.workers] == [(1, 2), (3, 3)]
    assert group.local_world_size == 2 and group.world_size == 4 and group.round == 5
    assert (group.master_addr, group.master_port) == ("a.host", 1234)


def test_a_warming_worker_has_no_rank_in_its_environment():
    spec = JobSpec(
        id="j",
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1,
        gid=1,
        user="u",
        nproc_per_node=2,
        env={"RANK": "7", "HOME": "/h"},
    )
    group = standby("j", "me", 2)
    env = worker_env(spec, group, group.workers[1], error_file="/e")
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2" and env["HOME"] == "/h"
    placed = worker_env(
        spec, round_group(round_of(0, me=2), "me", "j", [0, 1]), group.workers[1], error_file="/e"
    )
    assert {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"} <= set(placed)
    assert not {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "GROUP_RANK"} & set(env)
