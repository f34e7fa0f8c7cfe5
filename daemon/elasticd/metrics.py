"""Prometheus collectors on an explicit CollectorRegistry (no global state).

The names here are the contract with ``packaging/grafana-dashboard.json`` and
``packaging/prometheus-rules.yml``; a test checks that those use only names defined here.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client import start_http_server

from . import __version__
from .jobs import JobRecord
from .model import JobState, WorkerState

_ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)
_BARRIER_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 900)


class Metrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        Gauge("elasticd_build_info", "Build information", ["version"], registry=reg) \
            .labels(__version__).set(1)
        self.jobs = Gauge("elasticd_jobs", "Jobs known to this daemon, by state", ["state"], registry=reg)
        self.jobs_finished = Counter("elasticd_jobs_finished_total",
                                     "Jobs this daemon saw finish since it started, by final state",
                                     ["state"], registry=reg)
        self._finished: set[str] = set()
        self.workers = Gauge("elasticd_workers", "Worker processes on this node, by state",
                             ["state"], registry=reg)
        self.worker_restarts = Counter("elasticd_worker_restarts_total",
                                       "Group restarts after a worker failure", registry=reg)
        self.worker_exits = Counter("elasticd_worker_exits_total", "Worker exits, by exit code",
                                    ["exit_code"], registry=reg)
        self.control_requests = Counter("elasticd_control_requests_total",
                                        "Control requests, by op and result", ["op", "result"],
                                        registry=reg)
        self.refused_records = Counter("elasticd_store_refused_records_total",
                                       "Store records refused (bad MAC or unreadable)", registry=reg)
        self.store_up = Gauge("elasticd_store_up", "1 when the store answers", registry=reg)
        self.store_latency = Histogram("elasticd_store_latency_seconds", "Store operation latency",
                                       ["op"], buckets=_STORE_BUCKETS, registry=reg)
        self.store_errors = Counter("elasticd_store_errors_total", "Failed store operations",
                                    ["op"], registry=reg)
        self.nodes = Gauge("elasticd_nodes", "Nodes of the cluster, by state", ["state"], registry=reg)
        self.rounds = Counter("elasticd_rendezvous_rounds_total",
                              "Rendezvous rounds this node joined, by why the round opened",
                              ["reason"], registry=reg)
        self.round_duration = Histogram("elasticd_rendezvous_duration_seconds",
                                        "Time from joining a round to its completion",
                                        buckets=_ROUND_BUCKETS, registry=reg)
        self.barrier_wait = Histogram("elasticd_exit_barrier_wait_seconds",
                                      "Time spent in the exit barrier", buckets=_BARRIER_BUCKETS,
                                      registry=reg)
        for state in JobState:
            self.jobs.labels(state.value)
            if state.terminal:
                self.jobs_finished.labels(state.value)
        for state in WorkerState:
            self.workers.labels(state.value)

    # -- AgentMetrics -----------------------------------------------------------------------

    def round_joined(self, reason: str, seconds: float) -> None:
        self.rounds.labels(reason).inc()
        self.round_duration.observe(seconds)

    def worker_exited(self, exit_code: int) -> None:
        self.worker_exits.labels(str(exit_code)).inc()

    def restarted(self) -> None:
        self.worker_restarts.inc()

    def barrier_waited(self, seconds: float) -> None:
        self.barrier_wait.observe(seconds)

    # -- gauges recomputed from the registry ------------------------------------------------

    def known_finished(self, records: Iterable[JobRecord]) -> None:
        """Jobs that had ended before this daemon started (not counted as finishing now)."""
        self._finished.update(r.id for r in records if r.outcome is not None)

    def count_jobs(self, records: Iterable[JobRecord], node: str) -> None:
        """Set the job and local worker gauges from the registry's records; count new endings."""
        jobs: Tally[str] = Tally()
        workers: Tally[str] = Tally()
        for record in records:
            jobs[record.state.value] += 1
            if record.outcome is not None and record.id not in self._finished:
                self._finished.add(record.id)
                self.jobs_finished.labels(record.state.value).inc()
            part = record.parts.get(node)
            if part is not None and part.state.active:
                workers.update(w["state"] for w in part.workers)
        for state in JobState:
            self.jobs.labels(state.value).set(jobs[state.value])
        for state in WorkerState:
            self.workers.labels(state.value).set(workers[state.value])

    def count_nodes(self, states: Iterable[str]) -> None:
        tally = Tally(states)
        for state in ("up", "draining", "drained", "lost"):
            self.nodes.labels(state).set(tally[state])

    def store_call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a store operation, counting its latency (failures included) and errors."""
        started = time.perf_counter()
        try:
            return fn(*args)
        except Exception:
            self.store_errors.labels(op).inc()
            raise
        finally:
            if op != "wait_for":  # a wait blocks on purpose: its duration is not latency
                self.store_latency.labels(op).observe(time.perf_counter() - started)

    def serve(self, port: int, address: str) -> Any:
        """Start the HTTP endpoint (a thread of prometheus_client's); returns the server."""
        server, _thread = start_http_server(port, address, registry=self.registry)
        return server



class InstrumentedStore:
    """A StoreBackend that measures every call of the one it wraps."""

    def __init__(self, store: Any, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    def get(self, key: str) -> bytes | None:
        return self._metrics.store_call("get", self._store.get, key)

    def set(self, key: str, value: bytes) -> None:
        self._metrics.store_call("set", self._store.set, key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        return self._metrics.store_call("compare_set", self._store.compare_set, key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._metrics.store_call("add", self._store.add, key, amount)

    def append(self, key: str, value: bytes) -> None:
        self._metrics.store_call("append", self._store.append, key, value)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._metrics.store_call("get_many", self._store.get_many, keys)

    def wait_for(self, key: str, timeout: float) -> bool:
        return self._metrics.store_call("wait_for", self._store.wait_for, key, timeout)

    def delete(self, key: str) -> bool:
        return self._metrics.store_call("delete", self._store.delete, key)

    def close(self) -> None:
        self._store.close()
