"""torch's error file (``TORCHELASTIC_ERROR_FILE``): what a worker's ``@record`` wrote, and the
daemon's own copy of it.

While the worker runs the file is the user's: torch writes it as the user.  At the worker's
exit the daemon reads at most ``MAX_BYTES`` of it (no link followed, a regular file only,
whatever its mode or owner) and puts a file of its own in its place holding what it read,
made as the job's output files are (root's, readable by the job's user and the admin group).
What the worker wrote is decided then: nothing written into the user's file afterwards (by
a process that still holds it, or anyone the job let write it) changes the root cause.

The text is the job's, so every decode is bounded (``safejson``), every field's type is
checked, and message and traceback are capped; a file that cannot be read as torch's says
so in the root cause and never changes the outcome, which the exit status decides.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elasticd.wire import safejson
from elasticd.wire.numbers import decimal

log = logging.getLogger(__name__)

MAX_BYTES = 1024 * 1024  # what the daemon reads of an error file, and keeps
MAX_MESSAGE = 16 * 1024  # characters of a root cause's message
MAX_TRACEBACK = 64 * 1024  # characters of its traceback (the end is kept: the raise is there)
_CHUNK = 64 * 1024
_HEAD = re.compile(rb'\s*\{\s*"message"\s*:\s*(?:\{\s*"message"\s*:\s*)?"')  # torch's, to the text


@dataclass(frozen=True)
class Recorded:
    """What an error file said: the message, traceback and time torch wrote, or why it
    could not be read (``unreadable``)."""

    message: str = ""
    traceback: str = ""
    timestamp: float = 0.0
    unreadable: str = ""


def parse(raw: bytes, size: int) -> Recorded | None:
    """What the first bytes ``raw`` of an error file of ``size`` bytes say; None when the
    worker wrote nothing.  Never raises."""
    if not raw.strip() and size <= len(raw):
        return None
    if size > len(raw):
        return _cut(raw, size)
    try:
        doc = safejson.loads(raw, max_bytes=MAX_BYTES)
    except safejson.Undecodable as exc:
        return Recorded(unreadable=str(exc))
    return _from_doc(doc)


def _from_doc(doc: Any) -> Recorded:
    """torch's ``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp":
    ...}}}``, or the newer ``{"message": "...", "timestamp": ...}``."""
    if not isinstance(doc, dict) or "message" not in doc:
        return Recorded(unreadable="not torch's error file (no message)")
    message = doc["message"]
    if isinstance(message, str):
        return Recorded(_capped(message), "", _time(doc.get("timestamp")))
    if not isinstance(message, dict):
        return Recorded(
            unreadable="not torch's error file (its message is neither text nor an object)"
        )
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    text, trace = message.get("message", ""), extra.get("py_callstack", "")
    if not isinstance(text, str) or not isinstance(trace, str):
        return Recorded(unreadable="not torch's error file (its message or traceback is not text)")
    return Recorded(_capped(text), _tail(trace), _time(extra.get("timestamp")))


def _cut(raw: bytes, size: int) -> Recorded:
    """A file larger than what is read: the start of torch's message, where it has one."""
    why = f"the error file holds {size} bytes; elasticd reads {len(raw)}"
    head = _HEAD.match(raw)
    text, whole = (
        _string_start(raw[head.end() : head.end() + 4 * MAX_MESSAGE]) if head else ("", False)
    )
    if whole:
        return Recorded(_capped(text), f"[elasticd: not read: {why}]")
    if not text:
        return Recorded(unreadable=why)
    return Recorded(f"{_valid(text[:MAX_MESSAGE])} [elasticd: cut here: {why}]")


def _string_start(body: bytes) -> tuple[str, bool]:
    """The JSON string that ``body`` starts (after its opening quote), to its closing quote
    (then ``True``: it is whole) or as far as ``body`` goes (a cut escape at its end dropped)."""
    text = body.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    for drop in range(min(6, len(text)) + 1):  # "\\uXXXX" is the longest escape
        quoted = '"' + text[: len(text) - drop] + '"'
        try:
            value, end = decoder.raw_decode(quoted)
        except ValueError:
            continue
        return value, end < len(quoted)
    return "", False


def _capped(text: str) -> str:
    text = _valid(text)
    if len(text) <= MAX_MESSAGE:
        return text
    return text[:MAX_MESSAGE] + f" [elasticd: {len(text) - MAX_MESSAGE} more characters cut]"


def _tail(text: str) -> str:
    text = _valid(text)
    if len(text) <= MAX_TRACEBACK:
        return text
    return (
        f"[elasticd: {len(text) - MAX_TRACEBACK} earlier characters cut]\n" + text[-MAX_TRACEBACK:]
    )


def _valid(text: str) -> str:
    """Without lone surrogates (a cut ``\\ud83d`` escape), so that it encodes anywhere."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _time(value: Any) -> float:
    """torch writes ``str(int(time.time()))``; anything that is not a time is 0 (unknown)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return 0.0
    try:
        seconds = decimal(value) if isinstance(value, str) else float(value)
    except ValueError:
        return 0.0
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0


def read_capped(path: str, limit: int = MAX_BYTES) -> tuple[bytes, int]:
    """At most ``limit`` bytes of the regular file ``path`` and its size (OSError: it cannot
    be opened, or is not a regular file).  Neither a link nor the file's mode or owner is
    trusted: it may be the job's, changed since it was made."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
        return raw, max(info.st_size, len(raw))
    finally:
        os.close(fd)


def keep(path: str, create: Callable[[str], int]) -> Recorded | None:
    """Read the worker's error file ``path`` and put the daemon's copy in its place (made by
    ``create``, which returns a new file's fd); what the file said (None: nothing).  A copy
    that cannot be written (a full disk) loses nothing of what was read."""
    try:
        raw, size = read_capped(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Recorded(unreadable=exc.strerror or str(exc))
    recorded = parse(raw, size)
    try:
        _replace(path, raw, create)
    except OSError as exc:
        log.warning("cannot keep a copy of the error file %s: %s", path, exc.strerror or exc)
    return recorded


def _replace(path: str, raw: bytes, create: Callable[[str], int]) -> None:
    """The worker's file unlinked (a process holding it writes into nothing that is read),
    then the daemon's own under its name."""
    os.unlink(path)
    fd = create(path)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


MAX_STDERR_CAUSE = 1024  # characters of a root cause read from stderr
_TRACEBACK = "Traceback (most recent call last):"


def from_stderr(tail: bytes, whole: bool = True) -> str:
    """A root cause from the end of a worker's stderr, for a worker that left no error
    file: the exception line of its last traceback where the end holds one (``RuntimeError:
    boom``), else its last line that is not blank; "" when it wrote nothing.  A ``tail``
    that is not the ``whole`` stream starts with a line that may be cut: it is not used.
    The answer is capped."""
    text = _valid(tail.decode("utf-8", errors="replace"))
    lines = [line.rstrip("\r") for line in text.split("\n")]
    lines = lines if whole else lines[1:]
    cause = _exception_line(lines) or next((ln for ln in reversed(lines) if ln.strip()), "")
    cause = cause.strip()
    if len(cause) <= MAX_STDERR_CAUSE:
        return cause
    return (
        cause[:MAX_STDERR_CAUSE]
        + f" [elasticd: {len(cause) - MAX_STDERR_CAUSE} more characters cut]"
    )


def _exception_line(lines: list[str]) -> str:
    """The first line after the last traceback's header that is not one of its frames."""
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if not starts:
        return ""
    return next(
        (line for line in lines[starts[-1] + 1 :] if line.strip() and not line[:1].isspace()), ""
    )
