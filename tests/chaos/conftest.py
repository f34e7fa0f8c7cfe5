"""The chaos suite: a local user, a job, the OOM killer and a full disk against a real daemon.

Each test plays one attacker or fault from the threat model (docs/security.md) and asserts the safe
outcome.  The figures a test measures on the way (connections survived, memory reached,
time to notice a dead worker, processes left, records lost) are printed together at the end
of the run; they are reports, never pass/fail thresholds.
"""

from __future__ import annotations

import pytest

FIGURE = "chaos figure"


class Figures:
    """A test's figures, kept with its report (so that they reach the summary from a
    pytest-xdist worker too)."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item

    def add(self, name: str, value: str) -> None:
        self._item.user_properties.append((FIGURE, [name, value]))


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Figures:
    return Figures(request.node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    found = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "teardown"
        for key, value in getattr(report, "user_properties", ())
        if key == FIGURE
    ]
    if not found:
        return
    terminalreporter.section("chaos figures")
    width = max(len(name) for name, _ in found)
    for name, value in found:
        terminalreporter.write_line(f"{name:<{width}}  {value}")
