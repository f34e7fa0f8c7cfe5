"""Job history in sqlite under the state dir; survives daemon restarts.

One row per job: the indexed columns that queries need and the whole job document as
JSON.  The registry is the only writer.  The file is 0600: specs carry the submitter's
environment.

A history that sqlite finds corrupt (a damaged header, a bad page, a truncated file) never
keeps the node down: the file is renamed aside (``history.sqlite.corrupt-<time>``, kept for
inspection), the rows that can still be read are carried into a fresh file, and the daemon
starts.  A write that fails (a full disk) raises HistoryError and changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

from elasticd.errors import ElasticdError
from elasticd.wire import safejson

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id       TEXT PRIMARY KEY,
    seq      INTEGER NOT NULL,
    state    TEXT NOT NULL,
    created  REAL NOT NULL,
    ended    REAL,
    doc      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state);
"""
_COLUMNS = ("id", "seq", "state", "created", "ended", "doc")
MAX_ROW = 64 << 20  # bytes of one job's document (a spec comes from a request of 4 MiB at most)


class HistoryError(ElasticdError):
    """The job history cannot be written (most often: the state dir's disk is full)."""

    code = "state_dir"


FILE = "history.sqlite"  # in the state directory


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


class History:
    def __init__(self, path: str) -> None:
        self.path = path
        self.quarantined: str | None = None  # where a corrupt file was moved
        self.salvaged = 0  # rows carried over from it
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        try:
            self._db = _open(path)
            _check(self._db)
        except sqlite3.DatabaseError as exc:
            self._quarantine(str(exc))

    def _quarantine(self, problem: str) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
        rows = _salvage(self.path)
        self.quarantined = f"{self.path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.replace(self.path + suffix, self.quarantined + suffix)
        self._db = _open(self.path)
        for row in rows:
            self._db.execute(
                f"INSERT OR REPLACE INTO jobs({', '.join(_COLUMNS)}) VALUES (?,?,?,?,?,?)", row
            )
        self.salvaged = len(rows)
        log.error(
            "the job history %s is corrupt (%s): moved it to %s and started a fresh one "
            "with the %d rows that could still be read",
            self.path,
            problem,
            self.quarantined,
            len(rows),
        )

    def save(self, job: dict[str, Any]) -> None:
        try:
            self._db.execute(
                "INSERT INTO jobs(id, seq, state, created, ended, doc) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET seq=excluded.seq, state=excluded.state, "
                "ended=excluded.ended, doc=excluded.doc",
                (
                    job["id"],
                    job["seq"],
                    job["state"],
                    job["created"],
                    job.get("ended"),
                    json.dumps(job, separators=(",", ":")),
                ),
            )
        except sqlite3.Error as exc:
            raise HistoryError(f"cannot write the job history {self.path}: {exc}") from None

    def forget(self, job_id: str) -> None:
        self.forget_all([job_id])

    def forget_all(self, job_ids: list[str]) -> None:
        """Delete the rows of these jobs, all or none (one transaction)."""
        try:
            with self._db:  # commits, or rolls back on an error
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in job_ids])
        except sqlite3.Error as exc:
            raise HistoryError(f"cannot write the job history {self.path}: {exc}") from None

    def load(self) -> Iterator[tuple[str, Any]]:
        """(job id, document) of every job, oldest first; the document is None for a row
        that is not a JSON object (the caller skips and counts it)."""
        try:
            for job_id, doc in self._db.execute("SELECT id, doc FROM jobs ORDER BY created, seq"):
                yield str(job_id), _document(doc)
        except sqlite3.DatabaseError as exc:  # damage that the check at open did not see
            log.error("the job history %s could not be read to the end: %s", self.path, exc)

    def close(self) -> None:
        self._db.close()


def _open(path: str) -> sqlite3.Connection:
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
    except sqlite3.DatabaseError:
        db.close()
        raise
    return db


def _check(db: sqlite3.Connection) -> None:
    """Raise DatabaseError unless sqlite's quick integrity check passes."""
    problems = [row[0] for row in db.execute("PRAGMA quick_check")]
    if problems != ["ok"]:
        raise sqlite3.DatabaseError("; ".join(problems[:3]))


def _salvage(path: str) -> list[tuple[Any, ...]]:
    """The rows of a damaged history that can still be read: from the file as it is, else
    from a copy whose header was rebuilt (a damaged or stale header makes sqlite refuse
    every page, however many are sound)."""
    rows = _readable_rows(path)
    if rows or not os.path.exists(path):
        return rows
    repaired = f"{path}.repairing"
    try:
        _copy_with_rebuilt_header(path, repaired)
        return _readable_rows(repaired)
    except OSError:
        return []
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            if os.path.exists(repaired + suffix):
                os.unlink(repaired + suffix)


def _readable_rows(path: str) -> list[tuple[Any, ...]]:
    """A scan up to the damage, then each row id one by one (rows on sound pages past a bad
    one are still reachable)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return []
    rows: dict[int, tuple[Any, ...]] = {}
    select = f"SELECT rowid, {', '.join(_COLUMNS)} FROM jobs"
    try:
        for rowid, *row in db.execute(select):
            rows[rowid] = tuple(row)
    except sqlite3.Error:
        for rowid in range(1, _last_rowid(db) + 1):
            try:
                found = db.execute(f"{select} WHERE rowid = ?", (rowid,)).fetchone()
            except sqlite3.Error:
                continue
            if found is not None:
                rows[rowid] = tuple(found[1:])
    finally:
        db.close()
    return list(rows.values())


def _copy_with_rebuilt_header(path: str, copy: str) -> None:
    """Copy ``path`` with the fixed fields of its 100-byte sqlite header written anew (magic,
    rollback-journal format, payload fractions) and its size in pages set to the file's."""
    shutil.copyfile(path, copy)
    with open(copy, "r+b") as f:
        header = bytearray(f.read(100).ljust(100, b"\0"))
        page_size = 65536 if header[16:18] == b"\0\1" else int.from_bytes(header[16:18], "big")
        if page_size not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
            page_size = 4096  # sqlite's default, ours
        header[0:16] = b"SQLite format 3\0"
        header[16:18] = (page_size if page_size < 65536 else 1).to_bytes(2, "big")
        header[18:24] = bytes((1, 1, 0, 64, 32, 32))
        header[28:32] = (os.fstat(f.fileno()).st_size // page_size).to_bytes(4, "big")
        header[92:96] = header[24:28]  # "version valid for" = change counter: the size is valid
        f.seek(0)
        f.write(header)


def _last_rowid(db: sqlite3.Connection) -> int:
    try:
        return int(db.execute("SELECT max(rowid) FROM jobs").fetchone()[0] or 0)
    except (sqlite3.Error, TypeError, ValueError):
        return 0


def _document(raw: Any) -> Any:
    """The row's document: a JSON object within bounds, else None (a damaged row)."""
    if not isinstance(raw, (str, bytes)):
        return None
    try:
        doc = safejson.loads(raw, max_bytes=MAX_ROW)
    except safejson.Undecodable:
        return None
    return doc if isinstance(doc, dict) else None
