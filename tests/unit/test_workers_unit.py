"""Pieces of the worker and control layers that are pure: error files, exit text, peers."""

import json
import os
import socket

import pytest

from elasticd.control.server import Admission, Limits, peer_credentials
from elasticd.workers import describe_exit, read_error_file


def test_torch_record_error_file(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n...", "timestamp": "1700000000"}}}))
    assert read_error_file(str(path)) == ("ValueError: boom", "Traceback (most recent call last):\n...",
                                          1700000000.0)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"message": 3}', '{"nope": 1}',
                                     '{"message": {"extraInfo": {"timestamp": "x"}}}'])
def test_bad_error_files_are_ignored(tmp_path, content):
    path = tmp_path / "e.json"
    path.write_text(content)
    assert read_error_file(str(path)) is None
    assert read_error_file(str(tmp_path / "missing.json")) is None


def test_new_style_error_file(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "plain", "timestamp": 5}))
    assert read_error_file(str(path)) == ("plain", "", 5.0)


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
    admission = Admission(Limits(connections=3, connections_per_user=2))
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
