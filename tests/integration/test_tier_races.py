"""Races of the real checkpoint tier (a fake data plane: tier_rig.Peers) between what the
job's directory tells (inotify), what the other nodes' records tell, and the tier's own
tasks: a newer version of a file landing while the older one still sends; a share copied
again to a new keeper; a name deleted and saved again with ``--checkpoint-dir``; a restart
deleting a torn save while a record comes.  Each failed on the code before its fix."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from tier_rig import (
    Peers,
    TierTest,
    facts,
    job_spec,
    on_a_tier,
    published,
    round_record,
    until,
)

from elasticd.core import checkpoints as cp
from elasticd.core import events as ev
from elasticd.core.model import JobSpec
from elasticd.shell import checkpoints as tier_module
from elasticd.shell.checkpoints import CheckpointTier

JOB = "j-7ace01"
Test = Callable[[CheckpointTier, str, Peers, list[ev.Event], JobSpec], Awaitable[None]]


record = round_record


def on_node_a(tmp_path: Path, test: TierTest, spec: JobSpec | None = None) -> None:
    on_a_tier(tmp_path, JOB, test, node="a", spec=spec)


def hold_sends(peers: Peers, ckpt: str) -> tuple[asyncio.Event, list[str], list[str]]:
    """Sends of ``ckpt`` wait for the event returned; the lists: how each held send began
    ("sending"), then ended ("cancelled" while held, else "resumed" once the event is set)."""
    gate, started, ended = asyncio.Event(), [], []
    plain = peers.send

    async def held_back(node: str, job: str, name: str, file: str, source: Any) -> Any:
        if name == ckpt and not gate.is_set():
            started.append(node)
            try:
                await gate.wait()
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise
            ended.append("resumed")
        return await plain(node, job, name, file, source)

    peers.send = held_back  # type: ignore[method-assign]
    return gate, started, ended


def test_a_newer_version_landing_while_the_older_sends_is_stopped_by_a_rename(
    tmp_path: Path,
) -> None:
    """The older landing, cancelled, took the newer one out of the tier's tasks: renamed
    away, the file's newer landing ran on untracked and published a manifest of a file
    that was gone, whose copy the rename had dropped: the next restart failed the job."""

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, ("a", "c"), 0))
        tier.round(JOB, 0, 2, (0,))
        gate, started, ended = hold_sends(peers, "x.pt")
        Path(path, "x.pt").write_bytes(b"1" * 1000)
        await until(lambda: len(started) == 1, "the first version sending")
        Path(path, "x.pt").write_bytes(b"2" * 1000)
        await until(lambda: len(started) == 2, "the second version sending")
        os.replace(os.path.join(path, "x.pt"), os.path.join(path, "y.pt"))
        await until(lambda: ("c", "x.pt") in peers.dropped, "x.pt's copy dropped at c")
        gate.set()
        await until(lambda: len(ended) == 2, "both landings of x.pt ended")
        assert ended == ["cancelled", "cancelled"], "a landing of x.pt went on after its rename"
        await until(lambda: not tier._jobs[JOB].busy, "every landing done")
        assert [m.id for m in published(posted)] == ["y.pt"]
        assert await tier.prepare(JOB, record(job, ("a", "c"), 1), ("a", "c")) == ""

    on_node_a(tmp_path, test)


def test_a_file_copied_again_to_a_new_keeper_does_not_pass_a_newer_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied again, a share kept the time it was saved: described anew with the time of
    the copy, node a's old rank1.pt passed the newer one node c wrote since, and the next
    restart put the old one in place."""
    monkeypatch.setattr(tier_module, "REKEEP_AFTER", 0.3)

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, ("a", "b"), 0))
        tier.round(JOB, 0, 2, (1,))  # rank 1 is a's in round 0
        Path(path, "rank1.pt").write_bytes(b"1" * 1000)
        await until(
            lambda: any(m.id == "rank1.pt" and m.copied_to == "b" for m in published(posted)),
            "version 1 copied to b",
        )
        # b is lost; in round 1 (a and c) rank 1 is c's, which saves version 2
        peers.lost.add("b")
        newer = cp.Manifest(
            "rank1.pt",
            "c",
            1,
            2,
            (1,),
            {"rank1.pt": facts(b"2" * 1000)},
            time.time(),
            "a",
            kind=cp.FILE,
        )
        tier.record_changed(record(job, ("a", "c"), 1, {"c": (newer,)}))
        tier.round(JOB, 1, 2, (0,))
        await until(
            lambda: any(m.id == "rank1.pt" and m.copied_to == "c" for m in published(posted)),
            "version 1 kept on c now",
        )
        view = published(posted) + [newer]
        (restored,) = [c for c in cp.restored(view) if c.id == "rank1.pt"]
        assert restored.files()["rank1.pt"] == facts(b"2" * 1000), "the older version wins"

    on_node_a(tmp_path, test)


def test_a_name_deleted_and_saved_again_reaches_the_disk_whole(tmp_path: Path) -> None:
    """The name was still noted as on disk: only the new save's metadata was written there,
    beside the old save's data, and the manifest said on disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    spec = dataclasses.replace(job_spec(tmp_path, JOB), checkpoint_dir=str(disk))

    def save(path: str, data: bytes, metadata: bytes) -> None:
        os.mkdir(os.path.join(path, "latest"))
        Path(path, "latest", "__0_0.distcp").write_bytes(data)
        Path(path, "latest", cp.METADATA).write_bytes(metadata)

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.round(JOB, 0, 1, (0,))  # one node, one rank: complete once described
        save(path, b"A" * 1000, b"M" * 100)
        await until(
            lambda: any(m.id == "latest" and m.on_disk for m in published(posted)), "on disk"
        )
        shutil.rmtree(os.path.join(path, "latest"))
        await until(lambda: not published(posted), "forgotten")
        save(path, b"B" * 1000, b"N" * 100)
        await until(
            lambda: any(m.id == "latest" and m.on_disk for m in published(posted)),
            "the second save on disk",
        )
        assert (disk / "latest" / "__0_0.distcp").read_bytes() == b"B" * 1000
        assert (disk / "latest" / cp.METADATA).read_bytes() == b"N" * 100

    on_node_a(tmp_path, test, spec)


def test_a_torn_save_a_restart_deletes_is_not_landed_again_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record that came while the restart deleted a torn save had the tier land it again
    (hash, copy, publish): its path was not among those being deleted."""
    real = tier_module._remove_all

    async def slow_remove(jd: Any, paths: Any) -> None:  # a large share takes a while
        await asyncio.sleep(0.3)
        await real(jd, paths)

    monkeypatch.setattr(tier_module, "_remove_all", slow_remove)

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, ("a", "b"), 0))
        tier.round(JOB, 0, 2, (0,))
        gate, started, _ = hold_sends(peers, "step_50")
        os.mkdir(os.path.join(path, "step_50"))
        Path(path, "step_50", "__0_0.distcp").write_bytes(b"A" * 1000)
        Path(path, "step_50", cp.METADATA).write_bytes(b"M" * 100)
        await until(lambda: bool(started), "step_50 being copied when the failure comes")
        gate.set()
        await asyncio.sleep(0.05)  # a's share copied; b's never came: torn
        seen = len(posted)
        preparing = asyncio.create_task(tier.prepare(JOB, record(job, ("a", "b"), 1), ("a", "b")))
        await asyncio.sleep(0.05)
        tier.record_changed(record(job, ("a", "b"), 1))  # b's part changes meanwhile
        assert await preparing == ""
        await asyncio.sleep(0.3)
        assert "step_50" not in [
            cp.parse(m).id
            for e in posted[seen:]
            if isinstance(e, ev.CheckpointsChanged)
            for m in e.manifests
        ], "the torn save was described again"
        assert not os.path.exists(os.path.join(path, "step_50"))

    on_node_a(tmp_path, test)


def test_a_copy_that_failed_is_not_dropped_where_it_is_tried_again(tmp_path: Path) -> None:
    """A copy that failed is tried again at the same keeper: a drop sent there meanwhile
    (tried again itself while the keeper is unreachable) could delete the new copy."""

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, ("a", "b"), 0))
        tier.round(JOB, 0, 2, (0,))
        plain, failed = peers.send, []

        async def fails_once(node: str, job: str, name: str, file: str, source: Any) -> Any:
            if not failed:
                failed.append(node)
                raise ConnectionError("b is busy")
            return await plain(node, job, name, file, source)

        peers.send = fails_once  # type: ignore[method-assign]
        Path(path, "rank0.pt").write_bytes(b"0" * 1000)
        await until(
            lambda: any(m.id == "rank0.pt" and m.copied_to == "b" for m in published(posted)),
            "rank0.pt copied to b at the second try",
        )
        assert failed == ["b"] and peers.dropped == []

    on_node_a(tmp_path, test)


A_SHARE = {cp.METADATA: b"M" * 100, "__0_0.distcp": b"A" * 1000}  # rank 0's, on a
B_SHARE = {"__1_0.distcp": b"B" * 1000}  # rank 1's, on b, its copy kept on a


def b_share(ident: str, saved: float) -> cp.Manifest:
    files = {name: facts(data) for name, data in B_SHARE.items()}
    return cp.Manifest(ident, "b", 0, 2, (1,), files, saved, "a")


def save_on_a(tier: CheckpointTier, path: str, ident: str) -> None:
    """Rank 0's share of ``ident`` written on a, and b's share's copy received there."""
    for name, data in B_SHARE.items():
        tier.receive("b", JOB, ident, name, 0, data, facts(data))
    os.mkdir(os.path.join(path, ident))
    for name in sorted(A_SHARE, key=lambda n: n == cp.METADATA):  # DCP's metadata last
        Path(path, ident, name).write_bytes(A_SHARE[name])


def test_a_copy_finishing_after_the_stop_does_not_make_the_nodes_restore_different_steps(
    tmp_path: Path,
) -> None:
    """The workers stop while a still copies its share of step_50, and b, deciding from a
    record where a's share is not described, restores step_40.  a's copy used to finish
    then: step_50 complete on a alone, which put it in place and pruned step_40, and the
    ranks loaded different steps.  A stop now cuts a's landing short: both restore 40."""

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        jd = tier._jobs[JOB]
        tier.round(JOB, 0, 2, (0,))
        theirs = {"b": (b_share("step_40", time.time()),)}
        tier.record_changed(record(job, ("a", "b"), 0, theirs))
        save_on_a(tier, path, "step_40")
        await until(lambda: tier.holding(JOB) is not None, "step_40 complete")
        gate, started, _ = hold_sends(peers, "step_50")
        theirs = {"b": (*theirs["b"], b_share("step_50", time.time()))}
        tier.record_changed(record(job, ("a", "b"), 0, theirs))
        save_on_a(tier, path, "step_50")
        await until(lambda: bool(started), "a's share of step_50 being copied to b")
        tier.stopped(JOB)  # a rank fails: the workers are stopped
        gate.set()
        b_decides_from = list(theirs["b"]) + published(posted)
        held = tier.holding(JOB)  # what a declares, joining the next round
        assert held is not None and held.checkpoint == "step_40"
        assert os.path.isdir(os.path.join(path, "step_40")), "step_40 pruned after the stop"
        now = record(job, ("a", "b"), 1, theirs)
        assert await tier.prepare(JOB, now, ("a", "b"), held) == ""
        here = sorted(n for n in os.listdir(path) if not n.startswith("."))
        assert here == [c.id for c in cp.restored(b_decides_from)] == ["step_40"]
        assert cp.latest_complete(jd.found()) is not None

    on_node_a(tmp_path, test)


def test_a_restart_waits_for_the_checkpoint_its_round_agreed_on(tmp_path: Path) -> None:
    """A member declared step_50, complete in its view; this node's records do not show b's
    share of it yet: it waits for them, restores step_50, and not its own newest (40)."""

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.round(JOB, 0, 2, (0,))
        older = b_share("step_40", time.time())
        tier.record_changed(record(job, ("a", "b"), 0, {"b": (older,)}))
        save_on_a(tier, path, "step_40")
        save_on_a(tier, path, "step_50")
        await until(
            lambda: any(m.id == "step_50" and m.described for m in published(posted)),
            "a's share of step_50 described",
        )
        tier.stopped(JOB)
        newer = b_share("step_50", time.time())
        declared = cp.Holding("step_50", 2, (0, 1), 0, newer.saved)
        preparing = asyncio.create_task(
            tier.prepare(JOB, record(job, ("a", "b"), 1, {"b": (older,)}), ("a", "b"), declared)
        )
        await asyncio.sleep(0.2)
        assert not preparing.done(), "it restored before the agreed checkpoint was complete"
        tier.record_changed(record(job, ("a", "b"), 1, {"b": (older, newer)}))
        assert await preparing == ""
        assert sorted(os.listdir(os.path.join(path, "step_50"))) == sorted([*A_SHARE, *B_SHARE])

    on_node_a(tmp_path, test)


def test_a_restart_whose_agreed_checkpoint_never_shows_complete_here_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member declared step_50, and this node's records never show b's share of it: it
    used to restore its own newest (40) after the wait, while the member restored 50, and
    the ranks loaded different steps.  Now the job fails, saying which and why."""
    monkeypatch.setattr(tier_module, "AGREE_WAIT", 0.3)

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.round(JOB, 0, 2, (0,))
        older = b_share("step_40", time.time())
        tier.record_changed(record(job, ("a", "b"), 0, {"b": (older,)}))
        save_on_a(tier, path, "step_40")
        await until(lambda: tier.holding(JOB) is not None, "step_40 complete")
        tier.stopped(JOB)
        declared = cp.Holding("step_50", 2, (0, 1), 0, time.time())
        why = await tier.prepare(
            JOB, record(job, ("a", "b"), 1, {"b": (older,)}), ("a", "b"), declared
        )
        assert "checkpoint step_50" in why and "different steps" in why, why
        assert os.path.isdir(os.path.join(path, "step_40")), "nothing deleted"

    on_node_a(tmp_path, test)
