"""A sharded commit's load after a re-form (docs/in-place.md, "Sharded state"): errors raised
inside DCP's load (it gathers every rank's into one ``CheckpointException``, a
``BaseException``) are tried again and then reported as the ranks' failure to load, as the
tier's own errors are; an intact commit loads.  Real DCP files and one real gloo rank in a
process of its own (tests/fixtures/sharded_load_retry.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from harness import PY, ROOT
from hostwide import free_port

FIXTURE = str(ROOT / "tests" / "fixtures" / "sharded_load_retry.py")


def load(tmp_path: Path, case: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "daemon"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [PY, FIXTURE, str(tmp_path), str(free_port()), case],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_intact_commit_loads_with_its_attributes(tmp_path: Path):
    assert load(tmp_path, "intact") == {"attrs": {"step": 7}, "same": True}


def test_a_commit_torn_on_disk_is_tried_again_then_reported_as_not_loaded(tmp_path: Path):
    outcome = load(tmp_path, "torn")
    assert outcome["raised"] == "RuntimeError", outcome
    assert "could not load a commit in 3 tries" in outcome["message"], outcome
