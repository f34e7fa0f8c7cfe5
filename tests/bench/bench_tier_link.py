"""The checkpoint tier's data plane on loopback: a node's file fetched from another daemon's
tier, over the bulk port (AES-256-GCM) and over CURVE alone (a daemon without the bulk port).

The real ``TierServer`` in a process of its own, serving a file in /dev/shm, and the real
``TierLinks`` fetching it into another: byte ranges (what a re-formed rank asks for) and the
whole file with its SHA-256 (what a restart puts in place).  Each figure is the median of
``--runs``.

    .venv/bin/python tests/bench/bench_tier_link.py [--mib 640] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT / "tests")]

from tier_nodes import OneNode, Record

from elasticd.cluster import tierlink
from elasticd.cluster.peers import curve_policy
from elasticd.control.server import Zap


class FileTier:
    """The serving node's tier, for one file."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, job: str, owner: str, ckpt: str, name: str, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def size(self, job: str, owner: str, ckpt: str, name: str) -> int:
        return os.fstat(self._fd).st_size


def serve(source: str, bulk: bool, secret: bytes, client: bytes, ready: multiprocessing.Queue) -> None:  # fmt: skip
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        zap = Zap(ctx)
        zap.add(tierlink.TIER_DOMAIN, curve_policy(lambda: {client: "client"}))
        server = tierlink.TierServer(
            ctx,
            "tcp://127.0.0.1:*",
            FileTier(source),  # type: ignore[arg-type]
            curve_secret=secret,
            bulk_endpoint="tcp://127.0.0.1:*" if bulk else None,
        )
        endpoint = server.bind()
        if bulk:
            server.bind_bulk()
        ready.put(endpoint)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(zap.serve())
            tasks.create_task(server.serve())

    asyncio.run(main())


def measure(source: str, into: str, bulk: bool, runs: int) -> dict[str, float]:
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    ready: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(
        target=serve, args=(source, bulk, server_secret, public, ready), daemon=True
    )
    server.start()
    try:
        endpoint = ready.get(timeout=30)

        async def fetch_all() -> dict[str, float]:
            ctx = zmq.asyncio.Context()
            links = tierlink.TierLinks(
                ctx, public, secret, OneNode(Record(endpoint, server_public.decode()))
            )
            size = os.path.getsize(source)
            times: dict[str, list[float]] = {"ranges": [], "whole": []}
            for _ in range(runs):
                for kind in times:
                    fd = os.open(into, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                    try:
                        began = time.perf_counter()
                        ranges = [(0, size)] if kind == "ranges" else None
                        await links.fetch("server", "j-000001", "server", "c", "f", fd, ranges)
                        times[kind].append(time.perf_counter() - began)
                    finally:
                        os.close(fd)
            ctx.destroy(linger=0)
            return {kind: statistics.median(values) for kind, values in times.items()}

        return asyncio.run(fetch_all())
    finally:
        server.kill()
        server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=640, help="the file's size")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tier-link-", dir="/dev/shm"))
    try:
        source, into = work / "source", work / "into"
        with open(source, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        mib = args.mib
        print(f"{mib} MiB fetched on loopback from another process's tier, medians of {args.runs}")
        print(f"{'channel':<28} {'byte ranges':>18} {'whole, SHA-256':>18}")
        for name, bulk in (("bulk port (AES-256-GCM)", True), ("CURVE alone", False)):
            figures = measure(str(source), str(into), bulk, args.runs)
            cells = [
                f"{figures[k]:.2f} s {mib / figures[k]:5.0f} MiB/s" for k in ("ranges", "whole")
            ]
            print(f"{name:<28} {cells[0]:>18} {cells[1]:>18}")
    finally:
        for path in work.iterdir():
            path.unlink()
        work.rmdir()


if __name__ == "__main__":
    main()
