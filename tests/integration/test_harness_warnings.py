"""The harness fails a test whose daemon warned of a bug: a RuntimeWarning in a daemon's log
(a coroutine never awaited) is seen by no other check, so ``Daemon.stop`` raises on it."""

from __future__ import annotations

import pytest


def test_a_daemon_that_logged_a_runtime_warning_fails_its_test(daemon_factory):
    daemon = daemon_factory("warned").start()
    with open(daemon.log_path, "a") as log:  # as Python writes it to the daemon's stderr
        log.write(
            "/x/shell/node.py:1: RuntimeWarning: coroutine 'PeerLinks.unreachable' "
            "was never awaited\n"
        )
    with pytest.raises(AssertionError, match="was never awaited"):
        daemon.stop()
    assert daemon.proc.returncode == 0  # it was stopped all the same
    daemon.stop()  # told once: the factory's stop at the end passes


def test_a_daemon_that_warned_nothing_stops_quietly(daemon_factory):
    daemon = daemon_factory("quiet").start()
    assert daemon.stop() == 0
