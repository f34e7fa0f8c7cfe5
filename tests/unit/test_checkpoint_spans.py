"""The byte ranges a node fetched for a job's readers (shell/checkpoints.py): kept per file
merged and sorted, so that a worker's many small ranges cost its daemon's event loop no more
than their number, asked of the holder once each, and forgotten with their checkpoint.
Hypothesis compares the spans with sets of bytes."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tier_rig import job_spec

from elasticd.core import checkpoints as cp
from elasticd.core.model import JobSpec, PartState
from elasticd.core.records import JobRecord, Part
from elasticd.shell import checkpoints as tier_module
from elasticd.shell.checkpoints import CheckpointTier, TierSettings, _merge, _subtract

JOB = "j-5a6b7c"
FILE = "__0_0.distcp"
DATA = os.urandom(20_000)

spans_of = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=30
)  # (offset, length), overlapping, touching, empty or not, in any order


def covered(spans: list[tuple[int, int]]) -> set[int]:
    return {byte for offset, length in spans for byte in range(offset, offset + length)}


def canonical(spans: list[tuple[int, int]]) -> bool:
    """Sorted, none empty, and apart: each begins after the one before has ended, with a gap."""
    ends = [offset + length for offset, length in spans]
    return all(length > 0 for _, length in spans) and all(
        ends[i] < spans[i + 1][0] for i in range(len(spans) - 1)
    )


def test_adjacent_one_byte_spans_are_kept_as_one() -> None:
    assert _merge([(i, 1) for i in range(10_000)]) == [(0, 10_000)]
    assert _merge([(i, 1) for i in reversed(range(0, 20_000, 2))]) == [
        (i, 1) for i in range(0, 20_000, 2)
    ]
    gaps = [(i, 1) for i in range(1, 20_000, 2)]  # the second half of an interleaving
    assert _subtract(gaps, _merge([(i, 1) for i in range(0, 20_000, 2)])) == gaps


@given(spans_of)
def test_merge_covers_the_same_bytes_in_as_few_spans_as_can(spans: list[tuple[int, int]]) -> None:
    merged = _merge(spans)
    assert covered(merged) == covered(spans)
    assert canonical(merged)


@given(spans_of, spans_of)
def test_subtract_leaves_the_bytes_asked_for_that_were_not_fetched(
    spans: list[tuple[int, int]], fetched: list[tuple[int, int]]
) -> None:
    lacking = _subtract(spans, _merge(fetched))
    assert covered(lacking) == covered(spans) - covered(fetched)
    assert canonical(lacking)


class RangePeers:
    """Node n2 holds the file: each fetch of ranges writes them, and is noted."""

    def __init__(self) -> None:
        self.asked: list[list[tuple[int, int]]] = []

    async def fetch(self, node: str, job: str, owner: str, ckpt: str, name: str, into: int,
                    ranges: list[tuple[int, int]] | None = None, **kw: Any) -> None:  # fmt: skip
        assert ranges is not None
        self.asked.append(list(ranges))
        for offset, length in ranges:
            os.pwrite(into, DATA[offset : offset + length], offset)

    def alive(self, node: str) -> bool:
        return True

    def domain(self, node: str) -> str:
        return node


def tier_of(tmp_path: Path, peers: RangePeers) -> CheckpointTier:
    settings = TierSettings("n1", str(tmp_path / "tier"), 0, 0)
    return CheckpointTier(settings, peers, lambda event: None)  # type: ignore[arg-type]


def held_by_n2(spec_: JobSpec, *idents: str) -> JobRecord:
    """A record in which n2 wrote checkpoints ``idents`` whole (one rank, its metadata)."""
    files = {
        cp.METADATA: cp.FileFacts(10, "a" * 64),
        FILE: cp.FileFacts(len(DATA), hashlib.sha256(DATA).hexdigest()),
    }
    manifests = tuple(
        cp.Manifest(ident, "n2", 0, 1, (0,), files, float(i), "n3").to_json()
        for i, ident in enumerate(idents)
    )
    parts = {
        "n1": Part("n1", PartState.RUNNING, round=0, group_rank=1),
        "n2": Part("n2", PartState.RUNNING, round=0, group_rank=0, checkpoints=manifests),
    }
    return JobRecord(spec=spec_, seq=1, parts=parts)


def test_a_workers_one_byte_ranges_are_fetched_once_kept_as_one_span_and_forgotten_when_pruned(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        peers = RangePeers()
        tier = tier_of(tmp_path, peers)
        running = asyncio.create_task(tier.run())
        try:
            job = job_spec(tmp_path, JOB)
            path = tier.open(job)
            tier.record_changed(held_by_n2(job, "step_1"))
            jd = tier._jobs[JOB]

            def fetch(ranges: list[list[Any]]) -> Any:
                return tier._answer_worker(jd, {"op": "fetch", "id": "step_1", "ranges": ranges})

            first = await fetch([[FILE, i, 1] for i in range(0, 10_000)])
            again = await fetch([[FILE, i, 1] for i in reversed(range(10_000))])  # nothing new
            more = await fetch([[FILE, i, 1] for i in range(9_000, 12_000)] * 2)
            key = ("step_1", FILE, hashlib.sha256(DATA).hexdigest())
            assert jd.fetched == {key: [(0, 12_000)]} and jd.fetched_spans == 1
            assert peers.asked == [[(0, 10_000)], [(10_000, 2_000)]]
            into = first["paths"][FILE]
            assert into == again["paths"][FILE] == more["paths"][FILE]
            with open(into, "rb") as f:
                assert f.read(12_000) == DATA[:12_000]

            tier.record_changed(held_by_n2(job, "step_1", "step_2"))  # step_1 is pruned
            await asyncio.sleep(0)  # the change is considered on the loop's next turn
            assert jd.fetched == {} and jd.fetched_spans == 0
            assert os.path.join(path, tier_module.RANGES, "step_1") in jd.deleting
        finally:
            await tier.close(JOB)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())


@pytest.mark.parametrize(
    "ranges",
    [
        [[FILE, 0.5, 1]],
        [[FILE, 0, True]],
        [{FILE: 1, "x": 2, "y": 3}],
        [[FILE, 0, len(DATA) + 1]],
        [[FILE, 0, 1]] * (tier_module._MAX_RANGES + 1),
    ],
    ids=["float", "bool", "object", "past-the-end", "too-many"],
)
def test_a_fetch_of_ranges_that_are_not_counts_within_the_file_is_refused(
    tmp_path: Path, ranges: list[Any]
) -> None:
    async def main() -> None:
        peers = RangePeers()
        tier = tier_of(tmp_path, peers)
        running = asyncio.create_task(tier.run())
        try:
            job = job_spec(tmp_path, JOB)
            tier.open(job)
            tier.record_changed(held_by_n2(job, "step_1"))
            jd = tier._jobs[JOB]
            with pytest.raises(ValueError):
                await tier._answer_worker(jd, {"op": "fetch", "id": "step_1", "ranges": ranges})
            assert peers.asked == [] and jd.fetched == {}
        finally:
            await tier.close(JOB)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
