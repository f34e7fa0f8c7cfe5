"""Another local user floods the TCPStore a running job's round formed its group in.

The daemon serves each round's store (torchrun's agent store), and TCPStore has no
authentication: anyone who reaches the port may write there, as under torchrun.  Played by
``nobody`` with a TCPStore client, writing 8 MiB values until it is cut off: it is refused
past the store's cap (64 MiB) with its connection closed, the daemon answers on, the job's
group (formed already) trains on to success, and the store closes with the job.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import psutil
from harness import ROOT, free_port

from elasticd.shell.roundstore import MAX_BYTES

JOB = """
import pathlib, sys, time
import torch, torch.distributed as dist
go = pathlib.Path(sys.argv[1])
dist.init_process_group("gloo")
(go.parent / f"formed{dist.get_rank()}").touch()
while not go.exists():
    time.sleep(0.05)
total = torch.ones(1)
dist.all_reduce(total)
print("sum", total.item())
dist.destroy_process_group()  # torch 2.13: without it, 1 exit in 30 aborts under load
"""

FLOOD = """
import asyncio, json, sys
from elasticd.store.tcpstore import TCPStoreClient

async def flood():
    store = TCPStoreClient(f"127.0.0.1:{sys.argv[1]}", timeout=30)
    value, taken, error = b"x" * (8 << 20), 0, ""
    try:
        for n in range(64):
            await store.set(f"flood{n}", value)
            taken += len(value)
    except Exception as exc:  # the server closed the connection
        error = type(exc).__name__
    await store.close()
    print(json.dumps({"taken": taken, "error": error}))

asyncio.run(flood())
"""


def test_a_flood_of_the_rounds_store_is_cut_off_and_the_job_trains_on(
    daemon_factory, shared_tmp, figures
):
    daemon = daemon_factory("rs1", args=("--slots", "2")).start()
    script, go = shared_tmp / "job.py", shared_tmp / "go"
    script.write_text(JOB)
    port = free_port()
    job = daemon.submit("--nproc-per-node", "2", "--master-port", str(port), str(script), str(go))
    deadline = time.monotonic() + 120
    while not all((shared_tmp / f"formed{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, daemon.log_text()
        time.sleep(0.1)
    before = psutil.Process(daemon.proc.pid).memory_info().rss

    flood = subprocess.run(  # TCPStore's wire protocol, as torch's client speaks it
        ["/usr/bin/python3", "-c", FLOOD, str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        user="nobody",
        env={"PYTHONPATH": str(ROOT / "daemon"), "PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    found = json.loads(flood.stdout.strip().splitlines()[-1]), flood.stderr[-2000:]
    assert 0 < found[0]["taken"] <= MAX_BYTES and found[0]["error"], found
    grew = psutil.Process(daemon.proc.pid).memory_info().rss - before
    figures.add(
        "round store flood: taken, daemon RSS grew",
        f"{found[0]['taken'] >> 20} MiB, {grew >> 20} MiB",
    )
    assert daemon.ctl("list")[0]["id"] == job["id"]  # the daemon answers on
    assert "the store closed the connection" in daemon.log_text()

    go.touch()
    done = daemon.wait_job(job["id"], lambda doc: doc["state"] in ("SUCCEEDED", "FAILED"))
    logs = daemon.ctl_run("logs", job["id"]).stdout
    assert done["state"] == "SUCCEEDED", (done, logs[-4000:])
    assert logs.count("sum 2.0") == 2, logs
    deadline = time.monotonic() + 30
    while True:  # the round's store closes with the job
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline, "the round's store outlived its job"
        time.sleep(0.1)
