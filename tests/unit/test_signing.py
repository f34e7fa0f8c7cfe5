"""Signed store records and the cluster key file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from elasticd.errors import ConfigError, TamperedRecord
from elasticd.store.signing import (
    Freshness,
    Opened,
    SignedLines,
    Signer,
    VersionClock,
    canonical_json,
    create_key,
    load_key,
    load_or_create_key,
    open_or_refuse,
)

KEY = b"0123456789abcdef0123456789abcdef"
BODY = {"job": "j-1", "nodes": ["b", "a"], "n": 3, "ratio": 0.5, "none": None, "text": "é\n"}


KEY_NAME = "elasticd/c/jobs/outcome/j-000001"


def _signer(key: bytes = KEY, cluster: str = "c") -> Signer:
    return Signer(key, cluster)


@pytest.mark.parametrize("secret", [False, True])
def test_seal_then_open_returns_the_body_and_version(secret):
    signer = _signer()
    assert signer.open(KEY_NAME, signer.seal(KEY_NAME, BODY, version=7, secret=secret)) == Opened(
        BODY, 7
    )


def test_envelope_format():
    raw = _signer().seal(KEY_NAME, {"b": 1, "a": 2}, version=3)
    envelope = json.loads(raw)
    assert raw.startswith(b'{"v":2,"ver":3,"body":{"a":2,"b":1},"mac":"')
    assert set(envelope) == {"v", "ver", "body", "mac"} and len(envelope["mac"]) == 64


def test_a_secret_record_shows_nothing_of_its_body():
    raw = _signer().seal(KEY_NAME, {"env": {"SECRET_TOKEN": "hunter2"}}, secret=True)
    assert set(json.loads(raw)) == {"v", "ver", "enc"}
    assert b"hunter2" not in raw and b"SECRET_TOKEN" not in raw


def test_mac_covers_the_canonical_body_whatever_the_key_order():
    signer = _signer()
    envelope = json.loads(signer.seal(KEY_NAME, BODY))
    reordered = json.dumps(
        {"mac": envelope["mac"], "body": dict(reversed(BODY.items())), "ver": 0, "v": 2}
    )
    assert signer.open(KEY_NAME, reordered.encode()).body == BODY
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
        lambda e: e.update(v=1),  # wrong envelope version
        lambda e: e.pop("v"),
        lambda e: e.update(ver=8),  # another version
        lambda e: e.update(ver=True),
        lambda e: e.pop("ver"),
    ],
)
def test_tampered_records_are_refused(tamper):
    signer = _signer()
    with pytest.raises(TamperedRecord):
        signer.open(KEY_NAME, _rewrite(signer.seal(KEY_NAME, BODY, version=7), tamper))


@pytest.mark.parametrize(
    "tamper",
    [
        lambda e: e.update(ver=8),
        lambda e: e.update(enc=e["enc"][:-4] + ("AAAA" if e["enc"][-4:] != "AAAA" else "BBBB")),
        lambda e: e.update(enc="not base64!"),
        lambda e: e.update(enc=None),
    ],
)
def test_tampered_secret_records_are_refused(tamper):
    signer = _signer()
    with pytest.raises(TamperedRecord):
        signer.open(KEY_NAME, _rewrite(signer.seal(KEY_NAME, BODY, version=7, secret=True), tamper))


@pytest.mark.parametrize("secret", [False, True])
def test_a_record_copied_under_another_key_is_refused(secret):
    signer = _signer()
    raw = signer.seal(KEY_NAME, BODY, secret=secret)
    with pytest.raises(TamperedRecord, match="another key"):
        signer.open(KEY_NAME.replace("000001", "000002"), raw)


@pytest.mark.parametrize("secret", [False, True])
def test_a_record_of_another_cluster_is_refused(secret):
    with pytest.raises(TamperedRecord):
        _signer(cluster="c").open(
            KEY_NAME, _signer(cluster="d").seal(KEY_NAME, BODY, secret=secret)
        )


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b"[1,2]", b'"body"', b"\xff\xfe", b'{"v":2}', b'{"v":2,"ver":1}']
)
def test_garbage_is_refused(raw):
    with pytest.raises(TamperedRecord):
        _signer().open(KEY_NAME, raw)


def test_a_record_sealed_with_another_key_is_refused():
    with pytest.raises(TamperedRecord):
        _signer().open(KEY_NAME, _signer(b"another key").seal(KEY_NAME, BODY))


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError):
        Signer(b"", "c")


def test_freshness_refuses_an_older_version_of_a_key_and_counts_it():
    signer, fresh, refused = _signer(), Freshness(), []
    new, old = (
        signer.seal(KEY_NAME, {"n": 2}, version=2),
        signer.seal(KEY_NAME, {"n": 1}, version=1),
    )
    report = lambda key, why: refused.append((key, why))  # noqa: E731
    assert open_or_refuse(signer, KEY_NAME, new, dict, report, fresh) == {"n": 2}
    assert open_or_refuse(signer, KEY_NAME, new, dict, report, fresh) == {"n": 2}  # the same again
    assert open_or_refuse(signer, KEY_NAME, old, dict, report, fresh) is None
    assert refused == [
        (KEY_NAME, "record is version 1, older than version 2 seen before (written back)")
    ]


def test_version_clock_goes_up_even_when_the_wall_clock_goes_back():
    walls = iter([100.0, 100.0, 99.0, 101.0])
    clock = VersionClock(lambda: next(walls))
    versions = [clock.next() for _ in range(4)]
    assert versions == [100_000_000, 100_000_001, 100_000_002, 101_000_000]


def test_signed_lines_parse_each_line_once_and_refuse_forged_ones():
    signer, refused = _signer(), []
    lines = SignedLines(
        signer, KEY_NAME, lambda body: body["name"], lambda key, why: refused.append(key)
    )
    raw = lines.line({"name": "a"}) + b"forged\n" + lines.line({"name": "b"})
    assert lines.fold(raw) == ["a", None, "b"]
    assert lines.fold(raw + lines.line({"name": "c"})) == ["a", None, "b", "c"]
    assert refused == [KEY_NAME]  # the forged line was reported once
    copied = SignedLines(
        signer, KEY_NAME + "x", lambda body: body["name"], lambda key, why: refused.append(key)
    )
    assert copied.fold(raw) == [None, None, None]  # lines copied from another log do not open


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


def test_a_record_as_sealed_is_checked_over_its_bytes_before_anything_is_decoded():
    """The shape seal() writes: the MAC is checked over the body's bytes as read, so a byte
    changed anywhere (body, version, MAC) is refused, and junk under a forged MAC is refused
    for its MAC, never parsed."""
    signer = _signer()
    raw = signer.seal(KEY_NAME, BODY, version=12)
    assert signer.open(KEY_NAME, raw) == Opened(BODY, 12)
    at_body, at_mac = raw.index(b'"n":3') + 4, raw.index(b'"mac":"') + 8
    for damaged in (
        raw[:at_body] + b"4" + raw[at_body + 1 :],
        raw.replace(b'"ver":12', b'"ver":13'),
        raw[:at_mac] + (b"0" if raw[at_mac : at_mac + 1] != b"0" else b"1") + raw[at_mac + 1 :],
        raw.replace(b'"ver":12', b'"ver":012'),
    ):
        with pytest.raises(TamperedRecord):
            signer.open(KEY_NAME, damaged)
    junk = b'{"v":2,"ver":1,"body":' + b"[" * 100000 + b',"mac":"' + b"0" * 64 + b'"}'
    with pytest.raises(TamperedRecord, match="MAC does not match"):
        signer.open(KEY_NAME, junk)
