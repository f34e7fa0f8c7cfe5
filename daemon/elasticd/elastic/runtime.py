"""The worker's side of in-place elasticity: the channel to the local agent, the process
group's life, and the membership checks. Torch and the standard library only.

The agent listens on a per-job Unix socket (``$ELASTICD_AGENT_SOCKET``, owned by the job's
user) and speaks JSON lines:

- worker -> agent: ``{"op": "hello", "slot": S, "stacks": SIGNAL}`` once (the signal on
  which this worker dumps every thread's stack to its stderr: faulthandler);
  ``{"op": "ready", "round": R, "why": "start"|"interrupt"|"failure", "error": "..."}``:
  give me my place in a round after R (R = -1: any round); ``{"op": "progress"}``: a step
  or a commit (at most twice a second: a job with ``--hang-timeout`` is watched by them).
- agent -> worker: ``{"op": "place", "round": R, "env": {...}}``: this worker's rank, world
  size, master address and port in round R; ``{"op": "update", "round": R, "added": bool}``:
  round R is formed, stop at the next ``commit``; ``{"op": "abort", "round": R}``: a member
  is gone, abort the process group now.

A classic job (not ``--in-place``) with a hang timeout gets a channel for progress only
(``$ELASTICD_PROGRESS_SOCKET``): ``progress()`` and ``check_host_updates()`` report there.

An abort must end a collective that is blocked on a dead peer. NCCL's ``abort`` does that
(``ncclCommAbort``; verified on an H200 with torch 2.11 and NCCL 2.28, tests/gpu).  On NCCL a
thread also reads the communicator's asynchronous error (``Backend.get_error``, every 50 ms:
torch offers no callback for it) and, when NCCL saw a peer go (a remote or communication
error), tells the agent at once, as a failed collective does on gloo: the agent asks the
members' daemons, and a dead one's node is re-formed without (written for NCCL against
torch 2.13's API; run here only on gloo, where the thread does not start).
``torch.distributed.shrink_group`` (NCCL 2.27's ncclCommShrink) was weighed against the abort:
it needs every survivor to call it with the lost ranks while their main thread is blocked in
the failed collective, and no GPU was at hand to show that it ends that call and does not
hang; the abort and a new group, which did both on the H200, stay. Gloo's ``abort`` in torch 2.13
does not wake a blocked ``all_reduce``, so the sockets that the group opened are also shut
down (never its listening socket: gloo's listener dies on that), which makes the blocked
call raise "Connection closed by peer" at once, except where gloo lost a send it had queued:
this library's own collectives then leave the group (``collectives``), and a worker still in
one of the script's after half the rejoin timeout exits (``_end_if_stuck``).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import logging
import math
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import collectives
from .broadcast import default_device
from .errors import GroupAborted, HostsUpdatedInterrupt, TierError

log = logging.getLogger(__name__)

# On an H200 (torch 2.11, NCCL 2.28, tests/gpu), a survivor whose peer was SIGKILLed was
# released by ncclCommAbort, then hung for good freeing the failed collective's traceback;
# with blocking waits it re-formed at once (the main thread then waits for each collective
# itself, a little less overlap of CPU and GPU). No flight recorder either: an in-place
# worker re-forms rather than dumps. A value the job sets wins.
NCCL_DEFAULTS = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
# The flight recorder's size: torch 2.8 renamed it; the old name still works there but every
# process that sees it warns that it is deprecated.
RECORDER_SIZES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
SOCKET_ENV = "ELASTICD_AGENT_SOCKET"
PROGRESS_ENV = "ELASTICD_PROGRESS_SOCKET"  # a classic job's channel, for progress only
STACKS_SIGNAL = signal.SIGUSR2  # faulthandler dumps every thread's stack to stderr on it
PROGRESS_EVERY = 0.5  # seconds: progress is reported at most this often
SLOT_ENV = "ELASTICD_SLOT"
ROUND_ENV = "ELASTICD_ROUND"
_MAX_LINE = 64 * 1024
_POLL = 0.005  # seconds between a rank's looks at rank 0's store port
_STORE_WAIT = 1800.0  # how long a rank waits for that port: gloo's default group timeout
_GIVE_UP = 0.02  # seconds between shut-downs of a given-up forming's new sockets
_ERROR_POLL = 0.05  # seconds between two reads of NCCL's asynchronous error
_GIVE_UP_LIMIT = 5.0  # seconds a given-up forming may go on before the worker exits
GIVEN_UP_EXIT = 75  # that worker's exit status (EX_TEMPFAIL)
# An aborted round's worker may stay in that round half its job's --rejoin-timeout before it
# exits (so that it is replaced before its daemon stalls the round): a healthy one meets its
# next collective, which fails, well within it (FSDP: every layer; DDP: every backward); one
# stuck in a collective that the abort did not end never leaves
REJOIN_ENV = "ELASTICD_REJOIN_TIMEOUT"
_REJOIN_TIMEOUT = 60.0  # the daemon's default, where the variable is missing
# Text of errors that a broken process group raises (gloo and NCCL put them in plain
# RuntimeErrors): such a failure re-forms the group; anything else is the script's own.
_GROUP_ERRORS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "timed out",
    "socket",
    "process group",
)


class Channel:
    """The connection to the agent; a thread reads its notices."""

    def __init__(
        self,
        path: str,
        slot: int,
        on_abort: Callable[[int], None],
        on_place: Callable[[int], None] = lambda round: None,
    ) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._on_abort = on_abort
        self._on_place = on_place
        self._lock = threading.Condition()
        self._places: dict[int, dict[str, str]] = {}
        self.announced = -1  # newest round the agent announced
        self.added = False  # whether that round brings new workers (they need sync)
        self.aborted = -1  # newest round the agent said the old group cannot reach
        self.closed = False
        self._send({"op": "hello", "slot": slot, "stacks": register_stacks()})
        threading.Thread(target=self._read, name="elasticd-agent", daemon=True).start()

    def _send(self, doc: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(doc).encode() + b"\n")

    def _read(self) -> None:
        buffered = b""
        try:
            while True:
                data = self._sock.recv(_MAX_LINE)
                if not data:
                    break
                buffered += data
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    self._handle(json.loads(line))
        except (OSError, ValueError):
            pass
        with self._lock:
            self.closed = True
            self._lock.notify_all()

    def _handle(self, doc: dict[str, Any]) -> None:
        op, round = doc.get("op"), int(doc.get("round", -1))
        with self._lock:
            if op == "place":
                self._places[round] = {str(k): str(v) for k, v in doc["env"].items()}
            elif op == "update" and round > self.announced:
                self.announced, self.added = round, bool(doc.get("added"))
            elif op == "abort":
                self.aborted = max(self.aborted, round)
            self._lock.notify_all()
        phase(f"notice-{op}", round)
        if op == "abort":
            self._on_abort(round)
        elif op == "place":
            self._on_place(round)

    def progress(self) -> None:
        self._send({"op": "progress"})

    def failed(self, round: int, error: str) -> None:
        """A collective of ``round`` cannot complete (NCCL's asynchronous error): the same
        word as a failed collective's ask, sent from a thread while the main thread waits."""
        self._send({"op": "ready", "round": round, "why": "failure", "error": error[:2000]})

    def newest(self) -> list[int]:
        """[the newest announced round, whether it adds workers] (one all_reduce's payload)."""
        with self._lock:
            return [self.announced, int(self.added)]

    def newest_place(self) -> int:
        """The newest round this worker was placed in (-1: none yet)."""
        with self._lock:
            return max(self._places, default=-1)

    def place_after(self, round: int, why: str, error: str = "") -> tuple[int, dict[str, str]]:
        """Ask for this worker's place in a round after ``round``; blocks until the agent has one."""
        self._send({"op": "ready", "round": round, "why": why, "error": error[:2000]})
        with self._lock:
            while True:
                newer = [r for r in self._places if r > round]
                if newer:
                    newest = max(newer)
                    return newest, self._places[newest]
                if self.closed:
                    raise ConnectionError("the elasticd agent closed the channel")
                self._lock.wait()


def socket_fds() -> dict[int, int]:
    """This process's sockets: fd -> inode (the inode tells a reused fd number apart)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if stat.S_ISSOCK(info.st_mode):
            found[int(name)] = info.st_ino
    return found


def opened_since(before: dict[int, int]) -> dict[int, int]:
    """This process's sockets that are not in ``before`` (fd -> inode)."""
    return {fd: ino for fd, ino in socket_fds().items() if before.get(fd) != ino}


def shut_down(fds: dict[int, int]) -> None:
    """Shut down the connected TCP sockets among ``fds`` (still the same sockets)."""
    for fd, inode in fds.items():
        try:
            if os.fstat(fd).st_ino != inode:
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if not listening and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _tcp_sockets() -> str:
    """This process's TCP sockets, each as ``fd local->peer`` (for a stuck worker's last
    words: which of them the abort left open)."""
    described = []
    for fd in sorted(socket_fds()):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                host, port = sock.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "-"
            host, port = sock.getsockname()[:2]
            described.append(f"{fd} {host}:{port}->{peer}")
    return ", ".join(described) or "none"


class Runtime:
    """This worker's membership: its round, its process group, the agent's notices."""

    def __init__(self, path: str, slot: int, backend: str | None) -> None:
        for name, value in NCCL_DEFAULTS.items():
            os.environ.setdefault(name, value)  # before any NCCL group is made
        if not any(name in os.environ for name in RECORDER_SIZES):
            os.environ[recorder_size_name(torch.__version__)] = "0"
        self.slot = slot
        self.round = -1
        self.backend = backend
        self._group_lock = threading.Lock()
        self._group_sockets: dict[int, int] = {}
        self._asked_after = -2  # the round after which this worker last asked for a place
        self._stuck_watch = -1  # the newest round whose abort is watched (_end_if_stuck)
        self._before_group: dict[int, int] = {}  # the sockets this process had before the group
        self._forming_since: dict[int, int] | None = None  # sockets before an init in progress
        self.channel = Channel(path, slot, self._abort, self._placed)
        self._kept_stores: set[tuple[str, str]] = set()  # stores that left groups still host
        collectives.abandon_when(lambda: self.aborted, self._kept_group)
        self._progressed = -PROGRESS_EVERY
        self._watching: threading.Event | None = None  # set to stop the NCCL error watch
        atexit.register(_leave_group)

    def progress(self) -> None:
        """This worker made progress (a step, a commit): told to the agent, at most twice a
        second."""
        now = time.monotonic()
        if now - self._progressed >= PROGRESS_EVERY:
            self._progressed = now
            try:
                self.channel.progress()
            except OSError:
                pass

    # -- notices ------------------------------------------------------------------------

    def _abort(self, round: int) -> None:
        """On the reader thread: the group of our round cannot complete; make it fail now.
        NCCL: ``_abort_process_group`` (ncclCommAbort), verified on an H200 (tests/gpu);
        gloo: its sockets shut down."""
        with self._group_lock:
            if round <= self.round:
                return
            if dist.is_initialized() and str(dist.get_backend()) != "gloo":
                try:  # NCCL: ncclCommAbort (this also unregisters the default group)
                    dist.distributed_c10d._abort_process_group()
                except Exception:
                    pass
            self._shut_down_forming()
            shut_down(self._group_sockets)
            if self._forming_since is None and self.round > self._stuck_watch:
                self._stuck_watch = self.round
                threading.Thread(
                    target=self._end_if_stuck,
                    args=(self.round,),
                    daemon=True,
                    name="elasticd-aborted",
                ).start()

    def _kept_group(self) -> None:
        """A collective left its group, which is kept (collectives): on the round's rank 0,
        where no agent serves the store, it keeps the round's store server listening, with
        that round's keys.  (Served by the agent, the store is the agent's to close.)"""
        if os.environ.get("RANK") == "0" and not _agent_store():
            self._kept_stores.add(
                (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
            )

    def _end_if_stuck(self, round: int) -> None:
        """A worker still in ``round`` ``abort_limit`` s after its abort, never having asked
        for a newer place, ends: its agent replaces it.  Seen on gloo (torch 2.13): a survivor
        of a node frozen mid-allreduce, the frozen peer thawed after the others re-formed,
        waited in gloo's ``UnboundBuffer::waitSend`` with its pairs' sockets closed, until
        the group's timeout (30 minutes): its round-mates waited for it in the next round."""
        limit = abort_limit(os.environ.get(REJOIN_ENV, ""))
        time.sleep(limit)
        with self._group_lock:
            if self._asked_after >= round:
                return
        # where it is stuck first: the root cause the agent reads is the stderr's last line
        print(
            f"elasticd: this worker's threads, still in aborted round {round}; its TCP "
            f"sockets: {_tcp_sockets()} (those the abort shut down: "
            f"{sorted(self._group_sockets)})",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(
            f"elasticd: round {round}'s group was aborted and this worker is still in it "
            f"after {limit:g} s (a collective the abort did not end); it exits (the agent "
            "replaces it)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(GIVEN_UP_EXIT)

    def _placed(self, round: int) -> None:
        """On the reader thread: a place in a round newer than the one whose group this
        worker forms gives that round up (its members were placed anew), so the forming
        stops waiting for peers that moved on: a worker placed twice before any group
        formed (a job's nodes coming one after the other) may have taken the older round."""
        with self._group_lock:  # under the lock: a newer round's forming may have begun
            if round > self.round:
                self._shut_down_forming()

    def _shut_down_forming(self) -> None:
        """Under the group lock: a group being formed fails at once, and for good.  The
        sockets opened since its forming began are shut down now, and again every
        ``_GIVE_UP`` s while the init still runs (it may connect again).  Some waits no
        socket reaches: a rank other than 0 whose store client keeps retrying the port of
        a rank 0 that gave the round up (torch retries until gloo's timeout, 30 minutes),
        or a rank 0 whose store waits for ranks that moved on.  An init still running
        ``_GIVE_UP_LIMIT`` s after its round was given up ends the process: the agent
        takes it for a failed worker, and the job goes on without it or with a new one."""
        forming = self._forming_since
        if forming is None:
            return
        shut_down(opened_since(forming))
        threading.Thread(
            target=self._keep_failing,
            args=(forming, self.round),
            daemon=True,
            name="elasticd-give-up",
        ).start()

    def _keep_failing(self, forming: dict[int, int], round: int) -> None:
        deadline = time.monotonic() + _GIVE_UP_LIMIT
        while True:
            time.sleep(_GIVE_UP)
            with self._group_lock:
                if self._forming_since is not forming:  # that init returned
                    return
                if time.monotonic() >= deadline:
                    break
                shut_down(opened_since(forming))
        print(
            f"elasticd: round {round}'s group was given up but still forms after "
            f"{_GIVE_UP_LIMIT:g} s; this worker exits (the agent restarts it)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(GIVEN_UP_EXIT)

    @property
    def aborted(self) -> bool:
        return self.channel.aborted > self.round

    @property
    def superseded(self) -> bool:
        """Whether this worker was placed in a newer round than its own."""
        return self.channel.newest_place() > self.round

    def check_host_updates(self) -> None:
        """One collective: every rank learns the newest announcement any rank has seen."""
        self.progress()
        if self.aborted:
            raise GroupAborted("a member of the job is gone")
        agreed = torch.tensor(self.channel.newest(), dtype=torch.int64, device=default_device())
        collectives.all_reduce(agreed, op=dist.ReduceOp.MAX)
        newest, added = int(agreed[0]), bool(agreed[1])
        if newest > self.round:
            phase("interrupt", newest)
            raise HostsUpdatedInterrupt(skip_sync=not added)

    def is_group_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` came from the process group breaking (re-form), not from the script."""
        if isinstance(exc, GroupAborted) or isinstance(exc, getattr(dist, "DistError", ())):
            return True
        if self.aborted:  # the daemon said the group is gone: what broke is a consequence
            return True
        if isinstance(exc, TierError) or not isinstance(exc, RuntimeError):
            return False
        text = str(exc).lower()
        return any(word in text for word in _GROUP_ERRORS)

    # -- the process group ----------------------------------------------------------------

    def join(self, why: str, error: str = "") -> None:
        """Leave the old group (if any), get a place in a newer round, form its group.
        A broken group's sockets are shut down first: a collective still queued on it (DDP
        launches several) could otherwise hold the group's destructor, which waits for
        them, on a peer that is alive and waiting too, until gloo's timeout (30 minutes)."""
        if self._watching is not None:
            self._watching.set()
            self._watching = None
        if dist.is_initialized():
            self.backend = self.backend or str(dist.get_backend())
            with self._group_lock:
                if why == "failure":
                    shut_down(self._group_sockets)
                self._group_sockets = {}
            phase("leave-start", self.round)
            try:
                dist.destroy_process_group()
            except Exception:
                pass
            # the old round's FSDP2 model, optimizer and groups are cyclic garbage: without a
            # collection each re-form kept them (8 fds and about 40 MiB a round, measured
            # over 30 re-forms; on a GPU, the old model's device memory while the new is
            # built).  What was there at the first round is frozen (below): this collection
            # looks at what came since, in no time, where a full one took 0.2 s
            gc.collect()
            phase("leave-end", self.round)
        elif why == "start":
            gc.freeze()  # torch's and the script's imports: never garbage, never looked at again
        phase(f"ask-{why}", self.round)
        with self._group_lock:
            self._asked_after = self.round
        round, env = self.channel.place_after(self.round, why, error)
        phase("placed", round)
        store = (env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""))
        if store in self._kept_stores:  # a fixed --master-port: that server is in the way
            print(
                f"elasticd: round {round}'s store is at {store[0]}:{store[1]}, where a group "
                "this worker had to leave (a collective gloo never ended) still hosts the "
                "store of its round; this worker exits (the agent replaces it)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(GIVEN_UP_EXIT)
        os.environ.update(env)
        with self._group_lock:  # the reader thread compares notices with it under the lock
            self.round = round
        self._init_group()

    def _init_group(self) -> None:
        with self._group_lock:
            self._forming_since = socket_fds()
        try:
            phase("form-start", self.round)
            self._wait_for_store()
            init_default_group(self.backend or _default_backend())
            phase("form-end", self.round)
            self._watch_errors()
        except Exception as exc:
            if self.superseded and not isinstance(exc, GroupAborted):
                raise GroupAborted(
                    "a newer round replaced this one while its group formed"
                ) from exc
            raise
        finally:
            with self._group_lock:
                self._before_group, self._forming_since = self._forming_since, None
            self.note_group_sockets()

    def _wait_for_store(self) -> None:
        """Return once this round may form: its store's port listens, looked at every 5 ms
        (TCPStore's own retry backs off to ~0.5 s).  Under a daemon (or torchrun) the agent
        serves it from before the round formed, so it listens at once; launched without one,
        rank 0's ``init_process_group`` hosts it, and rank 0 does not wait for itself.
        Raises GroupAborted on an abort or a newer place."""
        deadline = time.monotonic() + _STORE_WAIT
        addr, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))
        while True:
            if self.aborted:
                raise GroupAborted("a member of the job left before its group formed")
            if self.superseded:
                raise GroupAborted("a newer round replaced this one before its group formed")
            if not port or (os.environ.get("RANK") == "0" and not _agent_store()):
                return
            try:
                socket.create_connection((addr, port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.channel.closed:
                    raise GroupAborted(
                        f"the round's store at {addr}:{port} never listened"
                    ) from None
                time.sleep(_POLL)

    def _watch_errors(self) -> None:
        """On NCCL: a thread that reads the group's asynchronous error and tells the agent
        at once when NCCL saw a peer go (see the module's docstring; written for NCCL,
        run here on gloo only, where it does not start)."""
        if str(dist.get_backend()) != "nccl":
            return
        backend = nccl_backend()
        if backend is None:
            return
        stop = self._watching = threading.Event()
        threading.Thread(
            target=self._error_watch,
            args=(backend, self.round, stop),
            daemon=True,
            name="elasticd-nccl-errors",
        ).start()

    def _error_watch(self, backend: Any, round: int, stop: threading.Event) -> None:
        while not stop.wait(_ERROR_POLL):
            error = group_error(backend)
            if error is not None:
                phase("nccl-error", round)
                try:
                    self.channel.failed(round, f"NCCL reported {error} (a peer is gone)")
                except OSError:
                    pass
                return

    def note_group_sockets(self) -> None:
        """The group's sockets: those opened since just before it formed (``run`` calls this
        again after the first collectives: gloo may connect its pairs lazily)."""
        with self._group_lock:
            before = self._before_group
            self._group_sockets = opened_since(before)


def abort_limit(rejoin_timeout: str) -> float:
    """Seconds an aborted round's worker may stay in it: half the job's rejoin timeout."""
    try:
        timeout = float(rejoin_timeout)
    except ValueError:
        timeout = _REJOIN_TIMEOUT
    if not math.isfinite(timeout) or timeout < 0:
        timeout = _REJOIN_TIMEOUT
    return timeout / 2


def recorder_size_name(version: str) -> str:
    """The name this torch reads the flight recorder's size from (2.8 renamed it)."""
    major, minor = (int(part) for part in re.findall(r"\d+", version)[:2])
    return RECORDER_SIZES[0] if (major, minor) >= (2, 8) else RECORDER_SIZES[1]


def nccl_backend() -> Any:
    """The default group's NCCL backend (None where torch has no such accessor).  Written
    for NCCL against torch 2.13's API; verified only on gloo (where it is not called)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cuda"))
    except (AttributeError, RuntimeError, ValueError):
        return None


def group_error(backend: Any) -> str | None:
    """The name of the backend's asynchronous error (a remote peer gone, a communication
    error, a timeout), or None while it has none.  ``Backend.get_error`` (torch 2.7+):
    written for NCCL; verified only on gloo, where the unit tests call it with stand-ins."""
    try:
        error = backend.get_error()
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    name = getattr(error, "name", str(error))
    return None if name == "SUCCESS" else name


def _agent_store() -> bool:
    """Whether the round's store is served for the workers (torch's test of it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_default_group(backend: str) -> None:
    """``init_process_group`` from the environment, as the group "0" that every peer forms.
    An init that failed (an abort or a newer place while forming) left torch's group counter
    one up (torch 2.13: ``destroy_process_group`` resets it, a failed init does not), and
    the next group would have been "1", whose store keys no peer reads: every rank of the
    next round waited in gloo's rendezvous for good."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0
    forget_meshes()
    dist.init_process_group(backend, init_method="env://")


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions before a new group forms.  They are
    keyed by ``DeviceMesh``, which compares equal for any mesh of the same layout whatever
    the group and this rank's place in it (torch 2.13): after a re-form to a world size this
    process had before at another rank, FSDP2's new parameters came out of the cache on the
    old round's mesh, with its coordinate, so DCP planned this rank's load for the shard it
    held then (an empty shard read as one row, or the wrong rows).  The redistribution's
    transforms are cached by the same keys, with shapes of the rank's own coordinate; and
    DTensor's random-number tracker, made once by a collective on its first random op, is
    dropped, so that survivors and newcomers make the next one together."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was made: nothing cached
    try:
        from torch.distributed.tensor import _random
        from torch.distributed.tensor._redistribute import (
            _gen_transform_infos,
            clear_redistribute_planner_cache,
        )
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # another torch: its caches are not known here
        return
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()
    _random._rng_tracker = None


def register_stacks() -> int:
    """Dump every thread's stack to stderr on STACKS_SIGNAL (``kill -USR2 PID`` does it by
    hand too); the signal's number, for the agent (0 where it cannot be registered)."""
    try:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        return 0
    return int(STACKS_SIGNAL)


class ProgressChannel:
    """A classic job's channel to its agent (``$ELASTICD_PROGRESS_SOCKET``): its hello, then
    progress only.  Nothing comes back."""

    def __init__(self, path: str, slot: int) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._send({"op": "hello", "slot": slot, "stacks": register_stacks()})
        self._progressed = -PROGRESS_EVERY

    def _send(self, doc: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(doc).encode() + b"\n")

    def progress(self) -> None:
        now = time.monotonic()
        if now - self._progressed >= PROGRESS_EVERY:
            self._progressed = now
            self._send({"op": "progress"})


def phase(name: str, round: int) -> None:
    """A point of a re-form on the worker's clock (debug level: tests/bench/bench_recovery.py
    collects them to print each figure's phases)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("elasticd: %s (round %d)", name, round, extra={"phase": name, "round": round})


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


_current: Runtime | None = None
_backend: str | None = None


def current() -> Runtime | None:
    """This worker's runtime when it runs in an in-place job (connects on first use)."""
    global _current
    path = os.environ.get(SOCKET_ENV)
    if _current is None and path:
        _current = Runtime(
            path, int(os.environ.get(SLOT_ENV, os.environ.get("LOCAL_RANK", "0"))), _backend
        )
    return _current


def init(backend: str | None = None) -> None:
    """Choose the backend. In an in-place job the group is formed by ``run`` (a worker may be
    warming up before it has a rank); elsewhere this is ``init_process_group(backend)``."""
    global _backend
    _backend = backend
    if os.environ.get(SOCKET_ENV):
        return
    if not dist.is_initialized():
        dist.init_process_group(backend or _default_backend())
        atexit.register(_leave_group)


def _leave_group() -> None:
    """At exit, the group this library formed is destroyed unless the script did it, and
    what is no longer reachable is collected: a gloo group destroyed during the
    interpreter's teardown aborts the process (SIGABRT, "terminate called without an active
    exception"; torch 2.13: about 1 exit in 10 of two DDP ranks here), a successful worker
    failing its job at its end.  A model (DDP's reducer, FSDP's mesh) holds its group after
    ``destroy_process_group``, and its reference cycles outlive the script's ``main``
    until a collection: this one, while the interpreter is whole."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    gc.collect()


_progress_channel: ProgressChannel | None = None
_progress_failed = False


def progress() -> None:
    """Tell the agent that this worker made progress (a step): a job with ``--hang-timeout``
    counts its ranks hung when none does for that long.  ``commit()`` and
    ``check_host_updates()`` do it already; a script that has neither calls this once per
    step (it costs a time check; the agent hears at most twice a second).  A no-op outside
    elasticd."""
    global _progress_channel, _progress_failed
    runtime = current()
    if runtime is not None:
        runtime.progress()
        return
    path = os.environ.get(PROGRESS_ENV)
    if not path or _progress_failed:
        return
    try:
        if _progress_channel is None:
            slot = int(os.environ.get(SLOT_ENV, os.environ.get("LOCAL_RANK", "0")))
            _progress_channel = ProgressChannel(path, slot)
        _progress_channel.progress()
    except (OSError, ValueError):
        _progress_failed = True  # the agent is gone or refused: stop trying


def check_host_updates() -> None:
    """Raise HostsUpdatedInterrupt on every rank at the same step when the daemon announced
    a membership change; a no-op outside an in-place job (where it reports progress only)."""
    runtime = current()
    if runtime is not None:
        runtime.check_host_updates()
    else:
        progress()
