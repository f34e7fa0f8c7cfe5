"""What the failure detector's system and chaos tests share: a three-node cluster running an
in-place job (examples/elastic_train.py on gloo, its events in a report directory), nodes
frozen and thawed whole (the daemon and every process under it), the daemons' detector
counters, and datagrams caught on the loopback interface (root)."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from harness import ROOT, Daemon
from store_attack import wait_for

EXAMPLE = str(ROOT / "examples" / "elastic_train.py")


def events(report: Path) -> list[dict[str, Any]]:
    path = report / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def formed(report: Path, world: int, since: float = 0.0) -> dict[int, dict[str, Any]] | None:
    """``world`` ranks started in one round after ``since`` (by pid), else None."""
    by_round: dict[int, dict[int, dict[str, Any]]] = {}
    for event in events(report):
        if event["event"] == "start" and event["world"] == world and event["time"] >= since:
            by_round.setdefault(event["round"], {})[event["pid"]] = event
    full = [group for group in by_round.values() if len(group) == world]
    return full[-1] if full else None


def never_split(report: Path) -> None:
    """Every round's ranks agree on its world and none is taken twice: no two groups of one
    job ever trained side by side under one round."""
    rounds: dict[int, list[dict[str, Any]]] = {}
    for event in events(report):
        if event["event"] == "start":
            rounds.setdefault(event["round"], []).append(event)
    for number, starts in rounds.items():
        worlds = {e["world"] for e in starts}
        ranks = [e["rank"] for e in starts]
        assert len(worlds) == 1 and len(ranks) == len(set(ranks)), (number, starts)


def submit_in_place(daemon: Daemon, report: Path, *extra: str) -> str:
    return daemon.submit(
        "--in-place",
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--last-call-timeout",
        "1",
        *extra,
        EXAMPLE,
        "--",
        "--batches",
        "1000000",
        "--commit-every",
        "5",
        "--step-time",
        "0.02",
        "--report",
        str(report),
    )["id"]


def tree(daemon: Daemon) -> list[psutil.Process]:
    assert daemon.proc is not None
    root = psutil.Process(daemon.proc.pid)
    return [root, *root.children(recursive=True)]


def freeze(daemon: Daemon) -> list[psutil.Process]:
    """SIGSTOP the daemon and everything under it (its workers): nothing closes."""
    procs = tree(daemon)
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    return procs


def thaw(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass


def kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
            proc.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def worker_stacks(daemon: Daemon, job: str) -> str:
    """Every thread's stack of ``daemon``'s workers (faulthandler, on SIGUSR2), as the tail of
    the job's output shows them: what a test that waited for a worker in vain prints."""
    for proc in tree(daemon)[1:]:
        try:
            if EXAMPLE in proc.cmdline():
                proc.send_signal(signal.SIGUSR2)
        except psutil.Error:
            pass
    time.sleep(1.0)  # the dump is written by the worker's own faulthandler thread
    lines = daemon.ctl_run("logs", job, timeout=30).stdout.splitlines()
    return "\n".join(lines[-200:])


def lost_by_detector(daemon: Daemon, node: str) -> bool:
    return f"detector: node {node} is lost" in daemon.log_text()


def detector_lines(daemon: Daemon, since: float = 0.0) -> list[str]:
    """What the daemon's detector declared (lost, back) at ``since`` (time.time()) or after:
    an attack is answerable for what follows it, not for a node a loaded host starved
    before it began."""
    lines = [line for line in daemon.log_text().splitlines() if "detector: node" in line]
    return [line for line in lines if _logged_at(line) >= since - 0.01]


def _logged_at(line: str) -> float:
    """The wall-clock time of a daemon log line ("2026-11-29 23:17:52,838 ...", local)."""
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def metric(daemon: Daemon, name: str, labels: str = "") -> float:
    """A sample of the daemon's Prometheus endpoint (0 when it has none yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else r"(\{[^}]*\})?")
    found = re.findall(r"^" + pattern + r" ([0-9.e+-]+)$", text, re.M)
    return sum(float(v if isinstance(v, str) else v[-1]) for v in found)


def refused(daemon: Daemon, why: str) -> float:
    return metric(daemon, "elasticd_detector_refused_total", f'why="{why}"')


def detector_port(daemon: Daemon) -> int:
    """The node's detector port: its peer port's number (its config file says it)."""
    config = daemon.args[daemon.args.index("--config") + 1]
    return int(re.search(r"peer_port = (\d+)", Path(config).read_text()).group(1))


def address(daemon: Daemon) -> str:
    return daemon.args[daemon.args.index("--node-address") + 1]


class Sniffer:
    """Datagrams of the detector seen on the loopback interface (an AF_PACKET socket: root),
    each as (source address, destination (address, port), payload)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.05)

    def catch(self, seconds: float, ports: set[int]) -> list[tuple[str, tuple[str, int], bytes]]:
        caught = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                frame = self._sock.recv(65535)
            except TimeoutError:
                continue
            packet = frame[14:]  # Ethernet header on lo
            if len(packet) < 28 or packet[0] >> 4 != 4 or packet[9] != 17:
                continue
            header = (packet[0] & 0x0F) * 4
            src = socket.inet_ntoa(packet[12:16])
            dst = socket.inet_ntoa(packet[16:20])
            _sport, dport, _length, _sum = struct.unpack("!HHHH", packet[header : header + 8])
            payload = packet[header + 8 :]
            if dport in ports and payload.startswith(b"EDD1"):
                caught.append((src, (dst, dport), payload))
        return caught

    def close(self) -> None:
        self._sock.close()


def send_all(datagrams: list[tuple[tuple[str, int], bytes]], times: int = 1) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(times):
            for target, payload in datagrams:
                try:
                    sock.sendto(payload, target)
                except OSError:
                    pass


def running_with_three(daemon: Daemon, report: Path) -> dict[int, dict[str, Any]]:
    three = wait_for(lambda: formed(report, 3), 180, "3 ranks training")
    since = time.time()
    wait_for(
        lambda: sum(e["event"] == "commit" and e["time"] > since for e in events(report)) >= 3,
        60,
        "the ranks committed",
    )
    return three


def pids_of(procs: list[psutil.Process]) -> set[int]:
    return {p.pid for p in procs}


def wait_exit_code(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
