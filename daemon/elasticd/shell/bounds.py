"""What bounds a job on this node, from this node's facts (its memory, ``pid_max``, its job
cgroups); ``core.containment`` decides."""

from __future__ import annotations

import logging

from elasticd.core.containment import MIN_MEMORY, Containment, decide, parse_memory, summary
from elasticd.errors import ConfigError
from elasticd.shell.cgroups import JobCgroups

log = logging.getLogger(__name__)


def contain(
    cgroups: JobCgroups, *, max_memory: str, max_pids_per_worker: int, slots: int
) -> Containment:
    """What bounds a job here (published in the node record); what cannot is said once."""
    try:
        memory = parse_memory(max_memory, memory_total())
    except ValueError as exc:  # checked at load; a percentage of an unknown total
        raise ConfigError("jobs.max_memory", str(exc)) from None
    if max_memory.strip().endswith("%") and memory < MIN_MEMORY:
        raise ConfigError(
            "jobs.max_memory",
            f"{max_memory} of this node's memory is "
            f"{memory} bytes, less than {MIN_MEMORY >> 20} MiB",
        )
    containment = decide(
        cgroup_reason=cgroups.reason if not cgroups.available else "",
        controls=cgroups.controls,
        lacking=cgroups.lacking,
        pids_per_worker=max_pids_per_worker,
        memory=memory,
        slots=slots,
        pid_max=_int_from("/proc/sys/kernel/pid_max"),
    )
    for missing in containment.missing:
        log.warning("%s", missing)
    log.info("%s", summary(containment))
    return containment


def memory_total() -> int:
    """This node's memory in bytes (MemTotal), 0 when /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _int_from(path: str) -> int:
    """A number that a /proc file holds, 0 when it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0
