"""The daemon's log to journald: the native protocol's encoding, the fields of a record, when
stderr is the journal stream, and that a record the journal cannot take goes to stderr."""

from __future__ import annotations

import io
import logging
import os
import socket
import struct
import time

import pytest
from fixtures.journald import decode

from elasticd import journal


def record(
    message: str, *args: object, level: int = logging.INFO, **extra: object
) -> logging.LogRecord:
    made = logging.LogRecord(
        "elasticd.scheduler", level, "/x/scheduler.py", 42, message, args, None, func="take"
    )
    made.__dict__.update(extra)
    return made


def test_a_plain_field_is_name_equals_value():
    assert (
        journal.encode_field("MESSAGE", "job j-0a1b2c: joining")
        == b"MESSAGE=job j-0a1b2c: joining\n"
    )


def test_a_value_with_a_newline_takes_the_binary_form():
    value = "failed\nTraceback (most recent call last):\n  boom"
    encoded = journal.encode_field("MESSAGE", value)
    assert encoded == b"MESSAGE\n" + struct.pack("<Q", len(value)) + value.encode() + b"\n"
    assert encoded[8:16] == len(value).to_bytes(8, "little")


def test_the_length_counts_bytes_not_characters():
    encoded = journal.encode_field("MESSAGE", "é\n")
    assert encoded == b"MESSAGE\n" + (3).to_bytes(8, "little") + "é\n".encode() + b"\n"


def test_a_value_that_is_not_utf8_still_encodes():
    assert journal.encode_field("MESSAGE", "bad \udcff byte") == b"MESSAGE=bad \\udcff byte\n"


def test_encode_then_decode_is_the_identity():
    fields = {"MESSAGE": "two\nlines", "PRIORITY": "3", "EMPTY": "", "EQUALS": "a=b"}
    assert decode(journal.encode(fields)) == fields


@pytest.mark.parametrize(
    "level, expected",
    [
        (logging.CRITICAL, 2),
        (logging.ERROR, 3),
        (logging.WARNING, 4),
        (logging.INFO, 6),
        (logging.DEBUG, 7),
        (logging.INFO + 5, 6),
        (logging.NOTSET, 7),
    ],
)
def test_syslog_priorities(level, expected):
    assert journal.priority(level) == expected


def test_the_fields_of_a_record():
    fields = journal.record_fields(
        record(
            "job %s: joining with %d workers",
            "j-0a1b2c",
            2,
            level=logging.WARNING,
            **journal.about("j-0a1b2c"),
        ),
        "the text",
        "node7",
    )
    assert fields == {
        "MESSAGE": "the text",
        "PRIORITY": "4",
        "SYSLOG_IDENTIFIER": "elasticd",
        "ELASTICD_LOGGER": "elasticd.scheduler",
        "ELASTICD_NODE": "node7",
        "CODE_FILE": "/x/scheduler.py",
        "CODE_LINE": "42",
        "CODE_FUNC": "take",
        "ELASTICD_JOB": "j-0a1b2c",
    }


@pytest.mark.parametrize(
    "made, job",
    [
        (record("store up", **journal.about("j-123456")), "j-123456"),
        (record("job j-abcdef: x", **journal.about("j-123456")), "j-123456"),
        # Row 0h: a job id in the text is nobody's word for it (a request's op, a job's error)
        (record("job %s round %d: restart", "j-00ff11", 1), None),
        (record("control: %s refused: %s: %s", "j-00ff11", "not_found", "no such op"), None),
        (record("node n1: drained"), None),
    ],
)
def test_the_job_a_record_concerns_is_the_daemons_word_only(made, job):
    assert journal.job_of(made) == job


@pytest.mark.parametrize(
    "text, line",
    [
        ("plain", "plain"),
        ("two\nlines\r\tand a tab", "two\\nlines\\r\\tand a tab"),
        ("\x1b[2J\x1b]0;title\x07 \x7f\x9b", "\\x1b[2J\\x1b]0;title\\x07 \\x7f\\x9b"),
        ("bidi \u202e and \u2066, a lone \udcff", "bidi \\u202e and \\u2066, a lone \\udcff"),
        ("x\nPRIORITY=0\nELASTICD_JOB=j-000000", "x\\nPRIORITY=0\\nELASTICD_JOB=j-000000"),
        ("é ✓ 中文", "é ✓ 中文"),  # printable text stays as it is
    ],
)
def test_one_line_escapes_as_elasticctl_shows_text(text, line):
    assert journal.one_line(text) == line


def test_one_line_caps_with_a_marker_that_says_how_long_it_was():
    assert journal.one_line("x" * 20, 10) == "x" * 10 + "… [cut: 20 characters]"
    assert journal.one_line("\n" * 8, 10) == "\\n" * 5 + "… [cut: 8 characters]"  # escapes count
    assert journal.one_line("x" * 10, 10) == "x" * 10
    assert (
        journal.excerpt(ValueError("y" * 5000))
        == "y" * journal.JOB_TEXT + "… [cut: 5000 characters]"
    )


def formatted(fmt: str, made: logging.LogRecord) -> str:
    return journal.LogFormatter(fmt).format(made)


def test_the_formatter_makes_the_message_one_line_and_keeps_a_traceback_multi_line():
    try:
        raise RuntimeError("bad\x1b[31m\nthing")
    except RuntimeError:
        import sys

        failed = logging.LogRecord(
            "elasticd.agent",
            logging.ERROR,
            __file__,
            7,
            "job %s failed: %s",
            ("j-abc123", "a\nPRIORITY=0\x1b[2J"),
            sys.exc_info(),
            func="run",
        )
    text = formatted("%(levelname)s %(name)s: %(message)s", failed)
    first, *rest = text.split("\n")
    assert first == "ERROR elasticd.agent: job j-abc123 failed: a\\nPRIORITY=0\\x1b[2J"
    assert rest[0] == "Traceback (most recent call last):" and len(rest) > 3
    assert rest[-2:] == ["RuntimeError: bad\\x1b[31m", "thing"]  # escaped, but for its newlines
    assert "\x1b" not in text


def test_a_long_traceback_keeps_its_end():
    made = record("failed")
    made.exc_text = "Traceback\n" + "  frame\n" * 10000 + "ValueError: the end"
    text = formatted("%(message)s", made)
    assert len(text) < journal.MAX_TRACEBACK + 200 and text.endswith("ValueError: the end")
    assert text.split("\n")[1].startswith("[cut: the last 16384 of ")


@pytest.mark.parametrize(
    "value, parsed",
    [("8:1234", (8, 1234)), ("", None), ("8", None), ("a:1", None), ("8:", None), ("-1:2", None)],
)
def test_journal_stream_parsing(value, parsed):
    assert journal.journal_stream(value) == parsed


def test_stderr_is_the_journal_only_when_device_and_inode_match(tmp_path):
    with open(tmp_path / "stderr", "w") as stream, open(tmp_path / "other", "w") as other:
        info, elsewhere = os.fstat(stream.fileno()), os.fstat(other.fileno())
        assert journal.is_journal(stream, {"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"})
        assert not journal.is_journal(
            stream, {"JOURNAL_STREAM": f"{elsewhere.st_dev}:{elsewhere.st_ino}"}
        )
        assert not journal.is_journal(stream, {})
        assert isinstance(journal.log_handler("n", {}, stream), logging.StreamHandler)
        chosen = journal.log_handler(
            "n",
            {"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}", journal.SOCKET_ENV: "/nowhere"},
            stream,
        )
        assert isinstance(chosen, journal.JournalHandler) and chosen.path == "/nowhere"
        chosen.close()
        assert (
            journal.JournalHandler("n", logging.NullHandler()).path == "/run/systemd/journal/socket"
        )
    assert not journal.is_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})  # no file descriptor


@pytest.fixture
def journald(tmp_path):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(tmp_path / "journal.sock"))
    server.settimeout(5)
    yield server
    server.close()


def handler_to(path: str, stderr: io.StringIO) -> journal.JournalHandler:
    return journal.JournalHandler("n1", journal.plain_handler(stderr), path)


def test_one_datagram_per_record_with_the_traceback_in_the_message(journald):
    stderr = io.StringIO()
    handler = handler_to(journald.getsockname(), stderr)
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = logging.LogRecord(
            "elasticd.agent",
            logging.ERROR,
            __file__,
            7,
            "agent for job %s failed",
            ("j-abc123",),
            sys.exc_info(),
            func="run",
        )
    failed.__dict__.update(journal.about("j-abc123"))
    handler.handle(failed)
    fields = decode(journald.recv(1 << 20))
    assert fields["MESSAGE"].startswith("agent for job j-abc123 failed\nTraceback")
    assert "ValueError: boom" in fields["MESSAGE"]
    assert (fields["PRIORITY"], fields["ELASTICD_JOB"], fields["ELASTICD_NODE"]) == (
        "3",
        "j-abc123",
        "n1",
    )
    assert stderr.getvalue() == ""
    handler.close()


def test_without_the_socket_the_record_goes_to_stderr(tmp_path):
    stderr = io.StringIO()
    handler = handler_to(str(tmp_path / "gone.sock"), stderr)
    handler.handle(record("job %s: joining", "j-0a1b2c", level=logging.WARNING))
    assert stderr.getvalue().endswith(" WARNING elasticd.scheduler: job j-0a1b2c: joining\n")
    handler.close()


def test_a_huge_message_reaches_the_journal_cut_to_one_line(journald):
    """Row 4: a job's error of 64 MiB with newlines and forged fields is one capped line."""
    stderr = io.StringIO()
    handler = handler_to(journald.getsockname(), stderr)
    handler.handle(record("failed: %s", "x\nPRIORITY=0\nELASTICD_JOB=j-000000\n" * (2 << 20)))
    fields = decode(journald.recv(1 << 20))
    assert fields["MESSAGE"].startswith("failed: x\\nPRIORITY=0\\nELASTICD_JOB=j-000000\\nx")
    assert fields["MESSAGE"].endswith(f"… [cut: {8 + 35 * (2 << 20)} characters]")
    assert len(fields["MESSAGE"]) < journal.MAX_MESSAGE + 40 and "\n" not in fields["MESSAGE"]
    assert fields["PRIORITY"] == "6" and "ELASTICD_JOB" not in fields
    assert stderr.getvalue() == ""
    handler.close()


def test_a_record_the_journal_refuses_goes_to_stderr_as_one_line(tmp_path):
    stderr = io.StringIO()
    handler = handler_to(str(tmp_path / "gone.sock"), stderr)
    handler.handle(record("failed: %s", "a\n2026-01-01 00:00:00,000 ERROR elasticd: forged\x1b[2J"))
    assert stderr.getvalue().count("\n") == 1
    assert stderr.getvalue().endswith(
        " INFO elasticd.scheduler: failed: a\\n2026-01-01 00:00:00,000 ERROR elasticd: forged\\x1b[2J\n"
    )
    handler.close()


def test_emit_never_raises_even_when_stderr_fails_too(tmp_path):
    stderr = io.StringIO()
    stderr.close()
    handler = handler_to(str(tmp_path / "gone.sock"), stderr)
    handler.handle(record("lost in every way"))
    handler.close()


def test_a_journald_that_does_not_read_never_blocks_the_daemon(journald):
    """Its queue full, records are dropped and counted (a blocking send would stall the
    event loop); once it reads again, a line says how many were lost, then the record."""
    stderr = io.StringIO()
    handler = handler_to(journald.getsockname(), stderr)
    started = time.monotonic()
    for n in range(2000):  # far past the kernel's queue of unread datagrams
        handler.handle(record("job %s: line %d", "j-0a1b2c", n))
    assert time.monotonic() - started < 30  # it returned: no send waited for journald
    assert handler.dropped > 0 and stderr.getvalue() == ""
    dropped = handler.dropped
    journald.setblocking(False)
    while True:  # journald catches up
        try:
            journald.recv(1 << 20)
        except BlockingIOError:
            break
    handler.handle(record("job %s: after", "j-0a1b2c"))
    journald.setblocking(True)
    notice, after = decode(journald.recv(1 << 20)), decode(journald.recv(1 << 20))
    assert notice["MESSAGE"] == f"{dropped} log records were dropped: journald did not keep up"
    assert notice["PRIORITY"] == "4"
    assert after["MESSAGE"] == "job j-0a1b2c: after" and handler.dropped == 0
    handler.close()
