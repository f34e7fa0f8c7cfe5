"""The daemon's own log: journald's native protocol, with structured fields, when systemd
connected our stderr to the journal; stderr in the plain format otherwise.

systemd sets ``JOURNAL_STREAM=<dev>:<inode>`` for a service whose stderr is the journal; it
names our stderr exactly when fstat(2) of stderr gives that device and inode (systemd.exec(5)).
Each record is then one datagram of ``KEY=value`` lines to journald's socket (the format of
sd_journal_send): MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, CODE_*, and our own ELASTICD_LOGGER,
ELASTICD_NODE and ELASTICD_JOB (``journalctl -u elasticd ELASTICD_JOB=j-7f3a21``).  A record
that cannot be sent goes to stderr instead, so none is lost.

A record concerns a job (ELASTICD_JOB) only when the daemon says so, with
``extra=about(job_id)``: never because its text names a job, since that text may be a
caller's (a request for another user's job) or a job's own.

Every record's message is one line, escaped and capped, on stderr and in the journal alike
(``LogFormatter``): control characters, bidi controls and lone surrogates become visible
escapes as elasticctl shows them (``\\n``, ``\\x1b``, ``\\u202e``), and a message longer than
``MAX_MESSAGE`` characters is cut with a marker.  A job's text (its error message) cannot
start a line of its own, forge a field or move a terminal's cursor.  The daemon's own
tracebacks stay multi-line (escaped but for their newlines, and capped to their last
``MAX_TRACEBACK`` characters).

``ELASTICD_JOURNAL_SOCKET`` names another socket than journald's: for tests only.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import sys
from collections.abc import Mapping
from typing import TextIO

from elasticd.wire.numbers import is_whole

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SOCKET_ENV = "ELASTICD_JOURNAL_SOCKET"
IDENTIFIER = "elasticd"
STDERR_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_MESSAGE = 1000  # characters of one record's message (the marker comes on top)
MAX_TRACEBACK = 16384  # characters of a traceback: its end, where the error is
JOB_TEXT = 300  # characters of a job's own text (its error message) in one record
_SEND_BUFFER = 8 << 20  # as sd_journal_send asks; the kernel caps it at wmem_max
# What is escaped (as elasticctl's render.clean does): C0 controls, DEL, C1 controls, bidi
# controls and lone surrogates; newlines too, but in a traceback.
_UNSAFE = r"\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_IN_LINE = re.compile(f"[\n{_UNSAFE}]")
_UNSAFE_IN_TRACEBACK = re.compile(f"[{_UNSAFE}]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` as one line: escaped, and cut after ``limit`` characters with a marker that
    says how long it was."""
    line = text if text.isprintable() else _UNSAFE_IN_LINE.sub(_escape, text[:limit])
    if len(text) <= limit and len(line) <= limit:
        return line
    return f"{line[:limit]}… [cut: {len(text)} characters]"


def excerpt(text: object) -> str:
    """A job's own text (its error message, a reason it gave) for a log call: one line,
    escaped, at most JOB_TEXT characters and a marker."""
    return one_line(str(text), JOB_TEXT)


def about(job_id: str) -> dict[str, str]:
    """``extra=about(job_id)``: the record concerns this job (ELASTICD_JOB in the journal).
    Only for a job id the daemon itself holds, never one read from a request's text."""
    return {"job": job_id}


def priority(level: int) -> int:
    """The syslog priority of a logging level (journald's PRIORITY)."""
    for floor, value in (
        (logging.CRITICAL, 2),
        (logging.ERROR, 3),
        (logging.WARNING, 4),
        (logging.INFO, 6),
    ):
        if level >= floor:
            return value
    return 7


def encode_field(name: str, value: str) -> bytes:
    """One field: ``NAME=value\\n``, or for a value with a newline the binary form
    ``NAME\\n`` + its length (64-bit little-endian) + value + ``\\n``."""
    data = value.encode("utf-8", "backslashreplace")
    if b"\n" in data:
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


def encode(fields: Mapping[str, str]) -> bytes:
    return b"".join(encode_field(name, value) for name, value in fields.items())


def job_of(record: logging.LogRecord) -> str | None:
    """The job a record concerns, as the daemon said (``extra=about(job_id)``), or None."""
    job = getattr(record, "job", None)
    return str(job) if job else None


class LogFormatter(logging.Formatter):
    """The message as one line (escaped, capped: see the module's docstring), then the
    traceback, if any, with its newlines."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for more in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if more:
                text += "\n" + _traceback(more)
        return text


def _traceback(text: str) -> str:
    if len(text) > MAX_TRACEBACK:
        text = (
            f"[cut: the last {MAX_TRACEBACK} of {len(text)} characters]\n" + text[-MAX_TRACEBACK:]
        )
    return text if text.isprintable() else _UNSAFE_IN_TRACEBACK.sub(_escape, text)


def record_fields(record: logging.LogRecord, message: str, node: str) -> dict[str, str]:
    """The journal fields of one record; ``message`` is its text with any traceback."""
    fields = {
        "MESSAGE": message,
        "PRIORITY": str(priority(record.levelno)),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "ELASTICD_LOGGER": record.name,
        "ELASTICD_NODE": node,
        "CODE_FILE": record.pathname,
        "CODE_LINE": str(record.lineno),
        "CODE_FUNC": record.funcName,
    }
    job = job_of(record)
    if job:
        fields["ELASTICD_JOB"] = job
    return fields


def journal_stream(value: str) -> tuple[int, int] | None:
    """JOURNAL_STREAM's ``<dev>:<inode>``; None when it is not that."""
    dev, colon, inode = value.partition(":")
    if not (colon and is_whole(dev) and is_whole(inode)):
        return None
    return int(dev), int(inode)


def is_journal(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` (our stderr) is the journal stream systemd gave us."""
    wanted = journal_stream(environ.get("JOURNAL_STREAM", ""))
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return wanted == (info.st_dev, info.st_ino)


class JournalHandler(logging.Handler):
    """One datagram per record to journald; a record it cannot send goes to ``fallback``.
    The socket never blocks: while journald does not keep up (its queue is full) records
    are dropped and counted, and the next one that goes through is preceded by a line
    saying how many were lost, for the daemon's event loop must never wait on its log."""

    def __init__(self, node: str, fallback: logging.Handler, path: str = JOURNAL_SOCKET) -> None:
        super().__init__()
        self.node = node
        self.path = path
        self._fallback = fallback
        self._socket = socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        self.dropped = 0  # records dropped since the last one journald took
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        except OSError:
            pass
        self.setFormatter(LogFormatter("%(message)s"))  # adds the traceback, if any

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped:
                self._send(self._dropped_notice())
                self.dropped = 0
            self._send(record)
        except BlockingIOError:  # journald is behind
            self.dropped += 1
        except Exception:  # gone, refused, too large: this record goes to stderr instead
            self._fallback.handle(record)

    def _send(self, record: logging.LogRecord) -> None:
        self._socket.sendto(
            encode(record_fields(record, self.format(record), self.node)), self.path
        )

    def _dropped_notice(self) -> logging.LogRecord:
        return logging.LogRecord(
            __name__,
            logging.WARNING,
            __file__,
            0,
            "%d log records were dropped: journald did not keep up",
            (self.dropped,),
            None,
            func="emit",
        )

    def close(self) -> None:
        self._socket.close()
        super().close()


def plain_handler(stream: TextIO) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogFormatter(STDERR_FORMAT))
    return handler


def log_handler(
    node: str, environ: Mapping[str, str] | None = None, stream: TextIO | None = None
) -> logging.Handler:
    """The daemon's log handler: the journal's when ``stream`` (stderr) is the journal stream."""
    environ = os.environ if environ is None else environ
    stream = sys.stderr if stream is None else stream
    plain = plain_handler(stream)
    if not is_journal(stream, environ):
        return plain
    return JournalHandler(node, plain, environ.get(SOCKET_ENV) or JOURNAL_SOCKET)
