"""This library's own collectives (the membership check, the agreements of a restore, the
broadcast of state), which a worker can leave when its group is aborted.

Gloo (torch 2.13) can leave a collective waiting on a group that an abort broke. A send
written after the group's sockets were shut down (or after its peer died) fails with
EPIPE, which gloo's asynchronous path takes for "write it later" and queues; the pair's
error then fails the pair's posted buffers but not that queued send, and the collective
waits for it in ``UnboundBuffer::waitSend`` until the group's timeout (30 minutes).
Reproduced here with three ranks looping ``all_reduce`` whose sockets are shut down at a
random moment: about 1 rank in 20 stayed.

So on gloo each collective here is started asynchronously and waited for in slices of
10 ms growing to 100 ms (``Work.wait`` wakes at once when the work ends; each slice that
runs out is an exception, few while a peer is late): once the runtime says the group was
aborted, and the abort's shut-down sockets have had ``_GRACE`` to fail the collective as
they do when gloo lost nothing, the wait ends with GroupAborted.  The group a stuck
collective ran on is then kept alive for good: its destructor joins gloo's threads, one of
which waits for that send, so destroying it would hang the process (in
``destroy_process_group``, or at exit).  That keeps its store too, and on the round's rank 0
the store's server and port: the runtime hears of it (``abandon_when``'s ``kept``).  A
collective of the script's own (DDP, FSDP) has no such exit: the runtime ends a worker
still in an aborted round after half the job's rejoin timeout.

On NCCL the collectives are plain calls: ``ncclCommAbort`` ends them (verified on an H200),
and a wait with a timeout under ``TORCH_NCCL_BLOCKING_WAIT`` would abort the communicator
when it expires.
"""

from __future__ import annotations

import ctypes
import datetime
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .errors import GroupAborted

_FIRST_SLICE, _LONGEST_SLICE = 0.01, 0.1  # seconds
_GRACE = 0.1  # seconds a collective has to fail by itself once its group was aborted


def _never() -> bool:
    return False


def _nothing() -> None:
    pass


_aborted: Callable[[], bool] = _never
_kept: Callable[[], None] = _nothing


def abandon_when(aborted: Callable[[], bool], kept: Callable[[], None] = _nothing) -> None:
    """Set the test of whether the current group was aborted, and what to call when a
    collective left the group it ran on (the runtime's)."""
    global _aborted, _kept
    _aborted, _kept = aborted, kept


def all_reduce(
    tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> None:
    """``dist.all_reduce`` that an abort ends (on gloo)."""
    if not _sliced(group, tensor):
        dist.all_reduce(tensor, op=op, group=group)
        return
    _wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), group)


def broadcast(tensor: torch.Tensor, source: int, group: dist.ProcessGroup | None = None) -> None:
    """``dist.broadcast`` that an abort ends (on gloo)."""
    if not _sliced(group, tensor):
        dist.broadcast(tensor, source, group=group)
        return
    _wait(dist.broadcast(tensor, source, group=group, async_op=True), group)


def _sliced(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """Whether the backend that moves ``tensor`` is gloo (also in "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        by_device = dict(item.split(":", 1) for item in backend.split(",") if ":" in item)
        backend = by_device.get(tensor.device.type, "")
    return backend == "gloo"


def _wait(work: Any, group: dist.ProcessGroup | None) -> None:
    clock, slice_s, left_at = time.monotonic, _FIRST_SLICE, math.inf
    while True:
        try:
            work.wait(datetime.timedelta(seconds=slice_s))
            return
        except RuntimeError:
            if work.is_completed():  # it ended as the slice ran out: its own outcome
                work.wait()
                return
        slice_s = min(2 * slice_s, _LONGEST_SLICE)
        if left_at == math.inf and _aborted():
            left_at, slice_s = clock() + _GRACE, _FIRST_SLICE
        if clock() >= left_at:
            _keep_forever(group if group is not None else dist.group.WORLD)
            _kept()
            raise GroupAborted("a member of the job is gone (a collective stayed on its group)")


def _keep_forever(group: Any) -> None:
    """One reference that is never given back: the group outlives every other holder, and
    the interpreter's exit, which frees no object still referenced."""
    if group is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
