"""Hung ranks, pure: when a part's ranks count as hung, where each one's stack says it is,
and which of them is the root cause.

A job whose ranks make no progress for ``--hang-timeout`` seconds is hung.  Progress is what
the worker library reports: each ``commit()`` / ``check_host_updates()``, and
``elastic.progress()`` for a script that commits nothing (at most twice a second).  A rank
that never reported progress is never judged (a script without the library, or one that
has not reached its first step).  The node then dumps each local rank's stack (the
library's faulthandler signal, py-spy where installed) into the job's logs and reads where
it is: the main thread inside a collective of ``torch.distributed`` (waiting for a peer), or
not (the rank the others wait for).  A rank not inside one is the root cause and is failed;
when every local rank is inside one, the node waits another timeout for the culprit's node
to act, then fails its own.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# frames of torch.distributed's collectives and waits (the main thread blocked in one)
_COLLECTIVE = re.compile(
    r"torch/distributed/|c10d|ProcessGroup|all_reduce|allreduce|all_gather|allgather|"
    r"reduce_scatter|broadcast|barrier|all_to_all|alltoall|ncclComm|gloo::"
)
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+", re.M)
_PYSPY_THREAD = re.compile(r'^Thread \d+ \((?:active|idle)[^)]*\): "MainThread"', re.M)


@dataclass(frozen=True)
class HungRank:
    """One local rank of a hung part and where its stack says it is."""

    slot: int
    rank: int
    in_collective: bool | None  # None: no stack could be read
    where: str = ""  # the innermost frame of its main thread, as its stack said


def hung_slots(
    progress: Mapping[int, float], slots: Iterable[int], timeout: float, now: float
) -> tuple[int, ...]:
    """The slots among ``slots`` that reported progress once and none for ``timeout`` s,
    when every reporting one did not (one that progresses means the job does)."""
    reporting = [s for s in slots if s in progress]
    if not reporting or any(now - progress[s] < timeout for s in reporting):
        return ()
    return tuple(sorted(reporting))


def next_check(progress: Mapping[int, float], slots: Iterable[int], timeout: float) -> float | None:
    """When the reporting slots could be hung at the earliest (None: none reports)."""
    times = [progress[s] for s in slots if s in progress]
    return max(times) + timeout if times else None


def main_stack(text: str) -> str:
    """The main thread's frames in a stack dump: faulthandler's block whose outermost frame
    is the script's ``<module>``, py-spy's ``"MainThread"`` block; else the whole text."""
    spy = _PYSPY_THREAD.search(text)
    if spy is not None:
        rest = text[spy.end() :]
        following = re.search(r"^Thread \d+ ", rest, re.M)
        return rest[: following.start()] if following else rest
    starts = [m.start() for m in _THREAD.finditer(text)] + [len(text)]
    blocks = [text[a:b] for a, b in itertools.pairwise(starts)]
    for block in blocks:
        frames = [line for line in block.splitlines() if line.strip().startswith("File ")]
        if frames and frames[-1].rstrip().endswith("in <module>"):
            return block
    return text


def where(text: str) -> tuple[bool | None, str]:
    """Whether the main thread's stack in ``text`` is inside a collective, and its innermost
    frame; (None, "") when ``text`` holds no stack."""
    stack = main_stack(text)
    if _PYSPY_THREAD.search(text):
        frames = [line.strip() for line in stack.splitlines() if line.strip()]
    else:
        frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return None, ""
    return bool(_COLLECTIVE.search(stack)), frames[0]


def culprits(ranks: Iterable[HungRank]) -> tuple[HungRank, ...]:
    """The ranks whose stack shows them outside any collective: the others wait for them."""
    return tuple(r for r in ranks if r.in_collective is False)


def cause(rank: HungRank, node: str, timeout: float) -> str:
    """The root cause a hung rank's failure says (``elasticctl status`` shows it)."""
    at = f" at {rank.where}" if rank.where else ""
    return (
        f"hung: rank {rank.rank} on {node} made no progress for {timeout:g} s and was not "
        f"inside a collective{at} (the others waited for it; every rank's stack is in the "
        "job's logs)"
    )


def waited_cause(rank: HungRank, node: str, timeout: float) -> str:
    """A hung rank inside a collective, failed once no other node named a culprit."""
    return (
        f"hung: rank {rank.rank} on {node} made no progress for {2 * timeout:g} s, waiting "
        "in a collective, and no node found the rank it waited for (every rank's stack is "
        "in the job's logs)"
    )
