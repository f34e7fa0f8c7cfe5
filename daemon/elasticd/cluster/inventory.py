"""This node's inventory: its GPUs (as CUDA device indices), its CPUs and its slots."""

from __future__ import annotations

import logging
import os
import subprocess

from elasticd import trust
from elasticd.config import AUTO, DaemonConfig

log = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT = 10.0


def parse_nvidia_smi(output: str) -> tuple[str, ...]:
    """GPU indices from ``nvidia-smi --query-gpu=index --format=csv,noheader``."""
    return tuple(line.strip() for line in output.splitlines() if line.strip().isdigit())


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
        done = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s); assuming no GPUs", exc)
        return ()
    return parse_nvidia_smi(done.stdout)


def cpu_count() -> int:
    """This host's CPUs, as torchrun counts them for ``--nproc-per-node cpu``."""
    return os.cpu_count() or 1


def slot_count(config: DaemonConfig, gpus: tuple[str, ...]) -> int:
    """Workers this node runs at once: configured, else one per CPU (at least one per GPU)."""
    if config.node.slots:
        return config.node.slots
    return max(cpu_count(), len(gpus))
