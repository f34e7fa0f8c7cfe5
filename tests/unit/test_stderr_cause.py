"""A failed worker's root cause from the end of its stderr, when it left no error file
(docs/concepts.md, "What a worker gets")."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from elasticd.shell.errorfile import MAX_STDERR_CAUSE, from_stderr
from elasticd.shell.logs import TAIL_BYTES, OutputFile

TRACE = b"""Traceback (most recent call last):
  File "train.py", line 3, in <module>
    step()
    ^^^^^^
  File "train.py", line 2, in step
    raise RuntimeError("boom")
RuntimeError: boom
"""


def test_the_exception_line_of_the_last_traceback():
    assert from_stderr(b"starting\n" + TRACE) == "RuntimeError: boom"
    chained = (
        TRACE
        + b"\nDuring handling of the above exception, another exception occurred:\n\n"
        + TRACE.replace(b"RuntimeError: boom", b"KeyError: 'lr'\nsecond line of it")
    )
    assert from_stderr(chained) == "KeyError: 'lr'"
    assert from_stderr(TRACE + b"W1125 shutting down the process group\n") == "RuntimeError: boom"


def test_else_the_last_line_that_is_not_blank():
    assert from_stderr(b"warming up\nout of patience\r\n  \n\n") == "out of patience"
    assert from_stderr(b"") == "" and from_stderr(b" \n\t\n") == ""


def test_a_tail_that_is_not_the_whole_stream_drops_its_cut_first_line():
    assert from_stderr(b"RuntimeError: half of a line", whole=False) == ""
    assert from_stderr(b"ror: cut\nthe last\n", whole=False) == "the last"


def test_bounded_and_valid_text():
    long = from_stderr(b"x" * 5000)
    assert long.startswith("x" * MAX_STDERR_CAUSE) and long.endswith(
        f"{5000 - MAX_STDERR_CAUSE} more characters cut]"
    )
    assert (
        from_stderr(b"bad \xff\xfe bytes \xed\xa0\xbd\n")
        == "bad \ufffd\ufffd bytes \ufffd\ufffd\ufffd"
    )


@given(st.binary(max_size=3 * TAIL_BYTES), st.booleans())
def test_never_raises_and_stays_bounded(tail, whole):
    cause = from_stderr(tail, whole)
    assert len(cause) <= MAX_STDERR_CAUSE + 64 and "\n" not in cause
    cause.encode("utf-8")


def test_a_stream_file_keeps_the_last_bytes_written(tmp_path):
    created = []

    def create(path: str) -> int:
        created.append(path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    sink = OutputFile(str(tmp_path / "rank_0.err"), create, lambda n, why: None)
    sink.write(b"a" * (TAIL_BYTES - 3))
    sink.write(b"bcdef")
    assert sink.tail == b"a" * (TAIL_BYTES - 5) + b"bcdef"
    sink.write(b"z" * (3 * TAIL_BYTES))
    assert sink.tail == b"z" * TAIL_BYTES
    sink.close()
    assert os.path.getsize(created[0]) == TAIL_BYTES + 2 + 3 * TAIL_BYTES
