"""The nodes of the cluster: this node's inventory (slots, GPUs) and, in the store, every
node's signed record and heartbeat."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from .config import AUTO, DaemonConfig

log = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT = 10.0


def parse_nvidia_smi(output: str) -> tuple[str, ...]:
    """GPU indices from ``nvidia-smi --query-gpu=index --format=csv,noheader``."""
    return tuple(line.strip() for line in output.splitlines() if line.strip().isdigit())


def discover_gpus(setting: int | str, path: str | None = None) -> tuple[str, ...]:
    """This node's GPUs as CUDA device indices.

    An integer setting is taken as is (devices 0..n-1).  ``auto`` asks ``nvidia-smi`` when
    it is on PATH, and finds none when it is not or when it fails.
    """
    if setting != AUTO:
        return tuple(str(i) for i in range(int(setting)))
    smi = shutil.which("nvidia-smi", path=path)
    if smi is None:
        return ()
    try:
        done = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s); assuming no GPUs", exc)
        return ()
    return parse_nvidia_smi(done.stdout)


def slot_count(config: DaemonConfig, gpus: tuple[str, ...]) -> int:
    """Workers this node runs at once: configured, else one per CPU (at least one per GPU)."""
    if config.node.slots:
        return config.node.slots
    return max(os.cpu_count() or 1, len(gpus))
