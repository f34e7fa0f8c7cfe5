"""The worker of the GPU suite (tests/gpu/test_gpu.py), one script with three modes:

    nccl_worker.py devices REPORT_DIR
    nccl_worker.py ddp REPORT_DIR [--backend nccl|gloo] [--steps N]
    nccl_worker.py inplace REPORT_DIR [--backend nccl|gloo] [--step-time S]

devices   what this worker sees: CUDA_VISIBLE_DEVICES, LOCAL_RANK, torch.cuda.device_count(),
          the name and UUID of its device (cuda:LOCAL_RANK); written to
          REPORT_DIR/devices_<LOCAL_RANK>.json.
ddp       DistributedDataParallel on cuda:LOCAL_RANK for N steps, each rank on its own data;
          then the parameters, as they are at the end and as they were at the start, written
          to REPORT_DIR/ddp_<RANK>.json.
inplace   an --in-place job's loop (elasticd.elastic.run): an all_reduce of a CUDA tensor
          every S seconds, until the job is cancelled; every start of a round, every step and
          every broken group appended as one JSON line to REPORT_DIR/events.jsonl.

``--backend gloo`` (CPU tensors) is the dry run of ELASTICD_GPU_TEST_DRY_RUN (conftest.py);
the suite runs nccl.  torch is imported inside the modes: bench_recovery.py's worker imports
``share_one_gpu`` from here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

# The process group's timeout in the in-place mode.  NCCL's own default is 10 minutes; 120 s
# is still far beyond what the test allows for a release (30 s), so a survivor freed within
# seconds was freed by the daemon's notice (or by NCCL seeing the peer's sockets close),
# never by a timeout.
PG_TIMEOUT = timedelta(seconds=120)


def share_one_gpu() -> None:
    """Let several ranks of one NCCL communicator use the same GPU of this host (a test rig for
    hosts with one GPU, not a recipe for training).

    NCCL refuses two ranks on the same GPU of the same host ("Duplicate GPU detected"): it
    compares each rank's host hash and its GPU's bus id, and it takes the host hash from
    NCCL_HOSTID when that is set.  So each process claims a host of its own (named after its
    pid): NCCL then sees one GPU on each of N hosts and joins them with its network transport.
    That transport is plain TCP (NCCL_NET=Socket, NCCL_IB_DISABLE: no InfiniBand, no plugin)
    over loopback (NCCL_SOCKET_IFNAME=lo: the daemons' 127.0.0.x addresses live there).  P2P
    and shared memory connect ranks of one host; they are off so that nothing tries CUDA IPC
    or /dev/shm between these "hosts".  Must run before the first NCCL call (NCCL reads its
    environment when the communicator is made).
    """
    os.environ["NCCL_HOSTID"] = f"elasticd-gpu-{os.getpid()}"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_NET"] = "Socket"
    os.environ["NCCL_IB_DISABLE"] = "1"
    os.environ["NCCL_P2P_DISABLE"] = "1"
    os.environ["NCCL_SHM_DISABLE"] = "1"


def write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)  # the test never reads half a file


def append(directory: str, doc: dict) -> None:
    """One JSON line (O_APPEND: lines of several processes never mix)."""
    fd = os.open(
        os.path.join(directory, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    try:
        os.write(fd, (json.dumps(doc) + "\n").encode())
    finally:
        os.close(fd)


# -- devices ------------------------------------------------------------------------------


def devices(report: str) -> None:
    import torch

    local_rank = int(os.environ["LOCAL_RANK"])
    doc = {
        "pid": os.getpid(),
        "local_rank": local_rank,
        "rank": int(os.environ["RANK"]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "name": None,
        "uuid": None,
    }
    if doc["cuda_available"] and local_rank < doc["device_count"]:
        props = torch.cuda.get_device_properties(local_rank)
        doc["name"] = props.name
        doc["uuid"] = str(getattr(props, "uuid", "")) or None
    write_json(os.path.join(report, f"devices_{local_rank}.json"), doc)


# -- ddp ----------------------------------------------------------------------------------


def device_for(backend: str):
    import torch

    if backend == "nccl":
        share_one_gpu()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()  # a tuple in torch 2.x; an int in old releases
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def ddp(report: str, backend: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device = device_for(backend)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway; same start everywhere
    model = torch.nn.Linear(16, 4).to(device)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()
    net = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=data).to(device)
        y = torch.randn(32, 4, generator=data).to(device)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = params.clone()
    dist.broadcast(reference, 0)  # rank 0's parameters, compared here bit for bit
    doc = {
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "backend": str(dist.get_backend()),
        "device": str(params.device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nccl_hostid": os.environ.get("NCCL_HOSTID"),
        "steps": steps,
        "losses": losses,
        "nccl_version": nccl_version() if backend == "nccl" else None,
        "params": params.cpu().tolist(),
        "initial": initial,
        "equal_to_rank0": bool(torch.equal(reference, params)),
    }
    dist.barrier()
    dist.destroy_process_group()
    write_json(os.path.join(report, f"ddp_{rank}.json"), doc)


# -- inplace ------------------------------------------------------------------------------


class _Broken(logging.Handler):
    """Notes elasticd.elastic's "the process group broke (...)" warning as an event: its text
    says what freed the survivor (the daemon's notice: "a member of the job is gone"; or an
    NCCL or gloo error)."""

    def __init__(self, report: str) -> None:
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        append(
            self.report,
            {
                "event": "broke",
                "pid": os.getpid(),
                "time": time.time(),
                "text": record.getMessage()[:500],
            },
        )


def inplace(report: str, backend: str, step_time: float) -> None:
    import torch
    import torch.distributed as dist

    device = device_for(backend)
    # elasticd.elastic forms the group itself (dist.init_process_group, looked up at call
    # time) and passes no timeout: give every group it forms PG_TIMEOUT instead of NCCL's
    # 10 minutes, so that the timeout is written here (see PG_TIMEOUT).
    plain_init = dist.init_process_group

    def init_with_timeout(*args, **kwargs):
        kwargs.setdefault("timeout", PG_TIMEOUT)
        return plain_init(*args, **kwargs)

    dist.init_process_group = init_with_timeout
    from elasticd import elastic

    logging.getLogger("elasticd.elastic").addHandler(_Broken(report))
    append(
        report,
        {
            "event": "warm",
            "pid": os.getpid(),
            "time": time.time(),
            "async_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        },
    )
    elastic.init(backend)
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state: elastic.ObjectState) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        round = int(os.environ.get("ELASTICD_ROUND", "-1"))
        base = {"pid": os.getpid(), "rank": rank, "world": world, "round": round}
        append(report, {"event": "start", "time": time.time(), "step": state.step, **base})
        while True:
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            value = t.item()  # on NCCL this waits for the collective (a dead peer: forever)
            state.step += 1
            append(
                report,
                {"event": "step", "time": time.time(), "step": state.step, "value": value, **base},
            )
            state.commit()
            time.sleep(step_time)

    train(state)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("mode", choices=("devices", "ddp", "inplace"))
    p.add_argument("report")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    if args.mode == "devices":
        devices(args.report)
    elif args.mode == "ddp":
        ddp(args.report, args.backend, args.steps)
    else:
        inplace(args.report, args.backend, args.step_time)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
