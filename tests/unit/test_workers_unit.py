"""Pieces of the worker and control layers that are pure: error files, exit text, peers."""

import json

import pytest

from elasticd.control.server import parse_peer, zap_user_id
from elasticd.errors import PermissionDenied
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


@pytest.mark.parametrize("address, user_id", [(b"localhost:0:0:1858", b"0:0:1858"),
                                              (b":1000:100:42", b"1000:100:42"),
                                              (b"127.0.0.1:5555", None), (b"", None),
                                              (b"h:a:b:c", None)])
def test_zap_address(address, user_id):
    assert zap_user_id(address) == user_id


def test_parse_peer():
    peer = parse_peer("1000:100:42")
    assert (peer.uid, peer.gid, peer.pid) == (1000, 100, 42)
    with pytest.raises(PermissionDenied):
        parse_peer("")
