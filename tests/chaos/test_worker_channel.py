"""A job against its agent's channel (shell/workerlink.py): one of its workers writes `ready`
lines as fast as the socket takes them.  Four such workers wrote 431,000 lines in 40 s, held
the daemon at 72% CPU and another user's `elasticctl list` went from 170 ms to 1.25 s.

What must hold (and the design: a job can hurt only itself): the flooder is slowed (its
lines wait unread in the kernel), then its channel is closed; the job's other workers keep
theirs and the job keeps running, no restart spent; another user's `list` keeps its latency
(a generous bound: the figure is printed).  A worker of elasticd.elastic whose channel was
closed fails at its next ask, a failed worker like any other (by the job's restart budget).
"""

from __future__ import annotations

import json
import statistics
import time

import psutil
from harness import FIXTURES, needs_root
from store_attack import wait_for

WORKER = FIXTURES / "channel_worker.py"
SLOTS = 4
FLOODER = 3


def reports(directory) -> dict[int, dict]:
    found = {}
    for slot in range(SLOTS):
        path = directory / f"slot_{slot}.json"
        if path.exists():
            found[slot] = json.loads(path.read_text())
    return found


def list_latency(daemon) -> float:
    """Seconds for another user's `elasticctl list` (a fresh process, as a user runs it)."""
    started = time.monotonic()
    done = daemon.ctl_run("--json", "list", "--all", user="nobody")
    assert done.returncode == 0, done.stderr
    return time.monotonic() - started


@needs_root
def test_a_worker_flooding_its_channel_is_slowed_then_cut_off(daemon, shared_tmp, figures):
    out = shared_tmp / "channel"
    out.mkdir()
    job = daemon.submit(
        "--in-place",
        "--nproc-per-node",
        str(SLOTS),
        str(WORKER),
        str(out),
        "--flood-slot",
        str(FLOODER),
    )["id"]
    wait_for(
        lambda: all(r.get("placed") for r in reports(out).values()) and len(reports(out)) == SLOTS,
        120,
        "every worker placed",
    )
    running = daemon.wait_running(job, SLOTS)
    pids = sorted(w["pid"] for w in running["workers"])
    before = sorted(list_latency(daemon) for _ in range(3))

    proc = psutil.Process(daemon.proc.pid)
    cpu_before, started = sum(proc.cpu_times()[:2]), time.monotonic()
    (out / "go").touch()
    during = []
    while not reports(out)[FLOODER].get("closed") and time.monotonic() - started < 90:
        during.append(list_latency(daemon))
    cpu = (sum(proc.cpu_times()[:2]) - cpu_before) / (time.monotonic() - started)
    flooder = reports(out)[FLOODER]
    figures.add(
        "worker channel: a flooding worker's lines sent / read before it was cut off",
        f"{flooder.get('sent')} in {flooder.get('seconds', 0):.1f} s ({flooder.get('ended')})",
    )
    figures.add(
        "worker channel: nobody's `list`, median before / during / max during the flood",
        f"{statistics.median(before) * 1000:.0f} / {statistics.median(during) * 1000:.0f} / "
        f"{max(during) * 1000:.0f} ms",
    )
    figures.add("worker channel: daemon CPU during the flood", f"{cpu * 100:.0f}%")

    assert flooder.get("closed"), flooder  # cut off, not left to flood for good
    assert "slowed" in flooder["ended"] and not flooder["ended"].startswith("closed after 0 ")
    assert max(during) < 5.0  # generous: 1.25 s before, on a quiet machine
    assert "closing its channel" in daemon.log_path.read_text()

    doc = daemon.ctl("status", job)  # the job runs on, its workers the same, no restart
    assert doc["state"] == "RUNNING" and doc["restarts"] == 0, doc
    assert sorted(w["pid"] for w in doc["workers"]) == pids
    (out / "stop").touch()
    ended = daemon.wait_job(job, lambda d: d["state"] in ("SUCCEEDED", "FAILED"), timeout=60)
    assert ended["state"] == "SUCCEEDED", ended
    others = {s: r for s, r in reports(out).items() if s != FLOODER}  # as each ended
    assert all(r["placed"] and not r["closed"] for r in others.values()), others
