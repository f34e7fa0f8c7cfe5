"""Output and retention with real daemons and workers: `elasticctl logs -f` across rotations
of the file it follows, history read after them, and retention forgetting an ended job (its
history row and output, and its records in the store) while a running one stays."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from harness import CLIENT_ENV, PY, Daemon, worker_args
from hostwide import free_port

from elasticd.store.c10d import connect
from elasticd.store.signing import SignedLines, Signer, create_key, load_key

LINES = 200_000  # 64 bytes each: 12.2 MiB through 64 KiB files, about 190 rotations
WRITER = f"""
import sys
print("ready", flush=True)
with open(sys.argv[1], "rb") as go:
    go.read()
for i in range({LINES}):
    print(f"line {{i:07d}} " + "x" * 50)
"""


def configured(daemon_factory, shared_tmp: Path, text: str) -> Daemon:
    """A daemon with ``text`` as its config, and a node name (a job cgroup) of its own."""
    config = shared_tmp / "config.toml"
    config.write_text(text)
    return daemon_factory(
        f"rot-{uuid.uuid4().hex[:6]}", args=("--slots", "4", "--config", str(config))
    ).start()


def numbers(texts: list[str]) -> list[int]:
    return [int(t.split()[1]) for t in texts if t.startswith("line ")]


@pytest.mark.slow
def test_a_follower_keeps_up_across_rotations_and_ends_with_the_job(daemon_factory, shared_tmp):
    daemon = configured(daemon_factory, shared_tmp, "[output]\nmax_bytes = 65536\nbackups = 2\n")
    script, go = shared_tmp / "writer.py", shared_tmp / "go"
    script.write_text(WRITER)
    os.mkfifo(go)
    job = daemon.submit(str(script), str(go))["id"]
    follower = subprocess.Popen(
        [PY, "-m", "elasticctl", "--socket", daemon.socket, "--json", "logs", "-f", job],
        stdout=subprocess.PIPE,
        text=True,
        env=CLIENT_ENV,
    )
    try:
        assert follower.stdout is not None
        assert json.loads(follower.stdout.readline())["text"] == "ready"  # it follows: go
        with open(go, "wb"):
            pass
        rest, _ = follower.communicate(timeout=60)  # it ends by itself when the job ended
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0
    texts = [json.loads(line)["text"] for line in rest.splitlines()]
    seen = numbers(texts)
    rotations = int(
        (daemon.state_dir / "logs" / job / "attempt_0" / "rank_0.out.rotated")
        .read_text()
        .split()[0]
    )
    assert rotations > 100  # it did follow across rotations
    assert seen[-1] == LINES - 1 and seen == sorted(set(seen))  # the latest, in order, none twice
    gaps = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1] + 1]
    notices = [t for t in texts if t.startswith("[elasticd: output was rotated away here")]
    assert len(gaps) <= len(notices)  # a line it could not read is said to be missing
    assert seen[0] == 0 or notices

    history = [
        json.loads(line)["text"]
        for line in daemon.ctl_run("--json", "logs", job).stdout.splitlines()
    ]
    kept = numbers(history)
    assert (
        history[0].startswith("[elasticd: ")
        and "bytes of earlier output were rotated away" in history[0]
    )
    assert kept == list(range(LINES - len(kept), LINES)) and 2048 < len(kept) <= 3 * 1024


def history_ids(state_dir: Path) -> set[str]:
    db = sqlite3.connect(f"file:{state_dir / 'history.sqlite'}?mode=ro", uri=True)
    try:
        return {job_id for (job_id,) in db.execute("SELECT id FROM jobs")}
    finally:
        db.close()


def wait_forgotten(daemon: Daemon, job: str, timeout: float = 20.0) -> None:
    """Until `elasticctl status JOB` says there is no such job."""
    deadline = time.monotonic() + timeout
    while True:
        done = daemon.ctl_run("status", job)
        if done.returncode == 1 and f"no job '{job}'" in done.stderr:
            return
        assert time.monotonic() < deadline, f"{job} was never forgotten:\n{daemon.log_text()}"
        time.sleep(0.2)  # between two looks (the daemon's pass is a timer of its own)


@pytest.mark.slow
def test_retention_forgets_an_ended_job_and_keeps_a_running_one(daemon_factory, shared_tmp):
    daemon = configured(daemon_factory, shared_tmp, "[history]\nretention = 2\n")
    running = daemon.submit(*worker_args("--print", "2", "--sleep", "0"))["id"]
    daemon.wait_output(running, ["out 0 1"])
    ended = daemon.submit_wait(*worker_args("--print", "2"))
    assert ended["state"] == "SUCCEEDED"
    wait_forgotten(daemon, ended["id"])
    logs = daemon.state_dir / "logs"
    assert not (logs / ended["id"]).exists() and ended["id"] not in history_ids(daemon.state_dir)
    assert [d["id"] for d in daemon.ctl("list", "--all")] == [running]
    # the running job is older than the retention, and kept whole
    assert daemon.ctl("status", running)["state"] == "RUNNING"
    assert (logs / running / "attempt_0" / "rank_0.out").read_text() == "out 0 0\nout 0 1\n"
    assert running in history_ids(daemon.state_dir)

    daemon.ctl("cancel", running)  # once it ended, it goes too
    wait_forgotten(daemon, running)
    assert not (logs / running).exists() and history_ids(daemon.state_dir) == set()
    assert daemon.ctl("list", "--all") == []


@pytest.mark.slow
def test_the_store_forgets_an_ended_job_and_keeps_a_running_one(daemon_factory, shared_tmp):
    """A daemon that hosts its cluster's TCPStore (and so observes the cluster): the records
    and the rendezvous of a job that ended a retention ago leave the store, read with a raw
    client."""
    tag = uuid.uuid4().hex[:6]
    port, key = free_port(), shared_tmp / f"store-{tag}.key"
    create_key(str(key))
    config = shared_tmp / f"store-{tag}.toml"
    config.write_text("[jobs]\nallow_root = true\n[history]\nretention = 2\n")
    args = ("--cluster", f"sr{tag}", "--store", f"127.0.0.1:{port}", "--store-host")
    args += ("--cluster-key", str(key), "--slots", "4", "--config", str(config))
    daemon = daemon_factory(f"sr-{tag}", args=args, standalone=False).start()
    running = daemon.submit(*worker_args("--print", "2", "--sleep", "0"))["id"]
    daemon.wait_output(running, ["out 0 1"])
    ended = daemon.submit_wait(*worker_args("--print", "2"))["id"]
    jobs = f"elasticd/sr{tag}/jobs"
    signer = Signer(load_key(str(key)), f"sr{tag}")
    records = [f"{jobs}/spec/{ended}", f"{jobs}/parts/{ended}"]
    records.append(f"{jobs}/part/{ended}/{daemon.name}")
    rdzv = f"elasticd/sr{tag}/rdzv"
    records += [f"{rdzv}/{ended}/state", f"{rdzv}/{ended}/head", f"{rdzv}/{ended}/hb/{daemon.name}"]

    def indexed(raw: bytes | None) -> list[str | None]:
        return SignedLines(signer, f"{jobs}/index/0", lambda b: b["name"], print).fold(raw)

    store = connect(f"127.0.0.1:{port}", connect_timeout=10)
    try:
        assert all(store.get(name) is not None for name in records)
        assert indexed(store.get(f"{jobs}/index/0")) == [running, ended]  # one piece: seqs 1, 2
        deadline = time.monotonic() + 30

        def kept() -> list[str]:
            """What is left of the ended job: the sweep deletes its records one by one,
            then rewrites the index."""
            left = [name for name in records if store.get(name) is not None]
            return left + ([] if indexed(store.get(f"{jobs}/index/0")) == [running] else ["index"])

        while kept():
            assert time.monotonic() < deadline, f"{kept()} kept:\n{daemon.log_text()}"
            time.sleep(0.2)
        assert store.get(f"{jobs}/outcome/{ended}") is not None  # kept: a replay reads it
        assert store.get(f"{jobs}/spec/{running}") is not None
        assert store.get(f"{rdzv}/{running}/state") is not None
        assert daemon.ctl("status", running)["state"] == "RUNNING"
    finally:
        store.close()
