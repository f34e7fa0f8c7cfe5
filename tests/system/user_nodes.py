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
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from harness import FIXTURES, python_for_everyone, wait_gone
from launched import Launched
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


class Launch(Launched):
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
        command = user.as_user([f"{python_for_everyone()}/bin/python3", *argv])
        if hosts is not None:
            command = on_host(hosts, index, command)
        super().__init__(command, env, str(cwd or user.home), f"host {index}")


def left_behind(
    user: Account,
    node_names: list[str] = (),  # type: ignore[assignment]
    hosts: object = None,
    timeout: float = 30.0,
) -> list[str]:
    """What is left of ``user`` here: its processes (waited for up to ``timeout``), its
    private daemons' directories, job cgroups of ``node_names``, and the nftables tables of
    those nodes (in each of ``hosts``' namespaces, or here).  [] when nothing is."""
    found = []
    procs = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == user.uid]
    found += [f"process {pid}: {_cmdline(pid)}" for pid in wait_gone(procs, timeout)]
    base = Path("/tmp") / f"elasticrun-{user.uid}"
    if base.exists():
        found += [f"directory {entry}" for entry in base.iterdir()]
    found += [f"cgroup {path}" for path in _cgroups(node_names)]
    if node_names and shutil.which("nft"):
        found += [f"nftables {table}" for table in _tables_of(node_names, hosts)]
    return found


def _tables_of(node_names: list[str], hosts: object) -> list[str]:
    """The nftables tables of these nodes: the daemon names each ``elasticd_<cluster>_<node>``,
    so a node's name must end the table's (a substring would match other tests' tables),
    or be followed by a pid alone (elasticrun names its node ``<host>-<pid>``)."""
    prefixes: list[list[str]] = [[]]
    if hosts is not None:
        count = hosts.count  # type: ignore[attr-defined]
        prefixes = [["ip", "netns", "exec", hosts.ns(i)] for i in range(1, count + 1)]  # type: ignore[attr-defined]
    ends = [re.sub(r"[^A-Za-z0-9_]", "_", name) for name in node_names]
    node = re.compile(rf"_({'|'.join(map(re.escape, ends))})(_\d+)?$")
    found = []
    for prefix in prefixes:
        listed = subprocess.run([*prefix, "nft", "list", "tables"], capture_output=True, text=True)
        if listed.returncode != 0:  # not "none": unknown, which a check must not pass
            found.append(f"{' '.join(prefix[3:]) or 'here'}: nft failed: {listed.stderr.strip()}")
        for line in listed.stdout.splitlines():
            name = line.split()[-1] if line.startswith("table ") else ""
            if name.startswith("elasticd_") and node.search(name):
                found.append(" ".join([*prefix[3:], line]))
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
