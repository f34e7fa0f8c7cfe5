"""A full disk and a corrupt history database (docs/concepts.md, "A full disk or a damaged
history hides nothing").

A full state dir must not hang or hide anything: a worker never blocks on its output (what
cannot be written is dropped and counted), every control operation happens wholly or not at
all with a clear error, cancel and SIGTERM always work, and what could not be recorded is
recorded once there is room.  A corrupt history never keeps the node down: the file is
renamed aside, the readable rows are carried over, bad rows are skipped, `list` works."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import urllib.request
from pathlib import Path

import pytest
from harness import free_port, needs_root, sleeping_job, wait_gone, worker_args


def metric(daemon, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def history_rows(state_dir: Path) -> dict[str, str]:
    """job id -> state, as the history file on disk says."""
    db = sqlite3.connect(f"file:{state_dir / 'history.sqlite'}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT id, state FROM jobs"))
    finally:
        db.close()


@pytest.fixture
def small_disk(shared_tmp):
    """A 2 MiB filesystem for the state dir."""
    mount = shared_tmp / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path) -> None:
    """Take every byte left on the filesystem of ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@needs_root
def test_a_full_disk_drops_output_and_loses_no_record(
    daemon_factory, small_disk, shared_tmp, figures
):
    daemon = daemon_factory(args=("--slots", "4"), metrics_port=free_port())
    daemon.state_dir = small_disk / "state"
    daemon.start()
    running, pids = sleeping_job(daemon, shared_tmp, 1)
    spewed = daemon.submit_wait(*worker_args("--spew", "10"))  # 10 MiB into 2 MiB
    assert spewed["state"] == "SUCCEEDED"  # the worker never blocked on its pipe
    dropped = metric(daemon, "elasticd_log_dropped_bytes_total")
    assert dropped > 7 * (1 << 20) and metric(daemon, "elasticd_disk_full") == 1
    figures.add(
        "item 6: output dropped on a 2 MiB state dir (10 MiB written)",
        f"{dropped / (1 << 20):.1f} MiB",
    )
    fill(small_disk / "filler")

    refused = daemon.ctl_run("submit", *worker_args())
    assert refused.returncode == 1 and "disk" in refused.stderr.lower(), refused.stderr
    assert [j["id"] for j in daemon.ctl("list")] == [running, spewed["id"]]  # no phantom job

    assert daemon.ctl("cancel", running)["state"] == "CANCELLED"
    assert wait_gone(pids, timeout=15) == []
    assert daemon.ctl("status", running)["state"] == "CANCELLED"

    os.unlink(small_disk / "filler")  # the operator makes room: what waited is written
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    assert daemon.stop() == 0
    rows = history_rows(small_disk / "state")
    lost = {running: "CANCELLED", spewed["id"]: "SUCCEEDED"}.items() - rows.items()
    figures.add("item 6: history records lost after the disk was full", str(len(lost)))
    assert not lost and len(rows) == 2


@needs_root
def test_sigterm_stops_a_daemon_whose_disk_is_full(daemon_factory, small_disk, shared_tmp, figures):
    daemon = daemon_factory(args=("--slots", "4"))
    daemon.state_dir = small_disk / "state"
    daemon.start()
    _, pids = sleeping_job(daemon, shared_tmp, 2, "--print", "100")
    fill(small_disk / "filler")
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(timeout=30) == 0
    assert wait_gone(pids, timeout=5) == []
    assert "unsaved" in daemon.log_text()  # what the history could not take is in the log


def corrupt_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"not a database!!")


def corrupt_page(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(4096 * 2)
        f.write(os.urandom(4096))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [corrupt_header, corrupt_page, truncate])
def test_a_corrupt_history_is_quarantined_and_the_node_comes_up(daemon_factory, figures, damage):
    daemon = daemon_factory(args=("--slots", "4"), metrics_port=free_port()).start()
    jobs = [daemon.submit(*worker_args("--print", "1"))["id"] for _ in range(12)]  # 4 at a time
    for job in jobs:
        assert (
            daemon.wait_job(job, lambda d: d["state"] in ("SUCCEEDED", "FAILED"))["state"]
            == "SUCCEEDED"
        )
    daemon.stop()
    history = daemon.state_dir / "history.sqlite"
    damage(history)
    daemon.start()
    assert metric(daemon, "elasticd_history_quarantined_total") == 1
    aside = sorted(p.name for p in daemon.state_dir.glob("history.sqlite.corrupt-*"))
    assert aside and not aside[0].endswith(("-wal", "-shm"))  # kept for inspection
    assert "history" in daemon.log_text() and "corrupt" in daemon.log_text()
    listed = daemon.ctl("list", "--all")  # works, with whatever could be salvaged
    kept = {j["id"] for j in listed} & set(jobs)
    figures.add(f"item 7: {damage.__name__}: rows salvaged of {len(jobs)}", str(len(kept)))
    assert daemon.submit_wait(*worker_args())["state"] == "SUCCEEDED"  # and the node works
    daemon.stop()
    daemon.start()  # the fresh history is sound: no second quarantine
    assert metric(daemon, "elasticd_history_quarantined_total") == 0


def test_bad_history_rows_are_skipped_and_never_break_list(daemon_factory, figures):
    daemon = daemon_factory(args=("--slots", "4"), metrics_port=free_port()).start()
    good = daemon.submit_wait(*worker_args())["id"]
    daemon.stop()
    db = sqlite3.connect(daemon.state_dir / "history.sqlite")
    (doc,) = db.execute("SELECT doc FROM jobs WHERE id = ?", (good,)).fetchone()
    template = json.loads(doc)

    def row(job_id: str, change) -> None:
        bad = json.loads(json.dumps(template))
        bad["id"] = bad["spec"]["id"] = job_id
        change(bad)
        db.execute(
            "INSERT INTO jobs(id, seq, state, created, ended, doc) VALUES (?,?,?,?,?,?)",
            (job_id, 99, "SUCCEEDED", bad["created"], bad["ended"], json.dumps(bad)),
        )

    row("j-bad001", lambda d: d["spec"].update(min_nodes=3, max_nodes=1))  # fails validation
    row("j-bad002", lambda d: d.update(parts={"n1": {"state": "RUNNING", "workers": [1, "x"]}}))
    row("j-bad003", lambda d: d["spec"].update(name="evil\ud800"))  # a lone surrogate
    row("j-bad004", lambda d: d.update(outcome={"state": "SUCCEEDED", "ended": "soon"}))
    db.execute(
        "INSERT INTO jobs(id, seq, state, created, ended, doc) VALUES "
        "('j-bad005', 1, 'X', 0, NULL, 'not json')"
    )
    infinite = json.loads(json.dumps(template))
    infinite["id"] = infinite["spec"]["id"] = "j-bad007"
    infinite = json.dumps(infinite).replace(
        f'"created": {json.dumps(template["created"])}', '"created": 1e999'
    )
    assert "1e999" in infinite
    for job_id, doc in (
        ("j-bad006", "[" * 100000 + "]" * 100000),  # beyond safejson's bounds
        ("j-bad007", infinite),
    ):
        db.execute(
            "INSERT INTO jobs(id, seq, state, created, ended, doc) VALUES (?, 1, 'X', 0, NULL, ?)",
            (job_id, doc),
        )
    db.commit()
    db.close()
    daemon.start()
    listed = {j["id"] for j in daemon.ctl("list", "--all")}
    assert good in listed and not {f"j-bad00{i}" for i in range(1, 8)} & listed
    skipped = metric(daemon, "elasticd_history_skipped_rows_total")
    figures.add("item 7: bad history rows skipped (of 7)", f"{skipped:.0f}")
    assert skipped == 7
    log = daemon.log_text()
    assert "history" in log and "j-bad001" in log
    assert daemon.ctl_run("list", "--all").returncode == 0  # human output too
