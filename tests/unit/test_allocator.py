"""The cluster's allocator (docs/scheduler.md) by table: each rule by a small scenario, named after
what a user sees.  Nodes are a, b, c, ... with 4 slots each unless a scenario says
otherwise; every job takes a whole node (4 slots) unless it says otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from elasticd.core import fairshare
from elasticd.core.allocator import (
    Allocation,
    JobDemand,
    NodeCapacity,
    Policy,
    Quota,
    Share,
    Waiting,
    WaitReason,
    allocate,
)

NOW = 1000.0
LONG_AGO = 0.0


def cluster(
    names: str = "abc", slots: int = 4, gpus: int = 0, down: str = ""
) -> dict[str, NodeCapacity]:
    return {n: NodeCapacity(slots, gpus, usable=n not in down) for n in names}


def job(
    id: str,
    size: str = "1:1",
    *,
    user: str | None = None,
    on: str = "abcdefgh",
    slots: int = 4,
    gpus: int = 0,
    has: str = "",
    **kw: Any,
) -> JobDemand:
    """A job ``id`` of ``user`` (default: the id's letters), ``size`` "min:max", eligible
    on the nodes ``on``, holding ``has`` now."""
    low, high = (int(x) for x in size.split(":"))
    user = user or id.rstrip("0123456789")
    kw.setdefault("seq", int(id[-1]) if id[-1].isdigit() else 0)
    kw.setdefault("last_grown", LONG_AGO if has else None)
    kw.setdefault("account", user)
    return JobDemand(
        id,
        user,
        shares={n: Share(slots, gpus) for n in on},
        min_nodes=low,
        max_nodes=high,
        current=frozenset(has),
        **kw,
    )


def run(
    nodes: dict[str, NodeCapacity],
    *jobs: JobDemand,
    policy: Policy = Policy(),
    usage: dict[str, float] | None = None,
) -> Allocation:
    return allocate(nodes, jobs, policy, usage or {}, NOW)


def uneven(id: str, size: str, shares: dict[str, tuple[int, int]], **kw: Any) -> JobDemand:
    """A running job ``id`` with a share of its own on each node: ``{node: (slots, gpus)}``,
    on all of them now; its user and account from its letters."""
    low, high = (int(x) for x in size.split(":"))
    user = id.rstrip("0123456789")
    return JobDemand(
        id,
        user,
        user,
        {n: Share(*share) for n, share in shares.items()},
        min_nodes=low,
        max_nodes=high,
        current=frozenset(shares),
        last_grown=LONG_AGO,
        seq=int(id[-1]),
        **kw,
    )


def held(result: Allocation) -> dict[str, str]:
    return {j: "".join(sorted(n)) for j, n in result.nodes.items()}


def reasons(result: Allocation) -> list[tuple[str, str]]:
    return [(w.job, w.reason.value) for w in result.waiting]


# -- order: priority, then fair share, then age -------------------------------------------------


def test_a_higher_priority_job_submitted_later_starts_first() -> None:
    result = run(cluster("a"), job("ann1"), job("bob2", priority=5))
    assert held(result) == {"bob2": "a"}
    assert reasons(result) == [("ann1", "Resources")]


def test_an_account_that_used_less_starts_first_at_equal_priority() -> None:
    result = run(cluster("a"), job("ann1"), job("bob2"), usage={"ann": 3600.0})
    assert held(result) == {"bob2": "a"} and result.order == ("bob2", "ann1")


def test_at_equal_priority_and_usage_the_older_job_starts_first() -> None:
    result = run(cluster("a"), job("bob2"), job("ann1"), usage={"ann": 50.0, "bob": 50.0})
    assert held(result) == {"ann1": "a"} and reasons(result) == [("bob2", "Resources")]


def test_an_account_with_three_shares_may_use_three_times_as_much() -> None:
    policy = Policy(account_shares={"ann": 3.0, "bob": 1.0})
    result = run(
        cluster("a"), job("bob1"), job("ann2"), policy=policy, usage={"ann": 299.0, "bob": 100.0}
    )
    assert held(result) == {"ann2": "a"}


def test_the_queue_lists_waiting_jobs_in_the_order_they_will_start() -> None:
    result = run(
        cluster("a"), job("ann1", has="a"), job("bob2"), job("cid3", priority=1), job("dan4")
    )
    assert [w.job for w in result.waiting] == ["cid3", "bob2", "dan4"]


# -- a running job's min is guaranteed ----------------------------------------------------------


def test_a_running_job_keeps_its_nodes_when_nobody_else_wants_them() -> None:
    result = run(cluster(), job("ann1", "1:3", has="abc"))
    assert held(result) == {"ann1": "abc"} and not result.grown and not result.reclaimed


def test_a_running_jobs_min_is_not_reclaimed_for_another_users_job() -> None:
    result = run(cluster("ab"), job("ann1", "2:2", has="ab"), job("bob2"))
    assert held(result) == {"ann1": "ab"} and reasons(result) == [("bob2", "Resources")]


def test_a_job_that_lost_a_node_below_its_min_keeps_what_it_has() -> None:
    result = run(cluster("ab", down="b"), job("ann1", "2:2", has="ab"), job("bob2"))
    assert held(result) == {"ann1": "a"} and result.dropped == {"ann1": frozenset("b")}
    assert reasons(result) == [("bob2", "Resources")]
    assert "ann1" not in {w.job for w in result.waiting}


def test_a_job_below_its_min_gets_a_free_node_back_at_once_even_if_it_grew_just_now() -> None:
    result = run(cluster("abc", down="b"), job("ann1", "2:2", has="ab", last_grown=NOW - 1))
    assert held(result) == {"ann1": "ac"}


def test_a_job_below_its_min_reclaims_a_lent_node_to_get_back_to_it() -> None:
    result = run(
        cluster("abcd", down="a"), job("ann1", "2:2", has="ab"), job("bob2", "1:3", has="cd")
    )
    assert held(result) == {"ann1": "bc", "bob2": "d"} and result.reclaimed == {
        "bob2": frozenset("c")
    }


def test_a_running_job_over_its_max_gives_back_the_excess() -> None:
    result = run(cluster(), job("ann1", "1:2", has="abc"))
    assert held(result) == {"ann1": "ab"} and result.dropped == {"ann1": frozenset("c")}


# -- shrink to admit -------------------------------------------------------------------------


def test_a_1_3_job_on_three_nodes_gives_one_up_when_another_users_1_1_job_arrives() -> None:
    result = run(cluster(), job("ann1", "1:3", has="abc"), job("bob2"))
    assert held(result)["ann1"] in ("ab", "ac", "bc") and len(held(result)["bob2"]) == 1
    assert result.reclaimed == {"ann1": result.nodes["bob2"]} and result.started == {"bob2"}
    assert not result.waiting


def test_a_waiting_job_takes_a_free_node_before_reclaiming_any() -> None:
    result = run(cluster("abcd"), job("ann1", "1:3", has="abc"), job("bob2"))
    assert held(result) == {"ann1": "abc", "bob2": "d"} and not result.reclaimed


def test_the_job_last_in_the_order_yields_first() -> None:
    result = run(
        cluster("abcd"), job("ann1", "1:2", has="ab"), job("bob2", "1:2", has="cd"), job("cid3")
    )
    assert held(result)["ann1"] == "ab" and result.reclaimed.keys() == {"bob2"}


def test_a_reclaim_leaves_a_job_a_multiple_of_its_step() -> None:
    result = run(cluster("abcd"), job("ann1", "2:4", has="abcd", step=2), job("bob2"))
    assert len(result.nodes["ann1"]) == 2 and len(result.nodes["bob2"]) == 1
    assert len(result.reclaimed["ann1"]) == 2


def test_a_job_of_higher_priority_keeps_its_lent_nodes_from_a_lower_priority_job() -> None:
    result = run(cluster(), job("ann1", "1:3", has="abc", priority=5), job("bob2"))
    assert held(result) == {"ann1": "abc"} and reasons(result) == [("bob2", "Resources")]


def test_a_waiting_job_takes_the_node_that_moves_the_fewest_jobs() -> None:
    # a is shared by two half-node jobs, each lending it; b is one whole-node job's lent node
    result = run(
        cluster("abcde"),
        job("ann1", "1:2", has="ac", slots=2, on="ac"),
        job("ann2", "1:2", has="ad", slots=2, on="ad"),
        job("cid3", "1:2", has="be", on="be"),
        job("dan5", on="ab"),
    )
    assert held(result)["dan5"] == "b" and result.reclaimed == {"cid3": frozenset("b")}


def test_a_large_job_that_cannot_start_keeps_its_room_from_smaller_jobs_behind_it() -> None:
    # ann1 runs on a and cannot yield; bob2 needs all three nodes; cid3 would fit on b
    result = run(cluster(), job("ann1", has="a"), job("bob2", "3:3"), job("cid3"))
    assert held(result) == {"ann1": "a"}
    assert reasons(result) == [("bob2", "Resources"), ("cid3", "Priority")]


def test_a_small_job_starts_on_a_node_the_blocked_job_cannot_use() -> None:
    result = run(cluster("abcd"), job("ann1", has="a"), job("bob2", "3:3", on="abc"), job("cid3"))
    assert held(result) == {"ann1": "a", "cid3": "d"} and reasons(result) == [("bob2", "Resources")]


def test_a_job_that_started_on_a_node_a_larger_job_needs_leaves_it_once_it_grows_elsewhere() -> (
    None
):
    # cid1 goes first and takes b (the tightest fit); dan2 needs a and b.  Once cid1 grows
    # onto c, b is lent, and dan2 takes it: both run, and a second run would move nothing
    nodes = {"a": NodeCapacity(4), "b": NodeCapacity(2), "c": NodeCapacity(2)}
    result = run(nodes, job("cid1", "1:2", slots=1, on="bc"), job("dan2", "2:2", slots=2, on="ab"))
    assert held(result) == {"cid1": "c", "dan2": "ab"} and not result.waiting


def test_a_running_job_may_grow_into_room_a_blocked_job_keeps() -> None:
    result = run(cluster(), job("ann1", has="a"), job("bob2", "3:3"), job("cid3", "1:3", has="b"))
    assert held(result) == {"ann1": "a", "cid3": "bc"} and result.grown == {"cid3": frozenset("c")}


# -- preemption below min, only of preemptible jobs ------------------------------------------------


def test_a_preemptible_job_is_requeued_for_a_higher_priority_job_that_cannot_start_otherwise() -> (
    None
):
    result = run(
        cluster("ab"),
        job("ann1", "2:2", has="ab", preemptible=True),
        job("bob2", "2:2", priority=5),
    )
    assert held(result) == {"bob2": "ab"} and result.preempted == {"ann1"}
    assert reasons(result) == [("ann1", "Resources")]


def test_a_job_not_submitted_preemptible_is_never_stopped_below_its_min() -> None:
    result = run(cluster("ab"), job("ann1", "2:2", has="ab"), job("bob2", "2:2", priority=5))
    assert held(result) == {"ann1": "ab"} and not result.preempted
    assert reasons(result) == [("bob2", "Resources")]


def test_a_preemptible_job_ahead_in_the_order_is_not_preempted() -> None:
    result = run(
        cluster("ab"),
        job("ann1", "2:2", has="ab", preemptible=True, priority=5),
        job("bob2", "2:2"),
    )
    assert held(result) == {"ann1": "ab"} and not result.preempted


def test_preemption_is_the_last_resort_lent_nodes_go_first() -> None:
    result = run(
        cluster(),
        job("ann1", has="a", preemptible=True),
        job("bob2", "1:2", has="bc"),
        job("cid3", priority=5),
    )
    assert (
        held(result)["ann1"] == "a" and not result.preempted and result.reclaimed.keys() == {"bob2"}
    )


def test_a_preempted_job_restarts_at_once_where_room_is_left() -> None:
    # ann1 (preemptible) must leave a and b to bob2; it starts again on e (idle) and a node lent by cid3
    result = run(
        cluster("abcde"),
        job("ann1", "2:2", has="ab", preemptible=True),
        job("bob2", "2:2", priority=5, on="ab"),
        job("cid3", "1:2", has="cd", on="cd"),
    )
    assert result.preempted == {"ann1"} and not result.waiting
    assert (
        held(result)["bob2"] == "ab"
        and "e" in result.nodes["ann1"]
        and len(result.nodes["cid3"]) == 1
    )
    assert result.nodes["ann1"] | result.nodes["cid3"] == frozenset("cde") and result.started == {
        "ann1",
        "bob2",
    }


# -- grow to fill ----------------------------------------------------------------------------------


def test_idle_nodes_go_to_a_running_job_below_its_max() -> None:
    result = run(cluster(), job("ann1", "1:3", has="a"))
    assert held(result) == {"ann1": "abc"} and result.grown == {"ann1": frozenset("bc")}


def test_a_job_grows_at_most_once_per_resize_interval() -> None:
    result = run(cluster(), job("ann1", "1:3", has="a", last_grown=NOW - 10))
    assert held(result) == {"ann1": "a"} and not result.grown
    policy = Policy(resize_interval=5.0)
    assert held(
        run(cluster(), job("ann1", "1:3", has="a", last_grown=NOW - 10), policy=policy)
    ) == {"ann1": "abc"}


def test_a_job_grows_by_whole_steps_only() -> None:
    assert held(run(cluster(), job("ann1", "2:4", has="ab", step=2))) == {"ann1": "ab"}
    assert held(run(cluster("abcd"), job("ann1", "2:4", has="ab", step=2))) == {"ann1": "abcd"}


def test_a_job_just_admitted_starts_above_its_min_when_room_is_free() -> None:
    result = run(cluster(), job("ann1", "1:3"))
    assert held(result) == {"ann1": "abc"} and result.started == {"ann1"}


def test_the_first_job_in_the_order_grows_first() -> None:
    result = run(
        cluster("abcd"), job("ann1", "1:4", has="a"), job("bob2", "1:4", has="b", priority=1)
    )
    assert held(result) == {"ann1": "a", "bob2": "bcd"}


def test_a_held_job_waits_and_a_held_running_job_does_not_grow() -> None:
    result = run(cluster("abcd"), job("ann1", "1:3", has="a", held=True), job("bob2", held=True))
    assert held(result) == {"ann1": "a"} and reasons(result) == [("bob2", "Held")]


def test_a_job_needing_two_lenders_to_yield_a_node_each_starts_whichever_it_clears_first() -> None:
    """cid5 needs "a" and "b".  "a" is cleared by either lender; "b" only by bob2 (its 2
    slots there).  bob2, last in the order, yields first: had it yielded "a" (first by name,
    as cheap as "b"), nothing would be left to clear "b", though yielding "b" and ann1 "a"
    starts cid5.  Such a job is not left to wait for the next plan."""
    nodes = cluster("ab", slots=8)
    lenders = (
        job("ann1", "1:2", slots=1, has="ab"),
        uneven("bob2", "1:2", {"a": (1, 0), "b": (2, 0)}),
    )
    fillers = (job("dan3", slots=3, on="a", has="a"), job("eve4", slots=3, on="b", has="b"))
    result = run(nodes, *lenders, *fillers, job("cid5", "2:2", on="ab"))
    assert held(result) == {"ann1": "b", "bob2": "a", "cid5": "ab", "dan3": "a", "eve4": "b"}
    assert result.started == {"cid5"}


# -- quotas --------------------------------------------------------------------------------------


def test_a_job_whose_min_would_take_its_user_over_the_node_limit_waits_with_quota_user() -> None:
    policy = Policy(users={"ann": Quota(nodes=2)})
    result = run(
        cluster("abcd"), job("ann1", "2:2", has="ab"), job("ann2"), job("bob3"), policy=policy
    )
    assert reasons(result) == [("ann2", "QuotaUser")] and held(result)["bob3"] in ("c", "d")


def test_an_account_limit_on_gpus_counts_every_job_of_the_account() -> None:
    policy = Policy(accounts={"lab": Quota(gpus=8)})
    nodes = cluster("abc", slots=8, gpus=8)
    result = run(
        nodes,
        job("ann1", has="a", gpus=4, account="lab"),
        job("bob2", gpus=8, account="lab"),
        job("cid3", gpus=4, account="lab"),
        policy=policy,
    )
    assert reasons(result) == [("bob2", "QuotaAccount")] and set(result.nodes) == {"ann1", "cid3"}


def test_the_default_limit_applies_to_every_user_without_one_of_their_own() -> None:
    policy = Policy(users={"ann": Quota()}, user_default=Quota(slots=4))
    result = run(cluster(), job("ann1", "2:2"), job("bob2"), job("bob3"), policy=policy)
    assert set(result.nodes) == {"ann1", "bob2"} and reasons(result) == [("bob3", "QuotaUser")]


def test_a_job_may_borrow_idle_nodes_over_its_quota() -> None:
    policy = Policy(users={"ann": Quota(nodes=1)})
    result = run(cluster(), job("ann1", "1:3"), policy=policy)
    assert held(result) == {"ann1": "abc"} and result.borrowing == {"ann1"}


def test_borrowed_nodes_are_reclaimed_before_lent_ones() -> None:
    # ann1 (first in the order) borrows over ann's quota; bob2 (after it) lends within bob's
    policy = Policy(users={"ann": Quota(nodes=1)})
    result = run(
        cluster("abcd"),
        job("ann1", "1:2", has="ab"),
        job("bob2", "1:2", has="cd"),
        job("cid3"),
        policy=policy,
    )
    assert result.reclaimed.keys() == {"ann1"} and held(result)["bob2"] == "cd"
    assert result.borrowing == frozenset()


def test_a_higher_priority_job_borrowing_over_its_quota_yields_the_borrowed_node() -> None:
    policy = Policy(users={"ann": Quota(nodes=1)})
    result = run(cluster(), job("ann1", "1:3", has="abc", priority=5), job("bob2"), policy=policy)
    assert len(result.nodes["ann1"]) == 2 and len(result.nodes["bob2"]) == 1


# -- few moves, shared nodes ---------------------------------------------------------------------


def test_jobs_share_a_node_when_its_slots_allow() -> None:
    result = run(cluster("a", slots=8), job("ann1", has="a"), job("bob2"))
    assert held(result) == {"ann1": "a", "bob2": "a"}


def test_a_node_is_never_given_past_its_gpus() -> None:
    result = run(cluster("a", slots=8, gpus=4), job("ann1", gpus=3, has="a"), job("bob2", gpus=2))
    assert held(result) == {"ann1": "a"} and reasons(result) == [("bob2", "Resources")]


def test_growth_takes_the_tightest_node_and_leaves_whole_nodes_whole() -> None:
    result = run(cluster("abc", slots=8), job("ann1", has="b"), job("bob2", "1:2", has="c"))
    assert held(result)["bob2"] == "bc"


def test_growth_prefers_nodes_no_waiting_job_keeps() -> None:
    # bob2 (three of b, c, d) cannot start while ann1 holds c, and keeps b and d; cid3 grows onto e
    result = run(
        cluster("abcde"),
        job("ann1", has="c", on="c"),
        job("bob2", "3:3", on="bcd"),
        job("cid3", "1:2", has="a", on="abe"),
    )
    assert held(result)["cid3"] == "ae" and reasons(result) == [("bob2", "Resources")]


def test_a_running_job_keeps_the_nodes_it_has_and_growth_only_adds() -> None:
    result = run(cluster("abcd"), job("ann1", "1:4", has="bd"))
    assert result.nodes["ann1"] >= frozenset("bd")


# -- jobs that cannot start -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario, demand",
    [
        ("more nodes than the cluster has", job("ann1", "4:4")),
        ("a step larger than its max", job("ann1", "1:3", step=4)),
        ("a share larger than any node", job("ann1", slots=16)),
        ("too few eligible nodes", job("ann1", "2:2", on="a")),
    ],
)
def test_a_job_that_can_never_fit_waits_with_size(scenario: str, demand: JobDemand) -> None:
    assert reasons(run(cluster(), demand)) == [("ann1", "Size")], scenario


def test_a_lost_node_is_not_a_reason_for_size_it_may_come_back() -> None:
    assert reasons(run(cluster(down="c"), job("ann1", "3:3"))) == [("ann1", "Resources")]


def test_a_held_job_waits_with_held_in_its_place_in_the_order() -> None:
    result = run(
        cluster("a"), job("ann1", held=True, priority=1), job("bob2", has="a"), job("cid3")
    )
    assert result.waiting == (
        Waiting("ann1", WaitReason.HELD),
        Waiting("cid3", WaitReason.RESOURCES),
    )


# -- fair share helpers -------------------------------------------------------------------------


def test_usage_halves_every_half_life() -> None:
    assert fairshare.decay({"ann": 100.0}, 7 * 86400.0) == {"ann": 50.0}
    assert fairshare.decay({"ann": 100.0}, 60.0, half_life=60.0) == {"ann": 50.0}
    assert fairshare.decay({"ann": 100.0}, -5.0) == {"ann": 100.0}
    assert fairshare.decay({"ann": 100.0}, 5.0, half_life=0) == {"ann": 0.0}


def test_charge_adds_node_seconds_to_an_account() -> None:
    usage = fairshare.charge({"ann": 1.0}, "bob", 10.0)
    assert fairshare.charge(usage, "ann", 2.0) == {"ann": 3.0, "bob": 10.0}
    assert fairshare.charge(usage, "ann", -2.0) == usage


def test_an_account_that_used_nothing_has_factor_one_and_one_that_used_its_share_one_half() -> None:
    factors = fairshare.factor({"ann": 10.0, "bob": 10.0, "cid": 0.0})
    assert factors["cid"] == 1.0
    assert factors["ann"] == factors["bob"] == pytest.approx(2**-1.5)
    assert fairshare.factor({"ann": 50.0, "bob": 50.0})["ann"] == 0.5
    assert fairshare.factor({}, accounts=["ann"]) == {"ann": 1.0}
    assert fairshare.factor({"ann": 5.0}, {"ann": 0.0, "bob": 1.0})["ann"] == 0.0


# -- quotas count what a job holds where it lands ------------------------------------------------


def gpu_sized(id: str, nodes: dict[str, NodeCapacity], **kw: Any) -> JobDemand:
    """A job of ``--nproc-per-node gpu``: on each node, one worker per GPU of that node."""
    low, high = kw.pop("size", "1:1").split(":")
    kw.setdefault("seq", int(id[-1]))
    return JobDemand(
        id,
        kw.pop("user", id.rstrip("0123456789")),
        kw.pop("account", id.rstrip("0123456789")),
        shares={n: Share(c.gpus, c.gpus) for n, c in nodes.items()},
        min_nodes=int(low),
        max_nodes=int(high),
        **kw,
    )


MIXED = {"one": NodeCapacity(4, 1), "two": NodeCapacity(4, 2)}


def test_a_job_sized_by_the_node_is_charged_the_gpus_of_the_node_it_lands_on() -> None:
    """A 1-GPU quota: the job lands on the 1-GPU node, never on the 2-GPU one (where it
    would hold 2), though its smallest share is 1 on either."""
    policy = Policy(users={"ann": Quota(gpus=1)})
    result = run(MIXED, gpu_sized("ann1", MIXED), policy=policy)
    assert held(result) == {"ann1": "one"}


def test_it_waits_with_quota_user_while_only_a_node_over_its_quota_is_free() -> None:
    policy = Policy(users={"ann": Quota(gpus=1)})
    busy = JobDemand("bob1", "bob", "bob", {"one": Share(4, 1)}, current=frozenset({"one"}), seq=1)
    result = run(MIXED, busy, gpu_sized("ann2", MIXED), policy=policy)
    assert held(result) == {"bob1": "one"} and reasons(result) == [("ann2", "QuotaUser")]
    # the same with the limit on the account: QuotaAccount
    policy = Policy(accounts={"lab": Quota(gpus=1)})
    result = run(MIXED, busy, gpu_sized("ann2", MIXED, account="lab"), policy=policy)
    assert reasons(result) == [("ann2", "QuotaAccount")]


def test_a_job_placed_first_come_over_its_quota_is_requeued_and_placed_within_it() -> None:
    """Nodes placed it themselves (no schedule), on the 2-GPU node: the allocator checks
    its quota at what it holds there, requeues it and starts it on the 1-GPU node."""
    policy = Policy(users={"ann": Quota(gpus=1)})
    placed = gpu_sized("ann1", MIXED, current=frozenset({"two"}), scheduled=False)
    result = run(MIXED, placed, policy=policy)
    assert held(result) == {"ann1": "one"} and result.preempted == {"ann1"}
    assert result.started == {"ann1"}
    # a job the allocator placed is kept where it runs, charged as it was
    kept = gpu_sized("ann1", MIXED, current=frozenset({"two"}))
    assert held(run(MIXED, kept, policy=Policy(users={"ann": Quota(gpus=2)}))) == {"ann1": "two"}


def test_a_node_yielded_to_a_job_of_the_same_user_counts_what_the_yielder_is_charged_then() -> None:
    """ann1 (min 1) is charged for its cheapest node, "zero" (0 GPUs), and grew onto
    "one".  ann2 needs "zero" whole with 2 GPUs, ann's quota: ann1 could yield it and stay
    within the quota alone (now charged 1 GPU, on "one"), ann2 could take it within the
    quota alone, but not both: ann2 waits and ann1 keeps both nodes."""
    nodes = {"zero": NodeCapacity(4, 2), "one": NodeCapacity(4, 2)}
    grown = uneven("ann1", "1:2", {"zero": (1, 0), "one": (1, 1)})
    whole = JobDemand("ann2", "ann", "ann", {"zero": Share(4, 2)}, seq=2)
    result = run(nodes, grown, whole, policy=Policy(users={"ann": Quota(gpus=2)}))
    assert held(result) == {"ann1": "onezero"} and reasons(result) == [("ann2", "QuotaUser")]
    # with room in the quota for both, ann1 yields "zero"
    result = run(nodes, grown, whole, policy=Policy(users={"ann": Quota(gpus=3)}))
    assert held(result) == {"ann1": "one", "ann2": "zero"}


def test_a_lender_left_a_multiple_of_its_step_gives_up_its_largest_shares() -> None:
    """ann1 (min 2, step 2) holds z (0 GPUs) and a, b, c (1 GPU each): charged 1 GPU, ann's
    quota.  It yields "a" to ann2 (0 GPUs there) and must give up one more node for its
    step: b or c, never z, which would charge it 2."""
    nodes = {n: NodeCapacity(1, 1) for n in "abcz"}
    lender = uneven("ann1", "2:4", {"z": (1, 0), "a": (1, 1), "b": (1, 1), "c": (1, 1)}, step=2)
    taker = JobDemand("ann2", "ann", "ann", {"a": Share(1, 0)}, seq=2)
    result = run(nodes, lender, taker, policy=Policy(users={"ann": Quota(gpus=1)}))
    assert held(result) == {"ann1": "bz", "ann2": "a"}


# -- a job is not disturbed again too soon -----------------------------------------------------------


def test_a_job_that_just_started_lends_nothing_until_its_min_run_time_is_over() -> None:
    policy = Policy(min_run_time=60.0)
    fresh = job("ann1", "1:3", has="abc", last_moved=NOW - 10)
    result = run(cluster(), fresh, job("bob2"), policy=policy)
    assert held(result) == {"ann1": "abc"} and reasons(result) == [("bob2", "Resources")]
    settled = job("ann1", "1:3", has="abc", last_moved=NOW - 60)
    result = run(cluster(), settled, job("bob2"), policy=policy)
    assert len(result.nodes["ann1"]) == 2 and result.reclaimed.keys() == {"ann1"}
    assert result.moved == {"ann1", "bob2"} and result.forced == {"bob2": 1}


def test_a_preemptible_job_that_just_started_is_not_preempted_again() -> None:
    policy = Policy(min_run_time=60.0)
    low = job("ann1", "2:2", has="ab", preemptible=True, last_moved=NOW - 5)
    result = run(cluster("ab"), low, job("bob2", "2:2", priority=5), policy=policy)
    assert held(result) == {"ann1": "ab"} and not result.preempted
    low = job("ann1", "2:2", has="ab", preemptible=True, last_moved=NOW - 61)
    result = run(cluster("ab"), low, job("bob2", "2:2", priority=5), policy=policy)
    assert held(result) == {"bob2": "ab"} and result.preempted == {"ann1"}
    assert result.forced == {"bob2": 2}  # the nodes the preempted job ran on


def test_what_a_job_was_given_in_this_very_allocation_it_may_give_back() -> None:
    """A node given now moves no worker: the min run time guards only nodes a job runs on."""
    nodes = {"a": NodeCapacity(4), "b": NodeCapacity(2), "c": NodeCapacity(2)}
    policy = Policy(min_run_time=60.0)
    result = run(
        nodes,
        job("cid1", "1:2", slots=1, on="bc", last_moved=NOW),
        job("dan2", "2:2", slots=2, on="ab"),
        policy=policy,
    )
    assert held(result) == {"cid1": "c", "dan2": "ab"} and not result.forced


# -- bounded: waiting jobs beyond the look-ahead are counted, not placed -----------------------------


def test_waiting_jobs_beyond_the_look_ahead_wait_behind_it_in_order() -> None:
    jobs = [job("ann1", has="a")] + [job(f"w{i:03d}", seq=i + 2) for i in range(20)]
    result = allocate(cluster("a"), jobs, Policy(), {}, NOW, look_ahead=5)
    assert [w.job for w in result.waiting] == [f"w{i:03d}" for i in range(5)]
    assert result.later == tuple(f"w{i:03d}" for i in range(5, 20))
    # jobs held, too large or over a quota cost nothing to judge: they are not counted
    held_jobs = [job(f"h{i:03d}", seq=i + 2, held=True) for i in range(10)]
    result = allocate(
        cluster("ab"), [*held_jobs, job("z999", seq=99)], Policy(), {}, NOW, look_ahead=3
    )
    assert held(result) == {"z999": "a"} and len(result.waiting) == 10


def test_a_running_job_below_its_min_is_topped_up_whatever_the_queue() -> None:
    jobs = [job("ann1", "2:2", has="ab", seq=1)] + [job(f"w{i:03d}", seq=i + 2) for i in range(9)]
    nodes = cluster("abc", down="b")
    result = allocate(nodes, jobs, Policy(), {}, NOW, look_ahead=1)
    assert held(result)["ann1"] == "ac"
