"""The daemon's own log goes to the journal (issue 15): a real daemon whose stderr is "the
journal stream" (JOURNAL_STREAM names its device and inode, as systemd sets it) sends its
records, with their fields, to a journal socket of the test's own (ELASTICD_JOURNAL_SOCKET);
without a usable socket they go to stderr as before."""

from __future__ import annotations

import os
import re
import uuid

from fixtures.journald import FakeJournal
from harness import Daemon, worker_args

PLAIN = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: .*$", re.M)  # stderr's format


def as_journal_stream(daemon: Daemon, socket_path: str) -> None:
    """Give the daemon the environment systemd gives a service whose stderr is the journal:
    its stderr is its log file (the harness appends to it), so that file's device and inode."""
    daemon.log_path.touch()
    info = os.stat(daemon.log_path)
    daemon.env = {**daemon.env, "JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}",
                  "ELASTICD_JOURNAL_SOCKET": socket_path}


def test_records_reach_the_journal_with_their_fields(daemon_factory, shared_tmp):
    journal = FakeJournal(shared_tmp / "journal.sock")
    try:
        daemon = daemon_factory(f"jn1-{uuid.uuid4().hex[:6]}", args=("--slots", "2"))
        as_journal_stream(daemon, journal.path)
        daemon.start()
        ready = journal.wait_for(lambda r: f"ready: node {daemon.name}" in r["MESSAGE"])
        assert ready["PRIORITY"] == "6" and ready["SYSLOG_IDENTIFIER"] == "elasticd"
        assert ready["ELASTICD_NODE"] == daemon.name and ready["ELASTICD_LOGGER"] == "elasticd"
        assert ready["CODE_FILE"].endswith("elasticd/app.py") and ready["CODE_LINE"].isdigit()
        assert ready["CODE_FUNC"] == "run" and "ELASTICD_JOB" not in ready

        job = daemon.submit_wait("--nproc-per-node", "1", *worker_args())
        assert job["state"] == "SUCCEEDED"
        record = journal.wait_for(lambda r: r.get("ELASTICD_JOB") == job["id"])
        assert record["ELASTICD_NODE"] == daemon.name and record["PRIORITY"] in {"4", "6"}
        assert job["id"] in record["MESSAGE"]
        daemon.stop()
        journal.wait_for(lambda r: r["MESSAGE"] == "elasticd stopped")
        assert not PLAIN.findall(daemon.log_text())  # none went (also) to stderr
    finally:
        journal.close()


def test_without_the_journal_socket_records_go_to_stderr(daemon_factory, shared_tmp):
    daemon = daemon_factory(f"jn2-{uuid.uuid4().hex[:6]}")
    as_journal_stream(daemon, str(shared_tmp / "no-journal.sock"))
    daemon.start()
    daemon.stop()
    lines = PLAIN.findall(daemon.log_text())
    assert "INFO elasticd: elasticd stopped" in lines[-1] and len(lines) > 2
    assert [line for line in lines if f"ready: node {daemon.name}" in line]
