"""LocalWorkers: one node's worker processes for one round of a job.

Each worker is exec'd directly (no shell, no wrapper) as the submitting user, in its own
session and process group, with ``PR_SET_PDEATHSIG=SIGKILL`` so that no worker outlives a
daemon killed with SIGKILL.  Its stdout and stderr are pipes that the daemon copies, chunk by
chunk, to ``<log_dir>/rank_<r>.out|.err`` and to live ``logs -f`` readers.  The directories
are the daemon's; the files in them (logs, torch's error file) are the user's.
Stop is SIGTERM to every process group, a grace period, then SIGKILL to the groups.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Callable

from .control.protocol import is_own_dir
from .model import Failure, JobSpec, RunResult, Worker, WorkerGroup, WorkerState, worker_env

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_CHUNK = 64 * 1024
_MAX_ERROR_FILE = 1024 * 1024

OutputSink = Callable[[int, str, int, bytes], None]  # (rank, "out"|"err", file offset, data)


@dataclass(frozen=True)
class RunAs:
    """Credentials a worker switches to before exec (only when the daemon is root)."""

    uid: int
    gid: int
    groups: tuple[int, ...]


def run_as(spec: JobSpec) -> RunAs | None:
    if os.getuid() != 0:
        return None
    try:
        groups = tuple(os.getgrouplist(spec.user, spec.gid))
    except (KeyError, OSError):
        groups = (spec.gid,)
    return RunAs(spec.uid, spec.gid, groups)


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: runs in the child after setuid (which clears PDEATHSIG), before exec."""
    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the daemon died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def read_error_file(path: str) -> tuple[str, str, float] | None:
    """(message, traceback, timestamp) from torch's ``@record`` error file, or None.

    The file is written by user code, so it is read with a size cap and parsed defensively.
    """
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            doc = json.loads(f.read(_MAX_ERROR_FILE))
        message = doc["message"]
        if isinstance(message, str):
            return message, "", float(doc.get("timestamp", 0) or 0)
        extra = message.get("extraInfo", {})
        return (str(message.get("message", "")), str(extra.get("py_callstack", "")),
                float(extra.get("timestamp", 0) or 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class LocalWorkers:
    """Start, watch and stop one WorkerGroup.  ``group`` always reflects the latest states."""

    def __init__(self, spec: JobSpec, group: WorkerGroup, log_dir: str, *,
                 on_output: OutputSink | None = None,
                 on_change: Callable[[WorkerGroup], None] | None = None,
                 stop_grace: float = 10.0) -> None:
        self.spec = spec
        self.group = group
        self.log_dir = log_dir
        self._on_output = on_output or (lambda *a: None)
        self._on_change = on_change or (lambda g: None)
        self._stop_grace = stop_grace
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._exits: dict[int, asyncio.Task[int]] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._failures: dict[int, Failure] = {}
        self._stopping = False

    def error_file(self, worker: Worker) -> str:
        return os.path.join(self.log_dir, f"rank_{worker.rank}.error.json")

    def log_file(self, worker: Worker, stream: str) -> str:
        return os.path.join(self.log_dir, f"rank_{worker.rank}.{stream}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    async def start(self) -> None:
        """Spawn every worker.  A worker that cannot be exec'd counts as failed (exit 127)."""
        credentials = run_as(self.spec)
        self._make_log_dir()
        for worker in self.group.workers:
            try:
                os.close(self._create_for_user(self.error_file(worker), credentials))
                proc = await self._spawn(worker, credentials)
            except OSError as exc:
                self._record_failure(worker, 127, f"cannot start worker: {exc}")
                continue
            self._procs[worker.local_rank] = proc
            self._exits[worker.local_rank] = asyncio.ensure_future(proc.wait())
            self._pumps += [asyncio.ensure_future(self._pump(proc.stdout, worker, "out", credentials)),
                            asyncio.ensure_future(self._pump(proc.stderr, worker, "err", credentials))]
            self._set(replace(worker, pid=proc.pid, state=WorkerState.HEALTHY))

    def _make_log_dir(self) -> None:
        """The job's and the attempt's directories stay the daemon's: a worker that could write
        in them could plant a symlink where the daemon (maybe root) is about to write."""
        os.makedirs(self.log_dir, mode=0o755, exist_ok=True)
        for path in (os.path.dirname(self.log_dir), self.log_dir):
            if not is_own_dir(path):
                raise PermissionError(f"refusing log directory {path}: not a directory of "
                                      f"elasticd's own that only it can write")

    @staticmethod
    def _create_for_user(path: str, credentials: RunAs | None) -> int:
        """A new file (never through a symlink) that belongs to the job's user; its fd."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o640)
        if credentials:
            os.fchown(fd, credentials.uid, credentials.gid)
        return fd

    async def _spawn(self, worker: Worker, credentials: RunAs | None) -> asyncio.subprocess.Process:
        env = worker_env(self.spec, self.group, worker, error_file=self.error_file(worker))
        kwargs = {}
        if credentials:
            kwargs = {"user": credentials.uid, "group": credentials.gid,
                      "extra_groups": list(credentials.groups)}
        return await asyncio.create_subprocess_exec(
            *self.spec.command(), env=env, cwd=self.spec.workdir,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()), **kwargs)

    async def _pump(self, stream: asyncio.StreamReader | None, worker: Worker, name: str,
                    credentials: RunAs | None) -> None:
        """Copy one pipe to its log file and to live readers until EOF."""
        fd = self._create_for_user(self.log_file(worker, name), credentials)
        offset = 0
        try:
            while stream is not None and (data := await stream.read(_CHUNK)):
                os.write(fd, data)
                self._on_output(worker.rank, name, offset, data)
                offset += len(data)
        finally:
            os.close(fd)

    async def wait(self) -> RunResult:
        """Return when every worker succeeded, or as soon as one failed."""
        if self._failures:
            return self._result()
        pending = set(self._exits.values())
        by_task = {task: rank for rank, task in self._exits.items()}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._record_exit(by_task[task], task.result())
            if self._failures:
                return self._result()
        return self._result()

    def _result(self) -> RunResult:
        if self._failures:
            return RunResult(WorkerState.FAILED, tuple(self._failures.values()))
        return RunResult(WorkerState.SUCCEEDED)

    def _record_exit(self, local_rank: int, code: int) -> None:
        worker = self.group.workers[local_rank]
        if worker.state not in (WorkerState.INIT, WorkerState.HEALTHY):
            return
        if code == 0:
            self._set(replace(worker, state=WorkerState.SUCCEEDED, exit_code=0))
        elif self._stopping:
            self._set(replace(worker, state=WorkerState.STOPPED, exit_code=code))
        else:
            self._record_failure(worker, code, describe_exit(code))

    def _record_failure(self, worker: Worker, code: int, message: str) -> None:
        recorded = read_error_file(self.error_file(worker))
        text, trace, stamp = recorded if recorded else (message, "", time.time())
        self._failures[worker.local_rank] = Failure(
            rank=worker.rank, local_rank=worker.local_rank, node=worker.node, exit_code=code,
            message=text or message, traceback=trace, timestamp=stamp or time.time())
        self._set(replace(worker, state=WorkerState.FAILED, exit_code=code))

    def _set(self, worker: Worker) -> None:
        self.group = self.group.with_worker(worker)
        self._on_change(self.group)

    async def stop(self) -> None:
        """SIGTERM every process group, wait up to the grace period, then SIGKILL the groups.

        The groups are killed even when their leader already exited, so that nothing a
        worker started outlives it.  Returns once every worker has been reaped.
        """
        self._stopping = True
        alive = [rank for rank, task in self._exits.items() if not task.done()]
        self._signal_groups(signal.SIGTERM, alive)
        if alive:
            await asyncio.wait([self._exits[r] for r in alive], timeout=self._stop_grace)
        self._signal_groups(signal.SIGKILL, list(self._procs))
        if self._exits:
            await asyncio.wait(list(self._exits.values()))
        for rank, task in self._exits.items():
            self._record_exit(rank, task.result())
        await self._drain_pumps()

    def _signal_groups(self, sig: signal.Signals, local_ranks: list[int]) -> None:
        for rank in local_ranks:
            try:
                os.killpg(self._procs[rank].pid, sig)
            except ProcessLookupError:
                pass

    async def _drain_pumps(self) -> None:
        """Let the pipes reach EOF; a descendant that escaped its group cannot hold us."""
        if self._pumps:
            _, stuck = await asyncio.wait(self._pumps, timeout=2.0)
            for task in stuck:
                task.cancel()
