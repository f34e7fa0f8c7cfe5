"""Control-plane figures of a real standalone elasticd (docs/benchmarks.md).

    python tests/bench/bench_control.py [--requests 1000] [--json]

- ``status`` round trip over the control socket: p50/p99 of N requests, one client;
- ``elasticctl version`` wall time (a fresh process each time: interpreter start included);
- the daemon's idle RSS and CPU% (sampled over 5 s with no job).

The daemon runs in a temporary directory and is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import PY, WORKER, Control, Daemon

from elasticd.wire import protocol


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def status_round_trips(daemon: Daemon, job_id: str, n: int) -> list[float]:
    times = []
    with Control(daemon.socket) as control:
        for _ in range(n):
            frame = protocol.encode_request(
                protocol.Request(uuid.uuid4().hex, "status", {"job": job_id})
            )
            started = time.perf_counter()
            control.send_raw(frame)
            reply = control.recv()
            times.append(time.perf_counter() - started)
            assert reply.ok
    return times


def ctl_version_times(daemon: Daemon, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        subprocess.run(
            [os.path.join(os.path.dirname(PY), "elasticctl"), "--socket", daemon.socket, "version"],
            check=True,
            capture_output=True,
        )
        times.append(time.perf_counter() - started)
    return times


def idle_usage(daemon: Daemon, seconds: float = 5.0) -> tuple[float, float]:
    proc = psutil.Process(daemon.proc.pid)
    proc.cpu_percent(None)
    time.sleep(seconds)  # a measurement window, not a wait for something
    return proc.memory_info().rss / 2**20, proc.cpu_percent(None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--runs", type=int, default=20, help="elasticctl version runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="elasticd-bench-") as base:
        daemon = Daemon(Path(base), "bench", args=("--slots", "2")).start()
        try:
            job = daemon.submit_wait(str(WORKER))
            rss, cpu = idle_usage(daemon)
            rtt = status_round_trips(daemon, job["id"], args.requests)
            version = ctl_version_times(daemon, args.runs)
        finally:
            daemon.stop()
    figures = {
        "status_p50_ms": percentile(rtt, 0.5) * 1e3,
        "status_p99_ms": percentile(rtt, 0.99) * 1e3,
        "requests": len(rtt),
        "elasticctl_version_median_ms": statistics.median(version) * 1e3,
        "elasticctl_version_max_ms": max(version) * 1e3,
        "idle_rss_mib": rss,
        "idle_cpu_percent": cpu,
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"status round trip ({len(rtt)} requests): p50 {figures['status_p50_ms']:.3f} ms, "
        f"p99 {figures['status_p99_ms']:.3f} ms"
    )
    print(
        f"elasticctl version ({args.runs} runs): median {figures['elasticctl_version_median_ms']:.0f} ms, "
        f"max {figures['elasticctl_version_max_ms']:.0f} ms"
    )
    print(f"daemon idle: RSS {rss:.0f} MiB, CPU {cpu:.1f} %")


if __name__ == "__main__":
    main()
