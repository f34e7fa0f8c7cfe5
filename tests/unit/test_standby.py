"""A standby's choices, as pure functions: which torch modules it imports ahead of the
script, and whether a restarted worker's environment lets it be used."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from elasticd.elastic.standby import sets_torch_variables, torch_imports
from elasticd.shell.workers import compatible


def test_it_imports_the_torch_modules_the_script_imports_and_dynamo_and_no_other(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "from torch.distributed.checkpoint import state_dict\n"
        "import numpy\n"
        "from . import sibling\n"
        "import mymodel\n"
        "def main():\n"
        "    import torch.distributed.fsdp\n"
    )
    assert torch_imports(str(script)) == [
        "torch",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "torch.distributed.fsdp",
        "torch._dynamo",  # imported by torch at the first fully_shard, DCP call, optimizer
    ]


def test_a_script_that_sets_torch_variables_gets_no_dynamo_imported_ahead(tmp_path: Path) -> None:
    """Dynamo and Inductor read theirs when imported, which a fresh worker does after the
    script's own code ran: imported ahead, they would not see what the script set."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch\n"
        "os.environ['TORCHINDUCTOR_CACHE_DIR'] = f'/tmp/cache-{os.environ[\"RANK\"]}'\n"
    )
    assert torch_imports(str(script)) == ["torch"]


@pytest.mark.parametrize(
    "line, sets",
    [
        ("os.environ['TORCHINDUCTOR_CACHE_DIR'] = d", True),
        ("environ['PYTORCH_X'] = '1'", True),
        ("os.environ[name] = value", True),  # computed: it may be one
        ("os.environ.setdefault('TORCH_LOGS', '+dynamo')", True),
        ("os.environ.update(TORCH_COMPILE_DISABLE='1')", True),
        ("os.environ.update({'OMP_NUM_THREADS': '1', 'TORCH_X': '2'})", True),
        ("os.environ.update(settings)", True),
        ("os.putenv('TORCH_X', '1')", True),
        ("os.environ |= {'TORCH_X': '1'}", True),
        ("os.environ['NCCL_DEBUG'] = 'INFO'", False),
        ("os.environ.setdefault('OMP_NUM_THREADS', '1')", False),
        ("os.environ.update({'OMP_NUM_THREADS': '1'}, HF_HOME='/h')", False),
        ("x = os.environ['TORCH_LOGS']", False),  # read, not set
        ("d['TORCH_X'] = 1", False),
    ],
)
def test_what_counts_as_setting_a_torch_variable(line: str, sets: bool) -> None:
    assert sets_torch_variables(ast.parse(line)) is sets


def test_an_unreadable_or_broken_script_imports_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert torch_imports(str(broken)) == []
    assert torch_imports(str(tmp_path / "missing.py")) == []


def test_a_standby_runs_a_worker_whose_environment_differs_in_its_place_alone() -> None:
    started = {"PYTHONPATH": "/lib", "OMP_NUM_THREADS": "1", "LOCAL_RANK": "0"}
    place = {"RANK", "WORLD_SIZE", "MASTER_PORT"}
    placed = {**started, "RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}
    assert compatible(started, placed, place)
    assert not compatible(started, {**placed, "OMP_NUM_THREADS": "2"}, place)
    assert not compatible(started, {**placed, "LD_PRELOAD": "/x.so"}, place)
    assert not compatible(started, {k: v for k, v in placed.items() if k != "PYTHONPATH"}, place)
