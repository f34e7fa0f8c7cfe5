"""The GPU suite (docs/getting-started.md): real daemons, real elasticctl, workers on real GPUs.

Every test here is skipped unless ``nvidia-smi -L`` lists a GPU and this Python's torch sees
CUDA (``torch.cuda.is_available()``, asked in a child process, so that neither collecting
nor running this folder loads torch into pytest).  On a machine without ``nvidia-smi`` the
check costs one PATH lookup.

Run it with ``tests/run --gpu`` (see README.md, "The two commands"); on a GPU host with its own
CUDA torch: ``ELASTICD_TEST_PYTHON=python3 tests/run --gpu``.

DRY RUN (a development aid, never a result): ``ELASTICD_GPU_TEST_DRY_RUN=gloo`` runs these
tests without a GPU, on CPU tensors with gloo instead of NCCL, with a fake ``nvidia-smi``
that lists two GPUs for the device test.  It proves the tests' own logic (the daemons, the
jobs, the waits, the assertions) on a machine without a GPU; it proves nothing about CUDA or
NCCL.  Without the variable the skip applies as above.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import harness
import pytest
from gpu_rig import HERE, Gpu, dry_run, list_gpus, skip_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if mine and skip_reason():
        marker = pytest.mark.skip(reason=skip_reason())
        for item in mine:
            item.add_marker(marker)


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def absolute_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    """This checkout's daemon/ and ctl/ first on PYTHONPATH, every entry absolute: on a GPU
    host the repository is not pip-installed (PYTHONPATH=daemon:ctl plus the daemon's
    wheels), and the daemons, elasticctl and the workers run in other directories.  The
    workers inherit it (a job gets its submitter's environment) and import elasticd.elastic."""
    entries = [str(harness.ROOT / "daemon"), str(harness.ROOT / "ctl")]
    entries += [os.path.abspath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    value = os.pathsep.join(dict.fromkeys(entries))
    monkeypatch.setenv("PYTHONPATH", value)
    monkeypatch.setitem(harness.CLIENT_ENV, "PYTHONPATH", value)  # elasticctl's environment


@pytest.fixture
def backend() -> str:
    """The process group backend the workers use: nccl (gloo in the dry run)."""
    return "gloo" if dry_run() else "nccl"


FAKE_SMI = """#!/bin/sh
# The dry run's nvidia-smi: two GPUs, as `-L` and the daemon's index query print them.
case "$1" in
-L) printf 'GPU 0: Dry Run GPU (UUID: GPU-00000000-0000-0000-0000-00000000d000)\\n'
    printf 'GPU 1: Dry Run GPU (UUID: GPU-00000000-0000-0000-0000-00000000d001)\\n' ;;
*) printf '0\\n1\\n' ;;
esac
"""


@pytest.fixture
def node_gpus(shared_tmp: Path) -> Iterator[tuple[list[Gpu], dict[str, str]]]:
    """The GPUs ``nvidia-smi -L`` lists, and the environment under which a daemon finds
    that nvidia-smi (nothing to add, except in the dry run: its fake's directory on PATH)."""
    if not dry_run():
        smi = shutil.which("nvidia-smi")
        assert smi is not None
        yield list_gpus(smi), {}
        return
    directory = shared_tmp / "fake-bin"
    directory.mkdir()
    smi = directory / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    yield list_gpus(str(smi)), {"PATH": f"{directory}:{os.environ.get('PATH', os.defpath)}"}
