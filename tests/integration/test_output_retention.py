"""Issue 15 with real daemons and workers: `elasticctl logs -f` across rotations of the file
it follows, and history read after them."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from harness import CLIENT_ENV, PY, Daemon

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
    return daemon_factory(f"rot-{uuid.uuid4().hex[:6]}", args=("--slots", "4", "--config", str(config))).start()


def numbers(texts: list[str]) -> list[int]:
    return [int(t.split()[1]) for t in texts if t.startswith("line ")]


@pytest.mark.slow
def test_a_follower_keeps_up_across_rotations_and_ends_with_the_job(daemon_factory, shared_tmp):
    daemon = configured(daemon_factory, shared_tmp, "[output]\nmax_bytes = 65536\nbackups = 2\n")
    script, go = shared_tmp / "writer.py", shared_tmp / "go"
    script.write_text(WRITER)
    os.mkfifo(go)
    job = daemon.submit(str(script), str(go))["id"]
    follower = subprocess.Popen([PY, "-m", "elasticctl", "--socket", daemon.socket, "--json", "logs",
                                 "-f", job], stdout=subprocess.PIPE, text=True, env=CLIENT_ENV)
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
    rotations = int((daemon.state_dir / "logs" / job / "attempt_0" / "rank_0.out.rotated").read_text().split()[0])
    assert rotations > 100  # it did follow across rotations
    assert seen[-1] == LINES - 1 and seen == sorted(set(seen))  # the latest, in order, none twice
    gaps = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1] + 1]
    notices = [t for t in texts if t.startswith("[elasticd: output was rotated away here")]
    assert len(gaps) <= len(notices)  # a line it could not read is said to be missing
    assert seen[0] == 0 or notices

    history = [json.loads(line)["text"] for line in
               daemon.ctl_run("--json", "logs", job).stdout.splitlines()]
    kept = numbers(history)
    assert history[0].startswith("[elasticd: ") and "bytes of earlier output were rotated away" in history[0]
    assert kept == list(range(LINES - len(kept), LINES)) and 2048 < len(kept) <= 3 * 1024
