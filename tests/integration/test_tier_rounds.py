"""What a node's real checkpoint tier makes of a new round.  What a restart puts in place
is other nodes' saves, not a share of this node's to describe (a newcomer that described
them as its own in its round hid the older round's shares, and the next restart deleted the
newest complete checkpoint everywhere as torn); a file a rank wrote itself is restored as the
version its manifests name, whatever its size says; and a share whose keeper left the round
is copied to its new keeper.  And a checkpoint saved into again, in any round, is no longer
one: DCP overwrites its files in place, so a restore would mix two saves.  The data plane is
a fake (tier_rig.Peers); the tier, its inotify and its directory are real."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from tier_rig import Peers, TierTest, facts, on_a_tier, published, round_record, until

from elasticd.core import checkpoints as cp
from elasticd.core.model import JobSpec
from elasticd.core.records import JobRecord
from elasticd.shell import checkpoints as tier_module
from elasticd.shell.checkpoints import CheckpointTier

JOB = "j-5e7a01"
SAVE = {  # step_40, saved in round 0 by two ranks: a (rank 0, with DCP's metadata) and b
    "a": {".metadata": b"M" * 100, "__0_0.distcp": b"A" * 1000},
    "b": {"__1_0.distcp": b"B" * 1000},
}


def manifest(
    node: str, ident: str, files: dict[str, bytes], *, ranks: tuple[int, ...], kind: str = cp.DCP
) -> cp.Manifest:
    described = {name: facts(data) for name, data in files.items()}
    keeper = {"a": "b", "b": "a"}.get(node, "a")
    return cp.Manifest(ident, node, 0, 2, ranks, described, 100.0, keeper, kind=kind)


def record(
    job: JobSpec,
    theirs: dict[str, tuple[cp.Manifest, ...]],
    members: tuple[str, ...] = ("a", "b", "c"),
    round: int = 1,
) -> JobRecord:
    """A round of ``members`` (by default round 1: a and b, and c, which joined it)."""
    return round_record(job, members, round, theirs)


def on_tier(
    tmp_path: Path,
    held: dict[tuple[str, str, str], bytes],
    test: TierTest,
    node: str = "c",
) -> None:
    on_a_tier(tmp_path, JOB, test, node=node, held=held)


def test_a_newcomer_does_not_describe_the_checkpoint_put_in_place_for_it_as_its_own(
    tmp_path: Path,
) -> None:
    held = {
        (node, "step_40", name): data
        for node, files in SAVE.items()
        for name, data in files.items()
    }
    theirs = {
        "a": (manifest("a", "step_40", SAVE["a"], ranks=(0,)),),
        "b": (manifest("b", "step_40", SAVE["b"], ranks=(1,)),),
    }

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        now = record(job, theirs)
        tier.record_changed(now)
        assert await tier.prepare(JOB, now, ("a", "b", "c")) == ""
        assert sorted(os.listdir(os.path.join(path, "step_40"))) == sorted([*SAVE["a"], *SAVE["b"]])
        tier.round(JOB, 1, 3, (2,))  # its workers start, rank 2 of 3
        landing = sorted(tier._jobs[JOB].busy)
        assert landing == [], "it lands step_40 as its own"
        # a save of its own in round 1 is still described (and copied), the restored one not
        os.mkdir(os.path.join(path, "step_45"))
        Path(path, "step_45", "__2_0.distcp").write_bytes(b"C" * 1000)
        Path(path, "step_45", ".metadata").write_bytes(b"N" * 100)
        await until(
            lambda: any(m.id == "step_45" and m.described for m in published(posted)),
            "c describes its own save step_45",
        )
        await until(lambda: not tier._jobs[JOB].busy, "every landing done")
        mine = published(posted)
        assert [m.id for m in mine] == ["step_45"], mine
        assert {ckpt for _, ckpt, _ in peers.sent} == {"step_45"}
        view = [m for ms in theirs.values() for m in ms] + mine
        newest = cp.latest_complete(view)
        assert newest is not None and newest.id == "step_40"
        assert cp.torn(["step_40"], view) == set()  # the next restart keeps it

    on_tier(tmp_path, held, test)


def test_a_file_put_in_place_is_not_described_again_and_its_next_version_is(
    tmp_path: Path,
) -> None:
    version = b"1" * 1000
    held = {("b", "rank1.pt", "rank1.pt"): version}
    theirs = {"b": (manifest("b", "rank1.pt", {"rank1.pt": version}, ranks=(1,), kind=cp.FILE),)}

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        now = record(job, theirs)
        tier.record_changed(now)
        assert await tier.prepare(JOB, now, ("a", "c")) == ""
        tier.round(JOB, 1, 3, (1,))  # its workers start: rank 1 is this node's now
        assert Path(path, "rank1.pt").read_bytes() == version
        # a file of the script's: its landing starts after any the rename above started
        Path(path, "next.pt").write_bytes(b"n")
        await until(lambda: any(m.id == "next.pt" for m in published(posted)), "next.pt")
        await until(lambda: not tier._jobs[JOB].busy, "every landing done")
        assert [m.id for m in published(posted)] == ["next.pt"], "rank1.pt described again"
        assert [(ckpt, name) for _, ckpt, name in peers.sent] == [("next.pt", "next.pt")]
        # the script writes rank1.pt's next version: that one is this node's, and copied
        Path(path, "rank1.pt").write_bytes(b"2" * 1000)
        await until(lambda: any(m.id == "rank1.pt" for m in published(posted)), "rank1.pt")
        (mine,) = [m for m in published(posted) if m.id == "rank1.pt"]
        assert mine.files["rank1.pt"] == facts(b"2" * 1000)

    on_tier(tmp_path, held, test)


def test_a_restart_replaces_an_older_version_of_a_file_of_the_same_size(tmp_path: Path) -> None:
    old, new = b"0" * 1000, b"1" * 1000
    held = {("b", "rank1.pt", "rank1.pt"): new}
    theirs = {"b": (manifest("b", "rank1.pt", {"rank1.pt": new}, ranks=(1,), kind=cp.FILE),)}

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        Path(path, "rank1.pt").write_bytes(old)  # put in place by an earlier restart
        now = record(job, theirs)
        tier.record_changed(now)
        assert await tier.prepare(JOB, now, ("a", "c")) == ""
        assert Path(path, "rank1.pt").read_bytes() == new

    on_tier(tmp_path, held, test)


def test_a_dcp_copy_kept_here_is_linked_into_place_and_a_files_is_copied(tmp_path: Path) -> None:
    """c keeps b's share of step_40 and b's rank1.pt: the restart puts the DCP file in place
    as another name of the kept copy (no bytes copied, none held twice, nothing fetched),
    and rank1.pt as a copy of its own (the script writes it again in place)."""
    b_file = {"rank1.pt": b"R" * 1000}
    held = {("a", "step_40", name): data for name, data in SAVE["a"].items()}
    theirs = {
        "a": (manifest("a", "step_40", SAVE["a"], ranks=(0,)),),
        "b": (
            dataclasses.replace(manifest("b", "step_40", SAVE["b"], ranks=(1,)), copied_to="c"),
            dataclasses.replace(
                manifest("b", "rank1.pt", b_file, ranks=(1,), kind=cp.FILE), copied_to="c"
            ),
        ),
    }

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        kept = {}
        for ckpt, files in (("step_40", SAVE["b"]), ("rank1.pt", b_file)):
            for name, data in files.items():
                kept[name] = Path(path, tier_module.COPIES, "b", ckpt, name)
                kept[name].parent.mkdir(parents=True, exist_ok=True)
                kept[name].write_bytes(data)
        now = record(job, theirs)  # b's records stay, b was lost
        peers.lost.add("b")
        tier.record_changed(now)
        assert await tier.prepare(JOB, now, ("a", "c")) == ""
        placed = Path(path, "step_40", "__1_0.distcp")
        assert placed.read_bytes() == SAVE["b"]["__1_0.distcp"]
        assert placed.stat().st_ino == kept["__1_0.distcp"].stat().st_ino
        assert Path(path, "rank1.pt").read_bytes() == b_file["rank1.pt"]
        assert Path(path, "rank1.pt").stat().st_ino != kept["rank1.pt"].stat().st_ino
        assert sorted(os.listdir(Path(path, "step_40"))) == sorted([*SAVE["a"], *SAVE["b"]])

    on_tier(tmp_path, held, test)


def test_a_share_whose_keeper_left_the_round_is_copied_to_its_new_keeper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier_module, "REKEEP_AFTER", 0.3)

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, {}, ("a", "b"), round=0))
        tier.round(JOB, 0, 1, (0,))  # a job of one rank on a; b keeps its copies
        os.mkdir(os.path.join(path, "step_40"))
        Path(path, "step_40", "__0_0.distcp").write_bytes(b"A" * 1000)
        Path(path, "step_40", ".metadata").write_bytes(b"M" * 100)

        def keeper() -> str | None:
            shares = [m for m in published(posted) if m.id == "step_40" and m.described]
            return shares[0].copied_to if shares else None

        await until(lambda: keeper() == "b", "step_40 copied to b")
        # b is lost; the round after it is a and c
        peers.lost.add("b")
        left = time.monotonic()
        tier.record_changed(record(job, {}, ("a", "c"), round=1))
        tier.round(JOB, 1, 2, (0,))
        await until(lambda: keeper() == "c", "step_40 copied to its new keeper, c")
        assert time.monotonic() - left >= 0.3  # not while the recovery runs
        assert [to for to, _, _ in peers.sent].count("c") == 2  # its two files
        newest = cp.latest_complete(published(posted))
        assert newest is not None and newest.id == "step_40"

    on_tier(tmp_path, {}, test, node="a")


def test_a_checkpoint_saved_into_again_is_no_longer_one_and_its_copy_goes(
    tmp_path: Path,
) -> None:
    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, {}, ("a", "b"), round=0))
        tier.round(JOB, 0, 1, (0,))
        os.mkdir(os.path.join(path, "latest"))
        Path(path, "latest", "__0_0.distcp").write_bytes(b"A" * 1000)
        Path(path, "latest", ".metadata").write_bytes(b"M" * 100)
        await until(
            lambda: any(m.id == "latest" and m.copied_to == "b" for m in published(posted)),
            "latest described and copied to b",
        )
        # the script saves its next step into the same directory: the data first
        Path(path, "latest", "__0_0.distcp").write_bytes(b"Z" * 1000)
        await until(lambda: ("b", "latest") in peers.dropped, "its copy dropped at b")
        assert [m.id for m in published(posted)] == []
        Path(path, "latest", ".metadata").write_bytes(b"N" * 100)
        Path(path, "marker.pt").write_bytes(b"m")  # noticed after the metadata above
        await until(lambda: any(m.id == "marker.pt" for m in published(posted)), "marker.pt")
        await until(lambda: not tier._jobs[JOB].busy, "every landing done")
        assert [m.id for m in published(posted)] == ["marker.pt"]  # never a mix of saves
        # deleted and saved again under its name: a new checkpoint
        shutil.rmtree(os.path.join(path, "latest"))
        os.mkdir(os.path.join(path, "latest"))
        Path(path, "latest", "__0_0.distcp").write_bytes(b"Y" * 1000)
        Path(path, "latest", ".metadata").write_bytes(b"O" * 100)
        await until(
            lambda: any(m.id == "latest" and m.described for m in published(posted)),
            "the new latest described",
        )
        (new,) = [m for m in published(posted) if m.id == "latest"]
        assert new.files["__0_0.distcp"] == facts(b"Y" * 1000)

    on_tier(tmp_path, {}, test, node="a")


def test_a_landing_cut_short_drops_what_it_sent_where_it_sent_it(tmp_path: Path) -> None:
    """A file renamed away while its copy is still being sent: the copy goes from the node
    it was sent to, even when the round's members changed meanwhile and the node's buddy is
    another one now (else that copy stays on the first node until the job ends)."""

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, {}, ("a", "c"), round=0))  # b's part not seen yet
        tier.round(JOB, 0, 3, (0,))
        gate = asyncio.Event()
        plain = peers.send

        async def held_back(node: str, job: str, ckpt: str, name: str, source: Any) -> Any:
            if ckpt == "state.pt.tmp":
                await gate.wait()  # sent to c, not yet acknowledged
            return await plain(node, job, ckpt, name, source)

        peers.send = held_back  # type: ignore[method-assign]
        Path(path, "state.pt.tmp").write_bytes(b"s" * 1000)
        await until(lambda: "state.pt.tmp" in tier._jobs[JOB].busy, "state.pt.tmp landing")
        tier.record_changed(record(job, {}, ("a", "b", "c"), round=0))  # a's buddy is b now
        await asyncio.sleep(0.05)
        os.replace(os.path.join(path, "state.pt.tmp"), os.path.join(path, "state.pt"))
        await until(lambda: ("c", "state.pt.tmp") in peers.dropped, "the copy dropped at c")
        gate.set()
        await until(lambda: any(m.id == "state.pt" for m in published(posted)), "state.pt")
        assert [m.id for m in published(posted)] == ["state.pt"]

    on_tier(tmp_path, {}, test, node="a")
