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

In an ``--in-place`` job (``$ELASTICD_AGENT_SOCKET`` set) the worker speaks the agent's
channel itself (elasticd/elastic/runtime.py's protocol, JSON lines, no torch): it says hello,
asks for a place, and works in that round until the agent says a newer round formed
(``update``) or a member is gone (``abort``); it then asks again and works on in the next
round with its new RANK and WORLD_SIZE, the same process.  A resize of such a job keeps its
survivors' processes, as elasticd.elastic does for a real script.

Every worker appends ``start`` (with the time its process was exec'd) and ``exit`` (at its
end, also when SIGTERM stops it) to ``events.jsonl`` (O_APPEND: lines never mix); an
in-place worker also ``placed`` (each round it works in) and ``asked`` (each time it stops
working to ask for a place).  Rank 0 also writes ``done`` when it completes the work.
bench_sharing.py reads the busy slots from these: an in-place worker is busy only from
being placed to its next ask or its exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
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
    doc = {
        "event": event,
        "t": time.time(),
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", -1)),
        "world": int(os.environ.get("WORLD_SIZE", 0)),
        "node": os.environ.get("GROUP_RANK"),
        **extra,
    }
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


class Agent:
    """An in-place worker's channel to its agent: a thread reads the notices."""

    def __init__(self, path: str, slot: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.lock = threading.Condition()
        self.places: dict[int, dict[str, str]] = {}
        self.newest = -1  # the newest round announced (update) or aborted for
        self.closed = False
        self.send({"op": "hello", "slot": slot})
        threading.Thread(target=self.read, daemon=True).start()

    def send(self, doc: dict[str, object]) -> None:
        self.sock.sendall(json.dumps(doc).encode() + b"\n")

    def read(self) -> None:
        with self.sock.makefile("rb") as lines:
            for line in lines:
                doc = json.loads(line)
                with self.lock:
                    round = int(doc.get("round", -1))
                    if doc.get("op") == "place":
                        self.places[round] = {str(k): str(v) for k, v in doc["env"].items()}
                    elif doc.get("op") in ("update", "abort"):
                        self.newest = max(self.newest, round)
                    self.lock.notify_all()
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def place_after(self, round: int, why: str) -> int:
        """Ask for a place in a round after ``round``; set this process's env to it."""
        self.send({"op": "ready", "round": round, "why": why, "error": ""})
        with self.lock:
            while not any(r > round for r in self.places):
                if self.closed:
                    raise ConnectionError("the agent closed the channel")
                self.lock.wait()
            newest = max(self.places)
            os.environ.update(self.places[newest])
            return newest

    def superseded(self, round: int) -> bool:
        with self.lock:
            return self.newest > round


def work(target: int, step: float, agent: Agent | None, round: int) -> int:
    """Steps at this round's size until the work is done (-1) or the round is superseded
    (the units done so far)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    done = read_done()
    while done < target:
        if agent is not None and agent.superseded(round):
            return done
        time.sleep(step)
        if rank == 0:
            done = min(target, read_done() + world)
            write_done(done)
        else:
            done = read_done()
    return -1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=int, required=True, help="sample-units of the whole job")
    p.add_argument("--step", type=float, required=True, help="seconds per step")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    path = os.environ.get("ELASTICD_AGENT_SOCKET")
    agent = Agent(path, int(os.environ.get("ELASTICD_SLOT", "0"))) if path else None
    record("start", exec=exec_time(), done=read_done())
    round, why = -1, "start"
    while True:
        if agent is not None:
            if why != "start":
                record("asked", round=round)
            round = agent.place_after(round, why)
            record("placed", round=round, done=read_done())
        if work(args.work, args.step, agent, round) < 0:
            break
        why = "interrupt"
    if int(os.environ["RANK"]) == 0:
        record("done", done=read_done())
    record("exit", why="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
