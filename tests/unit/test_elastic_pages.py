"""elasticd.elastic.pages: the huge pages asked for behind the tensors a load fills, and the
pages of a mapped checkpoint file mapped before they are read, seen in /proc/self/smaps; and
a load through the tier's reader into fresh memory, equal to the last bit."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticd.elastic import checkpoint, pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
FRESH = 40 << 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise hints are Linux's")


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``: its fields."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
            if inside:
                entry = {"range": head}
            continue
        if inside:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert entry, f"no mapping holds {address:#x}"
    return entry


def advised(tensor: torch.Tensor) -> bool:
    """Whether the mapping in the middle of ``tensor`` carries the huge-page advice."""
    middle = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    return "hg" in mapping_of(middle)["VmFlags"].split()


def fresh(nbytes: int = FRESH) -> torch.Tensor:
    """A tensor in memory of its own mapping: past glibc's largest mmap threshold (32 MiB),
    never memory another test advised and freed."""
    return torch.empty(nbytes, dtype=torch.uint8)


def thp_offered() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


@pytest.fixture
def fresh_budget(monkeypatch):
    monkeypatch.setitem(pages._state, "advised", 0)


@pytest.mark.skipif(not thp_offered(), reason="no transparent huge pages on this kernel")
def test_a_large_fresh_tensor_is_backed_by_huge_pages_on_request(fresh_budget):
    tensor = fresh()
    assert not advised(tensor)
    assert pages.huge_pages_for(tensor)
    assert advised(tensor)
    tensor.fill_(7)  # faulted in now, 2 MiB at a time where the kernel has them
    assert int(tensor.sum()) == 7 * FRESH


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(pages.AT_LEAST - 1, dtype=torch.uint8),  # small
        lambda: fresh().view(FRESH // 4096, 4096).t(),  # not contiguous
        lambda: torch.empty(FRESH, dtype=torch.uint8, device="meta"),  # no memory
    ],
    ids=["small", "strided", "meta"],
)
def test_a_tensor_small_strided_or_not_on_the_cpu_is_left_alone(make, fresh_budget):
    tensor = make()
    assert not pages.huge_pages_for(tensor)
    assert pages._state["advised"] == 0  # not counted against the bound either
    if tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() >= FRESH:
        assert not advised(tensor)


HEAP = """
import ctypes, json
import torch
from elasticd.elastic import pages
libc = ctypes.CDLL(None)
assert libc.mallopt(-3, 64 << 20) == 1  # M_MMAP_THRESHOLD: what is under it, from the heap
tensor = torch.empty(16 << 20, dtype=torch.uint8)
where = tensor.data_ptr()
with open("/proc/self/maps") as maps:
    lines = [line.split() for line in maps]
held = [l[-1] for l in lines if int(l[0].split("-")[0], 16) <= where < int(l[0].split("-")[1], 16)]
print(json.dumps({
    "heap": held == ["[heap]"],
    "advised": pages.huge_pages_for(tensor),
    "counted": pages._state["advised"],
}))
"""


def test_a_tensor_in_the_heap_is_not_advised():
    """Under glibc's mmap threshold (it grows to 32 MiB as large blocks are freed) a tensor
    is heap memory: advised, the hint outlived it, and what the heap held there next was
    backed by 2 MiB pages.  Such a tensor is left alone."""
    done = subprocess.run(
        [sys.executable, "-c", HEAP],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "daemon"),
            "PATH": "/usr/bin:/bin",
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "heap": True,
        "advised": False,
        "counted": 0,
    }
    assert not pages.in_heap(fresh().data_ptr())  # a mapping of its own


def test_no_more_tensors_are_advised_than_the_bound(monkeypatch):
    """Each advice may split a mapping: past the bound, a process asks for no more."""
    monkeypatch.setitem(pages._state, "advised", pages.MOST)
    tensor = fresh()
    assert not pages.huge_pages_for(tensor)
    assert not advised(tensor)


def test_populating_a_range_of_a_mapped_file_maps_its_pages_without_copying(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * (32 << 12))  # 8 MiB
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
        assert mapping_of(address)["Rss"] == "0 kB"
        pages.populate(mapped, 4096 + 10, 1 << 20)  # from inside a page: that page too
        if not pages._state["populate"]:
            pytest.skip("a kernel before 5.14: no MADV_POPULATE_READ")
        rss = int(mapping_of(address)["Rss"].split()[0])
        assert rss >= (1 << 10) + 4, rss  # the kernel may map whole folios around them
        assert mapping_of(address)["Anonymous"] == "0 kB"  # nothing copied on write
        pages.populate(mapped, len(mapped) + 4096, 10)  # past the end: the read says so
    finally:
        mapped.close()


@pytest.mark.skipif(not thp_offered(), reason="no transparent huge pages on this kernel")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: as meant
def test_a_load_into_fresh_memory_asks_for_huge_pages_and_is_exact(
    tmp_path, monkeypatch, fresh_budget
):
    monkeypatch.delenv(checkpoint.TIER_ENV, raising=False)
    saved = {"w": torch.randn(FRESH // 4), "b": torch.randn(1000)}  # 40 MiB and 4 KiB
    checkpoint.save(saved, tmp_path / "c")
    into = {"w": fresh().view(torch.float32), "b": torch.empty(1000)}
    assert not advised(into["w"])
    checkpoint.load(into, tmp_path / "c")
    assert advised(into["w"])
    for key in saved:
        assert torch.equal(into[key], saved[key]), key
