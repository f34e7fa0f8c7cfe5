"""The checks every change passes besides the tests: ruff's lint and format, and no
unresolved merge-conflict marker (`<<<<<<< ` or `>>>>>>> `) in any tracked file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(rb"^(<<<<<<<|>>>>>>>) ", re.MULTILINE)


def ruff() -> list[str]:
    """The venv's ruff (installed with the test extras), else one on PATH."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [found]


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(check: list[str]) -> None:
    done = subprocess.run(
        [*ruff(), *check, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_tracked_file_holds_a_merge_conflict_marker() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    if tracked == [b""]:
        pytest.skip("not a git checkout")
    marked = []
    for name in filter(None, tracked):
        path = ROOT / name.decode()
        if path.is_file() and not path.is_symlink():
            text = path.read_bytes()
            for match in MARKER.finditer(text):
                line = text.count(b"\n", 0, match.start()) + 1
                marked.append(f"{name.decode()}:{line}: {match.group().decode()}")
    assert not marked, "unresolved merge-conflict markers:\n" + "\n".join(marked)
