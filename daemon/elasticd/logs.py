"""Worker logs: the files under ``<state>/logs/<job>/attempt_<n>/rank_<r>.{out,err}``, the
bus that wakes ``logs -f`` followers, and the reader that turns the files into lines.

Followers read the files, never a copy of the output kept in memory: each remembers how far
it read every file, wakes when the job wrote something, and reads on from there at the pace
its client takes the lines.  A client that never reads holds one chunk, not the job's output.
"""

from __future__ import annotations

import asyncio
import os
import re
from contextlib import contextmanager
from typing import Callable, Iterator

_FILE = re.compile(r"^rank_(\d+)\.(out|err)$")
_ATTEMPT = re.compile(r"^attempt_(\d+)$")
MAX_PARTIAL = 64 * 1024  # a "line" longer than this is cut
READ_CHUNK = 64 * 1024   # bytes a follower reads from one file at a time

Source = tuple[int, int, str]  # (attempt, rank, stream)


class LogBus:
    """Wakes the followers of a job when it wrote output.  Runs on the event loop."""

    def __init__(self) -> None:
        self._followers: dict[str, set[asyncio.Event]] = {}

    def publish(self, job_id: str) -> None:
        for wake in self._followers.get(job_id, ()):
            wake.set()

    @contextmanager
    def follow(self, job_id: str) -> Iterator[asyncio.Event]:
        wake = asyncio.Event()
        self._followers.setdefault(job_id, set()).add(wake)
        try:
            yield wake
        finally:
            followers = self._followers[job_id]
            followers.discard(wake)
            if not followers:
                del self._followers[job_id]


class LogReader:
    """Reads a job's log files from where it left off, as lines of the wanted sources."""

    def __init__(self, root: str, job_id: str, node: str,
                 wanted: Callable[[int, int], bool] = lambda attempt, rank: True) -> None:
        self._root = root
        self._job_id = job_id
        self._wanted = wanted
        self._splitter = LineSplitter(node)

    def new_lines(self, snapshot: bool = False) -> Iterator[list[dict]]:
        """Batches of the lines written since the last call: a chunk of each file in turn
        until none has more.  With ``snapshot``, only what the files held at the start."""
        files = [(path, (attempt, rank, stream))
                 for attempt, rank, stream, path in log_files(self._root, self._job_id)
                 if self._wanted(attempt, rank)]
        ends = {path: _size(path) for path, _ in files} if snapshot else {}
        progressed = True
        while progressed:
            progressed = False
            for path, source in files:
                offset = self._splitter.seen.get(source, 0)
                chunk = _read_at(path, offset, min(READ_CHUNK, ends.get(path, offset + READ_CHUNK) - offset))
                if chunk:
                    progressed = True
                    lines = self._splitter.feed(source, chunk)
                    if lines:
                        yield lines

    def flush(self) -> list[dict]:
        """The partial last lines (at the end of a stream)."""
        return self._splitter.flush()


def _read_at(path: str, offset: int, size: int) -> bytes:
    if size <= 0:
        return b""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except OSError:
        return b""


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def log_files(root: str, job_id: str) -> list[tuple[int, int, str, str]]:
    """(attempt, rank, stream, path) of a job's log files, in order."""
    job_dir = os.path.join(root, job_id)
    found = []
    for attempt_name in _listdir(job_dir):
        attempt = _ATTEMPT.match(attempt_name)
        if not attempt:
            continue
        for name in _listdir(os.path.join(job_dir, attempt_name)):
            match = _FILE.match(name)
            if match:
                found.append((int(attempt.group(1)), int(match.group(1)), match.group(2),
                              os.path.join(job_dir, attempt_name, name)))
    return sorted(found)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


class LineSplitter:
    """Turns chunks of several sources into whole lines, keeping each source's partial line."""

    def __init__(self, node: str = "") -> None:
        self.node = node
        self._partial: dict[Source, bytes] = {}
        self.seen: dict[Source, int] = {}  # bytes of each source fed so far

    def feed(self, source: Source, data: bytes) -> list[dict]:
        """The lines that ``data``, the next bytes of ``source``, completes."""
        self.seen[source] = self.seen.get(source, 0) + len(data)
        text = self._partial.pop(source, b"") + data
        *lines, rest = text.split(b"\n")
        if len(rest) > MAX_PARTIAL:
            lines.append(rest)
            rest = b""
        if rest:
            self._partial[source] = rest
        return [self._line(source, line) for line in lines]

    def flush(self) -> list[dict]:
        lines = [self._line(source, rest) for source, rest in sorted(self._partial.items())]
        self._partial.clear()
        return lines

    def _line(self, source: Source, raw: bytes) -> dict:
        attempt, rank, stream = source
        return {"node": self.node, "attempt": attempt, "rank": rank, "stream": stream,
                "text": raw.decode("utf-8", errors="replace").rstrip("\r")}
