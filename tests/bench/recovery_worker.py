"""The worker both systems run in bench_recovery.py.

It appends one JSON line per event to ``<dir>/events.jsonl`` (O_APPEND: lines never mix):
``start`` as its first action (with the time the process was exec'd, read from /proc, so
that the workers' own Python start-up can be told apart), then ``ready`` once a gloo
process group formed and an all_reduce went through.  Then it goes on like a training loop,
an all_reduce every 100 ms, so that a peer's death breaks its collectives (as it would in
training) until the bench stops it; or, given ``idle``, it sleeps.
"""

import json
import os
import sys
import time


def exec_time() -> float:
    """When this process was exec'd (wall clock, 10 ms resolution).

    Computed from the uptime, not from /proc/stat's ``btime``, which is rounded to seconds."""
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


def record(directory: str, event: str, **extra: object) -> None:
    doc = {"event": event, "t": time.time(), "pid": os.getpid(),
           "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **extra}
    fd = os.open(os.path.join(directory, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (json.dumps(doc) + "\n").encode())
    os.close(fd)


def main() -> None:
    directory = sys.argv[1]
    mode = sys.argv[2:3]
    if mode == ["inplace"]:
        return in_place(directory)
    record(directory, "start", exec=exec_time())
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    record(directory, "ready")
    idle = mode == ["idle"]
    while True:
        time.sleep(3600 if idle else 0.1)  # a training step
        if not idle:
            dist.all_reduce(t)
            record(directory, "step")


def in_place(directory: str) -> None:
    """The same loop as an in-place job (elasticd.elastic): survivors keep this process."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from elasticd import elastic
    os.environ.setdefault("RANK", "-1")
    os.environ.setdefault("WORLD_SIZE", "0")
    record(directory, "warm", exec=exec_time())
    elastic.init("gloo")
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        t = torch.ones(1)
        record(directory, "start", exec=exec_time())
        dist.all_reduce(t)
        record(directory, "ready")
        while True:
            time.sleep(0.1)  # a training step
            dist.all_reduce(t)
            state.step += 1
            record(directory, "step")
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
