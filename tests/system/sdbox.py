"""A throwaway real systemd (PID 1) in a container, to run ``systemctl start elasticd`` for real.

``Box`` boots this host's own /usr with ``systemd-nspawn --volatile=yes`` (the root is a
tmpfs: nothing is written to the host), or a root directory of the test's, with a private
network (only ``lo``, so ports never clash with the host's) or a network namespace of the
test's (netns.py), and the given directories bind-mounted.  ``run`` executes a
command inside it (``nsenter`` into every namespace of the container's PID 1).

Booting is awaited, not polled: nspawn runs with ``--notify-ready=yes`` and a
``NOTIFY_SOCKET`` of ours, so its ``READY=1`` arrives when the container's systemd has
finished starting up.

How the container is isolated from the host (this host runs no systemd):
- nspawn runs in a fresh mount namespace where /run/systemd is an empty tmpfs, so neither
  it nor anything in the container sees the host's /run/systemd;
- it runs in cgroups of its own, ``sdbox-NAME`` (one per hierarchy), which ``down`` removes.

Needs root and ``systemd-nspawn`` (Debian: systemd-container, see .ci/setup-root.sh).
Keep bind-mounted host paths away from the container's /tmp: systemd-tmpfiles cleans it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

CGROUP_HIERARCHIES = ("systemd", "unified")  # named v1 + v2 (hybrid); whichever exist


def usable() -> str | None:
    """Why a container cannot be booted here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn)"
    for tool in ("systemd-nspawn", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool}; see .ci/setup-root.sh"
    return None


def _cgroups(name: str) -> list[Path]:
    return [
        Path("/sys/fs/cgroup", h, f"sdbox-{name}")
        for h in CGROUP_HIERARCHIES
        if Path("/sys/fs/cgroup", h).is_dir()
    ]


class Box:
    def __init__(
        self,
        name: str,
        work: Path,
        *,
        binds: list[str] = (),
        binds_ro: list[str] = (),
        root: Path | None = None,
        netns: str | None = None,
    ) -> None:
        """``work``: a host directory for the box's notify socket and console log.
        ``binds``/``binds_ro``: nspawn's ``SRC[:DST]`` specifications.  ``root``: a
        directory to boot, kept as the box leaves it (default: this host's /, volatile).
        ``netns``: a network namespace (/run/netns/NAME) instead of a private network."""
        self.name = name
        self.work = work
        self.log_path = work / f"{name}-console.log"
        self.options = [
            *(f"--bind={b}" for b in binds),
            *(f"--bind-ro={b}" for b in binds_ro),
            *(["--directory=/", "--volatile=yes"] if root is None else [f"--directory={root}"]),
            "--private-network"
            if netns is None
            else f"--network-namespace-path=/run/netns/{netns}",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.init_pid = 0

    def up(self, timeout: float = 60.0) -> Box:
        """Boot, and wait until the container's systemd has started up."""
        return self.start().wait_up(timeout)

    def start(self) -> Box:
        """Boot without waiting (several boxes boot at once; then ``wait_up`` each)."""
        self._notify_path = str(self.work / f"{self.name}-nspawn-notify.sock")
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(self._notify_path)
        argv = [
            "systemd-nspawn",
            "--register=no",
            "--keep-unit",
            "--machine",
            self.name,
            "--console=passive",
            "--notify-ready=yes",
            *self.options,
            "--boot",
            "--",
            "systemd.firstboot=off",
            "systemd.unit=multi-user.target",
        ]
        with open(self.log_path, "ab") as log:
            # unshare execs this file's main() (see below), which execs nspawn: one PID
            self.proc = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    __file__,
                    self.name,
                    *argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NOTIFY_SOCKET": self._notify_path},
                start_new_session=True,
            )
        return self

    def wait_up(self, timeout: float = 60.0) -> Box:
        assert self.proc is not None, "start() first"
        try:
            self._wait_ready(self._notify, timeout)
        finally:
            self._notify.close()
            os.unlink(self._notify_path)
        children = [p for p in psutil.Process(self.proc.pid).children() if p.name() == "systemd"]
        assert children, f"no systemd under nspawn\n{self.console()}"
        self.init_pid = children[0].pid
        return self

    def _wait_ready(self, notify: socket.socket, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"container {self.name} not ready in {timeout}s\n{self.console()}"
                )
            notify.settimeout(min(left, 1.0))
            try:
                if "READY=1" in notify.recv(4096).decode().split("\n"):
                    return
            except TimeoutError:  # only to notice an nspawn that died
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"nspawn exited with {self.proc.returncode}\n{self.console()}"
                    ) from None

    def run(
        self, *argv: str, check: bool = True, timeout: float = 120.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (its namespaces, root and working directory)."""
        assert self.init_pid, "the box is not up"
        done = subprocess.run(
            ["nsenter", "-t", str(self.init_pid), "-a", "-r", "-w", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"in {self.name}: {' '.join(argv)} exited {done.returncode}\n"
                f"stdout: {done.stdout}\nstderr: {done.stderr}"
            )
        return done

    def path(self, inside: str) -> str:
        """A path inside the container as the host can reach it (through its PID 1's root)."""
        return f"/proc/{self.init_pid}/root{inside}"

    def console(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def pull_the_plug(self) -> None:
        """Power loss: SIGKILL to every process of the box at once (its disk, a ``root``
        directory, stays as it was)."""
        for group in _cgroups(self.name):
            if group.exists():
                _kill_cgroup(group)
        self.down()

    def down(self) -> None:
        """Power off: SIGTERM to nspawn (the container shuts down), SIGKILL if it lingers,
        then remove the box's cgroups.  Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for group in _cgroups(self.name):
            if group.exists():
                _kill_cgroup(group)
                for path in sorted(group.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    if path.is_dir():
                        path.rmdir()
                group.rmdir()
        self.init_pid = 0


def _kill_cgroup(group: Path) -> None:
    """SIGKILL (by PID) whatever is still in the box's cgroup tree; wait for it to go."""
    procs = []
    for procs_file in group.rglob("cgroup.procs"):
        for pid in procs_file.read_text().split():
            try:
                proc = psutil.Process(int(pid))
                proc.kill()
                procs.append(proc)
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(procs, timeout=30)


def main(name: str, argv: list[str]) -> None:
    """Inside the fresh mount namespace made by ``unshare``: join the box's cgroups, hide
    the host's /run/systemd, become nspawn."""
    for group in _cgroups(name):
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run/systemd"], check=True)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
