"""torch's error file as the daemon reads and keeps it (docs/security.md, "The files of a job on disk"): every input
is a root cause or a reason it could not be read, bounded, and nothing raises."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.shell import errorfile
from elasticd.shell.errorfile import (
    MAX_BYTES,
    MAX_MESSAGE,
    MAX_TRACEBACK,
    Recorded,
    keep,
    parse,
    read_capped,
)


def torch_doc(
    message: str, trace: str = "Traceback (most recent call last):\n...", stamp: str = "1700000000"
) -> bytes:
    """What torch's ErrorHandler.record_exception writes."""
    return json.dumps(
        {"message": {"message": message, "extraInfo": {"py_callstack": trace, "timestamp": stamp}}}
    ).encode()


def parsed(raw: bytes) -> Recorded | None:
    return parse(raw[:MAX_BYTES], len(raw))


def test_torch_record_error_file():
    assert parsed(torch_doc("ValueError: boom")) == Recorded(
        "ValueError: boom", "Traceback (most recent call last):\n...", 1700000000.0
    )


def test_new_style_error_file():
    assert parsed(json.dumps({"message": "plain", "timestamp": 5}).encode()) == Recorded(
        "plain", "", 5.0
    )


@pytest.mark.parametrize("raw", [b"", b"  \n"])
def test_nothing_written_is_no_root_cause(raw):
    assert parsed(raw) is None


@pytest.mark.parametrize(
    "raw, why",
    [
        (b'{"message": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested more than"),  # row 0b
        (b"{", "not JSON"),
        (b"[]", "no message"),
        (b'{"nope": 1}', "no message"),
        (b'{"message": 3}', "neither text nor an object"),
        (b'{"message": [1]}', "neither text nor an object"),
        (b'{"message": {"message": ["x"]}}', "not text"),
        (b'{"message": {"message": "x", "extraInfo": {"py_callstack": {"a": 1}}}}', "not text"),
        (b'"\xff"', "not UTF-8"),
        (b'{"message": "\\ud800"}', "lone surrogate"),
        (b'{"message": 1e999}', "out of range"),
    ],
)
def test_a_file_that_is_not_torchs_says_why(raw, why):
    recorded = parsed(raw)
    assert recorded is not None and why in recorded.unreadable and not recorded.message


@pytest.mark.parametrize(
    "stamp, seconds",
    [
        ("x", 0.0),
        ("nan", 0.0),
        ("-5", 0.0),
        ("1e999", 0.0),
        (True, 0.0),
        ([1], 0.0),
        (12, 12.0),
        ("12.5", 12.5),
    ],
)
def test_a_timestamp_that_is_not_a_time_is_unknown(stamp, seconds):
    raw = json.dumps({"message": {"message": "m", "extraInfo": {"timestamp": stamp}}}).encode()
    assert parsed(raw) == Recorded("m", "", seconds)


def test_message_and_traceback_are_capped_keeping_the_end_of_the_traceback():
    recorded = parsed(torch_doc("M" * (MAX_MESSAGE + 10), "T" * MAX_TRACEBACK + "ValueError: here"))
    assert recorded.message == "M" * MAX_MESSAGE + " [elasticd: 10 more characters cut]"
    assert recorded.traceback.startswith("[elasticd: 16 earlier characters cut]\n")
    assert recorded.traceback.endswith("ValueError: here")
    assert len(recorded.traceback) < MAX_TRACEBACK + 100


def test_a_file_past_the_cap_shows_the_start_of_its_message():
    raw = torch_doc("ValueError: " + "é" * (20 << 20))  # 40 MiB of message, as in row 3
    recorded = parsed(raw)
    assert recorded.message.startswith("ValueError: éé") and not recorded.unreadable
    assert recorded.message.endswith(
        f"[elasticd: cut here: the error file holds {len(raw)} bytes; elasticd reads {MAX_BYTES}]"
    )
    assert len(recorded.message) < MAX_MESSAGE + 200


def test_a_file_past_the_cap_with_a_whole_message_keeps_it():
    raw = torch_doc('KeyError: "a\\b"', "T" * (2 * MAX_BYTES))
    recorded = parsed(raw)
    assert recorded.message == 'KeyError: "a\\b"'
    assert (
        recorded.traceback == f"[elasticd: not read: the error file holds {len(raw)} bytes; "
        f"elasticd reads {MAX_BYTES}]"
    )


@pytest.mark.parametrize("cut", range(1, 8))
def test_a_message_cut_inside_an_escape_loses_only_that_escape(cut):
    head = b'{"message": {"message": "ab\\u00e9'
    raw = head[: len(head) - 7 + cut] + b"x" * (MAX_BYTES + 10)
    recorded = parse(raw[: len(head) - 7 + cut], len(raw))
    assert recorded.message.startswith("ab") and "\\" not in recorded.message


def test_a_file_past_the_cap_that_is_not_torchs_is_unreadable():
    raw = b"[" * (MAX_BYTES + 1)
    assert parsed(raw) == Recorded(
        unreadable=f"the error file holds {MAX_BYTES + 1} bytes; elasticd reads {MAX_BYTES}"
    )


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=512) | st.text(max_size=200).map(str.encode), st.integers(0, 4 * MAX_BYTES)
)
def test_any_bytes_give_a_bounded_answer(raw, size):
    recorded = parse(raw, max(size, len(raw)))
    if recorded is not None:
        assert len(recorded.message) <= MAX_MESSAGE + 200
        assert len(recorded.traceback) <= MAX_TRACEBACK + 200
        (recorded.message + recorded.traceback + recorded.unreadable).encode("utf-8")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["message", "timestamp", "extraInfo", "x"]), json_values, max_size=3
    )
    | st.builds(lambda m, e: {"message": {"message": m, "extraInfo": e}}, json_values, json_values)
)
def test_any_json_of_the_wrong_types_gives_an_answer(doc):
    recorded = parse(json.dumps(doc).encode(), len(json.dumps(doc).encode()))
    assert recorded is not None and (recorded.unreadable or isinstance(recorded.message, str))


# -- reading the user's file, keeping the daemon's copy ---------------------------------------


def creator(made: list[str]):
    def create(path: str) -> int:
        made.append(path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)

    return create


def test_keep_reads_no_more_than_the_cap_and_replaces_the_file(tmp_path):
    path = tmp_path / "rank_0.error.json"
    path.write_bytes(torch_doc("ValueError: " + "x" * (3 * MAX_BYTES)))
    path.chmod(0o666)
    held = open(path, "r+b")  # a process of the job that still holds it
    made: list[str] = []
    recorded = keep(str(path), creator(made))
    assert made == [str(path)] and recorded.message.startswith("ValueError: xxx")
    assert path.stat().st_size == MAX_BYTES and stat.S_IMODE(path.stat().st_mode) == 0o600
    held.write(torch_doc("forged"))
    held.close()
    assert path.read_bytes().startswith(b'{"message": {"message": "ValueError: xxx')


def test_keep_of_a_link_or_a_fifo_reads_nothing_through_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(torch_doc("root's secret"))
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    recorded = keep(str(link), creator([]))
    assert recorded.unreadable and "secret" not in recorded.unreadable
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert "not a regular file" in keep(str(fifo), creator([])).unreadable  # and never blocks
    assert keep(str(tmp_path / "missing.json"), creator([])) is None


def test_a_copy_that_cannot_be_written_loses_nothing_of_what_was_read(tmp_path):
    path = tmp_path / "rank_0.error.json"
    path.write_bytes(torch_doc("ValueError: boom"))

    def full(_: str) -> int:
        raise OSError(28, "No space left on device")

    assert keep(str(path), full).message == "ValueError: boom"


def test_read_capped_gives_the_size_of_a_sparse_file(tmp_path):
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    raw, size = read_capped(str(path), limit=10)
    assert raw == b"\0" * 10 and size == 1 << 40
    assert (
        errorfile.parse(raw, size).unreadable
        == f"the error file holds {1 << 40} bytes; elasticd reads 10"
    )
