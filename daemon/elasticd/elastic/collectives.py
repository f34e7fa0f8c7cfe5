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
10 ms (``Work.wait`` wakes at once when the work ends): once the runtime says the group was
aborted, the wait ends with GroupAborted.  The group a stuck collective ran on is then
kept alive for good: its destructor joins gloo's threads, one of which waits for that send,
so destroying it would hang the process (in ``destroy_process_group``, or at exit).  A
collective of the script's own (DDP, FSDP) has no such exit: the runtime ends a worker
still in an aborted round after half the job's rejoin timeout.

On NCCL the collectives are plain calls: ``ncclCommAbort`` ends them (verified on an H200),
and a wait with a timeout under ``TORCH_NCCL_BLOCKING_WAIT`` would abort the communicator
when it expires.
"""

from __future__ import annotations

import ctypes
import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .errors import GroupAborted

_SLICE = datetime.timedelta(milliseconds=10)


def _never() -> bool:
    return False


_aborted: Callable[[], bool] = _never


def abandon_when(aborted: Callable[[], bool]) -> None:
    """Set the test of whether the current group was aborted (the runtime's)."""
    global _aborted
    _aborted = aborted


def all_reduce(
    tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> None:
    """``dist.all_reduce`` that an abort ends (on gloo)."""
    if not _sliced(group):
        dist.all_reduce(tensor, op=op, group=group)
        return
    _wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), group)


def broadcast(tensor: torch.Tensor, source: int, group: dist.ProcessGroup | None = None) -> None:
    """``dist.broadcast`` that an abort ends (on gloo)."""
    if not _sliced(group):
        dist.broadcast(tensor, source, group=group)
        return
    _wait(dist.broadcast(tensor, source, group=group, async_op=True), group)


def _sliced(group: dist.ProcessGroup | None) -> bool:
    return str(dist.get_backend(group)) == "gloo"


def _wait(work: Any, group: dist.ProcessGroup | None) -> None:
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # it ended as the slice ran out: its own outcome
                work.wait()
                return
        if _aborted():
            _keep_forever(group if group is not None else dist.group.WORLD)
            raise GroupAborted("a member of the job is gone (a collective stayed on its group)")


def _keep_forever(group: Any) -> None:
    """One reference that is never given back: the group outlives every other holder, and
    the interpreter's exit, which frees no object still referenced."""
    if group is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
