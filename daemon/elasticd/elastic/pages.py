"""Memory that a load fills, made cheap to fill: Linux ``madvise`` hints, on CPU tensors and
on the mapped checkpoint files they are copied from.  The standard library only.

A model rebuilt for a new world gets fresh memory for its shards, and the first write of
each 4 KiB page of it is a page fault: copying 640 MiB from a mapped tmpfs file into a fresh
tensor took 0.48 s here, into memory already touched 0.18 s.  Asked for huge pages before
the copy, the kernel faults it in 2 MiB at a time (0.29 s); the source's pages are then
mapped in one call rather than one fault each (0.25 s).  A load of 640 MiB through the
tier's reader: 0.50 s without, 0.34 s with (docs/benchmarks.md).  Both are hints: where the kernel has no transparent huge pages, or is older than 5.14
(``MADV_POPULATE_READ``), nothing happens and the copy faults as before.

Advising a range inside an allocation splits its mapping in up to three, and a process may
hold at most ``vm.max_map_count`` mappings (65530 by default): only tensors of at least
``AT_LEAST`` bytes are advised, and at most ``MOST`` of them in a process's life.  Only
memory of a mapping of its own: glibc serves a tensor under its mmap threshold (which grows
to 32 MiB) from the heap, where the advice would outlive the tensor and bloat whatever the
heap holds there next with 2 MiB pages; such a tensor lies below the program break.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import torch

HUGE = 2 << 20  # bytes: an x86-64 or arm64 transparent huge page
AT_LEAST = 8 << 20  # bytes: smaller tensors are not worth a mapping of their own
MOST = 4096  # tensors advised in a process's life: 8192 more mappings at most
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22

_lock = threading.Lock()
_state = {"advised": 0, "populate": sys.platform == "linux"}
_madvise = None
if sys.platform == "linux":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
        _sbrk = _libc.sbrk
        _sbrk.argtypes = [ctypes.c_ssize_t]
        _sbrk.restype = ctypes.c_void_p
    except (OSError, AttributeError):
        _madvise = None


def in_heap(address: int) -> bool:
    """Whether ``address`` is below the program break: the heap's (or the program's own)
    memory, not a mapping of its own."""
    brk = _sbrk(0) if _madvise is not None else None
    return brk is not None and address < brk


def huge_pages_for(target: torch.Tensor) -> bool:
    """Ask for huge pages behind the whole 2 MiB pages of ``target``'s memory, before it is
    first written.  True if the kernel took the hint (it may still lend 4 KiB pages)."""
    if _madvise is None or target.device.type != "cpu" or not target.is_contiguous():
        return False
    nbytes = target.numel() * target.element_size()
    if nbytes < AT_LEAST:
        return False
    start = target.data_ptr()
    if in_heap(start):
        return False
    low, high = -(-start // HUGE) * HUGE, (start + nbytes) // HUGE * HUGE
    with _lock:
        if _state["advised"] >= MOST:
            return False
        _state["advised"] += 1
    return _madvise(low, high - low, MADV_HUGEPAGE) == 0


def populate(mapped: mmap.mmap, offset: int, length: int) -> None:
    """Map the pages of ``mapped[offset:offset + length]`` now, in one call, instead of a
    fault on each as the copy reads them (no copy is made: they are mapped to be read)."""
    if not _state["populate"] or length <= 0:
        return
    low = offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mapped.madvise(MADV_POPULATE_READ, low, min(len(mapped), offset + length) - low)
    except OSError:  # a kernel before 5.14: the copy faults them in, as it always did
        _state["populate"] = False
    except ValueError:  # out of the mapping's range: the read will say so itself
        pass
