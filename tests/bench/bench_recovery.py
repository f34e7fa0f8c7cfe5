"""Recovery figures of elasticd side by side with torch's torchrun, on the same worker.

    python tests/bench/bench_recovery.py [--runs 3] [--quick] [--json] [--backend gloo|nccl]

Every "node" is a process on this host with its own 127.0.0.x address: an elasticd daemon
(node 1 hosts the store) or a torchrun agent (c10d rendezvous on node 1,
``--monitor-interval 0.1``, ``last_call_timeout=1`` like elasticd's default), one worker
per node (tests/bench/recovery_worker.py), fresh for every run.  The worker appends a
``start`` event as its first action, carrying the time the process was exec'd, so each
figure is given twice: to the last worker's ``start`` (everything), and to the last
worker's exec (the control plane alone: the workers' own Python start-up excluded).

1. worker failure: SIGKILL of rank 1's worker (2 nodes, max restarts 3) -> both workers of
   the next attempt started;
2. scale-up 2 -> 3: the third node's process started -> 3 workers started with
   WORLD_SIZE=3; the control figure starts once that process has loaded Python and torch
   (tests/bench/node_launcher.py runs both programs), which takes ~1.3 s here for both;
3. node loss 3 -> 2: SIGKILL of node 3 (daemon or agent, with its worker) -> 2 workers
   started with WORLD_SIZE=2, or nothing within 120 s; once with training workers (their
   collectives break), once with idle ones (only the control plane can notice; in place,
   they go idle once the world of 3 formed, and an idle survivor never reaches a commit:
   the daemon stops it after the job's rejoin timeout, 60 s by default, and starts every
   worker anew);
4. formation: 2 nodes up, the job accepted by the daemon (elasticd) / the agents started
   (torchrun: its start-up is its formation) -> both workers exec'd;
5. node frozen 3 -> 2: SIGSTOP of node 3's daemon (or agent) and its worker: no socket
   closes, nothing answers; the frozen processes are SIGKILLed when the run ends;
6. node cut off 3 -> 2: every node in a network namespace of its own (tests/system/netns.py,
   root only), node 3's port on the bridge taken down: its packets are dropped both ways.

For node loss, frozen and cut off, ``known`` is the time until the last survivor heard of the
loss: its worker was told to abort (in place) or was sent SIGTERM by its daemon or agent (a
restart); the target is 0.5 s.

The worker here is replicated.  A sharded one (FSDP2, 251.7M parameters with
``--hidden 4096 --layers 15``) losing node 3 of 3, in place and on the restart path, against
torchrun with DCP from disk, is tests/bench/bench_resume.py, which runs these nodes.

torchrun runs twice: as shipped, and with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see
TorchrunUnshared).  The worker runs an all_reduce every 100 ms, so a dead peer breaks the
survivors' collectives as it would in training.

``--backend nccl`` (default gloo) runs the workers' group on NCCL with CUDA tensors, for a
GPU host: elasticd's in-place system only (the others are refused), every node's worker on
cuda:0 of this host (recovery_worker.py: each worker claims an NCCL host of its own, as
tests/gpu does).  The node-loss figure then also says whether the survivors ``kept`` their
processes (1.0) or were replaced (0.0):

    python3 tests/bench/bench_recovery.py --backend nccl --only node-loss --system elasticd-inplace --runs 1

In place (elasticd-inplace), each figure is followed by its phases: the workers' library
logs each point of a re-form (``elasticd.elastic.runtime.phase``, debug level), the worker
records them as events, and the bench prints when the last rank concerned got to each
(medians; from the event, a scale-up's from the newcomer's ask for its place): the round
formed, the survivors notified, left the old group, the old group destroyed, the new
group's forming started and ended, the state synced, the first step.

elasticd-spares is in place with ``--spares 1`` on nodes of two slots: every node keeps a
warm worker parked (the bench waits for them before the event).  A worker failure is then
filled by its node's spare; a node loss by a survivor's spare, in the survivors' own round:
"back at full size" is the time until 3 ranks started in a world of 3 again (there is no
world of 2 in between).  The other figures count as for elasticd-inplace.

A figure that cannot be measured (no formation, a daemon that would not start) is shown
as such in the table, with its reason under it; its run's directory is kept and named.

The bench polls the event file every 10 ms (benchmarks may; tests may not).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "system"))
import netns  # tests/system/netns.py
from conftest import Cluster
from harness import PY, free_port
from hostwide import remove_tree

WORKER = str(HERE / "recovery_worker.py")
LAUNCHER = str(HERE / "node_launcher.py")
ENV = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
LOSS_CAP = 120.0


class Unmeasured(Exception):
    """A run that could not reach the event its figure starts at (e.g. no formation)."""


def need(found: Any, what: str) -> Any:
    if not found:
        raise Unmeasured(what)
    return found


class Events:
    def __init__(self, directory: Path) -> None:
        self.path = directory / "events.jsonl"

    def read(self) -> list[dict[str, Any]]:
        """The events written so far (a line still being appended is left for later)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def wait(self, found: Callable[[list[dict[str, Any]]], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = found(self.read())
            if result is not None:
                return result
            time.sleep(0.01)
        return None


def starts_after(t0: float, count: int, world: int | None = None):
    """The ``start`` events after t0, one per rank, once ``count`` ranks started."""

    def found(events):
        latest = {
            e["rank"]: e
            for e in events
            if e["event"] == "start" and e["t"] > t0 and (world is None or e["world"] == world)
        }
        return list(latest.values()) if len(latest) >= count else None

    return found


def ready(count: int, world: int):
    def found(events):
        ranks = {e["rank"] for e in events if e["event"] == "ready" and e["world"] == world}
        return ranks if len(ranks) >= count else None

    return found


def idling(count: int):
    def found(events):
        ranks = {e["rank"] for e in events if e["event"] == "idle" and e["world"] == count}
        return ranks if len(ranks) >= count else None

    return found


def worker_pid(events: Events, rank: int) -> int:
    return [e for e in events.read() if e["event"] == "start" and e["rank"] == rank][-1]["pid"]


def kill_tree(pid: int) -> None:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.01)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


class Elasticd:
    name = "elasticd"
    slots = 1  # each node's

    def __init__(self, base: Path, nodes: int, hosts: netns.Hosts | None = None) -> None:
        self.events = Events(base)
        self.base = base
        self.hosts = hosts
        self.frozen: list[psutil.Process] = []
        self.worker_mode: tuple[str, ...] = ()
        self.backend_args: tuple[str, ...] = ()  # ("nccl",): the in-place worker on NCCL
        self.env_args: tuple[str, ...] = ()
        if hosts is None:
            self.cluster: Any = Cluster(
                base,
                nodes,
                slots=self.slots,
                env={"RES_OPTIONS": ENV["RES_OPTIONS"]},
                resize_interval=None,
            )  # the daemon's defaults
        else:
            from test_partition import NetnsCluster  # tests/system: a daemon per test host

            self.cluster = NetnsCluster(hosts, base)
            for daemon in self.cluster.daemons:
                at = daemon.args.index("--slots")
                daemon.args = (*daemon.args[: at + 1], str(self.slots), *daemon.args[at + 2 :])
            self.env_args = ("--env", "GLOO_SOCKET_IFNAME=eth0")
        for daemon in self.cluster.daemons:
            daemon.program = (PY, LAUNCHER, str(base), "elasticd")

    def launch(self, count: int, nnodes: str) -> float:
        """Start ``count`` daemons, then submit the job; returns when the daemon accepted it
        (the CLI's own start-up, ~80 ms, is bench_control.py's figure)."""
        for daemon in self.cluster.daemons[:count]:
            daemon.start()
        job = self.cluster[0].submit(
            "--nnodes",
            nnodes,
            "--max-restarts",
            "3",
            *self.options,
            *self.env_args,
            *self.job_line(),
        )
        return float(job["created"])

    options: tuple[str, ...] = ()  # submit's, after the topology

    def job_line(self) -> tuple[str, ...]:
        """The submitted program and its arguments (after the options)."""
        line = (WORKER, "--", str(self.base), *self.worker_mode, *self.backend_args)
        return ("--python", PY, *line)

    def add_node(self) -> tuple[float, int]:
        """Start the next daemon; returns when, and its pid."""
        daemon = self.cluster.daemons[len([d for d in self.cluster.daemons if d.proc])]
        started = time.time()
        daemon.start(wait=False)
        assert daemon.proc is not None
        return started, daemon.proc.pid

    def kill_node(self, index: int) -> float:
        """SIGKILL the node whole, its daemon and its workers at once, as torchrun's agent
        and its workers are: a worker left to its PDEATHSIG outlives its daemon's exit."""
        daemon = self.cluster[index]
        started = time.time()
        kill_tree(daemon.proc.pid)
        daemon.wait_exit()
        return started

    def node_pid(self, index: int) -> int:
        return self.cluster[index].proc.pid

    def freeze_node(self, index: int) -> float:
        return freeze(self, self.node_pid(index))

    def cut_node(self, index: int) -> float:
        assert self.hosts is not None
        started = time.time()
        self.hosts.partition(index + 1)
        return started

    def stop(self) -> None:
        thaw(self)
        self.cluster.stop()


class ElasticdInPlace(Elasticd):
    """The same cluster, the job submitted with --in-place and the worker's loop under
    elasticd.elastic: survivors keep their processes."""

    name = "elasticd-inplace"
    options: tuple[str, ...] = ("--in-place",)

    def __init__(self, base: Path, nodes: int, hosts: netns.Hosts | None = None) -> None:
        super().__init__(base, nodes, hosts)
        self.worker_mode = ("inplace",)


class ElasticdSpares(ElasticdInPlace):
    """In place with a warm spare on every node (``--spares 1``, two slots a node): a lost
    worker's place is taken by its node's spare, a lost node's by a survivor's."""

    name = "elasticd-spares"
    slots = 2
    options = ("--in-place", "--spares", "1")

    def launch(self, count: int, nnodes: str) -> float:
        created = super().launch(count, nnodes)
        spares = self.events.wait(
            lambda events: (
                True
                if sum(e["event"] == "warm" and e["rank"] < 0 for e in events) >= count
                else None
            ),
            120,
        )
        need(spares, "the spares did not warm up")  # the job has them before the event
        return created


class Torchrun:
    """torchrun as shipped: the agents share the rendezvous TCPStore with the workers."""

    name = "torchrun"
    env = ENV

    def __init__(self, base: Path, nodes: int, hosts: netns.Hosts | None = None) -> None:
        self.events = Events(base)
        self.base = base
        self.hosts = hosts
        self.frozen: list[psutil.Process] = []
        self.worker_mode: tuple[str, ...] = ()
        self.port = free_port() if hosts is None else 29400
        self.agents: list[subprocess.Popen[bytes]] = []
        self.nnodes = "2:2"

    def addr(self, index: int) -> str:
        """Node ``index``'s address (1-based)."""
        return f"127.0.0.{index}" if self.hosts is None else self.hosts.addr(index)

    def launch(self, count: int, nnodes: str) -> float:
        """Start ``count`` agents (they are the job); returns when the first one started.

        The others start once the first listens on the rendezvous endpoint: on one host every
        agent finds 127.0.0.1 its own and the first to bind it hosts the store; on real hosts
        only node 1 would, as with elasticd here."""
        self.nnodes = nnodes
        started, _ = self.add_node()
        if self.hosts is None:
            wait_listening(self.port, 60)
        else:  # nothing in the root namespace connects to a test host: its log says it listens
            log = self.base / "torchrun1.log"
            deadline = time.monotonic() + 60
            while (
                time.monotonic() < deadline
                and not self.events.read()
                and (not log.exists() or b"rdzv" not in log.read_bytes())
            ):
                time.sleep(0.05)
            time.sleep(1.0)
        for _ in range(count - 1):
            self.add_node()
        return started

    log_name = "torchrun"  # node i's output goes to <log_name><i>.log

    def program(self) -> list[str]:
        """What node_launcher.py runs, before the torchrun options."""
        return ["torch.distributed.run"]

    def worker_args(self) -> list[str]:
        return [WORKER, str(self.base), *self.worker_mode]

    def node_env(self) -> dict[str, str]:
        return dict(self.env)

    def add_node(self) -> tuple[float, int]:
        """Start the next node's program; returns when, and its pid."""
        index = len(self.agents) + 1
        argv = [
            PY,
            LAUNCHER,
            str(self.base),
            *self.program(),
            *torchrun_line(self.nnodes, f"{self.addr(1)}:{self.port}", self.addr(index)),
            *self.worker_args(),
        ]
        env = self.node_env()
        if self.hosts is not None:
            argv = self.hosts.exec_argv(index, argv)
            env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
        started = time.time()
        log = open(self.base / f"{self.log_name}{index}.log", "wb")
        self.agents.append(
            subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
        return started, self.agents[-1].pid

    def kill_node(self, index: int) -> float:
        started = time.time()
        kill_tree(self.agents[index].pid)
        return started

    def node_pid(self, index: int) -> int:
        return self.agents[index].pid

    def freeze_node(self, index: int) -> float:
        return freeze(self, self.node_pid(index))

    def cut_node(self, index: int) -> float:
        assert self.hosts is not None
        started = time.time()
        self.hosts.partition(index + 1)
        return started

    def stop(self) -> None:
        thaw(self)
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                pass
            kill_tree(agent.pid)
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def torchrun_line(nnodes: str, endpoint: str, local_addr: str) -> list[str]:
    """The torchrun options of the node at ``local_addr``: given to torchrun and, as they
    are, to elasticrun."""
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "bench",
        "--rdzv-conf",
        "last_call_timeout=1,join_timeout=120",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
        "--local-addr",
        local_addr,
    ]


class Elasticrun(Torchrun):
    """torchrun's line, word for word, given to elasticrun on each node, with no daemon: each
    elasticrun starts a private daemon (docs/elasticrun.md, "Where no elasticd runs"); node 1,
    whose address is the endpoint, hosts the store.  A node killed is its elasticrun, daemon
    and worker at once (a host gone), as torchrun's agent and worker are.  Its scale-up
    figure's control plane includes the newcomer's daemon's start (its import of torch
    among it): that is what a node arriving costs here."""

    name = "elasticrun"
    options: tuple[str, ...] = ()

    log_name = "elasticrun"

    def program(self) -> list[str]:
        return ["elasticrun_node", "--private", *self.options]

    def worker_args(self) -> list[str]:
        return [*super().worker_args(), *getattr(self, "backend_args", ())]

    def node_env(self) -> dict[str, str]:
        return {**self.env, "TMPDIR": str(self.base), "PYTHONPATH": str(HERE)}

    def launch(self, count: int, nnodes: str) -> float:
        """Start ``count`` elasticruns at once (no daemon to wait for: each starts its own)."""
        self.nnodes = nnodes
        started = time.time()
        for _ in range(count):
            self.add_node()
        return started

    def stop(self) -> None:
        """SIGTERM to each elasticrun cancels the job; each waits for its daemon to stop."""
        for node in self.agents:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in self.agents:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                kill_tree(node.pid)


class ElasticrunInPlace(Elasticrun):
    """The same, with --in-place (the worker under elasticd.elastic): survivors keep their
    processes."""

    name = "elasticrun-inplace"
    options = ("--in-place",)

    def __init__(self, base: Path, nodes: int, hosts: netns.Hosts | None = None) -> None:
        super().__init__(base, nodes, hosts)
        self.worker_mode = ("inplace",)


class TorchrunUnshared(Torchrun):
    """torchrun with its documented opt-out of the shared store: in torch 2.13 a node that
    joins after the first round waits forever for a MASTER_ADDR that rank 0 only publishes
    in the first round, so scale-up needs this."""

    name = "torchrun-unshared"
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def freeze(system: Any, pid: int) -> float:
    """SIGSTOP a node's program and every process under it (its workers): nothing closes."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    started = time.time()
    for proc in tree:
        try:
            proc.suspend()
            system.frozen.append(proc)
        except psutil.NoSuchProcess:
            pass
    return started


def thaw(system: Any) -> None:
    """The frozen processes are killed (then woken, so that the kill lands)."""
    for proc in system.frozen:
        try:
            proc.kill()
            proc.resume()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(system.frozen, timeout=10)
    system.frozen = []


SYSTEMS = (
    Elasticd,
    ElasticdInPlace,
    ElasticdSpares,
    Elasticrun,
    ElasticrunInPlace,
    Torchrun,
    TorchrunUnshared,
)
BASELINES = ("torchrun", "torchrun-unshared")


def figure(
    t0: float, starts: list[dict[str, Any]] | None, control_t0: float | None = None
) -> dict[str, float] | None:
    """From t0 to the last worker's start (total), and from control_t0 (default t0) to its
    exec (control)."""
    if starts is None:
        return None
    return {
        "total": max(e["t"] for e in starts) - t0,
        "control": max(e["exec"] for e in starts) - (control_t0 or t0),
    }


def training(system, t0: float, figures: dict[str, float] | None) -> dict[str, float] | None:
    """What users feel, from the workers' steps (an all_reduce each): ``resumed``, from t0 to
    the first step of a world that did not step before t0 (a new process, or a survivor in
    its new world); ``stall``, the longest time in which no rank finished a step, from the
    last step before t0 until 2 s after training resumed.  In place, also the re-form's
    phases (``p:...``, see PHASES)."""
    if figures is None:
        return None

    def world(e: dict[str, Any]) -> tuple[Any, ...]:  # in place, a survivor's round too: a
        return e["pid"], e["world"], e.get("in_round")  # 2 -> 3 -> 2 job is at 2 twice

    old = {world(e) for e in system.events.read() if e["event"] == "step" and e["t"] <= t0}

    def first_new(events):
        new = [
            e["t"] for e in events if e["event"] == "step" and e["t"] > t0 and world(e) not in old
        ]
        return min(new) if new else None

    resumed = system.events.wait(first_new, 60)
    if resumed is None:
        return figures
    system.events.wait(lambda events: True if time.time() > resumed + 2 else None, 10)
    steps = sorted(e["t"] for e in system.events.read() if e["event"] == "step")
    last = max((t for t in steps if t <= t0), default=t0)
    window = [last] + [t for t in steps if last < t <= resumed + 2]
    stall, stalled = max(
        ((b - a, a) for a, b in itertools.pairwise(window)), default=(resumed - last, last)
    )
    if isinstance(system, (ElasticdInPlace, ElasticrunInPlace)):  # survivors were exec'd long ago
        figures = {k: v for k, v in figures.items() if k != "control"}
        figures = {**figures, **phases(system.events.read(), t0, resumed, stalled)}
    return {**figures, "resumed": resumed - t0, "stall": stall}


# An in-place re-form's points (the workers' elasticd.elastic logs them: runtime.phase), in
# order, each the time since the event at which the last rank concerned got there.
PHASES = (
    ("p:asked", "the newcomer asked for its place"),
    ("p:last-step", "the stall began (last step before it)"),
    ("p:formed", "round formed (first node's workers placed)"),
    ("p:notified", "survivors notified (update/abort)"),
    ("p:left", "survivors left the old group (interrupt)"),
    ("p:old-destroyed", "old group destroyed"),
    ("p:form-start", "new group's forming started"),
    ("p:form-end", "new group formed"),
    ("p:sync-end", "state synced"),
    ("p:first-step", "first step after"),
)


def phases(
    events: list[dict[str, Any]], t0: float, resumed: float, stalled: float
) -> dict[str, float]:
    """Where an in-place figure's time went: from t0 (a scale-up: from the newcomer's ask for
    a place, its warm-up excluded) to each point of the re-form that training resumed in,
    the last rank to reach it counting (see PHASES)."""
    old = {e["pid"] for e in events if e["t"] <= t0}
    points = [e for e in events if e["event"] == "phase" and t0 < e["t"] <= resumed]
    asks = [e["t"] for e in points if e["name"] == "ask-start" and e["pid"] not in old]
    origin = min(asks) if asks else t0
    rounds = [e["round"] for e in points if e["name"] == "placed"]
    if not rounds:
        return {}
    final = max(rounds)

    def latest(names: tuple[str, ...], pids: set[int] | None = None, round: int | None = None):
        """Per process its first such point, then the latest of those."""
        first: dict[int, float] = {}
        for e in points:
            if (
                e["name"] in names
                and (pids is None or e["pid"] in pids)
                and (round is None or e["round"] == round)
            ):
                first[e["pid"]] = min(first.get(e["pid"], e["t"]), e["t"])
        return max(first.values()) - origin if first else None

    placed = [e["t"] for e in points if e["name"] == "notice-place" and e["round"] == final]
    found = {
        "p:asked": origin - t0 if asks else None,
        "p:last-step": stalled - origin,
        "p:formed": min(placed) - origin if placed else None,
        "p:notified": latest(("notice-update", "notice-abort"), old),
        "p:left": latest(("interrupt", "leave-start"), old),
        "p:old-destroyed": latest(("leave-end",), old),
        "p:form-start": latest(("form-start",), round=final),
        "p:form-end": latest(("form-end",), round=final),
        "p:sync-end": latest(("sync-end",), round=final),
        "p:first-step": resumed - origin,
    }
    return {key: value for key, value in found.items() if value is not None}


def node_up(base: Path, pid: int) -> float:
    """When node ``pid`` had Python and torch loaded (node_launcher.py)."""
    return float((base / f"up-{pid}").read_text())


def training_steps(count: int):
    def found(events):
        return True if sum(e["event"] == "step" for e in events) >= count else None

    return found


def worker_failure(system) -> dict[str, float] | None:
    system.launch(2, "2:2")
    need(system.events.wait(ready(2, 2), 120), "no formation")
    system.events.wait(training_steps(10), 30)  # a steady step rhythm before the event
    t0 = time.time()
    os.kill(worker_pid(system.events, 1), signal.SIGKILL)
    return training(system, t0, figure(t0, system.events.wait(starts_after(t0, 2), 120)))


def scale_up(system) -> dict[str, float] | None:
    system.launch(2, "2:3")
    need(system.events.wait(ready(2, 2), 120), "no formation")
    system.events.wait(training_steps(10), 30)
    t0, pid = system.add_node()
    starts = system.events.wait(starts_after(t0, 3, world=3), 120)
    return training(system, t0, figure(t0, starts, node_up(system.base, pid) if starts else None))


def node_loss(system, event: str = "kill") -> dict[str, float] | None:
    system.launch(3, "2:3")
    need(system.events.wait(ready(3, 3), 120), "no formation")
    idle = "idle" in system.worker_mode
    if idle:  # in place, the workers commit until they see this file
        (system.base / "idle").touch()
        need(system.events.wait(idling(3), 30), "the workers did not go idle")
    else:
        system.events.wait(training_steps(15), 30)
    lost = {p.pid for p in psutil.Process(system.node_pid(2)).children(recursive=True)}
    if event == "freeze":
        t0 = system.freeze_node(2)
    elif event == "cut":
        t0 = system.cut_node(2)
    else:
        t0 = system.kill_node(2)
    # With spares a survivor's spare fills in, in the survivors' own round (world 3); idle
    # survivors never take their places, and every worker starts anew: a world of 2.
    sizes = ((3, 2) if idle else (3,)) if system.name == ElasticdSpares.name else (2,)

    def back(events: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return next(
            (found for size in sizes if (found := starts_after(t0, size, world=size)(events))),
            None,
        )

    starts = system.events.wait(back, LOSS_CAP)
    found = figure(t0, starts)
    result = found if idle else training(system, t0, found)
    if result is not None and getattr(system, "backend_args", ()):
        result = {**result, "kept": kept(system, t0)}
    if result is not None and starts[0]["world"] == 3:
        result = {**result, "full": result["total"]}
    if result is not None and not idle:
        told = known(system.events.read(), t0, lost)
        if told is not None:
            result = {**result, "known": told}
    return result


def known(events: list[dict[str, Any]], t0: float, lost: set[int]) -> float | None:
    """When the last survivor heard of the loss: its worker was told to abort or to re-form
    (in place) or got SIGTERM from its daemon or agent (a restart), from t0."""
    before = {e["pid"] for e in events if e["t"] <= t0} - lost
    heard: dict[int, float] = {}
    for e in events:
        told = e["event"] == "term" or (
            e["event"] == "phase" and e["name"] in ("notice-abort", "notice-update")
        )
        if told and e["t"] > t0 and e["pid"] in before:
            heard[e["pid"]] = min(heard.get(e["pid"], e["t"]), e["t"])
    return max(heard.values()) - t0 if heard and len(heard) >= len(before) else None


def node_frozen(system) -> dict[str, float] | None:
    """SIGSTOP of a node's daemon (or agent) and its worker: no socket closes."""
    return node_loss(system, "freeze")


def node_cut_off(system) -> dict[str, float] | None:
    """A node's packets dropped (its switch port down, in a network namespace)."""
    return node_loss(system, "cut")


def kept(system, t0: float) -> float:
    """1.0 when both ranks of the world of 2 after t0 are processes that ran before t0 (the
    survivors, in place), else 0.0 (the job restarted them)."""
    events = system.events.read()
    before = {e["pid"] for e in events if e["t"] <= t0}
    starts = starts_after(t0, 2, world=2)(events) or []
    return float(bool(starts) and all(e["pid"] in before for e in starts))


def node_loss_idle(system) -> dict[str, float] | None:
    """Node loss noticed by the control plane alone: the workers do no collectives (in place
    too: the worker's loop stays under elasticd.elastic, it only sleeps)."""
    system.worker_mode = (*system.worker_mode, "idle")
    return node_loss(system)


def formation(system) -> dict[str, float] | None:
    t0 = system.launch(2, "2:2")
    return figure(t0, system.events.wait(starts_after(t0, 2), 120))


SCENARIOS = {
    "failure": ("worker failure -> group running", worker_failure, 2),
    "scale-up": ("scale-up 2->3", scale_up, 3),
    "node-loss": ("node loss 3->2", node_loss, 3),
    "node-loss-idle": ("node loss 3->2, idle workers", node_loss_idle, 3),
    "node-frozen": ("node frozen 3->2", node_frozen, 3),
    "node-cut-off": ("node cut off 3->2", node_cut_off, 3),
    "formation": ("formation", formation, 2),
}


def measure(kind, scenario, nodes: int, backend: str = "gloo") -> dict[str, Any] | None:
    """One run in a fresh directory: its figures, None when it did not recover, or
    ``{"unmeasured": why}`` when it could not be measured (the run failed before its
    event: no formation, a daemon that did not start...).  The directory is kept (and named
    on stderr) unless the run recovered."""
    base = Path(tempfile.mkdtemp(prefix="elasticd-recovery-"))
    base.chmod(0o755)
    subnet = hosts = None
    result: dict[str, Any] | None
    try:
        try:
            if scenario is node_cut_off:
                why = netns.usable()
                if why:
                    raise Unmeasured(why)
                subnet = netns.Subnet.claim()
                hosts = subnet.hosts(nodes).up()
            system = kind(base, nodes, hosts) if hosts is not None else kind(base, nodes)
            if backend == "nccl":
                system.backend_args = ("nccl",)
            try:
                result = scenario(system)
            finally:
                if hosts is not None:
                    hosts.heal_all()
                system.stop()
        finally:
            if hosts is not None:
                hosts.down()
            if subnet is not None:
                subnet.release()
    except Exception as exc:  # any failure of the run is its table cell, not the bench's end
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        result = {
            "unmeasured": why if isinstance(exc, Unmeasured) else f"{type(exc).__name__}: {why}"
        }
    if result is None or "unmeasured" in result:
        print(
            f"{kind.name} {'did not recover' if result is None else result['unmeasured']}; "
            f"its logs: {base}",
            file=sys.stderr,
        )
    else:
        remove_tree(base)
    return result


def unmeasured(results: list[dict[str, Any] | None]) -> str | None:
    """Why a figure's runs could not be measured (the first run's reason), if none was."""
    if results and all(r is not None and "unmeasured" in r for r in results):
        return results[0]["unmeasured"]
    return None


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run each")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", choices=list(SCENARIOS), action="append", help="these figures only")
    p.add_argument(
        "--system",
        choices=[kind.name for kind in SYSTEMS],
        action="append",
        help="these systems only",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="the workers' process group (default gloo, on CPU); nccl: CUDA tensors "
        "on a GPU host, for the elasticd-inplace system only",
    )
    args = p.parse_args()
    if args.backend == "nccl":
        if any(name != ElasticdInPlace.name for name in args.system or ()):
            p.error("--backend nccl: only --system elasticd-inplace runs on NCCL")
        args.system = [ElasticdInPlace.name]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up as Ctrl-C does
    runs = 1 if args.quick else args.runs
    report: dict[str, Any] = {}
    for title, scenario, nodes in (SCENARIOS[key] for key in args.only or SCENARIOS):
        report[title] = {}
        for kind in (k for k in SYSTEMS if not args.system or k.name in args.system):
            results = []
            for _ in range(runs):
                result = measure(kind, scenario, nodes, args.backend)
                results.append(result)
                if not any(r is not None and "unmeasured" not in r for r in results):
                    break  # the first run did not recover (or could not be measured): taken as what it does
            report[title][kind.name] = results
            print(f"{title:34} {kind.name:17} {results}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)


def cell(results: list[dict[str, Any] | None], key: str) -> tuple[str, float | None]:
    """``median (min..max)`` of the runs that recovered, and how many did not; "not
    measured" when no run could be (the reason is printed under the table)."""
    if not results:
        return "not run", None
    if unmeasured(results) is not None:
        return "not measured (see below)", None
    done = [r[key] for r in results if r is not None and key in r]
    lost = sum(r is None for r in results)
    odd = sum(r is not None and "unmeasured" in r for r in results)
    failed = (f" {lost}/{len(results)} none" if lost else "") + (
        f" {odd}/{len(results)} not measured" if odd else ""
    )
    if not done:
        return f"none in {LOSS_CAP:g} s", None
    s = summary(done)
    return f"{s['median']:.3f} ({s['min']:.3f}..{s['max']:.3f}){failed}", s["median"]


def print_table(report: dict[str, Any]) -> None:
    """One row per figure: each system's median (min..max) in seconds, and elasticd's time
    as a fraction of each torchrun's; then why each figure not measured was not."""
    ours = [kind.name for kind in SYSTEMS if kind.name not in BASELINES]
    notes = []
    print(
        f"{'figure (s)':36} "
        + " ".join(f"{name:30}" for name in (*ours, *BASELINES))
        + " "
        + " ".join(f"{'in-place/' + name:26}" for name in BASELINES)
    )
    for title, by_system in report.items():
        for key, label in (
            ("total", title),
            ("control", "  control plane only"),
            ("resumed", "  training resumed (first step)"),
            ("stall", "  stall (longest gap in steps)"),
            ("full", "  back at full size (a spare placed)"),
            ("known", "  lost node known to every survivor"),
        ):
            row = [cell(by_system.get(name, []), key)[0] for name in (*ours, *BASELINES)]
            if key != "total" and all(
                text == "not run" or text.startswith(("none", "not measured")) for text in row
            ):
                continue
            _, inplace = cell(by_system.get("elasticd-inplace", []), key)
            ratios = []
            for name in BASELINES:
                _, theirs = cell(by_system.get(name, []), key)
                ratios.append(f"{inplace / theirs:.2f}x" if inplace and theirs else "-")
            print(
                f"{label:36} "
                + " ".join(f"{c:30}" for c in row)
                + " "
                + " ".join(f"{r:18}" for r in ratios)
            )
        print_phases(by_system.get("elasticd-inplace", []))
        notes += [
            f"{title}, {name}: not measured: {why}"
            for name, results in by_system.items()
            if (why := unmeasured(results)) is not None
        ]
    for note in notes:
        print(note)


def print_phases(results: list[dict[str, float] | None]) -> None:
    """The in-place figure's phases (medians over the runs; see PHASES): since the event, or
    for a scale-up since the newcomer asked for its place (``asked`` after the node started)."""
    for key, label in PHASES:
        text, median = cell(results, key)
        if median is not None:
            print(f"    {label:48} {text}")


if __name__ == "__main__":
    main()
