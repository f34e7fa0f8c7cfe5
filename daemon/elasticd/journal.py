"""The daemon's own log: journald's native protocol, with structured fields, when systemd
connected our stderr to the journal; stderr in the plain format otherwise.

systemd sets ``JOURNAL_STREAM=<dev>:<inode>`` for a service whose stderr is the journal; it
names our stderr exactly when fstat(2) of stderr gives that device and inode (systemd.exec(5)).
Each record is then one datagram of ``KEY=value`` lines to journald's socket (the format of
sd_journal_send): MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, CODE_*, and our own ELASTICD_LOGGER,
ELASTICD_NODE and ELASTICD_JOB (``journalctl -u elasticd ELASTICD_JOB=j-7f3a21``).  A record
that cannot be sent goes to stderr instead, so none is lost.

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

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SOCKET_ENV = "ELASTICD_JOURNAL_SOCKET"
IDENTIFIER = "elasticd"
STDERR_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JOB_ID = re.compile(r"\bj-[0-9a-f]{6}\b")  # what control.commands hands out
_SEND_BUFFER = 8 << 20  # as sd_journal_send asks; the kernel caps it at wmem_max


def priority(level: int) -> int:
    """The syslog priority of a logging level (journald's PRIORITY)."""
    for floor, value in ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
                         (logging.INFO, 6)):
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
    """The job a record concerns: its ``extra={"job": ...}``, else a job id its message names."""
    job = getattr(record, "job", None)
    if job:
        return str(job)
    found = _JOB_ID.search(record.getMessage())
    return found.group() if found else None


def record_fields(record: logging.LogRecord, message: str, node: str) -> dict[str, str]:
    """The journal fields of one record; ``message`` is its text with any traceback."""
    fields = {"MESSAGE": message, "PRIORITY": str(priority(record.levelno)),
              "SYSLOG_IDENTIFIER": IDENTIFIER, "ELASTICD_LOGGER": record.name,
              "ELASTICD_NODE": node, "CODE_FILE": record.pathname,
              "CODE_LINE": str(record.lineno), "CODE_FUNC": record.funcName}
    job = job_of(record)
    if job:
        fields["ELASTICD_JOB"] = job
    return fields


def journal_stream(value: str) -> tuple[int, int] | None:
    """JOURNAL_STREAM's ``<dev>:<inode>``; None when it is not that."""
    dev, colon, inode = value.partition(":")
    if not (colon and dev.isdigit() and inode.isdigit()):
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
    """One datagram per record to journald; a record it cannot send goes to ``fallback``."""

    def __init__(self, node: str, fallback: logging.Handler, path: str = JOURNAL_SOCKET) -> None:
        super().__init__()
        self.node = node
        self.path = path
        self._fallback = fallback
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        except OSError:
            pass
        self.setFormatter(logging.Formatter("%(message)s"))  # adds the traceback, if any

    def emit(self, record: logging.LogRecord) -> None:
        try:
            datagram = encode(record_fields(record, self.format(record), self.node))
            self._socket.sendto(datagram, self.path)
        except Exception:  # gone, refused, too large: this record goes to stderr instead
            self._fallback.handle(record)

    def close(self) -> None:
        self._socket.close()
        super().close()


def plain_handler(stream: TextIO) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(STDERR_FORMAT))
    return handler


def log_handler(node: str, environ: Mapping[str, str] | None = None,
                stream: TextIO | None = None) -> logging.Handler:
    """The daemon's log handler: the journal's when ``stream`` (stderr) is the journal stream."""
    environ = os.environ if environ is None else environ
    stream = sys.stderr if stream is None else stream
    plain = plain_handler(stream)
    if not is_journal(stream, environ):
        return plain
    return JournalHandler(node, plain, environ.get(SOCKET_ENV) or JOURNAL_SOCKET)
