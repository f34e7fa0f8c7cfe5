"""Fixtures shared by every test folder (the harness itself lives in harness.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Daemon
from hostwide import remove_tree

# Where each folder's tests go in the run, heaviest first: pytest-xdist deals the tests
# out in this order as workers free up, so the long ones start early and the many short
# unit tests fill in at the end (the last test to start decides when the run ends).
FOLDERS = ("system", "integration", "chaos", "contract", "gpu", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow-marked tests first, then folder by folder (FOLDERS); else as collected."""

    def weight(item: pytest.Item) -> tuple[int, int]:
        parts = item.path.relative_to(Path(__file__).parent).parts
        folder = FOLDERS.index(parts[0]) if parts[0] in FOLDERS else len(FOLDERS)
        return (0 if item.get_closest_marker("slow") else 1, folder)

    items.sort(key=weight)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory other users can enter (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="elasticd-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    remove_tree(path)


@pytest.fixture
def daemon_factory(shared_tmp: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def make(name: str = "n1", **kw: Any) -> Daemon:
        daemon = Daemon(shared_tmp, name, **kw)
        started.append(daemon)
        return daemon

    yield make
    warned = []
    for daemon in started:  # every one stopped before a warning fails the test
        try:
            daemon.stop()
        except AssertionError as exc:
            warned.append(exc)
    if warned:
        raise warned[0]


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(args=("--slots", "4")).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """When a test fails, show the tail of every daemon log it produced."""
    outcome = yield
    report = outcome.get_result()
    base = getattr(item, "funcargs", {}).get("shared_tmp")
    if report.failed and base is not None:
        for log in sorted(Path(base).glob("*.log")):
            report.sections.append(
                (f"daemon log {log.name}", log.read_text(errors="replace")[-5000:])
            )
        shown = 0
        for err in sorted(Path(base).rglob("*.err")):  # workers that said why they failed
            try:
                tail = err.read_text(errors="replace")[-4000:]
            except OSError:
                continue
            if shown < 8 and ("Traceback" in tail or "elasticd:" in tail):
                report.sections.append((f"worker {err.relative_to(base)}", tail))
                shown += 1
    if report.failed and call.when == "call":
        for daemon in list(Daemon.running):
            if daemon.proc is not None and daemon.proc.poll() is None:
                report.sections.append((f"stories on {daemon.name}", daemon.stories()))
