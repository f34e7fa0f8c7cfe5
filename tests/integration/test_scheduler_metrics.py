"""The scheduler's metrics (docs/scheduler.md, "Metrics") on a real cluster of two daemons, read from their
/metrics endpoints: the allocator's term on the one node that allocates, a reclaim counted
on the node that left, each job's wait observed once (on the node it was submitted on),
the waiting jobs by reason and the longest wait on every node, usage per account."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import worker_args
from prometheus_client.parser import text_string_to_metric_families
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

FAST = "[scheduler]\nresize_interval = 1.0\nmin_run_time = 0.0\n"


def scrape(daemon: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the daemon's /metrics: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(daemon: Any, name: str, **labels: str) -> float | None:
    return scrape(daemon).get((name, frozenset(labels.items())))


def world(daemon: Any, job: str, size: int) -> dict[str, Any]:
    return daemon.wait_job(
        job,
        lambda d: (
            d["state"] == "RUNNING"
            and d["world_size"] == size
            and sum(w["state"] == "HEALTHY" for w in d["workers"]) == size
        ),
        timeout=120,
    )


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="smet")
    for role in ("a", "b"):
        cluster.add(role, config=FAST)
    return cluster.start()


def test_a_reclaim_a_wait_and_the_allocator_show_on_the_metrics_endpoints(cluster: Cluster) -> None:
    a, b = cluster
    began = time.time()
    big = a.submit(
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--last-call-timeout",
        "1",
        *worker_args("--sleep", "0"),
    )["id"]
    world(a, big, 2)

    # one node allocates, in the term of the schedule both follow
    def one_allocator() -> list[float] | None:
        terms = [sample(d, "elasticd_allocator_term") for d in cluster]
        return terms if sorted(terms)[0] == 0 < sorted(terms)[1] else None

    terms = wait_for(one_allocator, 30, "one allocator")
    term = max(terms)
    allocator = cluster[terms.index(term)]
    assert sample(allocator, "elasticd_allocator_schedule_number") >= 1
    wait_for(
        lambda: all(sample(d, "elasticd_schedule_term") == term for d in cluster),
        30,
        "both follow the allocator's schedule",
    )

    # a job that needs a whole node (2 slots), submitted on b: only a reclaim admits it
    submitted = time.time()
    small = b.submit("--nproc-per-node", "2", *worker_args("--sleep", "0"))["id"]
    b.wait_running(small, 2, timeout=60)
    world(a, big, 1)
    reclaimed = {d.name: sample(d, "elasticd_reclaims_total") for d in cluster}
    doc = a.ctl("status", small)
    host = {n["node"] for n in doc["nodes"]}
    assert reclaimed == {d.name: float(d.name in host) for d in cluster}, (reclaimed, host)
    assert a.ctl("status", big)["restarts"] == 0

    # each job's wait once, on the node it was submitted on
    for daemon, since in ((a, began), (b, submitted)):
        wait_for(
            lambda: sample(daemon, "elasticd_job_wait_seconds_count") == 1,
            30,
            f"{daemon.name} observed its job's wait",
        )
        assert 0 <= sample(daemon, "elasticd_job_wait_seconds_sum") <= time.time() - since

    # a third job waits for room (b full, a's other slot too few): every node says so
    waiter = a.submit("--nproc-per-node", "2", *worker_args("--sleep", "0"))["id"]
    queued = wait_for(lambda: a.ctl("queue")["jobs"], 30, "the job queued")
    assert [(j["id"], j["reason"]) for j in queued] == [(waiter, "Resources")]
    for daemon in cluster:
        wait_for(
            lambda: sample(daemon, "elasticd_jobs_waiting", reason="Resources") == 1,
            30,
            f"{daemon.name} counts the waiting job",
        )
        assert sample(daemon, "elasticd_jobs_waiting", reason="Priority") == 0
    first = sample(a, "elasticd_longest_wait_seconds", reason="Resources")
    wait_for(
        lambda: sample(a, "elasticd_longest_wait_seconds", reason="Resources") > first,
        10,
        "the longest wait grows",
    )
    assert sample(allocator, "elasticd_scheduler_plan_seconds_count") >= 3

    # what each node's parts used, per account (the user's primary group: root's)
    for daemon in cluster:
        assert sample(daemon, "elasticd_usage_node_seconds_total", account="root") > 0

    # the waiting job cancelled, the small one ended: big grows back, counted by the allocator
    a.ctl("cancel", waiter)
    for daemon in cluster:
        wait_for(
            lambda: sample(daemon, "elasticd_jobs_waiting", reason="Resources") == 0,
            30,
            f"{daemon.name} counts no waiting job",
        )
    grown = [sample(d, "elasticd_scheduler_grown_nodes_total") for d in cluster]
    b.ctl("cancel", small)
    world(a, big, 2)
    now = [sample(d, "elasticd_scheduler_grown_nodes_total") for d in cluster]
    assert [n - g for n, g in zip(now, grown)] == [float(d is allocator) for d in cluster]
    assert sample(allocator, "elasticd_scheduler_preemptions_total") == 0
    assert sample(a, "elasticd_job_wait_seconds_count") == 1, "a job that never started has no wait"
    a.ctl("cancel", big)
