"""Signed store records and the cluster key file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from elasticd.errors import ConfigError, TamperedRecord
from elasticd.store.signing import Signer, canonical_json, create_key, load_key, load_or_create_key

KEY = b"0123456789abcdef0123456789abcdef"
BODY = {"job": "j-1", "nodes": ["b", "a"], "n": 3, "ratio": 0.5, "none": None, "text": "é\n"}


def test_seal_then_open_returns_the_body():
    signer = Signer(KEY)
    assert signer.open(signer.seal(BODY)) == BODY


def test_envelope_format():
    raw = Signer(KEY).seal({"b": 1, "a": 2})
    envelope = json.loads(raw)
    assert raw.startswith(b'{"v":1,"body":{"a":2,"b":1},"mac":"')
    assert set(envelope) == {"v", "body", "mac"} and len(envelope["mac"]) == 64


def test_mac_covers_the_canonical_body_whatever_the_key_order():
    signer = Signer(KEY)
    reordered = json.dumps({"mac": json.loads(signer.seal(BODY))["mac"], "body": dict(reversed(BODY.items())), "v": 1})
    assert signer.open(reordered.encode()) == BODY
    assert canonical_json({"b": 1, "a": [2]}) == b'{"a":[2],"b":1}'


def _rewrite(raw: bytes, change) -> bytes:
    envelope = json.loads(raw)
    change(envelope)
    return json.dumps(envelope).encode()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda e: e["body"].update(n=4),  # tampered body
        lambda e: e.update(mac="0" * 64),  # tampered mac
        lambda e: e.update(mac=e["mac"][:-1] + ("0" if e["mac"][-1] != "0" else "1")),
        lambda e: e.pop("mac"),  # missing mac
        lambda e: e.update(mac=None),
        lambda e: e.pop("body"),
        lambda e: e.update(v=2),  # wrong envelope version
        lambda e: e.pop("v"),
    ],
)
def test_tampered_records_are_refused(tamper):
    signer = Signer(KEY)
    with pytest.raises(TamperedRecord):
        signer.open(_rewrite(signer.seal(BODY), tamper))


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1,2]", b'"body"', b"\xff\xfe", b'{"v":1}'])
def test_garbage_is_refused(raw):
    with pytest.raises(TamperedRecord):
        Signer(KEY).open(raw)


def test_a_record_sealed_with_another_key_is_refused():
    with pytest.raises(TamperedRecord):
        Signer(KEY).open(Signer(b"another key").seal(BODY))


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError):
        Signer(b"")


def test_create_key_writes_a_0600_hex_file_once(tmp_path):
    path = str(tmp_path / "cluster.key")
    key = create_key(path)
    assert len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert open(path).read().strip() == key.hex()
    assert load_key(path) == key
    with pytest.raises(FileExistsError):
        create_key(path)


def test_load_or_create_key_creates_then_loads(tmp_path):
    path = str(tmp_path / "cluster.key")
    key = load_or_create_key(path)
    assert load_or_create_key(path) == key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o610])
def test_load_key_refuses_a_file_that_group_or_others_can_access(tmp_path, mode):
    path = tmp_path / "cluster.key"
    create_key(str(path))
    path.chmod(mode)
    with pytest.raises(ConfigError) as raised:
        load_key(str(path))
    assert raised.value.key == "cluster.key_file" and "chmod 600" in str(raised.value)


def test_load_key_refuses_an_empty_file(tmp_path):
    path = tmp_path / "cluster.key"
    path.write_bytes(b"\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="empty"):
        load_key(str(path))


def test_load_key_reports_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_key(str(tmp_path / "absent.key"))


def test_load_key_accepts_a_non_hex_secret_verbatim(tmp_path):
    path = tmp_path / "cluster.key"
    path.write_bytes(b"a passphrase, not hex\n")
    path.chmod(0o600)
    assert load_key(str(path)) == b"a passphrase, not hex"
