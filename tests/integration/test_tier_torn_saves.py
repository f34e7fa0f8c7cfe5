"""A save cut off by a failure, on the real checkpoint tier with a fake data plane: its copy
on the keeper goes, whether its owner lives to drop it or not, and the newest complete
checkpoint's copy stays.  Else each torn save left a share's worth of the keeper's memory
taken until the job ended, until copies were refused (ENOSPC) and no save could complete."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from tier_rig import Peers, facts, on_a_tier, until

from elasticd.core import checkpoints as cp
from elasticd.core.model import JobSpec, PartState
from elasticd.core.records import JobRecord, Part
from elasticd.shell import checkpoints as tier_module
from elasticd.shell.checkpoints import CheckpointTier

JOB = "j-70a2e1"
A_SHARE = {cp.METADATA: b"M" * 100, "__0_0.distcp": b"A" * 1000}  # rank 0, on node a
B_SHARE = {"__1_0.distcp": b"B" * 1000}  # rank 1, on node b


def record(job: JobSpec, round: int, a_manifests: tuple[cp.Manifest, ...] = ()) -> JobRecord:
    shares = tuple(m.to_json() for m in a_manifests)
    parts = [
        Part("a", PartState.RUNNING, round=round, group_rank=0, checkpoints=shares),
        Part("b", PartState.RUNNING, round=round, group_rank=1),
    ]
    return JobRecord(spec=job, seq=1, parts={p.node: p for p in parts})


def a_manifest(ident: str, round: int, saved: float) -> cp.Manifest:
    """Node a's share, copied to b."""
    files = {name: facts(data) for name, data in A_SHARE.items()}
    return cp.Manifest(ident, "a", round, 2, (0,), files, saved, copied_to="b")


def write(directory: str, files: dict[str, bytes]) -> None:
    """Files whole under their names, as DCP leaves them (the metadata last)."""
    os.makedirs(directory, exist_ok=True)
    for name in sorted(files, key=lambda n: n == cp.METADATA):
        with open(os.path.join(directory, f"{name}.tmp"), "wb") as f:
            f.write(files[name])
        os.rename(os.path.join(directory, f"{name}.tmp"), os.path.join(directory, name))


def land(tier: CheckpointTier, ckpt: str, files: dict[str, bytes]) -> None:
    """Node a's files of ``ckpt`` land on b whole."""
    for name, data in files.items():
        tier.receive("a", JOB, ckpt, name, 0, data, facts(data))


def test_the_owner_of_a_torn_save_drops_its_copy_on_the_keeper(tmp_path: Path) -> None:
    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        tier.record_changed(record(job, 0))
        tier.round(JOB, 0, 2, (0,))
        write(os.path.join(path, "step_50"), A_SHARE)  # rank 1, on b, never finishes
        await until(lambda: len(peers.sent) == len(A_SHARE), "a's share sent to b")
        await until(lambda: "step_50" in tier._jobs[JOB].manifests, "step_50 described")
        assert await tier.prepare(JOB, record(job, 1), ("a", "b")) == ""
        assert not os.path.exists(os.path.join(path, "step_50"))
        await until(lambda: peers.dropped == [("b", "step_50")], "step_50 dropped at b")

    on_a_tier(tmp_path, JOB, test, node="a")


def test_a_keeper_deletes_the_copies_of_a_torn_save_its_owner_never_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier_module, "_LANDING_IDLE", 0.5, raising=False)

    async def test(tier: CheckpointTier, path: str, peers: Peers, posted: list, job: JobSpec):
        copies = os.path.join(path, tier_module.COPIES, "a")

        def kept() -> list[str]:
            return sorted(os.listdir(copies))

        tier.round(JOB, 0, 2, (1,))
        # round 0: a's share of step_50 is copied here, then a's of step_55 starts to
        # land; the failure cuts both off, and a, deleting them, never says so (lost)
        land(tier, "step_50", A_SHARE)
        tier.receive("a", JOB, "step_55", "__0_0.distcp", 0, b"A" * 500, None)
        tier.record_changed(record(job, 0, (a_manifest("step_50", 0, time.time()),)))
        await asyncio.sleep(0.6)  # a sent no more of step_55 for longer than the bound
        # round 1: step_60 is saved by both and copied; a's copy of step_70 has landed,
        # its manifest not published yet
        tier.round(JOB, 1, 2, (1,))
        write(os.path.join(path, "step_60"), B_SHARE)
        land(tier, "step_60", A_SHARE)
        step_60 = a_manifest("step_60", 1, time.time())
        await asyncio.sleep(0.05)
        land(tier, "step_70", A_SHARE)
        tier.record_changed(record(job, 1, (step_60,)))
        await until(lambda: "step_50" not in kept(), "the torn step_50's copy gone")
        latest = cp.latest_complete(tier._jobs[JOB].found())
        assert latest is not None and latest.id == "step_60"
        assert kept() == ["step_60", "step_70"]
        assert sorted(os.listdir(os.path.join(copies, "step_60"))) == sorted(A_SHARE)
        assert not tier._receiving

    on_a_tier(tmp_path, JOB, test, node="b")
