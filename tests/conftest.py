"""Fixtures shared by every test folder (the harness itself lives in harness.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from harness import Daemon


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory other users can enter (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="elasticd-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_factory(shared_tmp: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def make(name: str = "n1", **kw: Any) -> Daemon:
        daemon = Daemon(shared_tmp, name, **kw)
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        daemon.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(args=("--slots", "4")).start()


