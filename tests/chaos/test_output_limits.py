"""A job that writes without end (docs/concepts.md, "What a worker gets"): its output is rotated at output.max_bytes with
output.backups files kept, so the state dir holds a bounded amount of it, and the daemon
answers others meanwhile.  Real daemon, real worker, 1 GiB through the pipe."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from harness import worker_args

MiB = 1 << 20
MAX_BYTES, BACKUPS = 1 * MiB, 2
# Besides the (BACKUPS + 1) x MAX_BYTES of rank_0.out: the count file (64 bytes), the
# empty rank_0.err and error file, each rounded up to a block (4 KiB) by du's measure.
SLACK = 64 * 1024


def on_disk(directory: Path) -> tuple[int, int]:
    """(bytes the files under ``directory`` take on disk, their apparent size)."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in files), sum(p.stat().st_size for p in files)


@pytest.mark.slow
def test_a_job_writing_1_gib_keeps_within_its_bound_and_the_daemon_answers(
    daemon_factory, shared_tmp, figures
):
    config = shared_tmp / "limits.toml"
    config.write_text(f"[output]\nmax_bytes = {MAX_BYTES}\nbackups = {BACKUPS}\n")
    daemon = daemon_factory(
        f"lim-{uuid.uuid4().hex[:6]}", args=("--slots", "2", "--config", str(config))
    ).start()
    go = shared_tmp / "go"
    os.mkfifo(go)
    job = daemon.submit(*worker_args("--wait-for", str(go), "--spew", "1024"))["id"]
    daemon.wait_running(job, 1)
    latencies, while_writing = [], 0
    started = time.monotonic()
    with open(go, "wb"):
        pass  # the worker starts writing
    while True:  # `status` meanwhile, one after the other, until the job ended
        asked = time.monotonic()
        reply = daemon.request("status", job=job)  # the daemon's answer (no client start-up)
        latencies.append(time.monotonic() - asked)
        state = reply.result["state"]
        if state != "RUNNING":
            break
        while_writing += 1
        assert time.monotonic() - started < 120, "the job never ended"
    seconds = time.monotonic() - started
    logs = daemon.state_dir / "logs" / job / "attempt_0"
    taken, apparent = on_disk(logs)
    rotated_away = int((logs / "rank_0.out.rotated").read_text().split()[1])
    kept = sum(
        p.stat().st_size for p in logs.glob("rank_0.out*") if not p.name.endswith(".rotated")
    )
    figures.add(
        "output rotation: 1 GiB of output, output.max_bytes 1 MiB, backups 2: left on disk",
        f"{taken / MiB:.2f} MiB ({apparent} bytes; {kept + rotated_away} written in {seconds:.1f} s)",
    )
    figures.add(
        "output rotation: a `status` request while the job wrote 1 GiB, median / max",
        f"{sorted(latencies)[len(latencies) // 2] * 1000:.0f} / {max(latencies) * 1000:.0f} ms "
        f"({while_writing} answered while it wrote)",
    )
    assert state == "SUCCEEDED"  # the worker never blocked
    assert kept + rotated_away == 1 << 30  # every byte is on disk or counted as rotated away
    assert taken <= (BACKUPS + 1) * MAX_BYTES + SLACK and kept == (BACKUPS + 1) * MAX_BYTES
    # answered throughout: never stuck behind the writer (which writes for seconds); the
    # latencies themselves are the figure above, not a pass mark
    assert while_writing >= 2 and max(latencies) < 5.0
    shown = daemon.ctl_run("logs", job).stdout.splitlines()
    assert (
        shown[0] == f"[rank 0] [elasticd: {rotated_away} bytes of earlier output were rotated "
        f"away (output.max_bytes, output.backups)]"
    )
    assert len(shown) == 1 + kept // 1024  # then every line that is kept (1 KiB each)
