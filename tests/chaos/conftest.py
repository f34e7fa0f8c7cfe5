"""The chaos suite: a local user, a job, the OOM killer and a full disk against a real daemon.

Each test plays one attacker or fault from the threat model (docs/security.md) and asserts the safe
outcome.  The figures a test measures on the way (connections survived, memory reached,
time to notice a dead worker, processes left, records lost) are printed together at the end
of the run; they are reports, never pass/fail thresholds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

_FIGURES: list[tuple[str, str]] = []


class Figures:
    def add(self, name: str, value: str) -> None:
        _FIGURES.append((name, value))


@pytest.fixture
def figures() -> Iterator[Figures]:
    yield Figures()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("chaos figures")
    width = max(len(name) for name, _ in _FIGURES)
    for name, value in _FIGURES:
        terminalreporter.write_line(f"{name:<{width}}  {value}")
