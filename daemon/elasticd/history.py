"""Job history in sqlite under the state dir; survives daemon restarts.

One row per job: the indexed columns that queries need and the whole job document as
JSON.  The registry is the only writer.  The file is 0600: specs carry the submitter's
environment.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any, Iterator

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


class History:
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def save(self, job: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO jobs(id, seq, state, created, ended, doc) VALUES (?,?,?,?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET seq=excluded.seq, state=excluded.state, "
            "ended=excluded.ended, doc=excluded.doc",
            (job["id"], job["seq"], job["state"], job["created"], job.get("ended"),
             json.dumps(job, separators=(",", ":"))))

    def load(self) -> Iterator[dict[str, Any]]:
        """Every job, oldest first.  A row that does not parse is skipped, not fatal."""
        for (doc,) in self._db.execute("SELECT doc FROM jobs ORDER BY created, seq"):
            try:
                yield json.loads(doc)
            except ValueError:
                continue

    def close(self) -> None:
        self._db.close()
