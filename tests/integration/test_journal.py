"""The daemon's own log goes to the journal (docs/operations.md, "The daemon's log"): a real daemon whose stderr is "the
journal stream" (JOURNAL_STREAM names its device and inode, as systemd sets it) sends its
records, with their fields, to a journal socket of the test's own (ELASTICD_JOURNAL_SOCKET);
without a usable socket they go to stderr as before."""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from fixtures.journald import FakeJournal
from harness import ROOT, Daemon, worker_args

PLAIN = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: .*$", re.M
)  # stderr's format


def as_journal_stream(daemon: Daemon, socket_path: str) -> None:
    """Give the daemon the environment systemd gives a service whose stderr is the journal:
    its stderr is its log file (the harness appends to it), so that file's device and inode."""
    daemon.log_path.touch()
    info = os.stat(daemon.log_path)
    daemon.env = {
        **daemon.env,
        "JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}",
        "ELASTICD_JOURNAL_SOCKET": socket_path,
    }


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


# -- what a job's text and a caller's text may do to the daemon's log (docs/operations.md) --

# The message of a worker that fails: 20 kB with newlines, terminal escapes and text that looks
# like journal fields and like lines of the daemon's own log.  It writes it to the error file
# that torchrun's contract gives it (as torch's @record does), then exits 1.
EVIL = (
    "boom\nPRIORITY=0\nELASTICD_JOB=j-000000\n"
    "2026-01-01 00:00:00,000 ERROR elasticd: forged line\n"
    "\x1b[2J\x1b]0;owned\x07\u202egnp.exe\n" + "A" * 20000
)
FAILING = f"""\
import json, os, sys, time
message = {EVIL!r}
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump({{"message": {{"message": message, "extraInfo": {{"py_callstack": "Traceback: " + message,
                                                             "timestamp": str(int(time.time()))}}}}}}, f)
sys.exit(1)
"""
CAP = 1100  # a record's message: journal.MAX_MESSAGE and its marker


def failing_job(daemon: Daemon, directory: Path) -> dict:
    script = directory / "evil_worker.py"
    script.write_text(FAILING)
    job = daemon.submit_wait("--max-restarts", "2", str(script), expect=1)
    assert job["state"] == "FAILED" and job["restarts"] == 2, job
    return job


def test_a_jobs_error_text_is_one_escaped_capped_line_on_stderr(daemon_factory, shared_tmp):
    """Row 4 (stderr): 3 failures of a 1 MiB message grew the log by 3 MB, with forged lines
    and escapes in it (here 20 kB: each failure was a 20 kB record)."""
    daemon = daemon_factory(f"jn3-{uuid.uuid4().hex[:6]}").start()
    before = len(daemon.log_text())
    job = failing_job(daemon, shared_tmp)
    daemon.stop()
    grown = daemon.log_text()[before:]
    assert len(grown) < 8 * 1024, f"the log grew by {len(grown)} characters"
    assert "\x1b" not in grown and "\u202e" not in grown and "A" * 1000 not in grown
    lines = grown.splitlines()
    assert all(PLAIN.fullmatch(line) for line in lines), [
        line for line in lines if not PLAIN.fullmatch(line)
    ]
    assert not [
        line for line in lines if "forged line" in line and " ERROR elasticd: forged" in line[:60]
    ]
    failures = [line for line in lines if f"job {job['id']} round" in line and "failed" in line]
    assert len(failures) == 3 and all(len(line) < CAP + 80 for line in failures)
    assert (
        "rank 0 failed: boom\\nPRIORITY=0\\nELASTICD_JOB=j-000000\\n2026-01-01 00:00:00,000 "
        "ERROR elasticd: forged line\\n\\x1b[2J\\x1b]0;owned\\x07\\u202egnp.exe\\nAAA"
    ) in failures[0]
    assert re.search(r"A… \[cut: \d{5} characters\] -> restart$", failures[0])  # (the error
    # file's own cap may have cut it first)


def test_a_jobs_error_text_is_one_escaped_capped_line_in_the_journal(daemon_factory, shared_tmp):
    """Row 4 (journal): the same, through journald's native protocol: no forged field, no
    second line, and the records of the job's story are its own."""
    journal = FakeJournal(shared_tmp / "journal.sock")
    try:
        daemon = daemon_factory(f"jn4-{uuid.uuid4().hex[:6]}")
        as_journal_stream(daemon, journal.path)
        daemon.start()
        job = failing_job(daemon, shared_tmp)
        daemon.stop()
        journal.wait_for(lambda r: r["MESSAGE"] == "elasticd stopped")
        story = [r for r in journal.records if job["id"] in r["MESSAGE"] or "boom" in r["MESSAGE"]]
        failures = [r for r in story if "rank 0 failed: boom" in r["MESSAGE"]]
        assert len(failures) == 3
        for record in story:
            assert record.get("ELASTICD_JOB") == job["id"] and record["PRIORITY"] in {"4", "6"}
            assert "\n" not in record["MESSAGE"] and "\x1b" not in record["MESSAGE"]
            assert len(record["MESSAGE"]) < CAP + 80
        assert "\\nPRIORITY=0\\nELASTICD_JOB=j-000000\\n" in failures[0]["MESSAGE"]
        assert not [
            r
            for r in journal.records
            if r.get("ELASTICD_JOB") == "j-000000" or r.get("PRIORITY") == "0"
        ]
        assert sum(len(r["MESSAGE"]) for r in story) < 8 * 1024
        assert not PLAIN.findall(daemon.log_text())  # none went (also) to stderr
    finally:
        journal.close()


# A client of the control socket, run as another user: one request whose op is a job id.
CLIENT = """\
import socket, sys, uuid
from elasticd.wire import protocol
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(protocol.framed(protocol.encode_request(protocol.Request(uuid.uuid4().hex, sys.argv[2], {}))))
reader, frames = protocol.FrameReader(), []
while not frames:
    frames = list(reader.feed(s.recv(65536)))
print(protocol.decode_reply(frames[0]).code)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="runs a client as nobody")
def test_a_request_naming_another_users_job_is_not_that_jobs_story(daemon_factory, shared_tmp):
    """Row 0h: nobody's request whose op is root's job id was logged with ELASTICD_JOB=<it>,
    and so was nobody's refused cancel of it."""
    journal = FakeJournal(shared_tmp / "journal.sock")
    try:
        daemon = daemon_factory(f"jn5-{uuid.uuid4().hex[:6]}", args=("--slots", "2"))
        as_journal_stream(daemon, journal.path)
        daemon.start()
        job = daemon.submit("--nproc-per-node", "1", *worker_args("--sleep", "0"))
        journal.wait_for(lambda r: r.get("ELASTICD_JOB") == job["id"])  # its own story
        asked = subprocess.run(
            ["/usr/bin/python3", "-c", CLIENT, daemon.socket, job["id"]],
            capture_output=True,
            text=True,
            timeout=60,
            user="nobody",
            env={"PYTHONPATH": str(ROOT / "daemon")},
        )
        assert asked.stdout.strip() == "unknown_op", asked
        cancel = daemon.ctl_run("cancel", job["id"], user="nobody")
        assert cancel.returncode != 0 and "you may not cancel it" in cancel.stderr, cancel
        refusals = [
            journal.wait_for(lambda r: r["MESSAGE"].startswith(start))
            for start in (
                f"control: invalid refused: unknown_op: unknown op '{job['id']}'",
                f"control: cancel refused: permission_denied: job {job['id']}",
            )
        ]
        assert [r.get("ELASTICD_JOB") for r in refusals] == [None, None], refusals
        story = [r for r in journal.records if r.get("ELASTICD_JOB") == job["id"]]
        assert story and not [
            r for r in story if r["ELASTICD_LOGGER"].startswith("elasticd.control")
        ]
        daemon.ctl("cancel", job["id"])
    finally:
        journal.close()
