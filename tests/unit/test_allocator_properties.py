"""Properties of the cluster's allocator (docs/scheduler.md) over random clusters and jobs
(hypothesis).  A cluster is drawn, its jobs are allocated from nothing, then the world
moves on (nodes are lost, jobs end, new ones arrive, usage and time pass) and the allocator
runs again on what the first run gave.  Whatever the cluster:

- a running job that is not preempted keeps its min (or all it had, when it had less),
  and only ``preemptible`` jobs are preempted;
- no node gives more slots or GPUs than it has, no job holds more than its max, a node it
  may not run on, or a lost node, and admitted mins (each at its share on the nodes it
  landed on) stay within every quota;
- a job started, resized or preempted less than ``min_run_time`` ago keeps every node it
  runs on;
- the same input gives the same output, whatever order it comes in;
- no room idles that a running job due to grow could use, nor that a waiting job's min
  would fit (unless a job ahead of it keeps it);
- a reclaim leaves a job a multiple of its step;
- running the allocator again on its own output moves nothing.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elasticd.core.allocator import (
    Allocation,
    JobDemand,
    NodeCapacity,
    Policy,
    Quota,
    Share,
    WaitReason,
    allocate,
)

NOW = 10_000.0
INTERVAL = 60.0
USERS = ("ann", "bob", "cid")


@st.composite
def clusters(draw: Any) -> dict[str, NodeCapacity]:
    names = [f"n{i}" for i in range(draw(st.integers(1, 6)))]
    gpus = draw(st.sampled_from([0, 2, 4]))
    return {n: NodeCapacity(draw(st.sampled_from([2, 4, 4, 8])), gpus) for n in names}


@st.composite
def demands(draw: Any, nodes: Mapping[str, NodeCapacity], seq: int) -> JobDemand:
    user = draw(st.sampled_from(USERS))
    low = draw(st.sampled_from([1, 1, 1, 2, 3]))
    on = sorted(nodes)
    if draw(st.integers(0, 3)) == 0:  # a job that may run only on some nodes
        on = draw(st.lists(st.sampled_from(on), unique=True, min_size=1, max_size=len(on)))

    def share() -> Share:
        gpus = max(nodes[n].gpus for n in on)
        return Share(draw(st.sampled_from([1, 2, 2, 4])), draw(st.integers(0, min(gpus, 2))))

    uniform = draw(st.integers(0, 3)) > 0
    first = share()
    shares = {n: first if uniform else share() for n in on}
    return JobDemand(
        f"j{seq}",
        user,
        draw(st.sampled_from([user, "lab"])),
        shares,
        low,
        low + draw(st.integers(0, 5)),
        draw(st.sampled_from([1, 1, 2])),
        draw(st.integers(0, 2)),
        seq,
        float(seq),
        draw(st.booleans()),
        draw(st.integers(0, 19)) == 0,
        last_grown=draw(st.sampled_from([None, NOW - 10, NOW - 100])),
        last_moved=draw(st.sampled_from([None, NOW - 1000])),
    )


@st.composite
def policies(draw: Any) -> Policy:
    def limits() -> Quota:
        return Quota(*(draw(st.sampled_from([None, None, 2, 4, 8])) for _ in range(3)))

    return Policy(
        users={u: limits() for u in USERS if draw(st.booleans())},
        accounts={a: limits() for a in ("lab",) if draw(st.booleans())},
        account_shares={"lab": draw(st.sampled_from([1.0, 3.0]))},
        resize_interval=INTERVAL,
    )


@st.composite
def worlds(draw: Any) -> tuple[dict[str, NodeCapacity], list[JobDemand], Policy, dict[str, float]]:
    """A cluster after one allocation and a change: its jobs hold what the allocator gave."""
    nodes = draw(clusters())
    jobs = [draw(demands(nodes, i)) for i in range(draw(st.integers(0, 6)))]
    if draw(st.booleans()):  # elastic jobs that fill the cluster, so that arrivals reclaim
        jobs = [
            replace(j, min_nodes=1, max_nodes=len(nodes), held=False, last_grown=None) for j in jobs
        ]
    policy = draw(policies())
    usage = {a: draw(st.sampled_from([0.0, 100.0, 5000.0])) for a in (*USERS, "lab")}
    first = allocate(nodes, jobs, policy, usage, NOW - 1000)
    jobs = [
        replace(
            j,
            current=first.nodes.get(j.id, frozenset()),
            last_grown=NOW - 1000 if j.id in first.grown else j.last_grown,
        )
        for j in jobs
    ]
    jobs = [j for j in jobs if draw(st.integers(0, 4))]  # some jobs end
    jobs += [draw(demands(nodes, 10 + i)) for i in range(draw(st.integers(0, 4)))]
    lost = draw(st.lists(st.sampled_from(sorted(nodes)), unique=True, max_size=2))
    nodes = {n: replace(c, usable=n not in lost) for n, c in nodes.items()}
    usage = {a: u + draw(st.sampled_from([0.0, 3000.0])) for a, u in usage.items()}
    return nodes, jobs, policy, usage


def check(
    nodes: dict[str, NodeCapacity], jobs: list[JobDemand], policy: Policy, usage: dict[str, float]
) -> Allocation:
    out = allocate(nodes, jobs, policy, usage, NOW)
    by_id = {j.id: j for j in jobs}
    assert set(out.nodes).isdisjoint(w.job for w in out.waiting)
    assert set(out.nodes) | {w.job for w in out.waiting} == set(by_id)
    return out


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def demand(id: str, user: str, account: str, shares: str, size: str, **kw: Any) -> JobDemand:
    """A job of a world the search once found: ``shares`` "n0:3 n1:1" (slots, no GPUs),
    ``size`` "min:max:step"."""
    low, high, step = (int(x) for x in size.split(":"))
    return JobDemand(
        id,
        user,
        account,
        {n: Share(int(k), 0) for n, k in (part.split(":") for part in shares.split())},
        min_nodes=low,
        max_nodes=high,
        step=step,
        seq=int(id[1:]),
        submitted=float(id[1:]),
        **kw,
    )


# A job preempted in one walk and started again in a later one, which a trial placement
# (rolled back) then preempted again: the roll-back forgot the first preemption.
PREEMPTED_TWICE = (
    {f"n{i}": NodeCapacity(slots, 0) for i, slots in enumerate((4, 8, 4, 4, 6))},
    [
        demand(
            "j0",
            "bob",
            "lab",
            "n1:1 n0:3",
            "1:3:2",
            preemptible=True,
            current=frozenset({"n0", "n1"}),
        ),
        demand(
            "j1",
            "bob",
            "lab",
            "n1:3 n0:1 n3:1",
            "2:5:2",
            priority=1,
            current=frozenset({"n0", "n3"}),
        ),
        demand("j2", "ann", "ann", "n3:1", "1:1:2", priority=1),
        demand(
            "j3",
            "ann",
            "ann",
            "n2:3 n0:2 n3:2 n4:1",
            "2:5:2",
            preemptible=True,
            current=frozenset({"n2", "n3"}),
            last_moved=9000.0,
        ),
        demand("j4", "cid", "cid", "n0:3 n3:1 n2:2", "2:5:2", priority=1),
        demand("j5", "cid", "lab", "n3:1", "2:6:1", priority=1, preemptible=True),
        demand("w10", "bob", "lab", "n3:4 n0:4", "2:2:1", priority=2),
        demand("w11", "bob", "lab", "n0:3 n3:3 n2:3 n4:2 n1:3", "3:3:1", priority=2),
        demand("w12", "cid", "lab", "n4:2 n2:2", "2:2:1"),
    ],
    Policy(users={"cid": Quota(nodes=2, gpus=8, slots=2)}, account_shares={"lab": 1.0}),
    {"ann": 0.0, "bob": 0.0, "cid": 0.0, "lab": 0.0},
)


@PROPERTY
@given(worlds())
def test_mins_capacity_max_and_quotas_hold(world: Any) -> None:
    nodes, jobs, policy, usage = world
    out = check(nodes, jobs, policy, usage)
    by_id = {j.id: j for j in jobs}
    for job_id, held in out.nodes.items():
        job = by_id[job_id]
        assert len(held) <= job.max_nodes
        assert all(nodes[n].usable and n in job.shares for n in held)
    for node, cap in nodes.items():
        on = [by_id[j].shares[node] for j, held in out.nodes.items() if node in held]
        assert sum(s.slots for s in on) <= cap.slots and sum(s.gpus for s in on) <= cap.gpus
    for job in jobs:
        kept = {n for n in job.current if nodes[n].usable}
        if job.id in out.preempted:
            assert job.preemptible and kept
            continue
        assert len(out.nodes.get(job.id, ())) >= min(len(kept), job.need), job.id
    _quotas_hold(out, by_id, policy)


def _quotas_hold(out: Allocation, by_id: dict[str, JobDemand], policy: Policy) -> None:
    """Every user's and account's admitted mins (at their shares where they run) are within its
    limits, wherever a job of theirs started now (before, the limits may have differed)."""
    for kind, limits_of, default in (
        ("user", policy.users, policy.user_default),
        ("account", policy.accounts, policy.account_default),
    ):
        owners = {getattr(by_id[j], kind) for j in out.started}
        for owner in owners:
            limits = limits_of.get(owner, default)
            mine = [by_id[j] for j in out.nodes if getattr(by_id[j], kind) == owner]
            charged = [_charge(j, out.nodes[j.id]) for j in mine]
            count, slots, gpus = (sum(c[i] for c in charged) for i in range(3))
            for limit, used in ((limits.nodes, count), (limits.slots, slots), (limits.gpus, gpus)):
                assert limit is None or used <= limit, (kind, owner, limit, used)


def _charge(job: JobDemand, held: frozenset[str]) -> tuple[int, int, int]:
    """Its min at its share on the nodes it holds (each kind at the smallest of its shares)."""
    shares = [job.shares[n] for n in held]
    slots = sorted(share.slots for share in shares)[: job.need]
    gpus = sorted(share.gpus for share in shares)[: job.need]
    return len(slots), sum(slots), sum(gpus)


@PROPERTY
@given(worlds())
def test_a_job_within_its_min_run_time_keeps_every_node_it_runs_on(world: Any) -> None:
    nodes, jobs, policy, usage = world
    fresh = {j.id for j in jobs if j.current and j.last_moved is not None}
    policy = replace(policy, min_run_time=INTERVAL)
    jobs = [replace(j, last_moved=NOW - 10) if j.id in fresh else j for j in jobs]
    out = check(nodes, jobs, policy, usage)
    for job in jobs:
        if job.id in fresh:
            kept = {n for n in job.current if nodes[n].usable}
            assert job.id not in out.preempted, job.id
            assert out.nodes.get(job.id, frozenset()) >= kept - out.dropped.get(job.id, set())


@PROPERTY
@given(worlds(), st.randoms(use_true_random=False))
def test_the_same_input_gives_the_same_output_in_any_order(world: Any, rnd: random.Random) -> None:
    nodes, jobs, policy, usage = world
    out = allocate(nodes, jobs, policy, usage, NOW)
    names = list(nodes)
    rnd.shuffle(names)
    shuffled = [
        replace(j, shares=dict(rnd.sample(list(j.shares.items()), len(j.shares)))) for j in jobs
    ]
    rnd.shuffle(shuffled)
    usage = dict(rnd.sample(list(usage.items()), len(usage)))
    assert allocate({n: nodes[n] for n in names}, shuffled, policy, usage, NOW) == out


@PROPERTY
@given(worlds())
def test_no_room_idles_that_a_running_or_waiting_job_could_use(world: Any) -> None:
    nodes, jobs, policy, usage = world
    out = check(nodes, jobs, policy, usage)
    by_id = {j.id: j for j in jobs}
    free = _free(nodes, by_id, out)
    for job_id, held in out.nodes.items():
        job = by_id[job_id]
        due = job.id in out.started or job.last_grown is None or NOW - job.last_grown >= INTERVAL
        if job.held or not due or len(held) < job.need:
            continue
        room = sum(1 for n in job.shares if n not in held and _fits(free, n, job.shares[n]))
        assert min(job.top, (len(held) + room) // job.step * job.step) <= len(held), job_id
    blocked = False
    for waiting in out.waiting:
        job = by_id[waiting.job]
        if waiting.reason is WaitReason.RESOURCES and job.id not in out.preempted:
            assert sum(1 for n in job.shares if _fits(free, n, job.shares[n])) < job.need, job.id
        if waiting.reason is WaitReason.PRIORITY:
            assert blocked, f"{job.id} waits behind nobody"
        blocked = blocked or waiting.reason in (WaitReason.RESOURCES, WaitReason.PRIORITY)


def _free(
    nodes: dict[str, NodeCapacity], by_id: dict[str, JobDemand], out: Allocation
) -> dict[str, list[int]]:
    free = {n: [c.slots, c.gpus] for n, c in nodes.items() if c.usable}
    for job_id, held in out.nodes.items():
        for n in held:
            free[n][0] -= by_id[job_id].shares[n].slots
            free[n][1] -= by_id[job_id].shares[n].gpus
    return free


def _fits(free: dict[str, list[int]], node: str, share: Share) -> bool:
    return node in free and free[node][0] >= share.slots and free[node][1] >= share.gpus


@PROPERTY
@given(worlds())
@example(PREEMPTED_TWICE)
def test_a_reclaim_leaves_a_multiple_of_the_step_and_few_moves(world: Any) -> None:
    nodes, jobs, policy, usage = world
    out = check(nodes, jobs, policy, usage)
    for job in jobs:
        held = out.nodes.get(job.id, frozenset())
        if job.id in out.reclaimed:
            assert len(held) % job.step == 0 and len(held) >= job.need, job.id
            assert not out.reclaimed[job.id] & held
        if job.id not in out.preempted:
            # a running job keeps every current node it can, but those reclaimed or dropped
            assert (
                job.current
                - out.reclaimed.get(job.id, frozenset())
                - out.dropped.get(job.id, frozenset())
                <= held
            )
            assert (
                held - job.current == out.grown.get(job.id, frozenset())
                or job.id in out.started
                or len(job.current - out.dropped.get(job.id, frozenset())) < job.need
            )


@PROPERTY
@given(worlds())
def test_running_the_allocator_on_its_own_output_moves_nothing(world: Any) -> None:
    nodes, jobs, policy, usage = world
    out = allocate(nodes, jobs, policy, usage, NOW)
    again = [
        replace(
            j,
            current=out.nodes.get(j.id, frozenset()),
            last_grown=NOW if j.id in out.grown else j.last_grown,
        )
        for j in jobs
    ]
    second = allocate(nodes, again, policy, usage, NOW)
    assert second.nodes == out.nodes
    assert not (
        second.grown or second.reclaimed or second.started or second.preempted or second.dropped
    )
    assert second.waiting == out.waiting
