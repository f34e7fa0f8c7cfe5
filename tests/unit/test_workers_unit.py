"""Pieces of the worker and control layers that are pure: exit text, peers."""

import os
import socket

import pytest

from elasticd.control.server import Admission, ConnectionLimits, peer_credentials
from elasticd.shell.workers import describe_exit


@pytest.mark.parametrize("code, text", [(1, "exited with code 1"), (-9, "killed by SIGKILL"),
                                        (-15, "killed by SIGTERM"), (-99, "killed by signal 99")])
def test_describe_exit(code, text):
    assert describe_exit(code) == text


def test_peer_credentials_come_from_the_kernel():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        caller = peer_credentials(ours)
    assert (caller.uid, caller.gid, caller.pid) == (os.getuid(), os.getgid(), os.getpid())


def test_admission_limits_connections_per_user_and_in_all():
    admission = Admission(ConnectionLimits(connections=3, connections_per_user=2))
    for uid in (1000, 1000):
        assert admission.refusal(uid) is None
        admission.opened(uid)
    assert "uid 1000" in admission.refusal(1000) and "max_connections_per_user = 2" in admission.refusal(1000)
    assert admission.refusal(65534) is None
    admission.opened(65534)
    assert "control.max_connections = 3" in admission.refusal(0)
    admission.closed(1000)
    assert admission.refusal(1000) is None and admission.open == {1000: 1, 65534: 1}
    admission.closed(1000)
    assert 1000 not in admission.open
