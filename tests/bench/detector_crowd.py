"""One process of bench_scale.py's detector crowd: nodes FIRST..LAST of a simulated cluster of
N, each a real failure detector (core/detector.py's rules, cluster/detector.py's wire: MAC,
replay window) on a UDP socket of its own at 127.0.0.1:BASE+i, all on one event loop.

    python detector_crowd.py N FIRST LAST BASE SECONDS WARMUP

All N nodes are the members of one job's round (the ring every node watches two neighbours
of) and know each other (helpers).  After WARMUP seconds it counts, for SECONDS, the
datagrams its nodes sent and accepted and its own CPU time, and prints them as JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import sys
import time

from elasticd.cluster.detector import MAX_DATAGRAM, Refused, Wire
from elasticd.core.detector import Detector, DetectorSettings, Kind, Lost, Send

KEY = b"k" * 32


def name(i: int) -> str:
    return f"n{i:05d}"


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main() -> None:
    n, first, last, base = (int(a) for a in sys.argv[1:5])
    seconds, warmup = float(sys.argv[5]), float(sys.argv[6])
    settings = DetectorSettings()
    names = [name(i) for i in range(n)]
    endpoints = {name(i): ("127.0.0.1", base + i) for i in range(n)}
    loop = asyncio.get_running_loop()
    counts = {"sent": 0, "accepted": 0, "refused": 0, "lost": 0, "asks": 0}
    counting = False
    nodes = []
    boot = int(time.time() * 1e6)
    for i in range(first, last + 1):
        me = name(i)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.bind(endpoints[me])
        except OSError:
            sock.close()
            continue
        detector = Detector(me, settings)
        detector.know(names)
        detector.watch({"job": names}, time.monotonic())
        nodes.append((me, sock, detector, Wire(KEY, me, boot)))

    def carry(sock, wire, out) -> None:
        for item in out:
            if isinstance(item, Lost):
                counts["lost"] += counting
                continue
            assert isinstance(item, Send)
            try:
                sock.sendto(
                    wire.seal(item.to, item.kind, item.nonce, item.target), endpoints[item.to]
                )
                counts["sent"] += counting
                counts["asks"] += counting and item.kind is Kind.ASK
            except OSError:
                pass

    def readable(sock, detector, wire) -> None:
        for _ in range(64):
            try:
                raw = sock.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            try:
                m = wire.open(raw, endpoints)
            except Refused:
                counts["refused"] += counting
                continue
            counts["accepted"] += counting
            carry(
                sock, wire, detector.receive(m.sender, m.kind, m.nonce, m.target, time.monotonic())
            )

    for _me, sock, detector, wire in nodes:
        loop.add_reader(sock, readable, sock, detector, wire)

    def tick() -> None:
        now = time.monotonic()
        for _me, sock, detector, wire in nodes:
            carry(sock, wire, detector.tick(now))
        loop.call_later(settings.tick, tick)

    loop.call_soon(tick)
    await asyncio.sleep(warmup)
    counting = True
    cpu0, t0 = cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    took, used = time.monotonic() - t0, cpu() - cpu0
    counting = False
    health = sorted(d.health for _m, _s, d, _w in nodes)
    print(
        json.dumps(
            {
                "nodes": len(nodes),
                "seconds": took,
                "cpu": used,
                **counts,
                "health_max": health[-1] if health else 0,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main())
