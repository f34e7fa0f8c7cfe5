"""A round's ranks given where the job's state is: the survivors take the places that leave
the least to fetch; newcomers follow; nothing moves without a strict gain."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from elasticd.core.checkpoints import METADATA, FileFacts, Holding, Manifest, buddy, holding
from elasticd.rendezvous.locality import by_locality
from elasticd.rendezvous.ops import View, complete
from elasticd.rendezvous.state import Participant, RendezvousSettings, RendezvousState

CKPT = "elastic-3-40"


def ring_holdings(
    nodes: list[str], nproc: int = 1, ckpt: str = CKPT, saved: float = 2.0
) -> dict[str, Holding]:
    """What each node holds with the tier's copy placement: its own ranks and the copy of
    the node before it (each node's copy goes to the next one)."""
    world = nproc * len(nodes)
    own = {n: set(range(i * nproc, (i + 1) * nproc)) for i, n in enumerate(nodes)}
    held = {n: set(own[n]) for n in nodes}
    for n in nodes:
        keeper = buddy(n, nodes, {})
        assert keeper is not None
        held[keeper] |= own[n]
    return {n: Holding(ckpt, world, tuple(sorted(held[n])), 3, saved) for n in nodes}


def records(holds: dict[str, Holding | None], nproc: int = 1) -> dict[str, Participant]:
    return {n: Participant(f"10.0.0.{i}", nproc, 0, h) for i, (n, h) in enumerate(holds.items())}


def fetched(order: list[str], parts: dict[str, Participant]) -> Fraction:
    """The share of the state the members fetch in ``order`` (a reference computed with
    fractions, not the module's integer units)."""
    total = Fraction(0)
    world = sum(parts[n].nproc for n in order)
    first = 0
    for n in order:
        low, high = Fraction(first, world), Fraction(first + parts[n].nproc, world)
        first += parts[n].nproc
        held = parts[n].holds
        have = Fraction(0)
        if held is not None:
            for r in held.ranks:
                a, b = Fraction(r, held.world), Fraction(r + 1, held.world)
                have += max(Fraction(0), min(high, b) - max(low, a))
        total += (high - low) - have
    return total


def test_the_last_of_three_lost_the_survivors_swap_and_fetch_a_sixth_not_half():
    holds = ring_holdings(["n1", "n2", "n3"])
    survivors = {n: holds[n] for n in ("n1", "n2")}
    parts = records(survivors)
    assert fetched(["n1", "n2"], parts) == Fraction(1, 2)
    order = by_locality(["n1", "n2"], 2, parts)
    assert order == ["n2", "n1"]
    assert fetched(order, parts) == Fraction(1, 6)


def test_the_first_or_a_middle_node_lost_the_old_order_stays():
    holds = ring_holdings(["n1", "n2", "n3"])
    for survivors in (["n2", "n3"], ["n1", "n3"]):
        parts = records({n: holds[n] for n in survivors})
        assert by_locality(survivors, 2, parts) == survivors


def test_nobody_holding_anything_or_one_survivor_changes_nothing():
    assert by_locality(["b", "a"], 2, records({"b": None, "a": None})) == ["b", "a"]
    one = ring_holdings(["a", "b"])
    assert by_locality(["b", "a"], 1, records({"b": one["b"], "a": one["a"]})) == ["b", "a"]


def test_members_running_different_numbers_of_workers_keep_their_order():
    holds = ring_holdings(["n1", "n2", "n3"])
    parts = {
        "n1": Participant("10.0.0.1", 1, 0, holds["n1"]),
        "n2": Participant("10.0.0.2", 2, 0, holds["n2"]),
    }
    assert by_locality(["n1", "n2"], 2, parts) == ["n1", "n2"]


def test_newcomers_stay_after_the_survivors_and_rank_0_is_a_survivor():
    holds = ring_holdings(["n1", "n2", "n3", "n4"])
    parts = records({"n1": holds["n1"], "n2": holds["n2"], "n3": holds["n3"], "new": None})
    order = by_locality(["n1", "n2", "n3", "new"], 3, parts)
    assert order[-1] == "new" and set(order[:3]) == {"n1", "n2", "n3"}


def test_the_newest_checkpoint_held_counts_and_an_older_one_is_nothing():
    nodes = ["n1", "n2", "n3", "n4"]
    # the older one's name sorts after the newer one's: names do not order checkpoints
    fresh, stale = (
        ring_holdings(nodes, ckpt="elastic-3-10"),
        ring_holdings(nodes, ckpt="elastic-3-9", saved=1.0),
    )
    survivors = ["n1", "n2", "n3"]  # n4 lost: its copy is on n1
    assert by_locality(survivors, 3, records(fresh)) == ["n2", "n3", "n1"]
    lagging = records({"n1": fresh["n1"], "n2": fresh["n2"], "n3": stale["n3"]})
    alone = records({"n1": fresh["n1"], "n2": fresh["n2"], "n3": None})
    assert by_locality(survivors, 3, lagging) == by_locality(survivors, 3, alone)
    # one member knows the newest: that is the one the ranks load, however few hold it
    ahead = records({"n1": fresh["n1"], "n2": stale["n2"], "n3": stale["n3"]})
    assert by_locality(survivors, 3, ahead) == by_locality(
        survivors, 3, records({"n1": fresh["n1"], "n2": None, "n3": None})
    )


def test_the_greedy_order_for_many_survivors_is_never_worse_than_the_old_one():
    nodes = [f"n{i:02}" for i in range(12)]
    holds = ring_holdings(nodes, nproc=2)
    survivors = nodes[:-1]  # the last lost: its copy is on n00
    parts = records({n: holds[n] for n in survivors}, nproc=2)
    order = by_locality(survivors, len(survivors), parts)
    assert sorted(order) == sorted(survivors)
    assert fetched(order, parts) < fetched(survivors, parts)


@given(
    st.integers(2, 6),
    st.integers(1, 3),
    st.data(),
)
def test_any_loss_the_order_is_a_permutation_that_fetches_no_more(size, nproc, data):
    nodes = [f"n{i}" for i in range(size)]
    holds = ring_holdings(nodes, nproc=nproc)
    lost = data.draw(st.sets(st.sampled_from(nodes), max_size=size - 1))
    survivors = [n for n in nodes if n not in lost]
    newcomers = data.draw(st.lists(st.sampled_from(["x", "y"]), unique=True))
    members = survivors + newcomers
    parts = records({**{n: holds[n] for n in survivors}, **{n: None for n in newcomers}}, nproc)
    order = by_locality(members, len(survivors), parts)
    assert sorted(order[: len(survivors)]) == sorted(survivors)
    assert order[len(survivors) :] == newcomers
    assert fetched(order, parts) <= fetched(members, parts)
    if len(survivors) <= 7:  # every order was tried: none fetches less
        assert by_locality(order, len(survivors), parts) == order


def test_a_node_holds_its_own_share_and_the_copies_kept_for_others():
    def share(node: str, ranks: tuple[int, ...], copied_to: str) -> Manifest:
        files = {f"__{ranks[0]}_0.distcp": FileFacts(8, "0" * 64)}
        if ranks == (0,):
            files[METADATA] = FileFacts(8, "1" * 64)
        return Manifest(CKPT, node, 3, 3, ranks, files=files, copied_to=copied_to)

    found = [share("n1", (0,), "n2"), share("n2", (1,), "n3"), share("n3", (2,), "n1")]
    assert holding(found, "n1") == Holding(CKPT, 3, (0, 2), 3, 0.0)
    assert holding(found, "n4") is None
    assert holding([], "n1") is None


def test_complete_gives_the_ranks_where_the_state_is():
    holds = ring_holdings(["n1", "n2", "n3"])
    settings = RendezvousSettings("job", 2, 3)
    state = RendezvousState(round=4, order=("n1", "n2", "n3"))
    done = complete(state, records({"n1": holds["n1"], "n2": holds["n2"]}), settings, View())
    assert done.order == ("n2", "n1")
