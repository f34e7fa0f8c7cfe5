"""The worker of bench_sharing.py: a fixed amount of work whose time shrinks with world size.

    python sharing_worker.py --work W --step S      (run in the job's working directory)

Standard library only (no torch), so that a worker starts in tens of milliseconds and the
2-core host can run a whole trace: every worker sleeps ``S`` seconds per step (a training
step), and each step processes WORLD_SIZE sample-units of the job's ``W``, so the job takes
``W / WORLD_SIZE * S`` seconds at a fixed size.  Rank 0 keeps the units done in
``progress.json`` in the working directory (written with a rename: never half a file) and
reads it back at each start, so a job that is shrunk or grown (its workers stopped and
restarted with another WORLD_SIZE: elasticd's restart path) loses at most the step it was
in.  The other ranks read it after each step and exit 0 once the work is done.

Every worker appends ``start`` (with the time its process was exec'd) and ``exit`` (at its
end, also when SIGTERM stops it) to ``events.jsonl`` (O_APPEND: lines never mix); rank 0
also writes ``done`` when it completes the work.  bench_sharing.py reads the busy slots
from these.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

PROGRESS = "progress.json"
EVENTS = "events.jsonl"


def exec_time() -> float:
    """When this process was exec'd (wall clock, 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def record(event: str, **extra: object) -> None:
    doc = {"event": event, "t": time.time(), "pid": os.getpid(), "rank": int(os.environ["RANK"]),
           "world": int(os.environ["WORLD_SIZE"]), "node": os.environ.get("GROUP_RANK"), **extra}
    fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(doc) + "\n").encode())
    finally:
        os.close(fd)


def read_done() -> int:
    try:
        with open(PROGRESS) as f:
            return int(json.load(f)["done"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return 0


def write_done(done: int) -> None:
    tmp = f"{PROGRESS}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"done": done, "t": time.time()}, f)
    os.replace(tmp, PROGRESS)


def on_sigterm(signum: int, frame: object) -> None:
    record("exit", why="SIGTERM")
    os._exit(128 + signum)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=int, required=True, help="sample-units of the whole job")
    p.add_argument("--step", type=float, required=True, help="seconds per step")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    done = read_done()
    record("start", exec=exec_time(), done=done)
    while done < args.work:
        time.sleep(args.step)
        if rank == 0:
            done = min(args.work, read_done() + world)
            write_done(done)
        else:
            done = read_done()
    if rank == 0:
        record("done", done=done)
    record("exit", why="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
