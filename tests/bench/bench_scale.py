"""Scale benchmark: simulated clusters of 128, 1024 and 4096 nodes on TCPStore and on etcd.

Usage: python tests/bench/bench_scale.py [--backend c10d|c10d-torch|etcd|both|servers]
                                         [--nodes 128,1024,4096]
                                         [--window S] [--quick] [--json]
                                         [--rdzv-only] [--profile DIR] [--keep-logs]

Harness.  Per row (a backend and a cluster size N), fresh:

- the store server in a process of its own, so that its CPU can be measured: TCPStore is
  ``TCPStoreServer`` (what a daemon hosts) in a child of this script (``--serve-c10d``),
  or, for ``c10d-torch``, torch's own libuv server there (the reference it replaced); etcd
  is ``/usr/bin/etcd`` with a data dir of its own;
- N simulated daemons: each node is a real ``NodeService(NodeRegistry(...))`` running its
  heartbeat duties exactly as app.py builds them (default keep-alive 1 s x 3, a signed
  record of ~520 bytes: 8 slots, 8 GPUs, labels, peer endpoint and key), with no workers,
  and counts its own store traffic:
  - node 0 starts first, in a process with a client of its own: the registry elects one
    observer that reads every heartbeat (membership.py), the first node to tick; node 1
    shares its process (the node killed below: its heartbeat never starves in a crowd);
  - a *crowd* of N-3 nodes spread over a few processes (``scale_crowd.py``), each process
    one event loop whose nodes share one store client (a small pool of connections);
    their starts are staggered over one interval;
  - the *probe*, node N-1, in this process with a client of its own on its own event loop,
    starts last: what one ordinary daemon feels while the cluster runs.

Figures, over a steady window once every node registered (ended a first duty) and the crowd
beats at its pace (--startup bounds the wait for both):

- duty ms: the probe's heartbeat duty (``NodeRegistry.tick``), wall time, median / p99, and
  the CPU time it took (its process's, the duty being all its loop runs: the figure that
  does not depend on how busy this machine is); observer ms: the same for whichever node
  observes (node 0 unless the election moved);
- store ops/node/s, bytes/node/s: every node's store requests (a key read or written: a
  ``get_many`` of k keys is k requests, as the server serves them) and the bytes of keys
  and values sent and received, summed over the crowd and the probe, / N / window;
- store CPU %: the server process's CPU time over the window, in % of one core;
- lost seen s: node 1 is killed (its heartbeat loop cancelled); the time until the
  probe's ``NodeService.states()`` reports it LOST (time.monotonic is CLOCK_MONOTONIC, one
  clock for every process);
- rdzv s (at --rdzv-at sizes, 1024 by default): after the crowd's heartbeat loops stopped,
  N rendezvous handlers (one per node, the probe's here, each with a store client of its own
  and its keeper running) are released together into one job's first rendezvous with
  min = max = N; from the release until the last one returned.  A run that does not complete
  within the join timeout (--join-timeout, 60 s) is null, with the reason.  Printed with
  it: the store bytes a node moved per second of the rendezvous and the nodes' CPU per node;
  where the simulated nodes alone need more CPU than the machine's cores have in the 2 s
  target, the row says so plainly (each real node spends its ms on its own machine).
  ``--rdzv-only``: the rendezvous alone, at every --nodes size (no steady window, no lost
  node); ``--profile DIR``: a cProfile of each crowd process's rendezvous.

A row whose duties overrun the keep-alive interval (the probe's p99, or any other duty) is
marked 'overloaded'; every phase has a bound (start-up, lost node, rendezvous), and a crowd
that grows past --memory-limit of the machine's memory ends its row, so that a registry that
does not keep up is reported, never waited for.  The crowd shares this machine's cores: to
beat at its pace it needs about N x the probe's CPU per duty every interval (printed when
that exceeds half the cores).  A starved crowd beats late, its nodes flap lost and back, and
every node reads those changes: its rows' store figures are the overload's, not the
design's, while the probe's and the observer's CPU per duty still are the code's cost.
Each row also prints the store traffic per node by kind of key, and for the rendezvous
the requests, bytes and the nodes' CPU in all.  ``--quick``: 128 nodes only, a 3 s window,
the rendezvous at 128 too (a smoke run of every phase, ~15 s a backend).

``--detector``: the failure detector instead (no store): N simulated nodes, every one a real
detector (core/detector.py's rules, cluster/detector.py's wire with its MAC and replay
window) on a UDP socket of its own, spread over --procs processes
(``detector_crowd.py``), all N the members of one job's round (each probes its two ring
neighbours every 100 ms) and known to each other (helpers).  Per size: datagrams sent and
accepted per node per second, and the crowd's CPU per node per second (ms), over the
window (``--active K``: only K consecutive nodes of the ring run, all N its members and
known to each: what one node pays in a cluster of N, where two cores cannot run N of them;
the two nodes at each end of the slice have a silent neighbour); beside them, today's
heartbeat per node (the steady rows' store requests and the
probe's duty CPU, from a run of this bench without --detector).  Where the crowd needs more
CPU than the machine has, its ticks come late and the row says 'overloaded' (the per-node
figures are then what each datagram costs, not what a node on its own machine pays less).

``--json`` prints one list of rows {"backend", "nodes", "duty_ms", "store_ops_per_node_s",
"lost_seen_s", "rdzv_s", ...} (null where not measured; more fields follow those) as its
last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see elasticd.store.c10d

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import psutil
from scale_crowd import (
    SIGNER_KEY,
    CountingStore,
    Counts,
    SimNode,
    Ticks,
    die_with_parent,
    node_name,
    node_record,
    open_store,
    percentile,
    raise_nofile,
)

from elasticd.core.liveness import KeepAlive
from elasticd.core.model import NodeState
from elasticd.rendezvous import RendezvousSettings
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous.keys import Keys
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import Signer

ETCD = "/usr/bin/etcd"
TARGETS = (
    "targets: duty <= 2 ms; store ops/node/s flat in N (store load linear in N, not N^2); "
    "lost node seen < 5 s at 4096 nodes; 1024-node rendezvous < 2 s"
)
RDZV_TARGET = 2.0  # seconds: the 1024-node rendezvous's target (docs/benchmarks.md)
REQUIRED = ("backend", "nodes", "duty_ms", "store_ops_per_node_s", "lost_seen_s", "rdzv_s")


# -- the store server ----------------------------------------------------------------------


def serve_c10d(kind: str) -> None:
    """The ``--serve-c10d [torch]`` role: host a TCPStore (the server a daemon hosts; torch:
    torch's libuv server, the reference), print its port, serve until stdin closes."""
    die_with_parent()
    raise_nofile()
    if kind == "torch":
        from datetime import timedelta

        from torch.distributed import TCPStore

        sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
        port = sock.getsockname()[1]
        store = TCPStore(
            "127.0.0.1",
            port,
            None,
            True,
            timedelta(seconds=300),
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
            use_libuv=True,
        )
        print(store.port, flush=True)
        sys.stdin.read()
        return
    from elasticd.store.tcpserver import TCPStoreServer

    server = TCPStoreServer("127.0.0.1", 0)
    print(server.port, flush=True)
    sys.stdin.read()
    server.close()


def client_kind(backend: str) -> str:
    """The store client a backend's nodes use: c10d-torch (torch's server) is a c10d store."""
    return "c10d" if backend.startswith("c10d") else backend


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    proc: asyncio.subprocess.Process
    endpoint: str
    data_dir: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def close(self) -> None:
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            else:
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


async def start_server(backend: str, scratch: str) -> Server:
    if backend.startswith("c10d"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            os.path.abspath(__file__),
            "--serve-c10d",
            *(["torch"] if backend == "c10d-torch" else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(scratch, "server.log"), "ab"),
        )
        try:
            port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
        except (TimeoutError, ValueError):
            proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"the store server did not start (see {scratch}/server.log)"
            ) from None
        return Server(proc, f"127.0.0.1:{port}")
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="etcd-", dir=scratch)
    proc = await asyncio.create_subprocess_exec(
        ETCD,
        "--name",
        "bench",
        "--data-dir",
        data,
        "--listen-client-urls",
        f"http://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"http://127.0.0.1:{client}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"bench=http://127.0.0.1:{peer}",
        "--log-level",
        "error",
        "--auto-compaction-mode",
        "revision",
        "--auto-compaction-retention",
        "100000",
        preexec_fn=die_with_parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(scratch, "etcd.log"), "ab"),
    )
    server = Server(proc, f"127.0.0.1:{client}", data)
    for _ in range(200):
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", client), timeout=0.5).close()
            return server
        await asyncio.sleep(0.05)
    await server.close()
    raise RuntimeError(f"etcd did not listen within 10 s (see {scratch}/etcd.log)")


class CpuMeter:
    """CPU time of some processes between mark() and read(), in % of one core."""

    def __init__(self, pids: list[int]) -> None:
        self._procs = [psutil.Process(pid) for pid in pids]
        self._start = 0.0
        self._used = 0.0

    def _total(self) -> float:
        total = 0.0
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def mark(self) -> None:
        self._start, self._used = time.monotonic(), self._total()

    def read(self) -> float:
        return 100.0 * self.seconds() / max(time.monotonic() - self._start, 1e-9)

    def seconds(self) -> float:
        """CPU seconds since mark()."""
        return self._total() - self._used

    def rss(self) -> int:
        total = 0
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total


# -- the crowd, seen from here -------------------------------------------------------------


class CrowdProcess:
    """One crowd process and its command pipe."""

    def __init__(self, proc: asyncio.subprocess.Process, first: int, count: int) -> None:
        self.proc, self.first, self.count = proc, first, count
        self.hello: dict[str, Any] = {}

    def holds(self, index: int) -> bool:
        return self.first <= index < self.first + self.count

    async def ask(self, msg: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(
                f"crowd process {self.proc.pid} died (exit {await self.proc.wait()})"
            )
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"crowd process {self.proc.pid}: {answer['error']}")
        return answer

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(OSError, RuntimeError):
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def start_crowds(
    opts: argparse.Namespace,
    backend: str,
    endpoint: str,
    cluster: str,
    n: int,
    scratch: str,
    crowds: list[CrowdProcess],
) -> None:
    """Nodes 0 (the first observer) and 1 (to be killed) in a process, then nodes 2..N-2
    over --procs processes (N-1 is the probe)."""
    members = n - 3
    procs = max(1, min(opts.procs, members))
    spans = [(0, 2)]
    first = 2
    for p in range(procs):
        count = members // procs + (1 if p < members % procs else 0)
        spans.append((first, count))
        first += count
    for p, (first, count) in enumerate(s for s in spans if s[1]):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            os.path.join(HERE, "scale_crowd.py"),
            "--backend",
            client_kind(backend),
            "--endpoint",
            endpoint,
            "--cluster",
            cluster,
            "--first",
            str(first),
            "--count",
            str(count),
            "--total",
            str(n),
            "--interval",
            str(opts.interval),
            "--connections",
            str(opts.connections if first else 4),
            *(["--profile", os.path.join(opts.profile, f"crowd-{p}.prof")] if opts.profile else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(scratch, f"crowd-{p}.log"), "ab"),
            limit=1 << 26,
        )
        crowds.append(CrowdProcess(proc, first, count))
    for crowd in crowds:
        line = await asyncio.wait_for(crowd.proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"a crowd process did not start (see {scratch}/crowd-*.log)")
        crowd.hello = json.loads(line)


async def ask_all(
    crowds: list[CrowdProcess], msg: dict[str, Any], timeout: float = 60.0
) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(c.ask(msg, timeout) for c in crowds)))


# -- one row -------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    nodes: int
    duty_ms: float | None = None
    duty_p99_ms: float | None = None
    duty_cpu_ms: float | None = None
    observer_cpu_ms: float | None = None
    observer_duty_ms: float | None = None
    observer_duty_p99_ms: float | None = None
    store_ops_per_node_s: float | None = None
    store_bytes_per_node_s: float | None = None
    store_cpu_pct: float | None = None
    lost_seen_s: float | None = None
    rdzv_s: float | None = None
    crowd_beats_per_node_s: float | None = None
    crowd_duty_p50_ms: float | None = None
    crowd_duty_max_ms: float | None = None
    probe_ops_per_s: float | None = None
    crowd_cpu_pct: float | None = None
    rdzv_store_cpu_pct: float | None = None
    rdzv_client_cpu_s: float | None = None
    rdzv_bytes_per_node_s: float | None = (
        None  # store bytes a node moved per second of the rendezvous
    )
    rdzv_cpu_ms_per_node: float | None = None
    status: str = "ok"
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)

    def overloaded(self, why: str) -> None:
        if self.status == "ok":
            self.status = "overloaded"
        self.notes.append(why)

    def doc(self) -> dict[str, Any]:
        doc = {k: getattr(self, k) for k in REQUIRED}
        doc.update({k: v for k, v in self.__dict__.items() if k not in doc})
        return doc


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


class Probe:
    """The bench's own node (the store host), on this process's loop."""

    def __init__(
        self, index: int, store: Any, cluster: str, endpoint: str, keep_alive: KeepAlive
    ) -> None:
        self.ticks = Ticks()
        self.victim: str | None = None
        self.lost_at: float | None = None  # since when the probe sees the victim lost
        self.lost = asyncio.Event()
        self.node = SimNode(
            index,
            store,
            Signer(SIGNER_KEY, cluster),
            cluster,
            endpoint,
            keep_alive,
            self.ticks,
            on_tick=self._ticked,
        )

    def _ticked(self) -> None:
        if self.victim is None:
            return
        if self.node.service.states().get(self.victim) is not NodeState.LOST:
            self.lost_at = None  # (a starved node may flap lost and back before it is killed)
            self.lost.clear()
        elif self.lost_at is None:
            self.lost_at = time.monotonic()
            self.lost.set()

    def state_of(self, name: str) -> NodeState | None:
        return self.node.service.states().get(name)


async def measure_row(opts: argparse.Namespace, backend: str, n: int, progress) -> Row:
    row = Row(backend, n)
    began = time.monotonic()
    scratch = tempfile.mkdtemp(prefix=f"bench-scale-{backend}-{n}-")
    cluster = f"scale-{backend}-{n}-{os.getpid()}"
    server: Server | None = None
    crowds: list[CrowdProcess] = []
    probe_store = None
    try:
        server = await start_server(backend, scratch)
        await start_crowds(
            opts, backend, server.endpoint, cluster, n, scratch, crowds
        )  # fills crowds
        probe_store = await open_store(client_kind(backend), server.endpoint, connections=4)
        row.phases["start"] = time.monotonic() - began
        pids = [c.proc.pid for c in crowds]
        guard = asyncio.create_task(memory_guard(CpuMeter(pids + [server.pid]), opts.memory_limit))
        phases = asyncio.create_task(
            run_phases(opts, row, server, crowds, probe_store, cluster, progress)
        )
        done, _ = await asyncio.wait({guard, phases}, return_when=asyncio.FIRST_COMPLETED)
        if guard in done:
            phases.cancel()
            await asyncio.gather(phases, return_exceptions=True)
            row.status = "overloaded"
            row.notes.append(guard.result())
        else:
            guard.cancel()
            phases.result()
    except Exception as exc:  # a failed row is reported, and the next one runs
        row.status = "failed"
        row.notes.append(f"{type(exc).__name__}: {exc}")
    finally:
        for crowd in crowds:
            await crowd.close()
        if probe_store is not None:
            await probe_store.close()
        if server is not None:
            await server.close()
        if row.status == "ok" and not opts.keep_logs:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            row.notes.append(f"logs in {scratch}")
    row.phases["total"] = time.monotonic() - began
    row.phases = {k: round(v, 1) for k, v in row.phases.items()}
    return row


async def memory_guard(meter: CpuMeter, limit: float) -> str:
    """Returns (ending the row) once the crowd and the server hold more than ``limit`` of
    the machine's memory, or the machine has less than 10% left."""
    total = psutil.virtual_memory().total
    while True:
        await asyncio.sleep(1.0)
        rss = meter.rss()
        if rss > limit * total or psutil.virtual_memory().available < 0.1 * total:
            return f"stopped: the crowd and the store held {rss / 2**30:.1f} GiB of memory"


async def run_phases(
    opts: argparse.Namespace,
    row: Row,
    server: Server,
    crowds: list[CrowdProcess],
    probe_store: Any,
    cluster: str,
    progress,
) -> None:
    n, interval = row.nodes, opts.interval
    keep_alive = KeepAlive(interval)
    if opts.rdzv_only:
        await ask_all(crowds, {"cmd": "halt"}, timeout=60)
        await rendezvous(opts, row, server, crowds, cluster, progress)
        return
    probe = Probe(n - 1, probe_store, cluster, server.endpoint, keep_alive)
    await probe.node.registry.create_epoch()  # as the store's host does
    try:
        # node 0 first (it becomes the observer), the others over one interval, the probe last
        t0 = time.monotonic() + 0.2
        await ask_all(crowds, {"cmd": "start", "first": t0, "t0": t0 + 0.5, "stagger": interval})
        probe.node.start(t0 + 0.5 + interval)

        # every node registered (its first duty ended), within --startup seconds
        registered = 0
        while time.monotonic() - t0 < opts.startup:
            stats = await ask_all(crowds, {"cmd": "stats"})
            registered = (
                sum(s["registered"] for s in stats) + probe.node.service.registered.is_set()
            )
            if registered == n:
                break
            await asyncio.sleep(0.5)
        row.phases["registered"] = time.monotonic() - t0
        if registered < n:
            row.overloaded(f"{registered}/{n} nodes ended a first duty within {opts.startup:g} s")
        progress(
            f"{row.backend} N={n}: {registered}/{n} nodes registered in {row.phases['registered']:.1f} s"
        )
        await settle(opts, row, crowds, t0, progress)

        # the steady window
        server_cpu = CpuMeter([server.pid])
        crowd_cpu = CpuMeter([c.proc.pid for c in crowds])
        await ask_all(crowds, {"cmd": "mark"})
        server_cpu.mark()
        crowd_cpu.mark()
        mark = time.monotonic()
        probe_base = probe.node.counts.snapshot()
        await asyncio.sleep(opts.window)
        stats = await ask_all(crowds, {"cmd": "stats"}, timeout=120)
        window = time.monotonic() - mark
        row.store_cpu_pct = _r(server_cpu.read(), 1)
        row.crowd_cpu_pct = _r(crowd_cpu.read(), 1)
        probe_delta = [a - b for a, b in zip(probe.node.counts.snapshot(), probe_base)]
        summarize_window(row, stats, probe, probe_delta, window, mark, interval)
        row.phases["window"] = window
        progress(
            f"{row.backend} N={n}: duty {row.duty_ms} ms (p99 {row.duty_p99_ms}), "
            f"{row.store_ops_per_node_s} ops/node/s, store CPU {row.store_cpu_pct}%"
        )

        # a node killed: until the probe sees it lost
        await lost_node(opts, row, crowds, probe, progress)
    finally:
        if probe.node.task is not None:
            probe.node.task.cancel()
            await asyncio.gather(probe.node.task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ask_all(crowds, {"cmd": "halt"}, timeout=60)

    if n in opts.rdzv_at:
        await rendezvous(opts, row, server, crowds, cluster, progress)


async def settle(
    opts: argparse.Namespace, row: Row, crowds: list[CrowdProcess], t0: float, progress
) -> None:
    """Until the nodes beat at their pace (over 2 s: at least 0.8 duties per node and
    interval, none overrunning it), within --startup seconds of the start."""
    members = row.nodes - 1
    while True:
        await ask_all(crowds, {"cmd": "mark"})
        await asyncio.sleep(2.0)
        stats = await ask_all(crowds, {"cmd": "stats"}, timeout=120)
        duties = sum(len(s["ticks"]) + len(s["observer_ticks"]) for s in stats)
        elapsed = max(s["elapsed"] for s in stats)
        rate = duties / members / elapsed * opts.interval
        overdue = sum(len(s["overdue"]) for s in stats)
        if rate >= 0.8 and not overdue:
            break
        if time.monotonic() - t0 > opts.startup:
            row.overloaded(
                f"the crowd never beat at its pace within {opts.startup:g} s of the start "
                f"(last: {rate:.2f} duties per node and interval, {overdue} overrunning)"
            )
            break
    row.phases["steady"] = time.monotonic() - t0
    progress(
        f"{row.backend} N={row.nodes}: steady after {row.phases['steady']:.1f} s "
        f"({rate:.2f} duties per node and interval)"
    )


def _top_kinds(kinds: dict[str, list[int]], per: float, unit: str) -> str:
    """The kinds of key that moved the most bytes, per ``per``."""
    top = sorted(kinds.items(), key=lambda kv: -kv[1][1])[:4]
    return (
        ", ".join(f"{kind} {ops / per:.1f} req {moved / per:,.0f} B" for kind, (ops, moved) in top)
        + f" {unit}"
    )


def _merge_kinds(docs: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    merged: dict[str, list[int]] = {}
    for doc in docs:
        for kind, (ops, moved) in doc.items():
            total = merged.setdefault(kind, [0, 0])
            total[0] += ops
            total[1] += moved
    return merged


def summarize_window(
    row: Row,
    stats: list[dict[str, Any]],
    probe: Probe,
    probe_delta: list[int],
    window: float,
    mark: float,
    interval: float,
) -> None:
    n = row.nodes
    ops = sum(s["ops"] for s in stats) + probe_delta[1]
    moved = sum(s["sent"] + s["received"] for s in stats) + probe_delta[2] + probe_delta[3]
    row.store_ops_per_node_s = _r(ops / n / window, 1)
    row.store_bytes_per_node_s = _r(moved / n / window, 0)
    row.probe_ops_per_s = _r(probe_delta[1] / window, 1)

    duties = [d for began, d, _ in probe.ticks.done if began >= mark]
    cpu = [c for began, _, c in probe.ticks.done if began >= mark]
    if cpu:
        row.duty_cpu_ms = _r(1000 * statistics.median(cpu), 2)
    running = probe.ticks.overdue(time.monotonic(), 0.0)
    if any(began >= mark for began, _, _ in probe.ticks.observer):
        row.notes.append("the probe was the observer for some duties (the election moved)")
    if duties:
        row.duty_ms = _r(1000 * statistics.median(duties), 2)
        row.duty_p99_ms = _r(1000 * percentile(duties, 0.99), 2)
    elif running:  # not one duty ended in the window: the one on now, a lower bound
        row.duty_ms = row.duty_p99_ms = _r(1000 * max(running), 1)
        row.notes.append("the probe ended no duty in the window (duty: the one still on, so far)")
    if row.duty_p99_ms is not None and row.duty_p99_ms > 1000 * interval:
        row.overloaded(
            f"the probe's duties overran the {interval:g} s interval (p99 {row.duty_p99_ms:.0f} ms)"
        )

    observed = [(d, c) for s in stats for d, c in s["observer_ticks"]] + [
        (d, c) for b, d, c in probe.ticks.observer if b >= mark
    ]
    observer = [d for d, _ in observed]
    if observer:
        row.observer_duty_ms = _r(1000 * statistics.median(observer), 2)
        row.observer_duty_p99_ms = _r(1000 * percentile(observer, 0.99), 2)
    observers = sorted(
        {name for s in stats for name in s["observers"]}
        | ({probe.node.name} if getattr(probe.node.registry, "observing", False) else set())
    )
    if observers == [node_name(0)]:  # on a loop of two nodes: its CPU is its own (nearly)
        row.observer_cpu_ms = _r(1000 * statistics.median(c for _, c in observed), 2)
    elif observer:
        row.notes.append(f"observing at the end of the window: {observers or 'nobody'}")
    row.notes.append(
        "store traffic per node and s, by key: "
        + _top_kinds(_merge_kinds([s["kinds"] for s in stats]), (n - 1) * window, "(crowd)")
    )
    crowd_duties = [d for s in stats for d in s["ticks"]] + observer
    overdue = [d for s in stats for d in s["overdue"]]
    members = max(n - 1, 1)  # every node but the probe
    row.crowd_beats_per_node_s = _r(len(crowd_duties) / members / window, 2)
    if crowd_duties:
        row.crowd_duty_p50_ms = _r(1000 * statistics.median(crowd_duties), 2)
    longest = max(crowd_duties + overdue, default=None)
    row.crowd_duty_max_ms = _r(None if longest is None else 1000 * longest, 1)
    late = sum(1 for d in crowd_duties if d > interval) + len(overdue)
    if late:
        row.overloaded(
            f"{late} crowd duties overran the {interval:g} s interval "
            f"({len(overdue)} still on at the end of the window)"
        )
    if row.duty_cpu_ms is not None:
        cores = (n - 1) * row.duty_cpu_ms / 1000 / interval
        if cores > 0.5 * (os.cpu_count() or 1):
            row.notes.append(
                f"at the probe's CPU per duty the other nodes alone need ~{cores:.1f} cores to beat at their "
                f"pace; this machine has {os.cpu_count()}: the crowd starves, beats late and flaps lost/up, "
                f"which inflates every node's reads (feed entries, records)"
            )
    errors = sum(s["store_errors"] for s in stats)
    if errors:
        problems = [p for s in stats for p, _ in s["problems"]]
        row.notes.append(f"{errors} crowd duties failed on the store (e.g. {problems[:1]})")
    refused = sum(s["refused"] for s in stats)
    if refused:
        row.notes.append(f"{refused} store records refused by crowd nodes")


async def lost_node(
    opts: argparse.Namespace, row: Row, crowds: list[CrowdProcess], probe: Probe, progress
) -> None:
    """Kill node 1 (or, if it observes now, a crowd node that does not); until the probe sees
    it lost."""
    observers = {name for s in await ask_all(crowds, {"cmd": "stats"}) for name in s["observers"]}
    index = next(
        i for i in [1, *range(row.nodes // 2, row.nodes - 1)] if node_name(i) not in observers
    )
    victim = node_name(index)
    crowd = next(c for c in crowds if c.holds(index))
    began = time.monotonic()
    while probe.state_of(victim) in (None, NodeState.LOST):  # the probe must have seen it alive
        if time.monotonic() - began > opts.lost_bound:
            row.notes.append(f"lost: the probe never saw {victim} up within {opts.lost_bound:g} s")
            return
        await asyncio.sleep(0.1)
    probe.victim = victim
    killed = (await crowd.ask({"cmd": "kill", "index": index}))["killed_at"]
    try:
        await asyncio.wait_for(probe.lost.wait(), opts.lost_bound)
    except TimeoutError:
        row.notes.append(f"lost: {victim} not seen lost within {opts.lost_bound:g} s of its death")
    else:
        seen = probe.lost_at if probe.lost_at is not None else time.monotonic()
        if seen < killed:
            row.notes.append(
                f"lost: {victim} was seen lost {killed - seen:.2f} s before it was killed "
                "(its heartbeats starved)"
            )
        row.lost_seen_s = _r(max(seen - killed, 0.0), 2)
    row.phases["lost"] = time.monotonic() - began
    progress(f"{row.backend} N={row.nodes}: killed node seen lost after {row.lost_seen_s} s")


async def rendezvous(
    opts: argparse.Namespace,
    row: Row,
    server: Server,
    crowds: list[CrowdProcess],
    cluster: str,
    progress,
) -> None:
    """N handlers (the probe here, the crowd's nodes there) released together into one job's
    first rendezvous, min = max = N."""
    n = row.nodes
    began = time.monotonic()
    job = f"bench-{n}"
    run_id = f"{cluster}-{job}"
    settings = RendezvousSettings(
        run_id, n, n, join_timeout=opts.join_timeout, keep_alive_interval=opts.interval
    )
    prefix = Keyspace(cluster).rendezvous(job)
    client = await open_store(client_kind(row.backend), server.endpoint, connections=2, waits=2)
    counts = Counts()
    handler = RendezvousHandler(
        CountingStore(client, counts),
        Signer(SIGNER_KEY, cluster),
        settings,
        node_name(n - 1),
        node_record(n - 1).info.address,
        prefix=prefix,
    )
    keeper = asyncio.create_task(handler.keep())
    try:
        msg = {"run_id": run_id, "job": job, "n": n, "join_timeout": opts.join_timeout}
        await ask_all(crowds, {"cmd": "rdzv_setup", **msg}, timeout=180)
        if not await client.wait_for(Keys(prefix).heartbeat(handler.node), 60):
            raise RuntimeError("the probe's keeper did not beat")
        row.phases["rdzv_setup"] = time.monotonic() - began
        cpu = CpuMeter([server.pid])
        clients_cpu = CpuMeter([c.proc.pid for c in crowds] + [os.getpid()])
        cpu.mark()
        clients_cpu.mark()
        at = time.monotonic() + 1.0
        bound = opts.join_timeout + 5.0

        async def probe_join() -> float:
            await asyncio.sleep(max(at - time.monotonic(), 0.0))
            await handler.next_rendezvous(8, 29500)
            return time.monotonic()

        mine, *theirs = await asyncio.gather(
            probe_join(),
            *(
                c.ask({"cmd": "rdzv_go", "at": at, "bound": bound}, timeout=bound + 30)
                for c in crowds
            ),
            return_exceptions=True,
        )
        row.rdzv_store_cpu_pct = _r(cpu.read(), 1)
        row.rdzv_client_cpu_s = _r(clients_cpu.seconds(), 2)
        took = time.monotonic() - at
        failures = [
            f"{type(r).__name__}: {r}" for r in [mine, *theirs] if isinstance(r, BaseException)
        ]
        failed = sum(t["failed"] for t in theirs if isinstance(t, dict))
        errors = [e for t in theirs if isinstance(t, dict) for e, _ in t["errors"]]
        if failures or failed:
            row.status = "failed"
            row.notes.append(
                f"rdzv: {failed + len(failures)} of {n} nodes failed: {(failures + errors)[:2]}"
            )
        else:
            last = max([mine] + [r for t in theirs for r in t["returned"]])
            row.rdzv_s = _r(last - at, 3)
        answered = [t for t in theirs if isinstance(t, dict)]
        ops = sum(t["ops"] for t in answered) + counts.ops
        moved = sum(t["bytes"] for t in answered) + counts.sent + counts.received
        row.rdzv_bytes_per_node_s = _r(moved / n / (row.rdzv_s or took), 0)
        row.rdzv_cpu_ms_per_node = _r(1000 * row.rdzv_client_cpu_s / n, 2)
        cores = os.cpu_count() or 1
        if (
            row.rdzv_client_cpu_s / cores > RDZV_TARGET
        ):  # the crowd alone needs longer than the target
            row.notes.append(
                f"rdzv: {cores} cores cannot show a {n}-node rendezvous under {RDZV_TARGET:g} s: the simulated "
                f"nodes alone needed {row.rdzv_client_cpu_s:.1f} CPU-s ({row.rdzv_cpu_ms_per_node:.1f} ms a node, "
                f"{row.rdzv_client_cpu_s / cores:.1f} s on {cores} cores); on machines of their own each node "
                f"spends those ms in parallel (compare the per-node ms and bytes/s with a smaller row's)"
            )
        row.notes.append(
            f"rdzv: {ops} store requests, {moved / 2**20:.1f} MiB; store CPU "
            f"{row.rdzv_store_cpu_pct}% meanwhile; the nodes' CPU {row.rdzv_client_cpu_s} s "
            f"in all ({row.rdzv_cpu_ms_per_node} ms a node); "
            f"{row.rdzv_bytes_per_node_s:.0f} store bytes a node per second of the rendezvous"
        )
        if answered:
            row.notes.append(
                "rdzv traffic by key, per node: "
                + _top_kinds(_merge_kinds([t["kinds"] for t in answered]), n - 1, "(crowd)")
            )
    finally:
        handler.shutdown()
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await client.close()
        with contextlib.suppress(Exception):
            await ask_all(crowds, {"cmd": "rdzv_stop"}, timeout=60)
    row.phases["rdzv"] = time.monotonic() - began
    progress(f"{row.backend} N={n}: rendezvous {row.rdzv_s} s")


# -- report --------------------------------------------------------------------------------


def _f(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def table(rows: list[Row], opts: argparse.Namespace) -> str:
    lines = [
        f"simulated clusters of N nodes: nodes 0 (first observer) and 1 (killed) + N-3 crowd nodes in {opts.procs} processes "
        f"+ the probe; keep-alive {opts.interval:g} s x 3; steady window {opts.window:g} s; "
        f"this machine: {os.cpu_count()} cores",
        f"{'backend':<10} {'nodes':>5} {'duty ms p50/p99/cpu':>20} {'observer ms p50/p99/cpu':>24} {'ops/node/s':>11} "
        f"{'bytes/node/s':>13} {'store CPU%':>10} {'lost seen s':>11} {'rdzv s':>8}  status",
    ]
    for row in rows:
        duty = f"{_f(row.duty_ms, '.2f')}/{_f(row.duty_p99_ms, '.1f')}/{_f(row.duty_cpu_ms, '.2f')}"
        observer = f"{_f(row.observer_duty_ms, '.1f')}/{_f(row.observer_duty_p99_ms, '.0f')}/{_f(row.observer_cpu_ms, '.1f')}"
        lines.append(
            f"{row.backend:<10} {row.nodes:>5} {duty:>20} {observer:>24} {_f(row.store_ops_per_node_s, '.1f'):>11} "
            f"{_f(row.store_bytes_per_node_s, ',.0f'):>13} {_f(row.store_cpu_pct, '.1f'):>10} "
            f"{_f(row.lost_seen_s, '.2f'):>11} {_f(row.rdzv_s, '.3f'):>8}  {row.status}"
        )
    lines.append(TARGETS)
    for backend in dict.fromkeys(row.backend for row in rows):
        steady = [
            r for r in rows if r.backend == backend and r.status == "ok" and r.store_ops_per_node_s
        ]
        if len(steady) > 1:
            low, high = steady[0], steady[-1]
            lines.append(
                f"{backend}: store ops/node/s x{high.store_ops_per_node_s / low.store_ops_per_node_s:.1f}, "
                f"bytes/node/s x{(high.store_bytes_per_node_s or 0) / max(low.store_bytes_per_node_s or 1, 1):.1f} "
                f"from N={low.nodes} to N={high.nodes} (x1 is a store load linear in N)"
            )
        elif len(steady) < sum(r.backend == backend for r in rows):
            lines.append(
                f"{backend}: store load vs N not judged from rows that were overloaded or failed "
                "(their nodes did not beat at their pace: their ops/node/s are not the design's)"
            )
    for row in rows:
        lines.append(
            f"  {row.backend} N={row.nodes}: crowd {_f(row.crowd_beats_per_node_s, '.2f')} duties/node/s, "
            f"crowd duty p50 {_f(row.crowd_duty_p50_ms, '.1f')} ms (longest {_f(row.crowd_duty_max_ms, '.0f')} ms), "
            f"crowd CPU {_f(row.crowd_cpu_pct, '.0f')}%, probe {_f(row.probe_ops_per_s, '.0f')} ops/s; "
            f"took {row.phases.get('total', 0):.0f} s "
            f"({', '.join(f'{k} {v:g}' for k, v in row.phases.items() if k != 'total')})"
        )
        for note in row.notes:
            lines.append(f"      {note}")
    return "\n".join(lines)


def backends(choice: str, note) -> list[str]:
    chosen = {"both": ["c10d", "etcd"], "servers": ["c10d", "c10d-torch"]}.get(choice, [choice])
    if "etcd" in chosen:
        missing = []
        if not os.access(ETCD, os.X_OK):
            missing.append(ETCD)
        try:
            import elasticd.store.etcd  # noqa: F401
        except ImportError as exc:
            missing.append(f"elasticd.store.etcd ({exc})")
        if missing:
            note(f"etcd skipped: {' and '.join(missing)} missing")
            chosen.remove("etcd")
    return chosen


async def run(opts: argparse.Namespace, progress) -> list[Row]:
    rows = []
    for backend in backends(opts.backend, progress):
        for n in opts.nodes:
            progress(f"{backend} N={n}: starting")
            row = await measure_row(opts, backend, n, progress)
            progress(f"{backend} N={n}: done in {row.phases.get('total', 0):.0f} s ({row.status})")
            rows.append(row)
    return rows


def measure_detector(
    n: int, procs: int, window: float, progress, active: int = 0
) -> dict[str, Any]:
    """One row of the detector's cost: N nodes over ``procs`` crowd processes; with
    ``active``, only that many consecutive nodes of the ring run (all N are its members and
    known to each one): what a node pays in a cluster of N, where two cores cannot run N."""
    base = 20000 + (os.getpid() * 7919) % 20000
    if base + n > 65000:
        base = 65000 - n
    running = min(active, n) if active else n
    offset = (n - running) // 2
    per = -(-running // procs)
    warmup = 3.0 + running / 1000
    crowds = []
    for k in range(procs):
        first, last = offset + k * per, offset + min(running, (k + 1) * per) - 1
        if first > last:
            break
        crowds.append(
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(HERE, "detector_crowd.py"),
                    str(n),
                    str(first),
                    str(last),
                    str(base),
                    str(window),
                    str(warmup),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    docs = []
    for crowd in crowds:
        try:
            out, _ = crowd.communicate(timeout=window + warmup + 300)
            docs.append(json.loads(out.strip().splitlines()[-1]))
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            crowd.kill()
            crowd.wait()
    if len(docs) < len(crowds):
        for crowd in crowds:
            crowd.kill()
        progress(f"detector N={n}: a crowd process did not finish (the machine is too slow)")
        return {"nodes": n, "status": "did not finish"}
    nodes = sum(d["nodes"] for d in docs)
    seconds = max(d["seconds"] for d in docs)
    cpu = sum(d["cpu"] for d in docs)
    row = {
        "nodes": n,
        "bound": nodes,
        "active": running,
        "sent_per_node_s": sum(d["sent"] for d in docs) / nodes / seconds,
        "accepted_per_node_s": sum(d["accepted"] for d in docs) / nodes / seconds,
        "cpu_ms_per_node_s": 1000 * cpu / nodes / seconds,
        "crowd_cpu_cores": cpu / seconds,
        "false_losses": sum(d["lost"] for d in docs),
        "health_max": max(d["health_max"] for d in docs),
    }
    row["status"] = "overloaded" if row["crowd_cpu_cores"] > 0.8 * (os.cpu_count() or 1) else "ok"
    progress(f"detector N={n}: {row}")
    return row


def detector_table(rows: list[dict[str, Any]]) -> str:
    heartbeat = (
        "today's heartbeat per node (bench_scale.py steady rows, c10d): ~7 store requests "
        "and ~1.2-1.8 ms of CPU a second, at every size (docs/benchmarks.md)"
    )
    lines = [
        f"{'nodes':>6} {'running':>8} {'datagrams out/node/s':>21} {'in/node/s':>10} {'CPU ms/node/s':>14} "
        f"{'crowd cores':>12} {'losses':>7} {'health max':>11}  status",
    ]
    for r in rows:
        if r["status"] == "did not finish":
            lines.append(f"{r['nodes']:>6}  did not finish")
            continue
        lines.append(
            f"{r['nodes']:>6} {r['active']:>8} {r['sent_per_node_s']:>21.1f} {r['accepted_per_node_s']:>10.1f} "
            f"{r['cpu_ms_per_node_s']:>14.2f} {r['crowd_cpu_cores']:>12.2f} "
            f"{r['false_losses']:>7} {r['health_max']:>11}  {r['status']}"
        )
    return "\n".join([*lines, heartbeat])


def main() -> int:
    if sys.argv[1:2] == ["--serve-c10d"]:
        serve_c10d(sys.argv[2] if len(sys.argv) > 2 else "elasticd")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=("c10d", "c10d-torch", "etcd", "both", "servers"),
        default="both",
        help="c10d-torch: a c10d store served by torch's own (libuv) server, the reference; "
        "servers: c10d and c10d-torch side by side",
    )
    parser.add_argument("--nodes", default="128,1024,4096", help="cluster sizes, comma-separated")
    parser.add_argument(
        "--window", type=float, default=10.0, help="steady window, seconds (at most 60)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="128 nodes only, a 3 s window, rendezvous at 128"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list, last")
    parser.add_argument(
        "--procs",
        type=int,
        default=max(2, min(16, (os.cpu_count() or 2) - 1)),
        help="crowd processes",
    )
    parser.add_argument(
        "--connections", type=int, default=64, help="store connections per crowd process"
    )
    parser.add_argument(
        "--rdzv-at", default="1024", help="sizes at which the rendezvous is measured"
    )
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument(
        "--rdzv-only",
        action="store_true",
        help="only the rendezvous (at every --nodes size): no steady window, no lost node",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="cProfile each crowd process's rendezvous into DIR"
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep every row's logs (a failed row's are kept)"
    )
    parser.add_argument("--startup", type=float, default=30.0, help="bound on start-up, seconds")
    parser.add_argument(
        "--lost-bound", type=float, default=30.0, help="bound on seeing a lost node, seconds"
    )
    parser.add_argument(
        "--memory-limit", type=float, default=0.6, help="fraction of the machine's memory"
    )
    parser.add_argument(
        "--interval", type=float, default=KeepAlive.interval, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--detector", action="store_true", help="the failure detector's cost instead (no store)"
    )
    parser.add_argument(
        "--active",
        type=int,
        default=0,
        help="--detector: run only this many consecutive nodes of each ring (0: all)",
    )
    opts = parser.parse_args()
    opts.window = min(opts.window, 60.0)
    opts.nodes = [int(n) for n in opts.nodes.split(",") if n]
    opts.rdzv_at = {int(n) for n in opts.rdzv_at.split(",") if n}
    if opts.quick:
        opts.nodes, opts.window, opts.rdzv_at = [128], 3.0, {128}
    if opts.rdzv_only:
        opts.rdzv_at = set(opts.nodes)
    if min(opts.nodes) < 4:
        parser.error(
            "a cluster here needs at least 4 nodes (nodes 0 and 1, a crowd node, the probe)"
        )
    raise_nofile()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)

    def progress(line):
        return print(line, file=sys.stderr, flush=True)

    if opts.detector:
        found = [
            measure_detector(n, opts.procs, opts.window, progress, opts.active) for n in opts.nodes
        ]
        print(detector_table(found), flush=True)
        if opts.json:
            print(json.dumps(found))
        return 0

    rows = asyncio.run(run(opts, progress))
    print(table(rows, opts), flush=True)
    if opts.json:
        print(json.dumps([row.doc() for row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
