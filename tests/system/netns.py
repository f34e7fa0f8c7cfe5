"""Test hosts as Linux network namespaces, so that a test can cut one off the network.

``Subnet.claim()`` reserves a /24 for this test session by adding an ``unreachable`` route
for it in the root namespace (the *guard*): nothing started from the root namespace can
then send a packet for a test address off this machine.  ``ip route add`` fails when the
route exists, so the claim is atomic and two sessions never share a subnet.

``Hosts`` (made by ``Subnet.hosts(n)``) are namespaces ``PREFIX-h1..n``, each with an
``eth0`` at ``10.77.X.i/24`` plugged into a port ``porti`` of a bridge that lives in its own
namespace ``PREFIX-sw``.  ``partition(i)`` takes host i's port down; ``heal(i)`` brings it
back.  Every process that talks to a test address must run inside a namespace
(``hosts.exec_argv(i, argv)``); the root namespace never connects to one.

Tear-down order: kill what runs in the namespaces (by PID), delete the namespaces, and only
then (``Subnet.release()``) remove the guard route.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import psutil

BASE = "10.77"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def usable() -> str | None:
    """Why network-namespace tests cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`); see .ci/setup-root.sh"
    return None


class Subnet:
    """A /24 under 10.77 reserved for this session by its guard route."""

    def __init__(self, third: int) -> None:
        self.third = third
        self.cidr = f"{BASE}.{third}.0/24"
        self.prefix = f"edt{third}"

    @classmethod
    def claim(cls) -> Subnet:
        for third in range(1, 255):
            if (
                ip("route", "add", "unreachable", f"{BASE}.{third}.0/24", check=False).returncode
                == 0
            ):
                return cls(third)
        raise RuntimeError(f"no free /24 under {BASE}.0.0/16 for test hosts")

    def release(self) -> None:
        """Remove the guard route.  Call only when no namespace of this subnet is left."""
        leftovers = [ns for ns in namespaces() if ns.startswith(f"{self.prefix}-")]
        assert not leftovers, f"namespaces still exist, keeping the guard route: {leftovers}"
        ip("route", "del", "unreachable", self.cidr, check=False)

    def hosts(self, count: int) -> Hosts:
        return Hosts(self, count)


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


class Hosts:
    """``count`` hosts on one bridge.  Use ``up()``/``down()`` (``down`` is safe to repeat)."""

    def __init__(self, subnet: Subnet, count: int) -> None:
        self.subnet = subnet
        self.count = count
        self.switch = f"{subnet.prefix}-sw"

    def ns(self, i: int) -> str:
        return f"{self.subnet.prefix}-h{i}"

    def addr(self, i: int) -> str:
        return f"{BASE}.{self.subnet.third}.{i}"

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host i (``ip`` execs it: the child's PID is argv's PID)."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def up(self) -> Hosts:
        assert ip("route", "show", self.subnet.cidr).stdout.startswith("unreachable"), (
            "the guard route must exist before any test host does"
        )
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.count + 1):
            ns = self.ns(i)
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"port{i}",
                "netns",
                self.switch,
            )
            ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
        return self

    def partition(self, i: int) -> None:
        ip("-n", self.switch, "link", "set", f"port{i}", "down")

    def heal(self, i: int) -> None:
        ip("-n", self.switch, "link", "set", f"port{i}", "up")

    def heal_all(self) -> None:
        for i in range(1, self.count + 1):
            ip("-n", self.switch, "link", "set", f"port{i}", "up", check=False)

    def down(self) -> None:
        """Kill every process left in the hosts (by PID), then delete the namespaces."""
        mine = [
            ns
            for ns in namespaces()
            if ns == self.switch or ns.startswith(f"{self.subnet.prefix}-h")
        ]
        procs = []
        for ns in mine:
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    proc = psutil.Process(int(pid))
                    proc.send_signal(signal.SIGKILL)
                    procs.append(proc)
                except psutil.NoSuchProcess:
                    pass
        psutil.wait_procs(procs, timeout=30)
        for ns in mine:
            ip("netns", "del", ns, check=False)
