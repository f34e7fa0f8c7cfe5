"""Launchers run as a test user on network-namespace test hosts (netns.py), for the tests of
torchrun lines run once per node with no elasticd installed (test_elasticrun_nodes.py,
test_slurm.py).

``Launch`` starts ``python ARGV`` inside a test host as the user (setpriv: no root, no
supplementary groups) and reads its stdout and stderr as they come, so that a test waits for
a line (``wait_line``) instead of sleeping.  ``left_behind`` says what is left of the user on
this machine: processes, private daemons' directories, cgroups, nftables tables.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from harness import FIXTURES, python_for_everyone, wait_gone
from local_users import local_users

ELASTICRUN = ("-c", "import sys; from elasticctl.cli import elasticrun; sys.exit(elasticrun())")
TORCHRUN = ("-m", "torch.distributed.run")
TRAIN = FIXTURES / "launch_train.py"


def host_name(index: int) -> str:
    """Test host i's name: its processes' host name (``Launch``) and in every host's hosts."""
    return f"h{index}"


def on_host(hosts: object, index: int, argv: list[str]) -> list[str]:
    """``argv`` run on test host ``index``: in its network namespace, with its own host name
    (a UTS namespace) and its own /etc/hosts (host_names; a mount namespace).  Unlike ``ip
    netns exec`` it keeps this machine's /sys, cgroups included (slurmd needs them).  Every
    step execs the next: the process's pid is argv's."""
    ns = hosts.ns(index)  # type: ignore[attr-defined]
    enter = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
    return [
        "nsenter",
        f"--net=/run/netns/{ns}",
        "unshare",
        "--mount",
        "--uts",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        enter,
        host_name(index),
        f"/etc/netns/{ns}/hosts",
        *argv,
    ]


def host_names(hosts: object) -> Callable[[], None]:
    """Each test host's own /etc/hosts (``ip netns exec`` mounts /etc/netns/NS/hosts), naming
    every test host by its address, as on a real cluster: torchrun finds the store's host by
    its name and gloo binds to it.  Returns the clean-up."""
    made = []
    count = hosts.count  # type: ignore[attr-defined]
    for i in range(1, count + 1):
        directory = Path("/etc/netns") / hosts.ns(i)  # type: ignore[attr-defined]
        directory.mkdir(parents=True, exist_ok=True)
        made.append(directory)
        lines = ["127.0.0.1 localhost"]
        lines += [f"{hosts.addr(j)} {host_name(j)}" for j in range(1, count + 1)]  # type: ignore[attr-defined]
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    def remove() -> None:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)

    return remove


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: Path

    def env(self, **extra: str) -> dict[str, str]:
        """What the user's shell would have, with the test venv's python first."""
        venv = python_for_everyone()
        return {
            "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "VIRTUAL_ENV": venv,
            "LANG": "C.UTF-8",
            **extra,
        }

    def as_user(self, argv: list[str]) -> list[str]:
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--",
            *argv,
        ]


@contextmanager
def user_made(base: Path) -> Iterator[Account]:
    """A user made for one test, with a home directory of its own under ``base``."""
    import pwd

    with local_users("erun") as users:
        account = pwd.getpwnam(users["erun"])
        home = base / "home"
        home.mkdir(mode=0o700)
        os.chown(home, account.pw_uid, account.pw_gid)
        yield Account(users["erun"], account.pw_uid, account.pw_gid, home)


class Lines:
    """The lines of a byte stream (a pipe, a FIFO), read by a thread as they come."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str | None] = []
        self._changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream: object) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append(None)  # the end of the stream
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return "\n".join(line for line in self.lines if line is not None)

    def mark(self) -> int:
        with self._changed:
            return len(self.lines)

    def wait_line(self, pattern: str, timeout: float = 120.0, after: int = 0) -> re.Match[str]:
        """The first line from line ``after`` on that matches ``pattern``, waiting for it."""
        wanted = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = after
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if line is None:
                        raise AssertionError(f"the stream ended without {pattern!r}")
                    if match := wanted.search(line):
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} in {timeout:g} s")
                self._changed.wait(left)


class Launch:
    """``python ARGV`` on one test host as ``user``; stdout and stderr read as they come."""

    def __init__(
        self,
        hosts: object,
        index: int,
        user: Account,
        argv: list[str],
        env: dict[str, str],
        cwd: Path | None = None,
    ) -> None:
        self.index = index
        python = f"{python_for_everyone()}/bin/python3"
        command = user.as_user([python, *argv])
        if hosts is not None:
            command = on_host(hosts, index, command)
        self.argv = command
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(cwd or user.home),
        )
        self.started = time.monotonic()
        self.streams = {"out": Lines(self.proc.stdout), "err": Lines(self.proc.stderr)}

    def text(self, stream: str = "out") -> str:
        return self.streams[stream].text()

    def mark(self, stream: str = "out") -> int:
        """Where ``stream`` is now: wait_line(..., after=mark) looks at later lines only."""
        return self.streams[stream].mark()

    def wait_line(
        self, pattern: str, stream: str = "out", timeout: float = 120.0, after: int = 0
    ) -> re.Match[str]:
        """The first line of ``stream`` (from line ``after`` on) that matches ``pattern`` (a
        regex), waiting for it; AssertionError when the stream ended or ``timeout`` passed
        first."""
        try:
            return self.streams[stream].wait_line(pattern, timeout, after)
        except AssertionError as exc:
            raise AssertionError(self.story(str(exc))) from None

    def wait(self, timeout: float = 120.0) -> int:
        """Its exit status, once it ended and its output is read (AssertionError after
        ``timeout``: it is killed then)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise AssertionError(self.story(f"still running after {timeout:g} s")) from None
        for lines in self.streams.values():
            lines.reader.join(30)
        return code

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill_tree(self) -> list[int]:
        """SIGKILL to it and everything it started (a host gone); their pids."""
        procs = [*self.descendants()]
        try:
            procs.insert(0, psutil.Process(self.proc.pid))
        except psutil.NoSuchProcess:
            pass
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        return [proc.pid for proc in procs]

    def story(self, why: str) -> str:
        return (
            f"host {self.index}: {why}\n--- stdout ---\n{self.text('out')[-3000:]}\n"
            f"--- stderr ---\n{self.text('err')[-6000:]}"
        )


def left_behind(user: Account, node_names: list[str] = (), timeout: float = 30.0) -> list[str]:  # type: ignore[assignment]
    """What is left of ``user`` here: its processes (waited for up to ``timeout``), its
    private daemons' directories, job cgroups of ``node_names``, nftables tables that name
    them.  [] when nothing is."""
    found = []
    procs = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == user.uid]
    found += [f"process {pid}: {_cmdline(pid)}" for pid in wait_gone(procs, timeout)]
    base = Path("/tmp") / f"elasticrun-{user.uid}"
    if base.exists():
        found += [f"directory {entry}" for entry in base.iterdir()]
    found += [f"cgroup {path}" for path in _cgroups(node_names)]
    if node_names and shutil.which("nft"):
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        found += [
            f"nftables {line}" for line in tables.splitlines() if any(n in line for n in node_names)
        ]
    return found


def job_directories(user: Account) -> dict[int, Path]:
    """The user's private daemons' directories, by the pid of the elasticrun that made each."""
    import json

    found = {}
    base = Path("/tmp") / f"elasticrun-{user.uid}"
    for entry in base.iterdir() if base.exists() else ():
        try:
            found[json.loads((entry / "owner").read_text())["pid"]] = entry
        except (OSError, ValueError, KeyError):
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return "(gone)"


def _cgroups(node_names: list[str], depth: int = 7) -> list[str]:
    """Job cgroups of these nodes (``elasticd-<node>-...``) anywhere under /sys/fs/cgroup."""
    if not node_names:
        return []
    marks = tuple(f"elasticd-{name}-" for name in node_names)
    found = []
    top = "/sys/fs/cgroup"
    for root, dirs, _ in os.walk(top):
        if root.count("/") - top.count("/") >= depth:
            dirs[:] = []
        for name in dirs:
            if name.startswith(marks):
                found.append(os.path.join(root, name))
    return found
