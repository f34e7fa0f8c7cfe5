"""Test harness: real elasticd daemons in temporary directories, driven by the real
elasticctl and by a small control-protocol client.

Nothing here sleeps and hopes: a daemon is ready when its sd_notify READY=1 datagram
arrives on a real NOTIFY_SOCKET; a job reaches a state when the daemon's own ``wait``
stream says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from hostwide import free_port as free_port  # the tests' ports, unique on this host
from hostwide import made_once

from elasticd.wire import protocol

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
WORKER = FIXTURES / "worker.py"
PY = sys.executable
# What a user with this checkout's venv activated has: elasticctl then submits jobs with the
# venv's python3 (the one with torch), whether or not the test runner activated it.
CLIENT_ENV = {
    **os.environ,
    "VIRTUAL_ENV": sys.prefix,
    "PATH": f"{os.path.dirname(PY)}:{os.environ.get('PATH', os.defpath)}",
}
START_TIMEOUT = 60.0
_WARNED = re.compile(r"RuntimeWarning|was never awaited")  # in a daemon's log: a test fails


def _needs_root():
    import pytest

    return pytest.mark.skipif(os.getuid() != 0, reason="needs root (another user, cgroups, mounts)")


needs_root = _needs_root()


class Daemon:
    """One elasticd process (standalone unless told otherwise) and ways to talk to it."""

    running: ClassVar[weakref.WeakSet[Daemon]] = weakref.WeakSet()  # for a failing test's stories

    def __init__(
        self,
        base: Path,
        name: str = "n1",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        standalone: bool = True,
        metrics_port: int = 0,
    ) -> None:
        self.base = base
        self.name = name
        self.state_dir = base / f"{name}-state"
        self.runtime_dir = base / f"{name}-run"
        self.socket = str(self.runtime_dir / "control.sock")
        self.log_path = base / f"{name}.log"
        self.notify_path = str(base / f"{name}-notify.sock")
        self.args = args
        self.env = env or {}
        self.standalone = standalone
        self.metrics_port = metrics_port
        self.program: tuple[str, ...] = (PY, "-m", "elasticd")
        self.messages: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopped: subprocess.Popen[bytes] | None = None  # the process stop() ended last
        self._notify: socket.socket | None = None
        self._log_checked = 0  # bytes of the log looked at for warnings

    # -- process ---------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT, *, wait: bool = True) -> Daemon:
        """Start the daemon; unless told not to, wait for its READY=1."""
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if os.path.exists(self.notify_path):
            os.unlink(self.notify_path)
        self._notify.bind(self.notify_path)
        self.messages = []
        self._log_checked = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {**os.environ, "NOTIFY_SOCKET": self.notify_path, **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.base)
            )
        Daemon.running.add(self)
        if wait:
            self.wait_notify("READY=1", timeout)
        return self

    def stories(self, timeout: float = 5.0) -> str:
        """Every job's story on this daemon (its node core's stimuli and instructions), as
        ``elasticctl status --debug`` shows it; "" when it does not answer."""
        try:
            with Control(self.socket) as control:
                jobs = [
                    row["id"]
                    for batch in control.stream("list", {"all": True}, timeout)
                    for row in batch.get("jobs", [])
                ]
                told, node_story = [], {}
                for job in jobs:
                    doc = control.call("status", {"job": job, "debug": True}, timeout).result or {}
                    for node, lines in (doc.get("story") or {}).items():
                        told.append(f"job {job} on {node}:\n" + "\n".join(lines[-60:]))
                    node_story = doc.get("node_story") or node_story
                for node, lines in node_story.items():
                    told.append(f"node {node}:\n" + "\n".join(lines[-60:]))
                return "\n\n".join(told)
        except Exception as exc:  # a daemon that died, or hangs: the test's own failure says more
            return f"(no stories: {exc!r})"

    def argv(self) -> list[str]:
        """The daemon's command line (``program`` runs ``python -m elasticd`` unless changed)."""
        return [
            *self.program,
            "--node-name",
            self.name,
            "--state-dir",
            str(self.state_dir),
            "--runtime-dir",
            str(self.runtime_dir),
            "--metrics-port",
            str(self.metrics_port),
            *(("--standalone",) if self.standalone else ()),
            *self.args,
        ]

    def ready(self) -> bool:
        """Whether READY=1 has arrived (reads what is queued, never blocks)."""
        assert self._notify is not None
        self._notify.setblocking(False)
        try:
            while True:
                self.messages.extend(self._notify.recv(4096).decode().split("\n"))
        except BlockingIOError:
            pass
        finally:
            self._notify.setblocking(True)
        return "READY=1" in self.messages

    def wait_status(self, predicate: Callable[[str], bool], timeout: float = 30.0) -> str:
        """Wait until the daemon's current STATUS= line (it sends one on every change)
        meets ``predicate``; returns it.  Blocks on the notify socket between lines."""
        assert self._notify is not None
        deadline = time.monotonic() + timeout
        while True:
            self.ready()  # take in what is queued, without blocking
            lines = [m for m in self.messages if m.startswith("STATUS=")]
            if lines and predicate(lines[-1]):
                return lines[-1]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{self.name}: status never matched; last {lines[-1:]}\n{self.log_text()}"
                )
            self._notify.settimeout(left)
            try:  # block until the next notification arrives (then look again)
                self.messages.extend(self._notify.recv(4096).decode().split("\n"))
            except TimeoutError:
                pass

    def wait_notify(self, wanted: str, timeout: float = 30.0, contains: str = "") -> str:
        """Block until a notification starting with ``wanted`` (and containing ``contains``)
        arrives; returns it."""
        assert self._notify is not None
        deadline = time.monotonic() + timeout

        def matches(message: str) -> bool:
            return message.startswith(wanted) and contains in message

        for message in self.messages:
            if matches(message):
                return message
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{self.name}: no {wanted!r} in {timeout}s; got {self.messages}\n"
                    f"{self.log_text()}"
                )
            self._notify.settimeout(min(left, 0.5))
            try:
                data = self._notify.recv(4096).decode()
            except TimeoutError:
                if self.proc is not None and self.proc.poll() is not None and wanted != "":
                    raise AssertionError(
                        f"{self.name} exited with {self.proc.returncode} before "
                        f"{wanted!r}:\n{self.log_text()}"
                    ) from None
                continue
            for message in data.split("\n"):
                self.messages.append(message)
                if matches(message):
                    return message

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        """SIGTERM, then its exit status.  A daemon that ended before (the test killed it) or
        did not end well is cleaned up after as systemd's ``ExecStopPost=`` does, so that its
        firewall table, cgroups and checkpoint mounts do not outlive the test.  AssertionError when
        its log shows a RuntimeWarning (a coroutine never awaited: a bug that no other check
        sees), once per run."""
        if self.proc is None:
            return None
        # ended before (its code may read 0: a test that reaped it with psutil took the code)
        ended_before = self.proc.poll() is not None
        if not ended_before:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            finally:
                if self._notify is not None:
                    self._notify.close()
        if (ended_before or self.proc.returncode != 0) and self._stopped is not self.proc:
            self.clean_up()
        self._stopped = self.proc
        self._check_warnings()
        return self.proc.returncode

    def clean_up(self) -> None:
        """``elasticd --clean-up`` with this daemon's options (it refuses while one runs)."""
        options = self.argv()[len(self.program) :]
        subprocess.run(
            [PY, "-m", "elasticd", "--clean-up", *options],
            env={**os.environ, **self.env},
            cwd=str(self.base),
            capture_output=True,
            timeout=60,
            check=False,
        )

    def _check_warnings(self) -> None:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_checked)
                raw = log.read()
        except OSError:
            return
        self._log_checked += len(raw)
        warned = [
            line for line in raw.decode(errors="replace").splitlines() if _WARNED.search(line)
        ]
        if warned:
            raise AssertionError(f"{self.name} warned of a bug:\n" + "\n".join(warned[:20]))

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    # -- elasticctl ------------------------------------------------------------------------

    def ctl_run(
        self,
        *args: str,
        user: str | None = None,
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run elasticctl, as ``user`` if given (with a Python that user can execute)."""
        python, extra, as_user = PY, {}, {}
        if user is not None:
            import pwd

            venv = python_for_everyone()
            python, extra = f"{venv}/bin/python3", {"VIRTUAL_ENV": venv, "HOME": "/"}
            account = pwd.getpwnam(user)
            as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        argv = [python, "-m", "elasticctl", "--socket", self.socket, *args]
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**CLIENT_ENV, **extra, **(env or {})},
            cwd=cwd or str(self.base),
            **as_user,
        )

    def ctl(self, *args: str, expect: int = 0, **kw: Any) -> Any:
        """Run ``elasticctl --json ARGS``; check the exit code; parse stdout (NDJSON -> list)."""
        done = self.ctl_run("--json", *args, **kw)
        assert done.returncode == expect, (
            f"elasticctl {' '.join(args)} exited {done.returncode}, wanted {expect}\n"
            f"stdout: {done.stdout}\nstderr: {done.stderr}\n--- daemon log ---\n{self.log_text()}"
        )
        try:
            return json.loads(done.stdout)
        except ValueError:  # a stream: one document per line
            return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    def submit_wait(self, *args: str, **kw: Any) -> dict[str, Any]:
        """``submit --wait``; returns the final job document."""
        docs = self.ctl("submit", "--wait", *args, **kw)
        return docs[-1] if isinstance(docs, list) else docs

    def submit(self, *args: str, **kw: Any) -> dict[str, Any]:
        return self.ctl("submit", *args, **kw)

    # -- protocol client (for streams a test needs to stop early, and malformed input) -------

    def request(self, op: str, **args: Any) -> protocol.Reply:
        with Control(self.socket) as control:
            return control.call(op, args)

    def wait_job(
        self, job_id: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120.0
    ) -> dict[str, Any]:
        """Follow the job's ``wait`` stream until ``predicate(doc)``; returns that doc."""
        with Control(self.socket) as control:
            last = None
            for doc in control.stream("wait", {"job": job_id}, timeout):
                last = doc
                if predicate(doc):
                    return doc
        raise AssertionError(
            f"job {job_id} ended without meeting the condition: {last}\n{self.log_text()}"
        )

    def wait_output(self, job_id: str, needles: list[str], timeout: float = 120.0) -> None:
        """Follow the job's logs until every needle appeared in some line."""
        missing = set(needles)
        with Control(self.socket) as control:
            for doc in control.stream("logs", {"job": job_id, "follow": True}, timeout):
                for line in doc.get("lines", []):
                    missing = {n for n in missing if n not in line["text"]}
                if not missing:
                    return
        raise AssertionError(f"job {job_id} ended before printing {missing}\n{self.log_text()}")

    def wait_running(self, job_id: str, workers: int, timeout: float = 120.0) -> dict[str, Any]:
        return self.wait_job(
            job_id,
            lambda d: (
                d["state"] == "RUNNING"
                and sum(1 for w in d["workers"] if w["state"] == "HEALTHY" and w["pid"]) == workers
            ),
            timeout,
        )


class Control:
    """A minimal real client of the control protocol (frames written and read by hand, so
    that tests can send what elasticctl never would)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._frames = protocol.FrameReader()
        self._ready: list[bytes] = []

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, payload: bytes) -> None:
        """One frame with ``payload`` as its body (any bytes)."""
        self.sock.sendall(protocol.framed(payload))

    def recv(self, timeout: float = 30.0) -> protocol.Reply:
        deadline = time.monotonic() + timeout
        while not self._ready:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                raise AssertionError(f"no reply in {timeout}s") from None
            if not data:
                raise AssertionError("the daemon closed the connection")
            self._ready.extend(self._frames.feed(data))
        return protocol.decode_reply(self._ready.pop(0))

    def call(self, op: str, args: dict[str, Any], timeout: float = 30.0) -> protocol.Reply:
        self.send_raw(protocol.encode_request(protocol.Request(uuid.uuid4().hex, op, args)))
        return self.recv(timeout)

    def stream(self, op: str, args: dict[str, Any], timeout: float) -> Iterator[Any]:
        self.send_raw(protocol.encode_request(protocol.Request(uuid.uuid4().hex, op, args)))
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(max(0.1, deadline - time.monotonic()))
            assert reply.ok, f"{reply.code}: {reply.message}"
            if reply.end:
                return
            yield reply.result


def with_sigint(disposition: Any, argv: list[str]) -> list[str]:
    """``argv`` (a path first) run with SIGINT at ``disposition`` (SIG_DFL, as a terminal
    leaves it, or SIG_IGN, as a script's background job inherits it), set by a Python that
    then execs it.  Not a ``preexec_fn``: Python code between fork and exec, in a test
    process whose other threads (gRPC's, once an etcd test ran in it) may hold a lock, can
    kill the child before its exec, and Popen takes that for a started program that wrote
    nothing."""
    name = "SIG_IGN" if disposition == signal.SIG_IGN else "SIG_DFL"
    code = (
        f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{name}); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", code, *argv]


def python_for_everyone() -> str:
    """A venv on the system's python3 that any user can run, seeing this checkout's packages.

    The project's own venv may sit on an interpreter under /root, which other users cannot
    execute; the packages themselves (pyzmq, elasticd) are readable, so a .pth adds them.
    One per checkout's venv (its name has a digest of the venv's path), made once and kept.
    """
    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    digest = hashlib.sha256(site.encode()).hexdigest()[:8]

    def make(venv: Path) -> None:
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
        lib = next(Path(venv, "lib").glob("python3*/site-packages"))
        (lib / "elasticd-checkout.pth").write_text(f"import site; site.addsitedir({site!r})\n")

    return str(made_once(Path(f"/tmp/elasticd-test-python-{digest}"), make))


def fake_nvidia_smi(directory: Path, gpus: int) -> dict[str, str]:
    """Put an ``nvidia-smi`` that reports ``gpus`` GPUs in ``directory``; returns the env
    (PATH) under which a daemon finds it."""
    directory.mkdir(exist_ok=True)
    smi = directory / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '" + "".join(f"{i}\\n" for i in range(gpus)) + "'\n")
    smi.chmod(0o755)
    return {"PATH": f"{directory}:{os.environ['PATH']}"}


def beside_torchrun(
    daemon: Daemon, workdir: Path, argv: list[str], env: dict[str, str], timeout: float
) -> tuple[str, str]:
    """The same torchrun command line, word for word, to elasticrun (which submits it to
    ``daemon`` and prints the workers' output as torchrun does) and to torch's torchrun, each
    with ``--ckpt-dir ckpt-elasticd`` / ``ckpt-torchrun`` after it; both must succeed.  Their
    standard outputs, elasticrun's first."""
    outs = []
    for launcher, extra in (
        ([os.path.join(os.path.dirname(PY), "elasticrun")], {"ELASTICD_SOCKET": daemon.socket}),
        ([PY, "-m", "torch.distributed.run"], {}),
    ):
        ckpt = "ckpt-elasticd" if extra else "ckpt-torchrun"
        done = subprocess.run(
            [*launcher, *argv, "--ckpt-dir", ckpt],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(workdir),
            env={**env, **extra},
        )
        assert done.returncode == 0, f"{launcher[-1]}: {done.stdout[-3000:]}{done.stderr[-5000:]}"
        outs.append(done.stdout)
    return outs[0], outs[1]


def worker_args(*args: str) -> list[str]:
    return [str(WORKER), *args]


def sleeping_job(daemon: Daemon, directory: Path, nproc: int, *extra: str) -> tuple[str, list[int]]:
    """A job whose workers sleep (with what ``extra`` asks of worker.py); returns its id and
    every pid the workers wrote (theirs and their children's), once all are written."""
    pids_dir = directory / "pids"
    pids_dir.mkdir(exist_ok=True)
    job = daemon.submit(
        "--nproc-per-node",
        str(nproc),
        *worker_args("--sleep", "0", "--pid-dir", str(pids_dir), *extra),
    )
    daemon.wait_running(job["id"], nproc)
    daemon.wait_output(job["id"], [f"ready {r}" for r in range(nproc)], timeout=60)
    return job["id"], [
        int(p) for r in range(nproc) for p in (pids_dir / f"rank_{r}.pid").read_text().split()
    ]


def alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Wait (on the kernel, not a sleep loop) until the processes are gone; returns survivors."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, survivors = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in survivors if alive(p.pid)]


def node_states(
    daemon: Daemon, predicate: Callable[[dict[str, str]], bool], timeout: float = 30.0
) -> dict[str, str]:
    """Follow the daemon's node list (it changes on heartbeats) until its states match."""
    with Control(daemon.socket) as control:
        for nodes in control.stream("nodes", {"watch": True}, timeout):
            states = {n["name"]: n["state"] for n in nodes}
            if predicate(states):
                return states
    raise AssertionError(f"{daemon.name}: the node stream ended")
