"""Worker logs: the files under ``<state>/logs/<job>/attempt_<n>/rank_<r>.{out,err}`` and
the live bus that ``logs -f`` follows.

A follower subscribes to the bus *before* reading the files, remembers how many bytes it
read from each, and drops the part of any live chunk it already saw, so that nothing is
lost or shown twice between the two.
"""

from __future__ import annotations

import asyncio
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

_FILE = re.compile(r"^rank_(\d+)\.(out|err)$")
_ATTEMPT = re.compile(r"^attempt_(\d+)$")
MAX_PARTIAL = 64 * 1024  # a "line" longer than this is cut


@dataclass(frozen=True)
class Chunk:
    attempt: int
    rank: int
    stream: str
    offset: int
    data: bytes

    @property
    def source(self) -> tuple[int, int, str]:
        return self.attempt, self.rank, self.stream


class LogBus:
    """Live worker output, by job, for followers.  Runs on the event loop."""

    def __init__(self) -> None:
        self._followers: dict[str, set[asyncio.Queue[Chunk]]] = {}

    def publish(self, job_id: str, attempt: int, rank: int, stream: str, offset: int,
                data: bytes) -> None:
        for queue in self._followers.get(job_id, ()):
            queue.put_nowait(Chunk(attempt, rank, stream, offset, data))

    @contextmanager
    def follow(self, job_id: str) -> Iterator[asyncio.Queue[Chunk]]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._followers.setdefault(job_id, set()).add(queue)
        try:
            yield queue
        finally:
            followers = self._followers[job_id]
            followers.discard(queue)
            if not followers:
                del self._followers[job_id]


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
        self._partial: dict[tuple[int, int, str], bytes] = {}
        self.seen: dict[tuple[int, int, str], int] = {}

    def feed(self, source: tuple[int, int, str], offset: int, data: bytes) -> list[dict]:
        """Lines completed by ``data`` (which starts at ``offset`` of its file); repeats dropped."""
        seen = self.seen.get(source, 0)
        if offset + len(data) <= seen:
            return []
        data = data[max(0, seen - offset):]
        self.seen[source] = max(seen, offset) + len(data)
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

    def _line(self, source: tuple[int, int, str], raw: bytes) -> dict:
        attempt, rank, stream = source
        return {"node": self.node, "attempt": attempt, "rank": rank, "stream": stream,
                "text": raw.decode("utf-8", errors="replace").rstrip("\r")}


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""
