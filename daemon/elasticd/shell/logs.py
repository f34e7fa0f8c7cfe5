"""Worker logs: the files under ``<state>/logs/<job>/attempt_<n>/rank_<r>.{out,err}``, their
writer and its rotation, the bus that wakes ``logs -f`` followers, the reader that turns the
files into lines, and what a follower of another node already passed on.

Followers read the files, never a copy of the output kept in memory: each remembers how far
it read every file, wakes when the job wrote something, and reads on from there at the pace
its client takes the lines.  A client that never reads holds one chunk, not the job's output.

A stream file that reaches ``OutputLimit.max_bytes`` is rotated as logrotate does it:
``rank_0.out`` becomes ``rank_0.out.1``, ``.1`` becomes ``.2`` ... and the file past
``backups`` is deleted.  ``rank_0.out.rotated`` counts the rotations and the bytes deleted:
the file ``.k`` holds the stream's generation ``count - k`` (the live file ``count``), so a
reader that knows which generation it was in finds that file again wherever it moved, and
knows when it was deleted before it was read.  Writer and readers run on the event loop, so
a reader never sees a rotation half done.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_FILE = re.compile(r"^rank_(\d+)\.(out|err)(?:\.\d+)?$")  # a stream file, live or rotated
_ATTEMPT = re.compile(r"^attempt_(\d+)$")
MAX_PARTIAL = 64 * 1024  # a "line" longer than this is cut
READ_CHUNK = 64 * 1024  # bytes a follower reads from one file at a time
MIN_MAX_BYTES = 64 * 1024  # a smaller limit would rotate at every chunk a worker writes
MAX_BACKUPS = 100  # each rotation renames every kept file (on the event loop)
ROTATED = ".rotated"  # beside a stream file: its Rotations
_RECORD = 64  # bytes of a Rotations file, rewritten in place (no new block needed)

TAIL_BYTES = 8 * 1024  # what a stream file's writer keeps of its last output
Source = tuple[int, int, str]  # (attempt, rank, stream)
DropSink = Callable[[int, str], None]  # (bytes dropped, why): output that could not be written


@dataclass(frozen=True)
class OutputLimit:
    """How large one worker stream's file grows before it is rotated, and how many rotated
    files are kept (supervisord's ``stdout_logfile_maxbytes`` and ``_backups``).  A stream
    then holds at most ``(backups + 1) * max_bytes`` on disk.  ``max_bytes`` 0: no limit."""

    max_bytes: int = 0
    backups: int = 0

    def cut(self, size: int, data: bytes) -> int:
        """How many bytes of ``data`` still go into a file of ``size`` bytes before it is
        rotated: all that fit, up to the last newline that fits, so that lines stay whole in
        one file; a line longer than a whole file is cut where the file is full."""
        if not self.max_bytes or size + len(data) <= self.max_bytes:
            return len(data)
        room = max(0, self.max_bytes - size)
        newline = data.rfind(b"\n", 0, room)
        if newline >= 0:
            return newline + 1
        return room if size == 0 else 0


@dataclass(frozen=True)
class Rotations:
    """What happened to a stream file so far: ``count`` rotations, ``dropped`` bytes of
    rotated files deleted."""

    count: int = 0
    dropped: int = 0


def read_rotations(path: str) -> Rotations:
    try:
        with open(path + ROTATED, "rb") as f:
            count, dropped = (int(word) for word in f.read(_RECORD).split())
    except (OSError, ValueError):
        return Rotations()
    return Rotations(count, dropped)


def _save_rotations(path: str, rotations: Rotations) -> None:
    record = f"{rotations.count} {rotations.dropped}".ljust(_RECORD - 1).encode() + b"\n"
    fd = os.open(path + ROTATED, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, record, 0)
    finally:
        os.close(fd)


def rotate(path: str, backups: int, done: Rotations) -> Rotations:
    """Move ``path`` to ``path.1`` (``.1`` to ``.2`` ...), delete what falls past
    ``backups``; the caller then makes a new ``path``.  Returns the new Rotations.

    The Rotations file is written before anything moves (so that on a full disk the
    rotation fails whole, raising OSError) and rewritten in place after.  A ``path`` that is
    missing (the new file of the last rotation could not be made) needs no rotation."""
    _save_rotations(path, done)
    if not os.path.lexists(path):
        return done
    last = f"{path}.{backups}" if backups else path
    dropped = _size(last) if os.path.lexists(last) else 0
    for k in range(backups - 1, 0, -1):
        if os.path.lexists(f"{path}.{k}"):
            os.replace(f"{path}.{k}", f"{path}.{k + 1}")
    if backups:
        os.replace(path, f"{path}.1")
    else:
        os.unlink(path)
    after = Rotations(done.count + 1, done.dropped + dropped)
    _save_rotations(path, after)
    return after


def move_stream(source: str, target: str) -> None:
    """Rename a stream file with its rotated files and Rotations (an in-place worker's output
    moving to its rank's name)."""
    os.rename(source, target)
    k = 1
    while os.path.lexists(f"{source}.{k}"):
        os.rename(f"{source}.{k}", f"{target}.{k}")
        k += 1
    if os.path.lexists(source + ROTATED):
        os.rename(source + ROTATED, target + ROTATED)


def oldest_kept(path: str, count: int) -> int:
    """The suffix of the oldest rotated file still there (0: none, only the live file)."""
    k = 0
    while k < count and os.path.lexists(f"{path}.{k + 1}"):
        k += 1
    return k


CAPTURE_BYTES = 256 * 1024  # of a stream kept while a stack dump is read back


class OutputFile:
    """One worker stream's log file, rotated where ``limit`` says (the new file is made by
    ``create``).  A write that fails (a full disk, a quota, a rotation that cannot be done)
    drops the data and counts it; once writes succeed again a line in the file says what was
    lost."""

    def __init__(
        self,
        path: str,
        create: Callable[[str], int],
        on_dropped: DropSink,
        limit: OutputLimit = OutputLimit(),
    ) -> None:
        self.path = path  # the live file's name (an in-place worker's moves once)
        self.fd = create(path)
        self._create = create
        self._limit = limit
        self._size = 0
        self._rotations = Rotations()
        self._on_dropped = on_dropped
        self._dropped = 0
        self._why = ""
        self.tail = b""  # the last TAIL_BYTES written: a failed worker's root cause may be there
        self.capture: bytearray | None = None  # set: what is written is also kept here (stacks)

    def write(self, data: bytes) -> None:
        self.tail = (self.tail + data[-TAIL_BYTES:])[-TAIL_BYTES:]
        if self.capture is not None and len(self.capture) < CAPTURE_BYTES:
            self.capture += data[: CAPTURE_BYTES - len(self.capture)]
        if self._dropped and self._write(self._gap_notice()):
            self._dropped = 0
        if self._dropped or not self._write(data):
            self._dropped += len(data)
            self._on_dropped(len(data), self._why)

    def _write(self, data: bytes) -> bool:
        """Write all of ``data``, rotating the file where the limit cuts it."""
        while data:
            cut = self._limit.cut(self._size, data)
            if cut and not self._write_all(data[:cut]):
                return False
            data = data[cut:]
            if data and not self._rotate():
                return False
        return True

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.fd, view)
            except OSError as exc:
                self._why = exc.strerror or str(exc)
                return False
            self._size += written
            view = view[written:]
        return True

    def _rotate(self) -> bool:
        try:
            self._rotations = rotate(self.path, self._limit.backups, self._rotations)
            fd = self._create(self.path)
        except OSError as exc:
            self._why = f"cannot rotate: {exc.strerror or exc}"
            return False
        os.close(self.fd)
        self.fd, self._size = fd, 0
        return True

    def _gap_notice(self) -> bytes:
        return f"\n[elasticd: {self._dropped} bytes of output dropped here: {self._why}]\n".encode()

    def close(self) -> None:
        os.close(self.fd)


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
    """Reads a job's log files from where it left off, as lines of the wanted sources.

    Each source is read from its oldest kept file on; where it was in a file is kept as
    (generation, offset), so a rotation does not lose its place.  Output deleted by rotation
    is named by a line of its own: before the oldest kept file, and where a reader fell so
    far behind that the file it was in went before it was read."""

    def __init__(
        self,
        root: str,
        job_id: str,
        node: str,
        wanted: Callable[[int, int], bool] = lambda attempt, rank: True,
    ) -> None:
        self._root = root
        self._job_id = job_id
        self._wanted = wanted
        self._splitter = LineSplitter(node)
        self._cursors: dict[Source, list[int]] = {}  # source -> [generation, offset]

    def new_lines(self, snapshot: bool = False) -> Iterator[list[dict]]:
        """Batches of the lines written since the last call: a chunk of each file in turn
        until none has more.  With ``snapshot``, only what the files held at the start."""
        files = [
            (path, (attempt, rank, stream))
            for attempt, rank, stream, path in log_files(self._root, self._job_id)
            if self._wanted(attempt, rank)
        ]
        ends = (
            {source: (read_rotations(path).count, _size(path)) for path, source in files}
            if snapshot
            else {}
        )
        progressed = True
        while progressed:
            progressed = False
            for path, source in files:
                lines = self._next_chunk(path, source, ends.get(source))
                if lines is not None:
                    progressed = True
                    if lines:
                        yield lines

    def _next_chunk(
        self, path: str, source: Source, end: tuple[int, int] | None
    ) -> list[dict] | None:
        """The lines of the next chunk of one source (a rotated file read to its end moves
        on to the next one); None when it has nothing more now, or before ``end``."""
        rotations = read_rotations(path)
        lines: list[dict] = []
        cursor = self._cursors.get(source)
        if cursor is None:
            cursor = self._cursors[source] = [
                rotations.count - oldest_kept(path, rotations.count),
                0,
            ]
            if rotations.dropped:
                lines.append(
                    self._splitter.notice(
                        source,
                        f"{rotations.dropped} bytes of earlier output "
                        f"were rotated away (output.max_bytes, output.backups)",
                    )
                )
        while end is None or (cursor[0], cursor[1]) < end:
            k = rotations.count - cursor[0]
            size = (
                READ_CHUNK
                if end is None or cursor[0] < end[0]
                else min(READ_CHUNK, end[1] - cursor[1])
            )
            chunk = _read_at(path if k <= 0 else f"{path}.{k}", cursor[1], size)
            if chunk:
                cursor[1] += len(chunk)
                return lines + self._splitter.feed(source, chunk)
            if k <= 0:
                break  # the live file has nothing more yet
            if chunk is None:  # rotated away before it was read to its end
                lines += self._splitter.flush(source)
                lines.append(
                    self._splitter.notice(
                        source,
                        "output was rotated away here before it "
                        "could be read (it came faster than it was read)",
                    )
                )
                cursor[:] = [
                    max(cursor[0] + 1, rotations.count - oldest_kept(path, rotations.count)),
                    0,
                ]
            else:
                cursor[:] = [cursor[0] + 1, 0]  # on to the next file
        return lines or None

    def flush(self) -> list[dict]:
        """The partial last lines (at the end of a stream)."""
        return self._splitter.flush()


def _read_at(path: str, offset: int, size: int) -> bytes | None:
    """Up to ``size`` bytes of ``path`` from ``offset``; None if it cannot be opened."""
    try:
        with open(path, "rb") as f:
            if size <= 0:
                return b""
            f.seek(offset)
            return f.read(size)
    except OSError:
        return None


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def log_files(root: str, job_id: str) -> list[tuple[int, int, str, str]]:
    """(attempt, rank, stream, path of its live file) of a job's log streams, in order; a
    stream is there when its live file or a rotated one is."""
    job_dir = os.path.join(root, job_id)
    found = set()
    for attempt_name in _listdir(job_dir):
        attempt = _ATTEMPT.match(attempt_name)
        if not attempt:
            continue
        for name in _listdir(os.path.join(job_dir, attempt_name)):
            match = _FILE.match(name)
            if match:
                found.add(
                    (
                        int(attempt.group(1)),
                        int(match.group(1)),
                        match.group(2),
                        os.path.join(job_dir, attempt_name, name[: match.end(2)]),
                    )
                )
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

    def flush(self, source: Source | None = None) -> list[dict]:
        """The partial lines kept (of ``source`` only, if given), as lines."""
        sources = (
            sorted(self._partial) if source is None else [source] if source in self._partial else []
        )
        return [self._line(s, self._partial.pop(s)) for s in sources]

    def notice(self, source: Source, text: str) -> dict:
        """A line of the daemon's own in ``source``'s place."""
        return self._line(source, f"[elasticd: {text}]".encode())

    def _line(self, source: Source, raw: bytes) -> dict:
        attempt, rank, stream = source
        return {
            "node": self.node,
            "attempt": attempt,
            "rank": rank,
            "stream": stream,
            "text": raw.decode("utf-8", errors="replace").rstrip("\r"),
        }


class SeenLines:
    """How many lines of each source a follower already passed on, so that a stream asked
    for again (a peer that did not answer, or went quiet) resumes where the last one
    stopped: a new stream reads every file from its start, and the lines already shown are
    dropped.  Lines are counted, not bytes: the peer's reader splits the same files into the
    same lines (a rotation between the two streams can shift them by its notice)."""

    def __init__(self) -> None:
        self._passed: dict[tuple, int] = {}

    def fresh(self, stream_seen: dict[tuple, int], lines: list[dict]) -> list[dict]:
        """The lines of one batch not passed on yet; ``stream_seen`` counts the lines of
        each source that this stream (one request) delivered so far."""
        new = []
        for line in lines:
            source = (line.get("attempt"), line.get("rank"), line.get("stream"))
            stream_seen[source] = stream_seen.get(source, 0) + 1
            if stream_seen[source] > self._passed.get(source, 0):
                self._passed[source] = stream_seen[source]
                new.append(line)
        return new
