"""The worker both systems run in bench_recovery.py.

It appends one JSON line per event to ``<dir>/events.jsonl`` (O_APPEND: lines never mix):
``start`` as its first action (with the time the process was exec'd, read from /proc, so
that the workers' own Python start-up can be told apart), then ``ready`` once a gloo
process group formed and an all_reduce went through.  Then it goes on like a training loop,
an all_reduce every 100 ms, so that a peer's death breaks its collectives (as it would in
training) until the bench stops it; or, given ``idle``, it records ``idle`` and sleeps.

Given ``inplace`` the loop runs under elasticd.elastic (an --in-place job: its process
stays through a re-form; it starts warm, with no RANK, until its place comes).  With
``idle`` too, it commits every 100 ms (so that the job's rounds can form) until the bench
makes the file ``<dir>/idle``: then every rank, agreeing on the same step, records ``idle``
and sleeps, and never reaches a commit again (the daemon alone learns of a lost peer, and
stops it after the job's rejoin timeout).

Given ``nccl`` (bench_recovery.py --backend nccl; elasticd's in-place system only) the
group is NCCL and the tensors live on cuda:LOCAL_RANK; every rank of this host may use the
same GPU (tests/gpu/nccl_worker.py's share_one_gpu: each process claims an NCCL host of its
own), and each step waits for its all_reduce to finish, as gloo's does.
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
    doc = {
        "event": event,
        "t": time.time(),
        "pid": os.getpid(),
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "in_round": os.environ.get("ELASTICD_ROUND"),
        **extra,
    }  # in place: the worker's round
    fd = os.open(
        os.path.join(directory, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    os.write(fd, (json.dumps(doc) + "\n").encode())
    os.close(fd)


def record_phases(directory: str) -> None:
    """Each point of a re-form that elasticd.elastic logs (runtime.phase) becomes a ``phase``
    event: bench_recovery.py prints where a figure's time went."""
    import logging

    class Phases(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            name = getattr(rec, "phase", None)
            if name is not None:
                record(
                    directory, "phase", name=name, round=getattr(rec, "round", -1), t=rec.created
                )

    logger = logging.getLogger("elasticd.elastic")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(Phases())


def nccl_device():
    """cuda:LOCAL_RANK, shared with the other ranks of this host (see the docstring)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
    from nccl_worker import share_one_gpu

    share_one_gpu()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def record_term(directory: str) -> None:
    """A ``term`` event when the daemon or agent stops this worker (SIGTERM), then the default
    action (bench_recovery.py's ``known`` figure for a restart).  A thread waits for the
    signal: a Python handler would run only once the main thread's blocked all_reduce
    returned, and the worker would outlive its SIGTERM until the SIGKILL."""
    import signal
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads made later inherit it

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        record(directory, "term")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, daemon=True).start()


def main() -> None:
    directory = sys.argv[1]
    record_term(directory)
    nccl, idle = "nccl" in sys.argv[2:], "idle" in sys.argv[2:]
    if "inplace" in sys.argv[2:]:
        return in_place(directory, nccl, idle)
    record(directory, "start", exec=exec_time())
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    device = nccl_device() if nccl else None
    dist.init_process_group("nccl" if nccl else "gloo")
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    if nccl:
        t.item()  # NCCL is asynchronous: wait for it
    record(directory, "ready")
    if idle:
        record(directory, "idle")
        while True:
            time.sleep(3600)
    while True:
        time.sleep(0.1)  # a training step
        dist.all_reduce(t)
        if nccl:
            t.item()
        record(directory, "step")


def in_place(directory: str, nccl: bool = False, idle: bool = False) -> None:
    """The same loop as an in-place job (elasticd.elastic): survivors keep this process."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from elasticd import elastic

    os.environ.setdefault("RANK", "-1")
    os.environ.setdefault("WORLD_SIZE", "0")
    record(directory, "warm", exec=exec_time())
    record_phases(directory)
    device = nccl_device() if nccl else None
    elastic.init("nccl" if nccl else "gloo")
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        t = torch.ones(1, device=device)
        record(directory, "start", exec=exec_time())
        dist.all_reduce(t)
        if nccl:
            t.item()  # NCCL is asynchronous: wait for it
        record(directory, "ready")
        if idle:
            go_idle(directory, state, device)
        while True:
            time.sleep(0.1)  # a training step
            dist.all_reduce(t)
            if nccl:
                t.item()
            state.step += 1
            record(directory, "step")
            state.commit()

    train(state)


def go_idle(directory: str, state, device) -> None:
    """Commit every 100 ms until some rank sees ``<dir>/idle`` (an all_reduce: every rank
    agrees at the same step), then sleep for good."""
    import torch
    import torch.distributed as dist

    seen = torch.zeros(1, device=device)
    while True:
        time.sleep(0.1)
        seen[0] = float(os.path.exists(os.path.join(directory, "idle")))
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if seen.item():
            break
        state.commit()
    record(directory, "idle")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
