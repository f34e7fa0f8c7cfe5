"""What the GPU suite knows of this host (its conftest.py and its tests import it): the GPUs
``nvidia-smi -L`` lists, whether torch sees CUDA, and the CPU dry run (conftest.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import harness
import pytest

HERE = Path(__file__).resolve().parent
DRY_RUN_ENV = "ELASTICD_GPU_TEST_DRY_RUN"
_LISTED = re.compile(r"^GPU (\d+): (.*?) \(UUID: (\S+)\)\s*$")


@dataclass(frozen=True)
class Gpu:
    index: str
    name: str
    uuid: str


def dry_run() -> bool:
    """Whether this is the CPU dry run (``ELASTICD_GPU_TEST_DRY_RUN=gloo``)."""
    value = os.environ.get(DRY_RUN_ENV, "")
    if value not in ("", "gloo"):
        raise pytest.UsageError(
            f"{DRY_RUN_ENV}={value!r}: the only dry run is 'gloo' (unset it for the real suite)"
        )
    return value == "gloo"


def list_gpus(smi: str) -> list[Gpu]:
    """The GPUs that ``nvidia-smi -L`` lists (MIG devices, indented under theirs, are not GPUs)."""
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    found = (_LISTED.match(line) for line in done.stdout.splitlines())
    return [Gpu(*m.groups()) for m in found if m]


def _torch_sees_cuda() -> str | None:
    """None when this Python's torch has CUDA; else why not."""
    code = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    try:
        done = subprocess.run([harness.PY, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{harness.PY} could not ask torch: {exc}"
    if done.returncode != 0 or not done.stdout.startswith("True"):
        return f"{harness.PY}'s torch sees no CUDA: {(done.stdout + done.stderr).strip()[-300:]}"
    return None


_skip: str | bool | None = False  # False: not decided yet


def skip_reason() -> str | None:
    """Why this folder is skipped here (None: it runs); decided once per session."""
    global _skip
    if _skip is False:
        if dry_run():
            _skip = None
        else:
            smi = shutil.which("nvidia-smi")
            if smi is None:
                _skip = "no GPU: nvidia-smi is not on PATH"
            elif not list_gpus(smi):
                _skip = "no GPU: nvidia-smi -L lists none"
            else:
                _skip = _torch_sees_cuda()
    return _skip  # type: ignore[return-value]
