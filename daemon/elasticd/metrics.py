"""Prometheus collectors on an explicit CollectorRegistry (no global state).

The names here are the contract with ``packaging/grafana-dashboard.json`` and
``packaging/prometheus-rules.yml``; a test checks that those use only names defined here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from elasticd import __version__
from elasticd.core.allocation import WaitReason
from elasticd.core.model import JobState, NodeState, WorkerState
from elasticd.core.records import JobRecord, hold_reason, started
from elasticd.core.schedule import Schedule, waiting_jobs, waiting_since
from elasticd.core.usage import spans
from elasticd.jobs.accounts import group_name

_ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)
_BARRIER_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 900)
_WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400, 259200)
_PLAN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


_FULL_BELOW = 1 << 20  # bytes: a state dir with less free space counts as full
_FULL_RECENTLY = 60.0  # seconds a failed write for lack of space keeps it counted as full
_NO_SPACE = ("No space left on device", "Disk quota exceeded", "database or disk is full")


class Metrics:
    def __init__(self, state_dir: str = "/") -> None:
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        self.disk = DiskCollector(state_dir)
        self.job_usage = JobUsageCollector()
        self.sharing = SharingCollector()
        reg.register(self.disk)
        reg.register(self.job_usage)
        reg.register(self.sharing)
        Gauge("elasticd_build_info", "Build information", ["version"], registry=reg).labels(
            __version__
        ).set(1)
        self.jobs = Gauge(
            "elasticd_jobs", "Jobs known to this daemon, by state", ["state"], registry=reg
        )
        self.jobs_held = Gauge(
            "elasticd_jobs_held",
            "Jobs held: a node refuses a record the job needs (elasticctl status says which and why)",
            registry=reg,
        )
        self.jobs_finished = Counter(
            "elasticd_jobs_finished_total",
            "Jobs this daemon saw finish since it started, by final state",
            ["state"],
            registry=reg,
        )
        self._finished: set[str] = set()
        self.job_wait = Histogram(
            "elasticd_job_wait_seconds",
            "Time from a job's submit to its first start, observed once per job by the node it "
            "was submitted on (a sum over the cluster counts each job once)",
            buckets=_WAIT_BUCKETS,
            registry=reg,
        )
        self._started: set[str] = set()  # jobs submitted here whose wait is observed
        self.reclaims = Counter(
            "elasticd_reclaims_total",
            "Parts of jobs this node left because the cluster's "
            "schedule gave its place to another job (a reclaim or a preemption: no restart "
            "spent)",
            registry=reg,
        )
        self.plan_duration = Histogram(
            "elasticd_scheduler_plan_seconds",
            "Time the allocator took to plan a schedule, on the node that allocates",
            buckets=_PLAN_BUCKETS,
            registry=reg,
        )
        self.grown_nodes = Counter(
            "elasticd_scheduler_grown_nodes_total",
            "Nodes the allocator gave to jobs that ran "
            "already (growth into idle nodes, a lost node replaced)",
            registry=reg,
        )
        self.preemptions = Counter(
            "elasticd_scheduler_preemptions_total",
            "Jobs the allocator stopped below their min "
            "(--preemptible: requeued, no restart spent)",
            registry=reg,
        )
        self.workers = Gauge(
            "elasticd_workers", "Worker processes on this node, by state", ["state"], registry=reg
        )
        self.spares = Gauge(
            "elasticd_spare_workers",
            "Warm spare workers parked on this node "
            "(--spares: started, waiting in elastic.run, holding no rank)",
            registry=reg,
        )
        self.worker_restarts = Counter(
            "elasticd_worker_restarts_total", "Group restarts after a worker failure", registry=reg
        )
        self.worker_exits = Counter(
            "elasticd_worker_exits_total", "Worker exits, by exit code", ["exit_code"], registry=reg
        )
        self.control_requests = Counter(
            "elasticd_control_requests_total",
            "Control requests, by op and result",
            ["op", "result"],
            registry=reg,
        )
        self.control_connections = Gauge(
            "elasticd_control_connections", "Open control-socket connections", registry=reg
        )
        self.peer_refused = Counter(
            "elasticd_peer_refused_total",
            "Connections to the peer port refused at the CURVE handshake (a key that is no node's)",
            registry=reg,
        )
        self.refused_records = Counter(
            "elasticd_store_refused_records_total",
            "Store records refused (forged, copied from another key, older than one seen, or unreadable)",
            registry=reg,
        )
        self.loop_faults = Counter(
            "elasticd_loop_faults_total",
            "Unexpected errors in the daemon's long-lived loops, by loop (each logged with its "
            "traceback, once a minute per loop; the loop went on)",
            ["loop"],
            registry=reg,
        )
        self.output_dropped_bytes = Counter(
            "elasticd_log_dropped_bytes_total",
            "Worker output that could not be written to its log file (a full disk), by reason",
            ["reason"],
            registry=reg,
        )
        self.checkpoint_save = Histogram(
            "elasticd_checkpoint_save_seconds",
            "From a checkpoint's first file to this node's share described (hashed, copied)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=reg,
        )
        self.checkpoint_copy = Histogram(
            "elasticd_checkpoint_copy_seconds",
            "Copy lag: from a share known whole to its copy landed on another node",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=reg,
        )
        self.checkpoint_disk = Histogram(
            "elasticd_checkpoint_disk_seconds",
            "From a checkpoint's first file to this node's share written in its --checkpoint-dir",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
            registry=reg,
        )
        self.checkpoint_bytes = Gauge(
            "elasticd_checkpoint_bytes",
            "Bytes of checkpoints held in this node's memory, by job (its own shares and copies)",
            ["job"],
            registry=reg,
        )
        self.checkpoint_restores = Counter(
            "elasticd_checkpoint_restores_total",
            "Checkpoint files put in place for a restarted round or fetched for a reader, by "
            "where they came from",
            ["source"],
            registry=reg,
        )
        self.checkpoint_restored_bytes = Counter(
            "elasticd_checkpoint_restored_bytes",
            "Bytes of those files (a reader's: only the byte ranges it fetched), by source",
            ["source"],
            registry=reg,
        )
        self.state_write_errors = Counter(
            "elasticd_state_dir_write_errors_total",
            "Writes to the state dir that failed, by what was written",
            ["what"],
            registry=reg,
        )
        self.history_quarantined = Counter(
            "elasticd_history_quarantined_total",
            "Corrupt history databases renamed aside (a fresh one was started)",
            registry=reg,
        )
        self.history_skipped = Counter(
            "elasticd_history_skipped_rows_total",
            "History rows skipped because they did not parse",
            registry=reg,
        )
        self.store_up = Gauge("elasticd_store_up", "1 when the store answers", registry=reg)
        self.store_latency = Histogram(
            "elasticd_store_latency_seconds",
            "Store operation latency",
            ["op"],
            buckets=_STORE_BUCKETS,
            registry=reg,
        )
        self.store_errors = Counter(
            "elasticd_store_errors_total", "Failed store operations", ["op"], registry=reg
        )
        self.nodes = Gauge(
            "elasticd_nodes", "Nodes of the cluster, by state", ["state"], registry=reg
        )
        self.node_blacklisted = Gauge(
            "elasticd_node_blacklisted",
            "1 while this node is blacklisted (its workers kept failing: it takes no new job)",
            registry=reg,
        )
        self.node_blacklistings = Counter(
            "elasticd_node_blacklistings_total", "Times this node was blacklisted", registry=reg
        )
        self.node_listed = Gauge(
            "elasticd_node_listed",
            "1 while the discovery script lists this node (always 1 without a script)",
            registry=reg,
        )
        self.node_listed.set(1)
        self.gpus_out = Gauge(
            "elasticd_gpus_out",
            "GPUs of this node that its NVML health checks took out of its offer (readmitted by "
            "elasticctl undrain NODE --gpu N, or after gpu.readmit_after healthy)",
            registry=reg,
        )
        self.gpu_faults = Counter(
            "elasticd_gpu_faults_total",
            "GPUs taken out of this node's offer, by what NVML read "
            "(xid 79, ecc, lost, rows pending remap ...)",
            ["why"],
            registry=reg,
        )
        self.gpu_xids = Counter(
            "elasticd_gpu_xids_total",
            "Xid events of this node's GPUs, each Xid (a drained GPU's "
            "and those that leave the GPU in)",
            ["xid"],
            registry=reg,
        )
        self.gpu_slowdown = Gauge(
            "elasticd_gpu_slowdown",
            "1 while a GPU of this node runs slowed down (thermal or "
            "power: a warning, it stays in the offer)",
            ["gpu"],
            registry=reg,
        )
        self.discovery_failures = Counter(
            "elasticd_discovery_failures_total",
            "Runs of the discovery script that failed (the last good list stayed in force)",
            registry=reg,
        )
        self.rounds = Counter(
            "elasticd_rendezvous_rounds_total",
            "Rendezvous rounds this node joined, by why the round opened",
            ["reason"],
            registry=reg,
        )
        self.round_duration = Histogram(
            "elasticd_rendezvous_duration_seconds",
            "Time from joining a round to its completion",
            buckets=_ROUND_BUCKETS,
            registry=reg,
        )
        self.barrier_wait = Histogram(
            "elasticd_exit_barrier_wait_seconds",
            "Time spent in the exit barrier",
            buckets=_BARRIER_BUCKETS,
            registry=reg,
        )
        for state in JobState:
            self.jobs.labels(state.value)
            if state.terminal:
                self.jobs_finished.labels(state.value)
        for worker_state in WorkerState:
            self.workers.labels(worker_state.value)
        self.detector_messages = Counter(
            "elasticd_detector_messages_total",
            "Failure-detector datagrams sent (out) and accepted (in)",
            ["direction"],
            registry=reg,
        )
        self.detector_refusals = Counter(
            "elasticd_detector_refused_total",
            "Failure-detector datagrams refused: format, mac (not sealed with the cluster key), "
            "stranger (for or from no node known), replay; flood: times reading paused",
            ["why"],
            registry=reg,
        )
        self.detector_losses = Histogram(
            "elasticd_detector_lost_silence_seconds",
            "Nodes the failure detector found lost, by how long they had been silent",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2, 5, 10),
            registry=reg,
        )
        self.detector_watched = Gauge(
            "elasticd_detector_watched", "Nodes this node's failure detector probes", registry=reg
        )
        self.detector_health = Gauge(
            "elasticd_detector_local_health",
            "The failure detector's local health score (0: healthy; its timeouts are "
            "multiplied by 1 + this)",
            registry=reg,
        )

    # the failure detector (cluster/detector.py), from its own thread
    def detector_message(self, direction: str) -> None:
        self.detector_messages.labels(direction).inc()

    def detector_refused(self, why: str) -> None:
        self.detector_refusals.labels(why).inc()

    def detector_lost(self, silent: float) -> None:
        self.detector_losses.observe(silent)

    def detector_state(self, watched: int, health: int) -> None:
        self.detector_watched.set(watched)
        self.detector_health.set(health)

    # -- AgentMetrics -----------------------------------------------------------------------

    def round_joined(self, reason: str, seconds: float) -> None:
        self.rounds.labels(reason).inc()
        self.round_duration.observe(seconds)

    def worker_exited(self, exit_code: int) -> None:
        self.worker_exits.labels(str(exit_code)).inc()

    def loop_fault(self, loop: str) -> None:
        self.loop_faults.labels(loop).inc()

    def restarted(self) -> None:
        self.worker_restarts.inc()

    def barrier_waited(self, seconds: float) -> None:
        self.barrier_wait.observe(seconds)

    def reclaimed(self) -> None:
        self.reclaims.inc()

    # -- the allocator (cluster/scheduler.Allocator's on_plan) -----------------------------------

    def planned(self, previous: Schedule | None, schedule: Schedule, took: float) -> None:
        """A plan took ``took`` seconds; a new schedule counts what it moved."""
        self.plan_duration.observe(took)
        if schedule is not previous:
            grown, preempted = moves(previous, schedule)
            self.grown_nodes.inc(grown)
            self.preemptions.inc(preempted)

    # -- gauges recomputed from the registry ------------------------------------------------

    def known_finished(self, records: Iterable[JobRecord]) -> None:
        """Jobs that had ended (or started) before this daemon started: not counted as
        finishing (or starting) now."""
        records = list(records)
        self._finished.update(r.id for r in records if r.outcome is not None)
        self._started.update(r.id for r in records if started(r) is not None)

    def count_jobs(self, records: Iterable[JobRecord], node: str) -> None:
        """Set the job and local worker gauges from the registry's records; count new endings."""
        jobs: Tally[str] = Tally()
        workers: Tally[str] = Tally()
        held = spares = 0
        records = list(records)
        self._first_starts(records, node)
        self._finished &= {
            record.id for record in records
        }  # forget jobs the registry no longer holds
        for record in records:
            jobs[record.state.value] += 1
            held += bool(hold_reason(record))
            if record.outcome is not None and record.id not in self._finished:
                self._finished.add(record.id)
                self.jobs_finished.labels(record.state.value).inc()
            part = record.parts.get(node)
            if part is not None and part.state.active:
                workers.update(w["state"] for w in part.workers)
                spares += part.spares
        self.spares.set(spares)
        for state in JobState:
            self.jobs.labels(state.value).set(jobs[state.value])
        self.jobs_held.set(held)
        for worker_state in WorkerState:
            self.workers.labels(worker_state.value).set(workers[worker_state.value])

    def _first_starts(self, records: list[JobRecord], node: str) -> None:
        """Observe the wait of each job submitted on this node when it first starts: one
        node per job, so that the cluster's sum is not one per node."""
        ours = {r.id: r for r in records if r.spec.submitted_on == node}
        self._started &= ours.keys()  # forget jobs the registry no longer holds
        for job, record in ours.items():
            first = started(record) if job not in self._started else None
            if first is not None:
                self._started.add(job)
                self.job_wait.observe(max(0.0, first - record.spec.created))

    # -- the checkpoint tier ---------------------------------------------------------------------

    def checkpoint_saved(self, seconds: float, copied: float | None) -> None:
        self.checkpoint_save.observe(max(0.0, seconds))
        if copied is not None:
            self.checkpoint_copy.observe(max(0.0, copied))

    def checkpoint_on_disk(self, seconds: float) -> None:
        self.checkpoint_disk.observe(max(0.0, seconds))

    def checkpoint_held(self, job: str, nbytes: int) -> None:
        if nbytes:
            self.checkpoint_bytes.labels(job).set(nbytes)
        else:
            with contextlib.suppress(KeyError):
                self.checkpoint_bytes.remove(job)

    def checkpoint_restored(self, source: str, nbytes: int) -> None:
        self.checkpoint_restores.labels(source).inc()
        self.checkpoint_restored_bytes.labels(source).inc(nbytes)

    def output_dropped(self, nbytes: int, why: str) -> None:
        self.output_dropped_bytes.labels(why).inc(nbytes)
        self.state_write_failed("logs", why)

    def state_write_failed(self, what: str, why: str) -> None:
        self.state_write_errors.labels(what).inc()
        if any(reason in why for reason in _NO_SPACE):
            self.disk.out_of_space()

    def blacklisted(self, on: bool) -> None:
        """This node was blacklisted (on) or readmitted."""
        self.node_blacklisted.set(1 if on else 0)
        if on:
            self.node_blacklistings.inc()

    def gpu_news(self, what: str, label: str, value: float) -> None:
        """What the GPU health checks counted (core/gpuhealth.py's Count instructions)."""
        if what == "gpus_out":
            self.gpus_out.set(value)
        elif what == "gpu_fault":
            self.gpu_faults.labels(label).inc()
        elif what == "xid":
            self.gpu_xids.labels(label).inc(value)
        elif what == "gpu_slowdown":
            self.gpu_slowdown.labels(label).set(value)

    def count_nodes(self, states: Iterable[NodeState | str] | Mapping[NodeState, int]) -> None:
        """Nodes by state: the states, or how many are in each."""
        tally = (
            states if isinstance(states, Mapping) else Tally(NodeState(state) for state in states)
        )
        for state in NodeState:
            self.nodes.labels(state.value).set(tally[state])

    async def store_call(self, op: str, call: Awaitable[Any]) -> Any:
        """Await a store operation, counting its latency (failures included) and errors."""
        started = time.perf_counter()
        try:
            return await call
        except Exception:
            self.store_errors.labels(op).inc()
            raise
        finally:
            if op != "wait_for":  # a wait blocks on purpose: its duration is not latency
                self.store_latency.labels(op).observe(time.perf_counter() - started)

    async def serve(self, port: int, address: str) -> asyncio.Server:
        """Start the HTTP endpoint on the event loop; returns the listening server."""
        return await asyncio.start_server(
            MetricsEndpoint(self.registry).handle, address, port, limit=_MAX_REQUEST_HEAD
        )


log = logging.getLogger(__name__)

_MAX_REQUEST_HEAD = 16 * 1024
_MAX_SCRAPERS = 32
_REQUEST_TIMEOUT = 10.0


class MetricsEndpoint:
    """``GET /metrics`` on the event loop.  prometheus_client's own server starts a thread per
    connection and waits for a request forever: anyone who reaches the port could exhaust the
    daemon's threads and descriptors.  Here a few scrapes run at once, each with a deadline."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._open = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= _MAX_SCRAPERS:
            writer.close()
            return
        self._open += 1
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._response(head))
                await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass
        except Exception:
            log.exception("metrics: a scrape failed")
        finally:
            self._open -= 1
            writer.close()

    def _response(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method != b"GET":
            return _http(405, b"text/plain", b"only GET\n")
        if path not in (b"/metrics", b"/"):
            return _http(404, b"text/plain", b"try /metrics\n")
        return _http(200, CONTENT_TYPE_LATEST.encode(), generate_latest(self._registry))


def _http(status: int, content_type: bytes, body: bytes) -> bytes:
    reason = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}[status]
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % (status, reason, content_type, len(body))
    ) + body


class DiskCollector(Collector):
    """Free space of the state dir (history, logs, keys), read at each scrape, and whether it
    is full: under 1 MiB or no inode left, or a write failed for lack of space (a quota, which
    statvfs does not show) in the last minute."""

    def __init__(self, state_dir: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._state_dir = state_dir
        self._clock = clock
        self._failed_at: float | None = None

    def out_of_space(self) -> None:
        self._failed_at = self._clock()

    def free(self) -> tuple[int, int] | None:
        """(bytes, inodes) this daemon may still use, or None if the dir cannot be read."""
        try:
            info = os.statvfs(self._state_dir)
        except OSError:
            return None
        blocks, inodes = (
            (info.f_bfree, info.f_ffree) if os.geteuid() == 0 else (info.f_bavail, info.f_favail)
        )
        return blocks * info.f_frsize, inodes

    def full(self) -> bool:
        free = self.free()
        recently = self._failed_at is not None and self._clock() - self._failed_at < _FULL_RECENTLY
        return recently or (free is not None and (free[0] < _FULL_BELOW or free[1] == 0))

    def collect(self) -> Iterable[Any]:
        free = self.free()
        if free is not None:
            yield GaugeMetricFamily(
                "elasticd_state_dir_free_bytes",
                "Free space in the state dir this daemon may use",
                value=free[0],
            )
        yield GaugeMetricFamily(
            "elasticd_disk_full",
            "1 when the state dir is full (worker output is being dropped)",
            value=1 if self.full() else 0,
        )


class JobUsageCollector(Collector):
    """CPU time, memory peak and OOM kills of each job running here, from its cgroup, and
    its waiting standbys (--warm-restart)."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, dict[str, Any]]] = dict

    def collect(self) -> Iterable[Any]:
        cpu = CounterMetricFamily(
            "elasticd_job_cpu_seconds",
            "CPU time of a job's processes on this node (its cgroup)",
            labels=["job"],
        )
        peak = GaugeMetricFamily(
            "elasticd_job_memory_peak_bytes",
            "Memory peak of a job's processes on this node (its cgroup)",
            labels=["job"],
        )
        ooms = CounterMetricFamily(
            "elasticd_job_oom_kills",
            "Processes of a job killed by the OOM killer on this node",
            labels=["job"],
        )
        standbys = GaugeMetricFamily(
            "elasticd_job_warm_standbys",
            "Standby interpreters of a --warm-restart job waiting on this node "
            "(torch imported; a restart's workers are made of them)",
            labels=["job"],
        )
        families = ((cpu, "cpu_seconds"), (peak, "memory_peak"), (ooms, "oom_kills"))
        for job, usage in sorted(self.source().items()):
            for family, key in (*families, (standbys, "standbys")):
                if usage.get(key) is not None:
                    family.add_metric([job], usage[key])
        yield from (cpu, peak, ooms, standbys)


NO_REASON = "None"  # a waiting job without a schedule's reason (Slurm's word for none)
MAX_ACCOUNTS = 64  # accounts with series of their own; later ones are summed as OTHER
OTHER = "(other)"
_USAGE = (("node", "Node"), ("slot", "Slot"), ("gpu", "GPU"))


def moves(previous: Schedule | None, schedule: Schedule) -> tuple[int, int]:
    """What ``schedule`` moved since ``previous``: nodes given to jobs that held nodes
    already, and jobs newly preempted."""
    before = previous.nodes if previous is not None else {}
    grown = sum(len(nodes - before[job]) for job, nodes in schedule.nodes.items() if job in before)
    return grown, len(
        schedule.preempted - (previous.preempted if previous is not None else frozenset())
    )


def waiting(records: Iterable[JobRecord], schedule: Schedule | None) -> list[tuple[JobRecord, str]]:
    """The jobs that wait and why, as ``elasticctl queue`` shows them (NO_REASON: no schedule)."""
    return [(record, reason or NO_REASON) for record, reason in waiting_jobs(records, schedule)]


class SharingCollector(Collector):
    """The cluster's sharing, read at each scrape: the waiting jobs by reason and the
    longest wait (every node's view of the cluster: take the max over nodes), the schedule
    this node follows and, on the node that allocates, its term; and what this node's own
    parts used, per account (a counter from the usage spans: summed over nodes, each part
    counts once)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._node = ""
        self._records: Callable[[], Iterable[JobRecord]] = list
        self._followed: Callable[[], Schedule | None] = lambda: None
        self._allocating: Callable[[], Schedule | None] = lambda: None
        self._charged: dict[str, tuple[float, ...]] = {}  # job -> its usage counted so far
        self._ended: dict[
            str, tuple[JobRecord, str, tuple[float, ...]]
        ] = {}  # this node's part ended
        self._used: dict[str, list[float]] = {}  # account -> node, slot, GPU seconds

    def watch(
        self,
        node: str,
        records: Callable[[], Iterable[JobRecord]],
        followed: Callable[[], Schedule | None],
        allocating: Callable[[], Schedule | None],
    ) -> None:
        """Read these from now on: usage counts from now (what the jobs used before is in
        ``elasticctl usage``)."""
        self._node, self._records, self._followed, self._allocating = (
            node,
            records,
            followed,
            allocating,
        )
        now = self._clock()
        self._charged = {r.id: self._usage(r, now)[1] for r in records() if node in r.parts}

    def collect(self) -> Iterable[Any]:
        records, now = list(self._records()), self._clock()
        yield from self._waiting(records, now)
        for (term, number), schedule, what in (
            (
                ("elasticd_schedule_term", "elasticd_schedule_number"),
                self._followed(),
                "the schedule this node follows (0: none, it places jobs itself)",
            ),
            (
                ("elasticd_allocator_term", "elasticd_allocator_schedule_number"),
                self._allocating(),
                "the last schedule of the allocator on this node (0: this node does not allocate)",
            ),
        ):
            yield GaugeMetricFamily(
                term, f"The term of {what}", value=schedule.term if schedule else 0
            )
            yield GaugeMetricFamily(
                number,
                f"The number within its term of {what}",
                value=schedule.number if schedule else 0,
            )
        yield from self._usage_families(records, now)

    def _waiting(self, records: list[JobRecord], now: float) -> Iterable[Any]:
        count = GaugeMetricFamily(
            "elasticd_jobs_waiting",
            "Jobs that wait to start, by the schedule's reason (elasticctl queue)",
            labels=["reason"],
        )
        longest = GaugeMetricFamily(
            "elasticd_longest_wait_seconds",
            "How long the job that has waited longest has waited, by its reason",
            labels=["reason"],
        )
        found: dict[str, list[float]] = {reason.value: [] for reason in WaitReason}
        found[NO_REASON] = []
        for record, reason in waiting(records, self._followed()):
            found.setdefault(reason, []).append(max(0.0, now - waiting_since(record)))
        for reason, waits in found.items():
            count.add_metric([reason], len(waits))
            longest.add_metric([reason], max(waits, default=0.0))
        yield from (count, longest)

    def _usage(self, record: JobRecord, now: float) -> tuple[str, tuple[float, ...]]:
        """The account and what this node's parts of the job used until ``now`` (once the
        part here ended, the same until the record changes: kept, not read again)."""
        ended = self._ended.get(record.id)
        if ended is not None and ended[0] is record:
            return ended[1], ended[2]
        account, used = self._spans(record, now)
        part = record.parts.get(self._node)
        if part is not None and not part.state.active:
            self._ended[record.id] = (record, account, used)
        return account, used

    def _spans(self, record: JobRecord, now: float) -> tuple[str, tuple[float, ...]]:
        own = [s for s in spans(record, group_name) if s.node == self._node]
        held = [(s.clipped(-math.inf, now), s.slots, s.gpus) for s in own]
        account = own[0].account if own else ""
        return account, (
            math.fsum(h for h, _, _ in held),
            math.fsum(h * n for h, n, _ in held),
            math.fsum(h * g for h, _, g in held),
        )

    def _usage_families(self, records: list[JobRecord], now: float) -> Iterable[Any]:
        charged = {}
        for record in records:
            if self._node not in record.parts:
                continue
            account, used = self._usage(record, now)
            before = self._charged.get(record.id, (0.0, 0.0, 0.0))
            charged[record.id] = tuple(
                map(max, used, before)
            )  # a clock stepped back takes none back
            if account and charged[record.id] != before:
                key = account if account in self._used or len(self._used) < MAX_ACCOUNTS else OTHER
                total = self._used.setdefault(key, [0.0, 0.0, 0.0])
                for i, (new, old) in enumerate(zip(charged[record.id], before)):
                    total[i] += new - old
        self._charged = charged  # jobs the registry no longer holds are forgotten
        self._ended = {job: ended for job, ended in self._ended.items() if job in charged}
        for i, (unit, word) in enumerate(_USAGE):
            family = CounterMetricFamily(
                f"elasticd_usage_{unit}_seconds",
                f"{word}-seconds that jobs used on this node "
                f"since the daemon started, by account (elasticctl usage's; at most "
                f"{MAX_ACCOUNTS} accounts, the rest as {OTHER!r})",
                labels=["account"],
            )
            for account, total in sorted(self._used.items()):
                family.add_metric([account], total[i])
            yield family


class InstrumentedStore:
    """A Store that measures every call of the one it wraps."""

    def __init__(self, store: Any, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    async def get(self, key: str) -> bytes | None:
        return await self._metrics.store_call("get", self._store.get(key))

    async def set(self, key: str, value: bytes) -> None:
        await self._metrics.store_call("set", self._store.set(key, value))

    async def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        return await self._metrics.store_call(
            "compare_set", self._store.compare_set(key, expected, desired)
        )

    async def add(self, key: str, amount: int) -> int:
        return await self._metrics.store_call("add", self._store.add(key, amount))

    async def append(self, key: str, value: bytes) -> None:
        await self._metrics.store_call("append", self._store.append(key, value))

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        return await self._metrics.store_call("get_many", self._store.get_many(keys))

    async def wait_for(self, key: str, timeout: float) -> bool:
        return await self._metrics.store_call("wait_for", self._store.wait_for(key, timeout))

    async def delete(self, key: str) -> bool:
        return await self._metrics.store_call("delete", self._store.delete(key))

    async def delete_under(self, prefixes: list[str]) -> int:
        return await self._metrics.store_call("delete_under", self._store.delete_under(prefixes))

    async def close(self) -> None:
        await self._store.close()
