"""LocalWorkers: one node's worker processes for one round of a job.

Each worker is exec'd directly (no shell, no wrapper) in its own session and process group.
Between fork and exec the child joins the job's cgroup (while still root), takes the
submitting user's credentials, asks for ``PR_SET_PDEATHSIG=SIGKILL`` (no worker outlives a
daemon killed with SIGKILL) and only then enters the working directory, with the user's
rights: a root daemon never opens a directory for a user who could not.  Where no pids
controller bounds the job, the child also takes ``RLIMIT_NPROC`` (containment.py).

A worker's exit is seen from the process itself (a pidfd), never from its pipes closing: a
worker killed by the OOM killer while its DataLoader children hold its stdout is a failure
at once.  Its stdout and stderr are pipes that the event loop copies to
``<log_dir>/rank_<r>.out|.err`` (``logs.OutputFile``), rotated at a size limit; output that
cannot be written (a full disk) is dropped and counted, so a worker never blocks on its
pipe.  The directories and the output files are the daemon's, readable by the job's user
and the admin group only (``fileaccess``); torch's error file is the user's while the worker
runs, and the daemon's capped copy of it from the worker's exit (``errorfile``).  A worker
that exited with an error and left no error file has its root cause read from the end of its
stderr (``errorfile.from_stderr``).

Stop is SIGTERM to every process of the job (its cgroup, or each worker's process group
without one), a grace period, then SIGKILL to all of them (``cgroup.kill``): what a worker
started, even with ``setsid``, dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import psutil

from elasticd.core.model import (
    WORKER_STATES,
    Failure,
    JobSpec,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerState,
    placement_env,
    worker_env,
)
from elasticd.core.records import WorkerGroupLeft
from elasticd.journal import about
from elasticd.shell import errorfile
from elasticd.shell.cgroups import JobCgroup
from elasticd.shell.errorfile import Recorded
from elasticd.shell.fileaccess import DIR_MODE, FILE_MODE, FileAccess, Readers
from elasticd.shell.logs import TAIL_BYTES, DropSink, OutputFile, OutputLimit, move_stream
from elasticd.wire.paths import is_own_dir

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_CHUNK = 64 * 1024
_DRAIN_CHUNKS = 16  # chunks of stderr copied at a failed exit, before its root cause is read
_EMPTY_TIMEOUT = 10.0  # seconds for a killed cgroup to empty (processes in D state may lag)
_STACK_BYTES = 256 * 1024  # of a worker's stack dump kept (py-spy's, faulthandler's)
_DRAIN_TIMEOUT = 2.0  # seconds for the pipes to reach EOF once every worker is gone
EXEC_FAILED = 127  # a worker that could not be started counts as this exit code
NO_WORKDIR = 126  # the working directory could not be entered (as the user)

SOCKET_ENV = "ELASTICD_AGENT_SOCKET"  # an in-place worker's channel to its agent (elastic.runtime)
PROGRESS_ENV = "ELASTICD_PROGRESS_SOCKET"  # a classic job's, for progress only (--hang-timeout)
SLOT_ENV = "ELASTICD_SLOT"
REJOIN_ENV = "ELASTICD_REJOIN_TIMEOUT"  # an in-place job's --rejoin-timeout (elastic.runtime)
_REAP_PASSES = 20  # looks for a dead daemon's leftovers, while the last one was not final
_REAP_PAUSE = 0.01  # seconds between two
JOB_ENV = "ELASTICD_JOB"  # the job's id, the daemon's own: how its leftovers are known

OutputSink = Callable[[], None]  # a worker wrote output (followers read the files)


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


def _child_setup(
    join_fds: list[int],
    credentials: RunAs | None,
    workdir: str,
    parent_pid: int,
    nproc_limit: int = 0,
    nice: int = 0,
) -> Callable[[], None]:
    """preexec_fn: in the child, before exec.  Only thin system calls (the daemon has
    threads): join the cgroup while root, drop to the user, then enter the workdir as the
    user.  PDEATHSIG is set after the uid change, which would clear it.  ``nproc_limit``
    (RLIMIT_NPROC, 0: leave it) is lowered after the uid change: set before it, a user who
    already runs that many tasks would have the exec itself fail (PF_NPROC_EXCEEDED).

    subprocess's own ``user``/``group``/``extra_groups``/``cwd`` do not cover it: its child
    enters ``cwd`` while still root (a directory the user may not enter would be entered),
    it has no way to join a cgroup before user code runs (no CLONE_INTO_CGROUP), and none to
    set PDEATHSIG."""

    def setup() -> None:
        for fd in join_fds:
            os.write(fd, b"0")
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            _set_autogroup_nice("self", nice)  # setsid made the child an autogroup of its own
        if credentials is not None:
            os.setgroups(list(credentials.groups))
            os.setresgid(credentials.gid, credentials.gid, credentials.gid)
            os.setresuid(credentials.uid, credentials.uid, credentials.uid)
        if nproc_limit:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc_limit, nproc_limit))
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the daemon died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            os.chdir(workdir)
        except OSError as exc:
            os.write(
                2,
                f"elasticd: cannot enter the working directory {workdir}: {exc.strerror}\n".encode(
                    errors="replace"
                ),
            )
            os._exit(NO_WORKDIR)

    return setup


def nproc_rlimit(limit: int) -> int:
    """``limit`` as a child may set it: a daemon that is not root cannot raise its hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return limit if not limit or hard == resource.RLIM_INFINITY else min(limit, hard)


def describe_exit(code: int, oom_killed: bool = False) -> str:
    if code < 0:
        try:
            text = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            text = f"killed by signal {-code}"
        return text + (" (out of memory: the kernel's OOM killer)" if oom_killed else "")
    if code == NO_WORKDIR:
        return f"exited with code {code} (the working directory could not be entered)"
    return f"exited with code {code}"


def exit_code(status: os.waitid_result) -> int:
    """A waitid result as Popen.returncode: the exit status, or minus the signal."""
    if status.si_code == os.CLD_EXITED:
        return status.si_status
    return -status.si_status


def reap_leftovers(groups: Mapping[int, WorkerGroupLeft], boot_time: float | None = None) -> int:
    """Kill what is left in the process groups of workers that a previous daemon ran here
    (``groups``: a worker's pid, which is its group's id -> whose); how many were killed.

    Workers die with their daemon (PDEATHSIG); this catches descendants that stayed in a
    worker's process group when the job had no cgroup.  Pids are reused, so a process is
    taken for the job's only if all of this holds: the host has not rebooted since the job
    started here, the process started after it, runs as the job's user, and carries the
    job's id in its environment (JOB_ENV, which every worker is given and passes on; not
    TORCHELASTIC_RUN_ID, which elasticrun's private daemons set to the rendezvous id, as
    torchrun does).  Anything else (a user's shell that got a dead worker's pid as its
    group) is left alone.  The environment is the job's user's to change, as is everything
    that runs as them: a process that drops JOB_ENV escapes this (only a cgroup holds all),
    and one that takes another job's id can only get the user's own processes killed.
    """
    booted = psutil.boot_time() if boot_time is None else boot_time
    killed: set[int] = set()
    for _ in range(_REAP_PASSES):  # again while one forks, or is in the middle of its exec
        again = False
        for proc in psutil.process_iter(["pid", "create_time"]):
            pid = proc.info["pid"]
            try:
                left = groups.get(os.getpgid(pid))
                if (
                    pid in killed
                    or left is None
                    or booted > left.started
                    or proc.info["create_time"] < left.started - 1
                    or proc.uids().real != left.uid
                ):
                    continue
                environ = proc.environ()
                if not environ:  # none yet: it is in its exec (or was given none)
                    again = True
                if environ.get(JOB_ENV) != left.job_id:
                    continue
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                again = True  # what it forked meanwhile is looked for
            except (OSError, psutil.Error):
                continue
        if not again:
            break
        time.sleep(_REAP_PAUSE)
    return len(killed)


class _Pipe:
    """A worker's stdout or stderr: non-blocking, read by the event loop until EOF."""

    def __init__(self, fd: int, sink: OutputFile) -> None:
        self.fd = fd
        self.sink = sink
        self.closed = asyncio.get_running_loop().create_future()


@dataclass(frozen=True)
class Standby:
    """An interpreter waiting for a slot's next worker (elastic/standby.py), and the
    environment it was started with."""

    proc: subprocess.Popen[bytes]
    env: Mapping[str, str]


class Standbys:
    """A --warm-restart job's standbys on this node, one per slot at most: started beside a
    round's workers, they import torch while the round trains, and the next round's workers
    are made of them (``LocalWorkers.start``), skipping Python's and torch's start.  They
    start at the lowest CPU priority, so as not to slow the round's own start, and get the
    daemon's ``hurry_later``: where the training keeps every CPU busy, nice 19 alone would
    leave them importing when the restart comes.  They wait in a cgroup of their own: a
    round's stop kills everything in the job's cgroup, and a standby joins that one only
    when it becomes a worker.  Outlives each round's LocalWorkers; ``close`` when the part
    ends."""

    def __init__(self, script: str, cgroup: JobCgroup | None = None) -> None:
        self.script = script  # elastic/standby.py, as the workers' library has it
        self.cgroup = cgroup
        self._by_slot: dict[int, Standby] = {}
        self._hurry: asyncio.TimerHandle | None = None

    def hurry_later(self, delay: float) -> None:
        """In ``delay`` seconds, every standby gets the daemon's own CPU priority."""
        if self._hurry is not None:
            self._hurry.cancel()
        self._hurry = asyncio.get_running_loop().call_later(delay, self._hurry_now)

    def lower(self) -> None:
        """The standbys' cgroup to the least share of the CPU against the job's own (where
        the cpu controller is there; nice values do not weigh across cgroups)."""
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.set_cpu_weight(_STANDBY_CPU_WEIGHT)

    def _hurry_now(self) -> None:
        self._hurry = None
        for standby in self._by_slot.values():
            _give_own_priority(standby.proc.pid)
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.set_cpu_weight(_DEFAULT_CPU_WEIGHT)

    def waiting(self) -> int:
        """How many standbys wait now (their process runs)."""
        return sum(standby.proc.poll() is None for standby in self._by_slot.values())

    def missing(self, slots: list[int]) -> list[int]:
        """Slots without a standby that still runs."""
        return [s for s in slots if s not in self._by_slot or self._exited(s)]

    def put(self, slot: int, standby: Standby) -> None:
        self._by_slot[slot] = standby

    def take(self, slot: int) -> Standby | None:
        """The slot's standby, if one still waits (it is the caller's from now on)."""
        standby = self._by_slot.pop(slot, None)
        if standby is None or standby.proc.poll() is not None:
            return None
        return standby

    def _exited(self, slot: int) -> bool:
        if self._by_slot[slot].proc.poll() is None:
            return False
        del self._by_slot[slot]
        return True

    async def close(self) -> None:
        """Kill every standby and remove their cgroup."""
        if self._hurry is not None:
            self._hurry.cancel()
        standbys, self._by_slot = list(self._by_slot.values()), {}
        for standby in standbys:
            dismiss(standby.proc)
        if self.cgroup is not None:
            self.cgroup.kill()
            await self.cgroup.wait_empty(_EMPTY_TIMEOUT)
            self.cgroup.remove()
        for standby in standbys:
            await asyncio.to_thread(standby.proc.wait)


def dismiss(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a standby's process group (it never ran the job's code: nothing to drain)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def compatible(started: Mapping[str, str], wanted: Mapping[str, str], place: set[str]) -> bool:
    """Whether a standby started with ``started`` may run a worker whose environment is
    ``wanted``: they differ only in the variables that name its place, which the
    interpreter and torch read only once the script runs."""

    def rest(env: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k not in place}

    return rest(started) == rest(wanted)


def _give_own_priority(pid: int) -> None:
    """Every thread of ``pid`` to the daemon's own nice value, as a worker started now would
    have (setpriority changes one thread at a time), and its autogroup back to a new
    session's 0 where ``pid`` leads a session of its own (as a standby does)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, own)
    with contextlib.suppress(OSError):
        if os.getsid(pid) == pid:
            _set_autogroup_nice(str(pid), 0)


def _set_autogroup_nice(pid: str, nice: int) -> None:
    """The nice value of the autogroup of ``pid`` ("self" or a number).  Where the kernel
    groups tasks by session (sched_autogroup_enabled, the default of most distributions),
    the scheduler shares the CPU between sessions first, and a thread's nice value weighs
    only against the threads of its own session: a worker or a standby, each in a session
    of its own, would have its nice value ignored.  Nothing where autogroups are off or
    absent (the file is missing or refuses the write)."""
    with contextlib.suppress(OSError):
        fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(nice).encode())
        finally:
            os.close(fd)


_STANDBY_NICE = 19  # a standby's priority while its round's workers start
_STANDBY_GRACE = 10.0  # seconds at nice 19 (Standbys.hurry_later)
_STANDBY_CPU_WEIGHT = 1  # the standbys' cgroup's cpu.weight meanwhile
_DEFAULT_CPU_WEIGHT = 100
_ORDER_MAX = 1 << 20  # bytes of a standby's order (its pipe is made this large)


class LocalWorkers:
    """Start, watch and stop one WorkerGroup.  ``group`` always reflects the latest states."""

    def __init__(
        self,
        spec: JobSpec,
        group: WorkerGroup,
        log_dir: str,
        *,
        cgroup: JobCgroup | None = None,
        on_output: OutputSink | None = None,
        on_dropped: DropSink | None = None,
        on_change: Callable[[WorkerGroup], None] | None = None,
        stop_grace: float = 10.0,
        extra_env: Mapping[str, str] | None = None,
        output_limit: OutputLimit = OutputLimit(),
        nproc_limit: int = 0,
        access: FileAccess | None = None,
        standbys: Standbys | None = None,
    ) -> None:
        self.spec = spec
        self.group = group
        self.log_dir = log_dir
        self._cgroup = cgroup
        self._on_output = on_output or (lambda: None)
        self._on_dropped = on_dropped or (lambda n, why: None)
        self._on_change = on_change or (lambda g: None)
        self._stop_grace = stop_grace
        self._extra_env = dict(extra_env or {})
        self._output_limit = output_limit
        self._nproc_limit = nproc_rlimit(nproc_limit)  # RLIMIT_NPROC of each worker (0: inherited)
        self._access = access or FileAccess()
        self._readers: Readers | None = self._access.readers(spec.uid)  # of its files on disk
        self._loop = asyncio.get_running_loop()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._pipes: list[_Pipe] = []
        self._failures: dict[int, Failure] = {}
        self._files: dict[int, dict[str, str]] = {}  # slot -> its worker's out, err, error files
        self._outputs: dict[
            int, dict[str, OutputFile]
        ] = {}  # slot -> its worker's out and err writers
        self._spawned = 0
        self._stopping = False
        # slots whose workers were stopped on their own (spares given back)
        self._shed: set[int] = set()
        # slots whose workers are being stopped as failed, and why (a warm-up past its deadline)
        self._failing: dict[int, str] = {}
        self._oom_before = self._oom_kills()
        self._standbys = standbys

    def error_file(self, worker: Worker) -> str:
        return self._files.get(worker.local_rank, {}).get("error") or os.path.join(
            self.log_dir, f"rank_{worker.rank}.error.json"
        )

    def log_file(self, worker: Worker, stream: str) -> str:
        return os.path.join(self.log_dir, f"rank_{worker.rank}.{stream}")

    # -- in place: workers that outlive rounds ----------------------------------------------

    async def warm(self, slots: list[int]) -> None:
        """Start new workers in ``slots`` before they have a rank (their old ones are gone).
        Their output goes to ``<log_dir>/slot_<s>-<n>.*`` until ``place`` names it."""
        credentials = run_as(self.spec)
        try:
            self._make_log_dir()
        except OSError as exc:
            for slot in slots:
                self._record_failure(self._renew(slot), EXEC_FAILED, f"cannot start worker: {exc}")
            return
        for slot in slots:
            worker = self._renew(slot)
            self._spawned += 1
            stem = os.path.join(self.log_dir, f"slot_{slot}-{self._spawned}")
            self._files[slot] = {
                "out": f"{stem}.out",
                "err": f"{stem}.err",
                "error": f"{stem}.error.json",
            }
            try:
                self._start(worker, credentials)
            except (OSError, subprocess.SubprocessError) as exc:
                self._record_failure(worker, EXEC_FAILED, f"cannot start worker: {exc}")

    def _renew(self, slot: int) -> Worker:
        """A fresh (INIT) worker in ``slot``: a new process, not a state change of the old one."""
        worker = Worker(local_rank=slot, rank=-1, world_size=0, node=self.group.workers[slot].node)
        self._change(self.group.with_worker(worker), renewed=slot)
        self._failures.pop(slot, None)
        self._exits.pop(slot, None)
        return worker

    def place(self, group: WorkerGroup, attempt_dir: str) -> None:
        """Show ``group`` (this round's ranks; workers keep pid and state; one the round
        does not hold, a spare or a worker still warming, has no rank: the core's
        ``placed_group``).  A worker placed for the first time has its output files moved
        to ``attempt_dir/rank_<r>.*``."""
        by_slot = {w.local_rank: w for w in group.workers}
        workers = []
        for old in self.group.workers:
            new = by_slot.get(old.local_rank)
            if new is not None and old.rank < 0 and old.local_rank in self._files:
                self._move_output(old.local_rank, attempt_dir, new.rank)
            workers.append(
                replace(old, rank=new.rank, world_size=new.world_size)
                if new
                else replace(old, rank=-1, world_size=0)
            )
        self._change(replace(group, workers=tuple(workers)))
        self._on_change(self.group)

    def _move_output(self, slot: int, attempt_dir: str, rank: int) -> None:
        try:
            self._make_log_dir(attempt_dir)
            for stream in ("out", "err"):
                target = os.path.join(attempt_dir, f"rank_{rank}.{stream}")
                if not os.path.lexists(target):
                    move_stream(self._files[slot][stream], target)
                    self._files[slot][stream] = target
                    if stream in self._outputs.get(slot, {}):
                        self._outputs[slot][stream].path = target
        except OSError as exc:
            log.warning(
                "job %s: output of slot %d stays in %s: %s",
                self.spec.id,
                slot,
                self._files[slot]["out"],
                exc,
                extra=about(self.spec.id),
            )

    @property
    def failures(self) -> tuple[Failure, ...]:
        """Why each failed worker failed (its exit, and its error file's words)."""
        return tuple(self._failures.values())

    def alive(self) -> list[int]:
        """Slots whose worker runs."""
        return [slot for slot, exited in self._exits.items() if not exited.done()]

    async def start(self) -> None:
        """Spawn every worker.  A worker that cannot be started counts as failed (exit 127)."""
        credentials = run_as(self.spec)
        try:
            self._make_log_dir()
        except OSError as exc:  # e.g. a full disk: every worker fails, saying why
            for worker in self.group.workers:
                self._record_failure(worker, EXEC_FAILED, f"cannot start worker: {exc}")
            return
        for worker in self.group.workers:
            try:
                self._start(worker, credentials)
            except (OSError, subprocess.SubprocessError) as exc:
                self._record_failure(worker, EXEC_FAILED, f"cannot start worker: {exc}")
        self._start_standbys(credentials)

    def _start_standbys(self, credentials: RunAs | None) -> None:
        """A standby for each slot of the group that has none (--warm-restart)."""
        standbys = self._standbys
        if standbys is None:
            return
        kind = "module" if self.spec.kind == "module" else "script"
        command = [self.spec.python, standbys.script, kind, self.spec.argv[0]]
        nice = _STANDBY_NICE if os.geteuid() == 0 else 0  # only root could undo it
        by_slot = {w.local_rank: w for w in self.group.workers}
        if nice:
            standbys.lower()
        for slot in standbys.missing(list(by_slot)):
            env = self._env(replace(by_slot[slot], rank=-1))
            try:
                proc = self._popen(
                    command, env, credentials, standbys.cgroup, nice=nice, stdin=subprocess.PIPE
                )
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning(
                    "job %s: no standby for slot %d: %s",
                    self.spec.id,
                    slot,
                    exc,
                    extra=about(self.spec.id),
                )
                continue
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, _ORDER_MAX)
            standbys.put(slot, Standby(proc, env))
        if nice:
            standbys.hurry_later(_STANDBY_GRACE)

    def _from_standby(
        self, worker: Worker, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes] | None:
        """The slot's standby made ``worker``: moved into the job's cgroup, given the daemon's
        own CPU priority, then its environment and argv; None when there is none to use."""
        standby = self._standbys.take(worker.local_rank) if self._standbys is not None else None
        if standby is None:
            return None
        proc = standby.proc
        assert proc.stdin is not None
        order = (json.dumps({"env": dict(env), "argv": list(self.spec.argv)}) + "\n").encode()
        place = {*placement_env(self.group, worker), "TORCHELASTIC_ERROR_FILE"}
        try:
            fd = proc.stdin.fileno()
            if not compatible(standby.env, env, place):
                raise ValueError("the environment changed since it started")
            if len(order) > fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ):
                raise ValueError(f"its environment ({len(order)} bytes) exceeds its pipe")
            if self._cgroup is not None:
                self._cgroup.adopt(proc.pid)
            _give_own_priority(proc.pid)
            os.set_blocking(fd, False)
            os.write(fd, order)  # fits the pipe: all of it or an error
            proc.stdin.close()
        except (OSError, ValueError) as exc:
            log.info(
                "job %s: slot %d starts anew, not from its standby: %s",
                self.spec.id,
                worker.local_rank,
                exc,
                extra=about(self.spec.id),
            )
            dismiss(proc)
            return None
        return proc

    def _start(self, worker: Worker, credentials: RunAs | None) -> None:
        os.close(self._create(self.error_file(worker), credentials))
        names = self._files.get(worker.local_rank) or {
            s: self.log_file(worker, s) for s in ("out", "err")
        }
        files = [
            OutputFile(names[s], self._create, self._on_dropped, self._output_limit)
            for s in ("out", "err")
        ]
        self._outputs[worker.local_rank] = dict(zip(("out", "err"), files))
        try:
            proc = self._spawn(worker, credentials)
        except BaseException:
            for file in files:
                file.close()
            raise
        self._procs[worker.local_rank] = proc
        self._watch_exit(worker.local_rank, proc)
        for stream, file in zip((proc.stdout, proc.stderr), files):
            assert stream is not None
            self._watch_pipe(os.dup(stream.fileno()), file)
            stream.close()
        self._set(replace(worker, pid=proc.pid, state=WorkerState.HEALTHY))

    def _make_log_dir(self, path: str = "") -> None:
        """The job's and the attempt's (``path``, else ``log_dir``) directories stay the
        daemon's: a worker that could write in them could plant a symlink where the daemon
        (maybe root) is about to write.  Only the job's readers may search them."""
        path = path or self.log_dir
        os.makedirs(os.path.dirname(os.path.dirname(path)), mode=0o755, exist_ok=True)
        for directory in (os.path.dirname(path), path):
            try:
                os.mkdir(directory, DIR_MODE)
            except FileExistsError:
                pass
            if not is_own_dir(directory):
                raise PermissionError(
                    f"refusing log directory {directory}: not a directory of "
                    f"elasticd's own that only it can write"
                )
            self._access.grant_dir(directory, self._readers)

    def _create(self, path: str, credentials: RunAs | None = None) -> int:
        """A new file in place of any at ``path`` (never through a symlink); its fd.  With
        ``credentials`` it is the worker's error file, the user's alone (torch's @record in
        the worker writes it); else it is the daemon's (output files, the error file's copy),
        readable by the job's readers only: a user who owned one could write past
        output.max_bytes, truncate it to a sparse terabyte, or chmod it."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE
        )
        if credentials:
            os.fchown(fd, credentials.uid, credentials.gid)
        else:
            self._access.grant_file(fd, self._readers)
        return fd

    def _env(self, worker: Worker) -> dict[str, str]:
        """``worker``'s environment (one warming, or a standby: no rank, no place)."""
        group = self.group if worker.rank >= 0 else replace(self.group, round=-1)
        env = worker_env(self.spec, group, worker, error_file=self.error_file(worker))
        for inherited in (SOCKET_ENV, PROGRESS_ENV, SLOT_ENV, REJOIN_ENV):  # a job in a job
            env.pop(inherited, None)
        env.update(self._extra_env)
        if SOCKET_ENV in self._extra_env or PROGRESS_ENV in self._extra_env:
            env[SLOT_ENV] = str(worker.local_rank)
        env[JOB_ENV] = self.spec.id  # last: what a job in a job inherited is not its own
        return env

    def _spawn(self, worker: Worker, credentials: RunAs | None) -> subprocess.Popen[bytes]:
        env = self._env(worker)
        made = self._from_standby(worker, env) if worker.rank >= 0 else None
        return made or self._popen(self.spec.command(), env, credentials, self._cgroup)

    def _popen(
        self,
        command: list[str],
        env: Mapping[str, str],
        credentials: RunAs | None,
        cgroup: JobCgroup | None,
        *,
        nice: int = 0,
        stdin: int = subprocess.DEVNULL,
    ) -> subprocess.Popen[bytes]:
        """A child of the job: a worker, or a standby (``nice``, ``stdin`` a pipe)."""
        join_fds = cgroup.join_fds() if cgroup is not None else []
        try:
            return subprocess.Popen(
                command,
                env=env,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_child_setup(
                    join_fds,
                    credentials,
                    self.spec.workdir,
                    os.getpid(),
                    self._nproc_limit,
                    nice,
                ),
            )
        finally:
            for fd in join_fds:
                os.close(fd)

    def _watch_exit(self, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        pidfd = os.pidfd_open(proc.pid)
        exited: asyncio.Future[int] = self._loop.create_future()
        self._exits[local_rank] = exited

        def reap() -> None:
            status = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            if status is None:
                return  # woken early; the pidfd stays readable until the exit is reaped
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
            proc.returncode = exit_code(status)
            exited.set_result(proc.returncode)
            self._record_exit(local_rank, proc.returncode, self._keep_error_file(local_rank))

        self._loop.add_reader(pidfd, reap)

    def _watch_pipe(self, fd: int, sink: OutputFile) -> None:
        os.set_blocking(fd, False)
        pipe = _Pipe(fd, sink)
        self._pipes.append(pipe)
        self._loop.add_reader(fd, self._copy, pipe)

    def _copy(self, pipe: _Pipe) -> bool:
        """Copy what the pipe holds now, one chunk; whether there was any."""
        try:
            data = os.read(pipe.fd, _CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._close_pipe(pipe)
            return False
        pipe.sink.write(data)
        self._on_output()
        return True

    def _close_pipe(self, pipe: _Pipe) -> None:
        if pipe.closed.done():
            return
        self._loop.remove_reader(pipe.fd)
        os.close(pipe.fd)
        pipe.sink.close()
        pipe.closed.set_result(None)

    async def wait(self) -> RunResult:
        """Return when every worker succeeded, or as soon as one failed."""
        pending = set(self._exits.values())
        while pending and not self._failures:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return self._result()

    def _result(self) -> RunResult:
        if self._failures:
            return RunResult(WorkerState.FAILED, tuple(self._failures.values()))
        return RunResult(WorkerState.SUCCEEDED)

    def _keep_error_file(self, local_rank: int) -> Recorded | None:
        """At a worker's exit: the daemon's copy of its error file, and what it said."""
        try:
            return errorfile.keep(self.error_file(self.group.workers[local_rank]), self._create)
        except Exception as exc:  # a fault here must not change the outcome: the exit decides it
            log.exception(
                "job %s: the error file of local rank %d",
                self.spec.id,
                local_rank,
                extra=about(self.spec.id),
            )
            return Recorded(unreadable=f"elasticd failed to read it: {exc!r}")

    def _record_exit(self, local_rank: int, code: int, recorded: Recorded | None = None) -> None:
        worker = self.group.workers[local_rank]
        if worker.state not in (WorkerState.INIT, WorkerState.HEALTHY):
            return
        if code == 0:
            self._set(replace(worker, state=WorkerState.SUCCEEDED, exit_code=0))
        elif local_rank in self._failing:
            self._record_failure(worker, code or 1, self._failing.pop(local_rank), recorded)
        elif self._stopping or local_rank in self._shed:
            self._set(replace(worker, state=WorkerState.STOPPED, exit_code=code))
        else:
            oom = code == -signal.SIGKILL and self._oom_kills() > self._oom_before
            self._record_failure(
                worker, code, self._exit_message(local_rank, code, oom, recorded), recorded
            )

    def _exit_message(
        self, local_rank: int, code: int, oom: bool, recorded: Recorded | None
    ) -> str:
        """How a failed worker ended; for one that exited with an error and left no error
        file, the root cause its stderr ends with (what it wrote before its exit is in the
        pipe: copied first, a bounded amount)."""
        sink = self._outputs.get(local_rank, {}).get("err")
        if code < 0 or code == NO_WORKDIR or recorded is not None or sink is None:
            return describe_exit(code, oom_killed=oom)
        for pipe in [p for p in self._pipes if p.sink is sink]:
            for _ in range(_DRAIN_CHUNKS):
                if not self._copy(pipe):
                    break
        return errorfile.from_stderr(sink.tail, whole=len(sink.tail) < TAIL_BYTES) or describe_exit(
            code
        )

    def _oom_kills(self) -> int:
        count = self._cgroup.usage().oom_kills if self._cgroup is not None else None
        return count or 0

    def _record_failure(
        self, worker: Worker, code: int, message: str, recorded: Recorded | None = None
    ) -> None:
        """``message`` says how it ended; the error file (``recorded``), where there is one,
        says why."""
        text, trace, stamp = message, "", 0.0
        if recorded is not None and recorded.unreadable:
            text = f"{message}; its error file was unreadable ({recorded.unreadable})"
        elif recorded is not None:
            text, trace, stamp = recorded.message or message, recorded.traceback, recorded.timestamp
        self._failures[worker.local_rank] = Failure(
            rank=worker.rank,
            local_rank=worker.local_rank,
            node=worker.node,
            exit_code=code,
            message=text,
            traceback=trace,
            timestamp=stamp or time.time(),
        )
        self._set(replace(worker, state=WorkerState.FAILED, exit_code=code))

    def _set(self, worker: Worker) -> None:
        self._change(self.group.with_worker(worker))
        self._on_change(self.group)

    def _change(self, group: WorkerGroup, renewed: int | None = None) -> None:
        """The one place the workers change: each worker's state moves by WORKER_STATES (a
        ``renewed`` slot holds a new worker, whose first state is INIT), or nothing changes."""
        for old, new in zip(self.group.workers, group.workers):
            WORKER_STATES.check(None if old.local_rank == renewed else old.state, new.state)
        self.group = group

    async def stop(self) -> None:
        """SIGTERM every process of the job, wait up to the grace period for the workers,
        then SIGKILL whatever is left.  Returns once every worker is reaped and its output
        copied (idempotent)."""
        self._stopping = True
        alive = [exited for exited in self._exits.values() if not exited.done()]
        if alive or self._cgroup_populated():
            self._signal_all(signal.SIGTERM)
            if alive:
                await asyncio.wait(alive, timeout=self._stop_grace)
        self._signal_all(signal.SIGKILL)
        if self._exits:
            await asyncio.wait(list(self._exits.values()))
        if self._cgroup is not None and not await self._cgroup.wait_empty(_EMPTY_TIMEOUT):
            log.warning(
                "job %s: processes left in %s after SIGKILL: %s",
                self.spec.id,
                self._cgroup.path,
                self._cgroup.pids(),
                extra=about(self.spec.id),
            )
        await self._drain_pipes()

    async def dump_stacks(
        self, slots: tuple[int, ...], signals: Mapping[int, int], settle: float = 1.0
    ) -> dict[int, str]:
        """Each live worker of ``slots``: its stack written into its stderr log, and read
        back.  A worker whose library named a signal (``signals``) gets it (faulthandler
        writes every thread's stack to its stderr); py-spy, where installed, adds the native
        frames (``py-spy dump --native``, its output written into the same log under a line
        that says so).  What each wrote is returned (an empty text: nothing could be had)."""
        live = {
            s: self._procs[s] for s in slots if s in self._procs and self._procs[s].poll() is None
        }
        sinks = {s: self._outputs.get(s, {}).get("err") for s in live}
        for sink in sinks.values():
            if sink is not None:
                sink.capture = bytearray()
        for slot, proc in live.items():
            if slot in signals:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signals[slot])
        spy = shutil.which("py-spy")
        native = await asyncio.gather(
            *(_py_spy(spy, proc.pid) if spy else asyncio.sleep(0, "") for proc in live.values())
        )
        await asyncio.sleep(settle)  # the pipes are copied on the loop meanwhile
        texts = {}
        for (slot, proc), spied in zip(live.items(), native):
            sink = sinks[slot]
            caught = bytes(sink.capture or b"") if sink is not None else b""
            if sink is not None:
                sink.capture = None
                if spied:
                    sink.write(
                        f"\nelasticd: py-spy dump --native --pid {proc.pid} (this worker):\n".encode()
                        + spied.encode(errors="replace")
                        + b"\n"
                    )
            texts[slot] = caught.decode(errors="replace") + ("\n" + spied if spied else "")
        return texts

    async def stop_slots(self, slots: tuple[int, ...], failure: str = "") -> None:
        """Stop the workers in ``slots`` only: spares given back (they show STOPPED), or, with
        ``failure``, workers that failed by the daemon's judgement (a warm-up past its
        deadline: they show FAILED, saying ``failure``).  SIGTERM to each one's process
        group, SIGKILL after the grace period; returns once each is reaped and every other
        process of its group has exited (its children may hold the slot's GPU), or
        ``_EMPTY_TIMEOUT`` s later."""
        if failure:
            self._failing.update(dict.fromkeys(slots, failure))
        else:
            self._shed.update(slots)
        pending = [s for s in slots if s in self._exits and not self._exits[s].done()]
        groups = {self._procs[s].pid for s in pending}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                if sig is signal.SIGKILL and not _members({pgid}):
                    continue  # all gone: its number may be another group's soon
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            if pending:
                await asyncio.wait(
                    [self._exits[s] for s in pending],
                    timeout=self._stop_grace if sig is signal.SIGTERM else None,
                )
        await _exited(_members(groups), _EMPTY_TIMEOUT)

    def _cgroup_populated(self) -> bool:
        return self._cgroup is not None and self._cgroup.populated()

    def _signal_all(self, sig: signal.Signals) -> None:
        """Every process in the job's cgroup; without one, every worker's process group."""
        if self._cgroup is not None:
            if sig == signal.SIGKILL:
                self._cgroup.kill()
            else:
                self._cgroup.signal(sig)
            return
        for proc in self._procs.values():
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    async def _drain_pipes(self) -> None:
        """Copy what is left in the pipes.  Without a cgroup a process that left its group
        (setsid) may still hold one: it is closed after a short wait."""
        open_pipes = [p.closed for p in self._pipes if not p.closed.done()]
        if open_pipes:
            await asyncio.wait(open_pipes, timeout=_DRAIN_TIMEOUT)
        for pipe in self._pipes:
            self._close_pipe(pipe)


async def _py_spy(program: str, pid: int, timeout: float = 20.0) -> str:
    """``py-spy dump --native`` of ``pid`` ("" when it fails or takes too long)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            program,
            "dump",
            "--native",
            "--pid",
            str(pid),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError:
        return ""
    try:
        async with asyncio.timeout(timeout):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return ""
    return out.decode(errors="replace")[-_STACK_BYTES:] if proc.returncode == 0 else ""


def _members(groups: set[int]) -> list[int]:
    """The processes of the process ``groups`` that have not exited (zombies aside)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def _exited(pids: list[int], timeout: float) -> None:
    """Until each of ``pids`` has exited (its pidfd turns readable), or ``timeout`` s."""
    loop = asyncio.get_running_loop()
    watched: list[tuple[int, asyncio.Future[None]]] = []
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        exited = loop.create_future()
        loop.add_reader(pidfd, _settle, exited)
        watched.append((pidfd, exited))
    try:
        if watched:
            await asyncio.wait([exited for _, exited in watched], timeout=timeout)
    finally:
        for pidfd, _ in watched:
            loop.remove_reader(pidfd)
            os.close(pidfd)
