"""What this node bounds of a job, decided once at start and published in its record.

A job's tasks (processes and threads) are bounded per worker by ``jobs.max_pids_per_worker``
and its memory by ``jobs.max_memory``, in the job's cgroup where the controllers are there
(shell/cgroups.py writes them).  Where the pids controller is not, a fork bomb is still stopped: each worker
gets ``RLIMIT_NPROC``, which the kernel counts per real uid (every process and thread of the
job's user on this node, its other jobs and logins included) and does not apply to root.
``missing`` says, one sentence each, what this node cannot do; the daemon logs them at start
and ``elasticctl nodes`` shows them.  Pure: the facts are passed in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

V2 = "cgroup v2"
V1 = "cgroup v1"
RLIMIT = "RLIMIT_NPROC"
MIN_PIDS = 16  # a Python worker alone has a few threads
MIN_MEMORY = 16 << 20  # and some MiB
_MAX_NOTES = 8
_MAX_NOTE = 1000
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%")


def parse_memory(value: str, total: int) -> int:
    """``jobs.max_memory`` in bytes: "0" (no limit), "8G", "512MiB", "1073741824" (bytes),
    or "90%" of ``total``, this node's memory.  Raises ValueError."""
    text = value.strip()
    percent = _PERCENT.fullmatch(text)
    if percent:
        share = float(percent.group(1))
        if not 0 < share <= 100:
            raise ValueError("a percentage must be more than 0 and at most 100")
        return int(total * share / 100)
    size = _SIZE.fullmatch(text)
    if size is None:
        raise ValueError(
            "must be bytes, a size such as 64G or 512M, a percentage of this "
            "node's memory such as 90%, or 0 (no limit)"
        )
    return int(size.group(1)) << (10 * " KMGT".index(size.group(2).upper() or " "))


@dataclass(frozen=True)
class JobLimits:
    """What one job may use on this node, as its cgroup gets it; 0: no limit."""

    pids: int = 0  # tasks (processes and threads: the kernel counts both)
    memory: int = 0  # bytes, RAM and swap together


@dataclass(frozen=True)
class Containment:
    """What bounds a job here.  ``pids_by``/``memory_by``: where the controller is (V2, V1)
    or RLIMIT (pids only); "" when nothing can bound it.  0: no limit."""

    cgroup: bool = False
    pids_per_worker: int = 0
    pids_by: str = ""
    memory: int = 0
    memory_by: str = ""
    missing: tuple[str, ...] = ()

    def job_limits(self, workers: int) -> JobLimits:
        """What the job's cgroup gets, for ``workers`` workers here."""
        cgroup_pids = self.pids_by in (V1, V2)
        return JobLimits(
            pids=self.pids_per_worker * max(workers, 1) if cgroup_pids else 0,
            memory=self.memory if self.memory_by else 0,
        )

    def rlimit_nproc(self, workers: int) -> int:
        """RLIMIT_NPROC for each worker, when no cgroup bounds the job's tasks (0: none)."""
        return self.pids_per_worker * max(workers, 1) if self.pids_by == RLIMIT else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "cgroup": self.cgroup,
            "pids_per_worker": self.pids_per_worker,
            "pids_by": self.pids_by,
            "memory": self.memory,
            "memory_by": self.memory_by,
            "missing": list(self.missing),
        }

    @classmethod
    def from_json(cls, doc: Any) -> Containment | None:
        """Another node's, as published; None when absent (an older daemon) or not a table.
        Wrong types become "not known" (0, ""); the notes are capped."""
        if not isinstance(doc, Mapping):
            return None

        def count(name: str) -> int:
            value = doc.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63:
                return value
            return 0

        def word(name: str) -> str:
            value = doc.get(name)
            return value[:40] if isinstance(value, str) else ""

        notes = doc.get("missing")
        notes = notes if isinstance(notes, list) else []
        return cls(
            cgroup=doc.get("cgroup") is True,
            pids_per_worker=count("pids_per_worker"),
            pids_by=word("pids_by"),
            memory=count("memory"),
            memory_by=word("memory_by"),
            missing=tuple(note[:_MAX_NOTE] for note in notes[:_MAX_NOTES] if isinstance(note, str)),
        )


def decide(
    *,
    cgroup_reason: str,
    controls: Mapping[str, str],
    lacking: Mapping[str, str],
    pids_per_worker: int,
    memory: int,
    slots: int,
    pid_max: int,
) -> Containment:
    """This node's containment.  ``cgroup_reason``: why there are no job cgroups ("" when
    there are); ``controls``: memory/pids -> V2 or V1 where job cgroups have them;
    ``lacking``: why they lack the others; the limits as configured (memory in bytes);
    ``pid_max``: the kernel's (0: not known)."""
    cgroup = not cgroup_reason
    pids_by = controls.get("pids") or (RLIMIT if pids_per_worker else "")
    memory_by = controls.get("memory", "")
    missing = []
    if not cgroup:
        missing.append(
            f"no cgroups for jobs ({cgroup_reason}): a job's processes are tracked "
            f"by process group only, and one that leaves its group (setsid) "
            f"outlives the job"
        )
    if pids_by == RLIMIT:
        why = lacking.get("pids") or "no job cgroups"
        missing.append(
            f"no pids controller ({why}): a job's processes and threads are bounded "
            f"by RLIMIT_NPROC instead ({pids_per_worker} per worker), which counts "
            f"every process of the job's user on this node (its other jobs and "
            f"logins too) and does not bind jobs that run as root"
        )
    if memory and not memory_by:
        why = lacking.get("memory") or "no job cgroups"
        missing.append(f"jobs.max_memory is not enforced: no memory controller ({why})")
    total = slots * pids_per_worker
    if pids_by and pid_max and total > pid_max:
        missing.append(
            f"{slots} slots x jobs.max_pids_per_worker {pids_per_worker} = {total} "
            f"tasks, more than kernel.pid_max {pid_max}: jobs together can still "
            f"use up this node's pids"
        )
    return Containment(cgroup, pids_per_worker, pids_by, memory, memory_by, tuple(missing))


def summary(containment: Containment) -> str:
    """One line for the daemon's log: 'tasks 1024 per worker (cgroup v2), memory no limit
    (cgroup v1)'."""
    pids = (
        f"{containment.pids_per_worker} per worker" if containment.pids_per_worker else "no limit"
    )
    memory = f"{containment.memory} bytes" if containment.memory else "no limit"
    return (
        f"job limits: tasks {pids} ({containment.pids_by or 'nothing enforces it'}), "
        f"memory {memory} ({containment.memory_by or 'nothing enforces it'})"
    )
