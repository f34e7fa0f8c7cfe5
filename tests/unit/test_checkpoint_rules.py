"""The checkpoint tier's rules (core/checkpoints.py), pure: manifests as they travel in part
records, which checkpoints are complete, whose copy a node keeps, what a restart deletes and
fetches.  Tables for the paths, hypothesis for what must hold whatever the order."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.core import checkpoints as cp

SHA = "a" * 64


def manifest(
    ident: str,
    node: str,
    ranks: tuple[int, ...],
    *,
    world: int = 3,
    round: int = 0,
    saved: float = 1.0,
    copied_to: str = "x",
    metadata: bool = False,
    on_disk: bool = False,
) -> cp.Manifest:
    files = {f"__{r}_0.distcp": cp.FileFacts(100, SHA) for r in ranks}
    if metadata:
        files[cp.METADATA] = cp.FileFacts(10, SHA)
    return cp.Manifest(ident, node, round, world, ranks, files, saved, copied_to, on_disk)


def three(ident: str, *, saved: float = 1.0, copied: bool = True, **kw: Any) -> list[cp.Manifest]:
    """A checkpoint of 3 ranks on n1 (with the metadata), n2, n3."""
    return [
        manifest(
            ident, "n1", (0,), metadata=True, saved=saved, copied_to="n2" if copied else "", **kw
        ),
        manifest(ident, "n2", (1,), saved=saved, copied_to="n3" if copied else "", **kw),
        manifest(ident, "n3", (2,), saved=saved, copied_to="n1" if copied else "", **kw),
    ]


def test_a_manifest_travels_as_json_and_comes_back_whole():
    m = manifest("step_5", "n1", (0, 1), world=2, metadata=True)
    assert cp.parse(m.to_json()) == m
    assert m.metadata and m.size == 210


@pytest.mark.parametrize(
    "change, why",
    [
        ({"id": "../etc"}, "checkpoint name"),
        ({"id": ".metadata"}, "checkpoint name"),
        ({"files": {"../x": [1, SHA]}}, "file name"),
        ({"files": {"f": [-1, SHA]}}, "file f"),
        ({"files": {"f": [1, "not a digest"]}}, "file f"),
        ({"ranks": [0, 7]}, "ranks"),  # a rank outside its world
        ({"world": 0}, "round or world"),
        ({"round": True}, "round or world"),
        ({"saved": float("nan")}, "saved"),
        ({"kind": "zip"}, "kind"),
        ({"described": "yes"}, "described"),
        ({"kind": "file"}, "one file"),  # a file checkpoint names only itself
        ({"files": {f"f{i}": [1, SHA] for i in range(cp.MAX_FILES + 1)}}, "files"),
    ],
)
def test_a_manifest_that_is_not_one_is_refused(change: dict[str, Any], why: str):
    doc = {**manifest("step_5", "n1", (0,)).to_json(), **change}
    with pytest.raises(cp.BadManifest, match=why):
        cp.parse(doc)


def test_a_manifest_claimed_for_another_node_is_not_believed():
    mine = manifest("step_5", "n1", (0,)).to_json()
    found = cp.manifests([("n1", [mine, {"junk": 1}]), ("n2", [mine])])
    assert [m.node for m in found] == ["n1"]


def test_complete_takes_every_rank_the_metadata_and_every_copy():
    assert cp.latest_complete(three("step_5")).id == "step_5"
    assert cp.latest_complete(three("step_5")[:2]) is None  # rank 2's share missing
    no_metadata = [cp.Manifest(**{**m.__dict__, "files": {}}) for m in three("s")]
    assert cp.latest_complete(no_metadata) is None
    assert cp.latest_complete(three("step_5", copied=False)) is None  # not copied yet
    alone = [manifest("step_5", "n1", (0, 1), world=2, metadata=True, copied_to="")]
    assert cp.latest_complete(alone).id == "step_5"  # one node: nowhere to copy
    # rank 0's node tells its metadata before it lists its data files: not yet written
    telling = [cp.Manifest(**{**alone[0].__dict__, "described": False})]
    assert cp.latest_complete(telling) is None and not cp.checkpoints(telling)[0].on_disk
    assert cp.parse(telling[0].to_json()) == telling[0]


def test_the_newest_complete_is_in_save_order_however_long_each_took_to_copy():
    older = three("step_5", saved=10.0)
    newer = three("step_10", saved=11.0)
    assert cp.latest_complete(older + newer).id == "step_10"
    half = three("step_15", saved=12.0, copied=False)
    assert cp.latest_complete(older + newer + half).id == "step_10"
    assert cp.to_delete(["step_5", "step_10", "step_15"], older + newer + half, []) == {"step_5"}


def test_a_name_reused_after_a_re_form_is_a_new_checkpoint():
    before = three("step_5", round=0)
    after = [manifest("step_5", "n1", (0, 1), world=2, round=1, metadata=True, copied_to="")]
    cps = cp.checkpoints(before + after)
    assert len(cps) == 1 and cps[0].round == 1 and cps[0].world == 2


def test_torn_saves_are_deleted_before_the_workers_read():
    done = three("step_5")
    torn = [manifest("step_10", "n1", (0,), metadata=False)]
    assert cp.torn(["step_5", "step_10", "unknown"], done + torn) == {"step_10", "unknown"}


def test_a_copy_no_manifest_names_goes_once_older_than_the_newest_complete():
    done = three("step_10", saved=100.0)
    landed = {
        ("n1", "step_10"): 90.0,  # the newest complete's: named
        ("n1", "step_5"): 50.0,  # a torn save's, whose owner never dropped it
        ("n3", "file.pt"): 60.0,  # a file its writer deleted
        ("n1", "step_15"): 110.0,  # a save in flight: its manifest is not published yet
        ("n3", "step_7"): 70.0,  # still landing
    }
    assert cp.orphaned(landed, done, [("n3", "step_7")]) == {("n1", "step_5"), ("n3", "file.pt")}
    # no complete checkpoint: nothing to be older than
    assert cp.orphaned(landed, three("step_10", copied=False), []) == set()
    # named by any node's manifest, even a torn save's: to_delete's, by its place in the order
    torn = [manifest("step_5", "n2", (1,), saved=50.0)]
    assert ("n1", "step_5") not in cp.orphaned(landed, done + torn, [])


def test_in_a_job_that_saves_only_files_a_copy_of_a_deleted_one_goes_too():
    """A script that rotates its own files (``torch.save``), no DCP: the copy of one its
    writer deleted, whose drop never came, went only when the job ended."""
    kept = cp.Manifest(
        "step-20.pt",
        "n1",
        0,
        2,
        (0,),
        {"step-20.pt": cp.FileFacts(5, SHA)},
        100.0,
        "n2",
        kind=cp.FILE,
    )
    landed = {("n1", "step-10.pt"): 50.0, ("n1", "step-20.pt"): 99.0, ("n1", "step-30.pt"): 101.0}
    assert cp.orphaned(landed, [kept], []) == {("n1", "step-10.pt")}
    assert cp.orphaned(landed, [], []) == set()  # nothing saved yet: nothing to be older than


@given(st.lists(st.tuples(st.integers(0, 9), st.floats(0.0, 20.0)), max_size=12))
def test_no_copy_named_or_landed_after_the_newest_complete_was_saved_is_orphaned(copies):
    known = three("step_3", saved=10.0) + [manifest("step_5", "n1", (0,), saved=12.0)]
    landed = {("n2", f"step_{step}"): at for step, at in copies}
    for _, name in cp.orphaned(landed, known, []):
        assert name not in {"step_3", "step_5"} and landed["n2", name] < 10.0


def test_what_a_node_must_fetch_and_from_whom():
    latest = cp.latest_complete(three("step_5"))
    assert latest.holders("__2_0.distcp") == ["n3", "n1"]  # its writer, then its copy's keeper
    lacking = cp.missing(latest, {"__0_0.distcp": 100, "__1_0.distcp": 99})
    assert set(lacking) == {"__1_0.distcp", "__2_0.distcp", cp.METADATA}


def test_a_file_is_fetched_from_here_then_the_rounds_members_and_the_lost_writer_last():
    holders = cp.latest_complete(three("step_5")).holders("__2_0.distcp")  # n3, its copy on n1
    assert cp.fetch_order(holders, "n2", ("n1", "n2")) == ["n1", "n3"]  # n3 left the round
    assert cp.fetch_order(holders, "n1", ("n1", "n2")) == ["n1", "n3"]  # the copy is here
    assert cp.fetch_order(holders, "n2", ("n1", "n2", "n3")) == ["n3", "n1"]  # as written
    assert cp.fetch_order(["n3", "n1", "n3"], "n2", ()) == ["n3", "n1"]  # each once


def test_a_part_carries_its_newest_save_however_many_files_its_ranks_wrote_after_it():
    save = manifest("step_40", "n1", (0,), world=1, metadata=True, saved=40.0)
    files = [
        cp.Manifest(
            f"loader_{i}.pt",
            "n1",
            0,
            1,
            (0,),
            {f"loader_{i}.pt": cp.FileFacts(1, SHA)},
            41.0 + i,
            "x",
            kind=cp.FILE,
        )
        for i in range(cp.MAX_KEPT_FILES + 5)
    ]
    older = [manifest(f"step_{i}", "n1", (0,), world=1, saved=float(i)) for i in range(12)]
    kept = cp.kept([*files, save, *older])
    assert save in kept  # else the other nodes find step_40 incomplete, and delete it
    assert [m for m in kept if m.kind == cp.FILE] == files[-cp.MAX_KEPT_FILES :]
    assert [m.id for m in kept if m.kind == cp.DCP] == [
        *(f"step_{i}" for i in range(12 - cp.MAX_KEPT + 1, 12)),
        "step_40",
    ]
    assert cp.latest_complete(kept).id == "step_40"


def test_files_a_rank_wrote_itself_are_restored_as_their_newest_version():
    old = cp.Manifest(
        "rank1.pt", "n2", 0, 2, (1,), {"rank1.pt": cp.FileFacts(5, SHA)}, 1.0, "n1", kind=cp.FILE
    )
    new = cp.Manifest(
        "rank1.pt", "n1", 1, 2, (1,), {"rank1.pt": cp.FileFacts(7, SHA)}, 2.0, "n2", kind=cp.FILE
    )
    restored = cp.restored([old, new])
    assert [(c.id, c.files()["rank1.pt"].size) for c in restored] == [("rank1.pt", 7)]
    assert cp.torn(["rank1.pt"], [old, new]) == set()  # the script's own: never deleted


@pytest.mark.parametrize(
    "members, domains, node, keeper",
    [
        (["a", "b", "c"], {}, "a", "b"),  # the next member
        (["a", "b", "c"], {}, "c", "a"),  # round and round
        (["a", "b", "c"], {"a": "r1", "b": "r1", "c": "r2"}, "a", "c"),  # another domain first
        (["a", "b"], {"a": "r1", "b": "r1"}, "a", "b"),  # none in another domain: the next
        (["a"], {}, "a", None),  # alone: nowhere
        (["b", "c"], {}, "a", None),  # not a member
    ],
)
def test_the_keeper_of_a_nodes_copy(members, domains, node, keeper):
    assert cp.buddy(node, members, domains) == keeper


@given(
    st.lists(st.sampled_from(["n1", "n2", "n3", "n4"]), min_size=1, max_size=4, unique=True),
    st.dictionaries(st.sampled_from(["n1", "n2", "n3", "n4"]), st.sampled_from(["r1", "r2"])),
)
def test_a_copy_is_never_kept_by_its_writer_and_every_member_keeps_one_at_most_once(
    members, domains
):
    keepers = [cp.buddy(node, members, domains) for node in members]
    assert all(k != n for k, n in zip(keepers, members))
    if len(members) > 1:
        assert None not in keepers


@given(st.permutations(list(range(6))), st.data())
def test_whatever_the_order_manifests_arrive_in_the_newest_complete_is_the_newest_whole(
    order, data
):
    """Checkpoints step_0..step_5 saved in order; any subset of their shares known, in any
    order: the newest complete is the newest whose every share is known and copied."""
    shares = [m for step in range(6) for m in three(f"step_{step}", saved=float(step))]
    known = [m for m in shares if data.draw(st.booleans())]
    known = [known[i] for i in sorted(range(len(known)), key=lambda i: order[i % 6])]
    whole = [s for s in range(6) if len([m for m in known if m.id == f"step_{s}"]) == 3]
    latest = cp.latest_complete(known)
    assert (latest.id if latest else None) == (f"step_{max(whole)}" if whole else None)
    deleted = cp.to_delete([f"step_{s}" for s in range(6)], known, [])
    assert all(int(name.split("_")[1]) < max(whole) for name in deleted)
