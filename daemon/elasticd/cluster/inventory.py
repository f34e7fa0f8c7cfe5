"""This node's inventory: its GPUs (by UUID where NVML is here, else as CUDA device
indices) and their health checks, its CPUs and its slots; and the record it publishes of
itself (``LocalNode``)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from elasticd import __version__, trust
from elasticd.aio import on_own_thread, wait_or_timeout
from elasticd.cluster.nvml import Nvml, NvmlUnavailable, open_nvml
from elasticd.cluster.registry import NodeRecord
from elasticd.config import AUTO, DaemonConfig
from elasticd.core import events
from elasticd.core.containment import Containment
from elasticd.core.gpuhealth import GpuReading
from elasticd.core.model import NodeInfo
from elasticd.core.placement import Resources
from elasticd.wire.numbers import is_whole

log = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT = 10.0


def parse_nvidia_smi(output: str) -> tuple[str, ...]:
    """GPU indices from ``nvidia-smi --query-gpu=index --format=csv,noheader``."""
    return tuple(line.strip() for line in output.splitlines() if is_whole(line.strip()))


def discover_gpus(setting: int | str, path: str | None = None) -> tuple[str, ...]:
    """This node's GPUs as CUDA device indices.

    An integer setting is taken as is (devices 0..n-1).  ``auto`` asks ``nvidia-smi`` when
    it is on PATH (and root's alone: the daemon would run it as root), and finds none when it
    is not or when it fails.
    """
    if setting != AUTO:
        return tuple(str(i) for i in range(int(setting)))
    smi = trust.which("nvidia-smi", path=path)
    if smi is None:
        return ()
    try:
        trust.check_program(smi)
    except trust.Untrusted as exc:
        log.warning("not running %s; assuming no GPUs (set node.gpus)", exc)
        return ()
    try:
        done = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s); assuming no GPUs", exc)
        return ()
    return parse_nvidia_smi(done.stdout)


def local_gpus(setting: int | str, path: str | None = None) -> tuple[tuple[str, ...], Nvml | None]:
    """This node's GPUs, and NVML to watch their health where it is here.

    With ``auto`` and NVML, the GPUs are their UUIDs (``CUDA_VISIBLE_DEVICES`` takes them: a
    renumbering under a running job cannot hand it another job's GPU); without NVML, as
    before (nvidia-smi's indices, or ``node.gpus``), said once.
    """
    if setting != AUTO:
        return discover_gpus(setting, path), None
    try:
        nvml = open_nvml()
    except NvmlUnavailable as exc:
        log.info("no NVML here (%s): GPUs from nvidia-smi, their health not watched", exc)
        return discover_gpus(setting, path), None
    if not nvml.devices:
        nvml.close()
        return (), None
    log.info(
        "GPUs from NVML: %s",
        ", ".join(f"{d.index} {d.name} ({d.uuid or 'lost'})" for d in nvml.devices),
    )
    return tuple(d.uuid for d in nvml.devices if d.uuid), nvml  # one lost at start is not offered


async def watch_gpus(
    nvml: Nvml, interval: float, post: Callable[[events.GpusRead], None], stop: asyncio.Event
) -> None:
    """Read the GPUs' health every ``interval`` and tell the node core.  A read that does not
    answer within ``min(interval, 10)`` s (NVML can hang on a GPU gone bad) is said once and
    waited for at the next check, never started twice."""
    patience = max(1.0, min(interval, 10.0))
    reading: asyncio.Future[tuple[GpuReading, ...]] | None = None
    hung = False
    while True:
        reading = reading or on_own_thread(nvml.read, name="nvml-read")
        try:
            async with asyncio.timeout(patience):  # never wait_for (aio.py says why)
                readings = await asyncio.shield(reading)
        except TimeoutError:
            if not hung:
                log.warning(
                    "NVML did not answer within %g s: a GPU or the driver hangs; "
                    "GPU health unknown until it does",
                    patience,
                )
            hung = True
        else:
            reading = None
            if hung:
                log.info("NVML answers again")
            hung = False
            post(events.GpusRead(readings))
        if await wait_or_timeout(stop, interval):
            return


def cpu_count() -> int:
    """This host's CPUs, as torchrun counts them for ``--nproc-per-node cpu``."""
    return os.cpu_count() or 1


def slot_count(config: DaemonConfig, gpus: tuple[str, ...]) -> int:
    """Workers this node runs at once: configured, else one per CPU (at least one per GPU)."""
    if config.node.slots:
        return config.node.slots
    return max(cpu_count(), len(gpus))


class JobsHere(Protocol):
    """What this node's jobs use and why it takes none (the node shell says)."""

    @property
    def resources(self) -> Resources: ...
    @property
    def draining(self) -> bool: ...
    @property
    def blacklisted_until(self) -> float: ...
    @property
    def listed(self) -> bool: ...
    @property
    def gpus_out(self) -> dict[int, str]: ...

    def used(self) -> Resources: ...

    def local_jobs(self) -> list[str]: ...


@dataclass
class LocalNode:
    """This node as it publishes itself: what its daemon knows of it (its peer endpoint and
    key once bound, what bounds a job here once decided) and what its jobs use now."""

    name: str
    address: str
    labels: Mapping[str, str]
    started: float
    peer: tuple[str, str] = ("", "")  # (endpoint, public key)
    tier: str = ""  # the checkpoint tier's endpoint, once bound
    containment: Containment | None = None
    jobs: JobsHere | None = field(default=None, repr=False)

    def record(self) -> NodeRecord:
        """This node's record as of now."""
        jobs = self.jobs
        assert jobs is not None
        used = jobs.used()
        info = NodeInfo(
            self.name,
            self.address,
            jobs.resources.slots,
            jobs.resources.gpus,
            dict(self.labels),
            __version__,
            jobs.draining,
            self.started,
            cpus=jobs.resources.cpus,
        )
        return NodeRecord(
            info,
            jobs.draining,
            used.slots,
            len(used.gpus),
            tuple(jobs.local_jobs()),
            *self.peer,
            blacklisted_until=jobs.blacklisted_until,
            listed=jobs.listed,
            containment=self.containment,
            gpus_out=jobs.gpus_out,
            tier_endpoint=self.tier,
        )
