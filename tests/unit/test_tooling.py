"""The checks every change passes besides the tests: ruff's lint and format, mypy's type
check (pyproject.toml's [tool.mypy]: strict on the core, basic elsewhere), and no
unresolved merge-conflict marker (`<<<<<<< ` or `>>>>>>> `) in any tracked file."""

from __future__ import annotations

import importlib.util
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


@pytest.mark.slow
def test_mypy() -> None:
    """The packages pyproject.toml names, type-checked as configured there (its cache in
    .mypy_cache: a check after a small change takes seconds, a first one about half a minute)."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    done = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
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
