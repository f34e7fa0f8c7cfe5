"""A torchrun line run once per node where no elasticd runs (docs/elasticrun.md, "Where no
elasticd runs"): this node's elasticrun starts a private elasticd for the job, as the
calling user, with its state in a directory of its own, and the private daemons of the
job's nodes form the job's cluster for the job's life.

The directory is ``$TMPDIR/elasticrun-<uid>/<run id>-<random>/`` (node-local, as torchrun's
own log directory): ``daemon.toml`` (the daemon's config), ``job.json`` (this node's
command line, environment and working directory: what this node runs, 0600), ``owner``
(this elasticrun's pid and start time), ``state/`` and ``run/`` (the daemon's).  The daemon
removes it when it ends; one that was SIGKILLed with its elasticrun is reaped by the next
elasticrun of the same user on the node (``elasticd --clean-up``, then the directory).
The base directory must lie in directories that only the user and root may change, as ssh's
StrictModes asks of a home directory: anyone else who could rename what lies there could
swap it for a directory of theirs once checked, and have this user's elasticrun (root's,
maybe) clean up with their config.

The daemon holds one end of a socket pair that this process opened: it writes its news
there (the job's id once it is known, or why it gave up, one JSON object a line) and stops
when the other end closes, that is when this process ends, however it ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elasticctl import topology as topo
from elasticctl.client import ClientError, SignalWakeup
from elasticd.wire import paths, safejson

STOP_TIMEOUT = 120.0  # seconds a private daemon gets to stop (its workers' grace, a linger)
SLURM_KEY_WAIT = 120.0  # seconds a task waits for the key its allocation's task 0 makes
MAX_NEWS = 1 << 20  # bytes of one line from the daemon
MAX_OWNER = 4096  # bytes of a job directory's owner file
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its NUL)
MAX_RUN_ID_IN_NAME = 12  # characters of the run id that name a job directory (cut there)
RANDOM_CHARS = 8  # characters that tempfile.mkdtemp adds to a job directory's name
RUN_DIR = "run"  # the private daemon's runtime directory, in its job directory
# The daemon's longest socket path in its runtime directory: a job's checkpoint tier's
# (elasticd.shell.checkpoints), with the longest job id (elasticd.jobs.board.JOB_ID); its
# control.sock and agents/<job id>.sock are shorter.
DEEPEST_SOCKET = os.path.join("checkpoints", "j-" + "f" * 12, ".tier.sock")
# bytes of the base directory's path, for <base>/<run id>-<random>/run/<socket> to fit
MAX_BASE = MAX_SOCKET_PATH - len(
    f"/{'x' * MAX_RUN_ID_IN_NAME}-{'x' * RANDOM_CHARS}/{RUN_DIR}/{DEEPEST_SOCKET}"
)
CLEAN_UP_TIMEOUT = 60.0  # seconds a leftover daemon's clean-up may take
ORPHAN_AGE = 60.0  # seconds after which a job directory without its owner file is a leftover
LOG_LEVELS = ("debug", "info", "warning", "error")
_DAEMON_ENV_DROPPED = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)


class Failed(ClientError):
    """The private daemon could not run the job (its own words, or how it ended)."""

    code = "private_daemon"


def base_dir(uid: int | None = None) -> str:
    """Where this user's elasticruns keep their daemons' directories (node-local): in
    $TMPDIR, as torchrun's own; in /tmp where $TMPDIR is too long a path for the daemon's
    sockets (a Unix socket's path has 107 bytes at most).  Links resolved: the path
    checked is the path used."""
    name = f"elasticrun-{os.getuid() if uid is None else uid}"
    base = os.path.join(os.path.realpath(tempfile.gettempdir()), name)
    return base if len(base) <= MAX_BASE else os.path.join(os.path.realpath("/tmp"), name)


def make_base(base: str) -> None:
    """Make ``base`` (0700) unless it is there, and refuse it (Failed, saying why) unless it is
    a directory of this user's that nobody else can write, in directories that nobody but
    this user and root can change: another user who could rename entries above it could swap
    it for a directory of theirs after it was checked."""
    above = os.path.dirname(base)
    unsafe = _changeable_by_others(above)
    if unsafe:
        sticky = f"make {unsafe[0]} sticky (chmod +t, as /tmp is; a Kubernetes emptyDir is not) or "
        raise Failed(
            f"refusing {base}: {unsafe[0]} is {unsafe[1]}, so another user could replace "
            f"what lies in it; {sticky if 'sticky' in unsafe[1] else ''}{_elsewhere(base)}"
        )
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass  # an earlier elasticrun's, or somebody's: checked below
    if not paths.is_own_dir(base):
        raise Failed(
            f"refusing {base}: it must be a directory of yours that nobody else can write, "
            f"and is {_kind(base)} (someone else made it?); {_elsewhere(base)}"
        )


def make_job_dir(base: str, run_id: str) -> str:
    """A new job directory in ``base`` (0700), named after the run id (its first characters;
    "job" for one that is not a plain name): a name short enough for the daemon's sockets."""
    name = run_id[:MAX_RUN_ID_IN_NAME] if _plain(run_id) else "job"
    return tempfile.mkdtemp(prefix=f"{name}-", dir=base)


def _changeable_by_others(directory: str) -> tuple[str, str] | None:
    """The first of ``directory`` and those above it that a user other than this one and
    root may change, and how (another's, or writable by others without the sticky bit, that
    keeps /tmp's entries their owners'); None: none."""
    path = os.path.abspath(directory)
    while True:
        try:
            info = os.lstat(path)
        except OSError as exc:
            return path, f"unreadable ({exc.strerror})"
        if not stat.S_ISDIR(info.st_mode):
            return path, "not a directory"
        if info.st_uid not in (0, os.geteuid()):
            return path, f"uid {info.st_uid}'s"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (
                path,
                f"mode {info.st_mode & 0o7777:o}: writable by others, without the sticky bit",
            )
        if path == os.path.dirname(path):
            return None
        path = os.path.dirname(path)


def _kind(path: str) -> str:
    """What is at ``path``, in a few words."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return "a link"
    if stat.S_ISREG(info.st_mode):
        return "a file"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    return f"a directory of uid {info.st_uid}, mode {info.st_mode & 0o7777:o}"


def _elsewhere(base: str) -> str:
    """What to do about a base directory refused: use another $TMPDIR, short enough to be
    used (a longer one is not: the base is then in /tmp)."""
    if os.path.dirname(base) == os.path.realpath(tempfile.gettempdir()):
        return "set TMPDIR to a directory of yours, on a path only you and root may change"
    room = MAX_BASE - len(os.path.basename(base)) - 1
    return (
        f"set TMPDIR to a directory of yours whose path has at most {room} bytes (TMPDIR "
        f"{tempfile.gettempdir()} is too long a path for the daemon's sockets, so /tmp is used)"
    )


def node_name(pid: int | None = None) -> str:
    """This node's name in the job: the host's short name and this elasticrun's pid (two
    elasticruns of one job on one host are two nodes, as two torchruns are)."""
    return f"{socket.gethostname().split('.')[0] or 'node'}-{os.getpid() if pid is None else pid}"


@dataclass
class PrivateDaemon:
    """One started private daemon: its directory, its process, the channel to it."""

    directory: str
    proc: subprocess.Popen[bytes]
    channel: socket.socket
    node: str
    made_key: str = ""  # a Slurm key file this task made, removed at the end
    _buffer: bytes = b""

    @property
    def socket(self) -> str:
        return os.path.join(self.directory, RUN_DIR, paths.SOCKET_NAME)

    def wait_job(self) -> dict[str, Any]:
        """The job document the daemon sends once this node knows its job (Failed with the
        daemon's words, or how it ended, if it gives up first).  A signal interrupts it."""
        wakeup = SignalWakeup()
        try:
            while True:
                news = self._next(wakeup)
                if news is None:
                    code = self.proc.wait()
                    raise Failed(
                        f"the job's private elasticd ended (status {code}) before the job "
                        "started; its log is above"
                    )
                if "error" in news:
                    raise Failed(str(news["error"]))
                if "job" in news:
                    return news
        finally:
            wakeup.close()

    def last_words(self) -> str:
        """What the daemon said last (why it gave up), once it ended; "" if nothing."""
        said = ""
        self.channel.settimeout(STOP_TIMEOUT)
        while (news := self._next(None)) is not None:
            said = str(news.get("error", said))
        return said

    def _next(self, wakeup: SignalWakeup | None) -> dict[str, Any] | None:
        """The next line from the daemon (None: it closed its end)."""
        while b"\n" not in self._buffer:
            if wakeup is not None and wakeup.fd is not None:
                ready, _, _ = select.select([self.channel.fileno(), wakeup.fd], [], [])
                if wakeup.fd in ready:
                    wakeup.drain()  # the signal's handler runs as this returns
                    continue
            try:
                data = self.channel.recv(65536)
            except OSError:
                data = b""
            if not data:
                return None
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            news = safejson.loads(line, max_bytes=MAX_NEWS)
        except safejson.Undecodable:
            return {"error": f"the private elasticd said something unreadable: {line[:200]!r}"}
        return news if isinstance(news, dict) else {}

    def close(self) -> int | None:
        """Tell the daemon to go (close our end), wait until it has, and leave nothing of it
        behind: a daemon that does not stop in time is killed and cleaned up after.
        Returns its exit status."""
        self.channel.close()
        try:
            code = self.proc.wait(STOP_TIMEOUT)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            self.proc.kill()
            code = self.proc.wait()
        if os.path.isdir(self.directory):  # it did not get to remove it: it died
            clean_up(self.directory)
        if self.made_key:
            _remove(self.made_key)
        return code


def start(
    request: Mapping[str, Any],
    where: topo.Topology,
    environ: Mapping[str, str],
    warn: Callable[[str], None] | None = None,
) -> PrivateDaemon:
    """Make the job's directory and start this node's private daemon for ``request`` (the
    submit request of the line as this node sees it); ``warn`` prints a warning."""
    warn = warn or (lambda text: print(f"elasticrun: warning: {text}", file=sys.stderr))
    base = base_dir()
    make_base(base)
    reap_leftovers(base)
    directory = make_job_dir(base, where.run_id)
    node = node_name()
    try:
        key_file, made, keyless = _key(where, directory, environ, warn)
        _write(os.path.join(directory, "owner"), json.dumps(_owner()))
        _write(
            os.path.join(directory, "job.json"),
            json.dumps({"request": dict(request), "run_id": where.run_id, "keyless": keyless}),
        )
        _write(
            os.path.join(directory, "daemon.toml"),
            daemon_config(request, where, directory, node, key_file, environ),
        )
        parent, child = socket.socketpair()
        argv = [
            sys.executable,
            "-m",
            "elasticd",
            "--config",
            os.path.join(directory, "daemon.toml"),
        ]
        argv += ["--private", directory, "--private-fd", str(child.fileno())]
        if where.one_node:
            argv.append("--standalone")
        env = {k: v for k, v in environ.items() if k not in _DAEMON_ENV_DROPPED}
        try:
            # its own session: the terminal's Ctrl-C is elasticrun's to turn into a cancel
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                pass_fds=(child.fileno(),),
                env=env,
                cwd=directory,
                start_new_session=True,
            )
        finally:
            child.close()
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return PrivateDaemon(directory, proc, parent, node, made_key=made)


def daemon_config(
    request: Mapping[str, Any],
    where: topo.Topology,
    directory: str,
    node: str,
    key_file: str,
    environ: Mapping[str, str],
) -> str:
    """The private daemon's config: one job's node, no metrics, no firewall, no scheduler,
    any free peer port; the store where the line says."""
    nproc = request.get("nproc_per_node", 1)
    slots = (
        max(nproc + int(request.get("spares", 0)), os.cpu_count() or 1)
        if isinstance(nproc, int)
        else 0
    )
    level = environ.get("LOGLEVEL", "").lower()
    tables: dict[str, dict[str, Any]] = {
        "node": {"name": node, "peer_port": 0, "slots": slots},
        "paths": {
            "state_dir": os.path.join(directory, "state"),
            "runtime_dir": os.path.join(directory, RUN_DIR),
        },
        "metrics": {"port": 0},
        "jobs": {"allow_root": True},
        "scheduler": {"enabled": False},
        "history": {"retention": 0.0},
        "log": {"level": level if level in LOG_LEVELS else "warning"},
    }
    if where.local_addr:
        tables["node"]["address"] = where.local_addr
    if not where.one_node:
        tables["cluster"] = {"name": where.cluster, "key_file": key_file}
        connect = float(request.get("join_timeout", 600.0))
        if where.backend == topo.ETCD:
            tables["store"] = {
                "backend": "etcd",
                "endpoints": [where.endpoint],
                "connect_timeout": connect,
                **where.etcd_tls,
            }
        else:
            host = "auto" if where.hosts_store is None else where.hosts_store
            tables["store"] = {
                "endpoint": where.endpoint,
                "host": host,
                "firewall": False,
                "connect_timeout": connect,
            }
    return toml(tables)


def toml(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML for tables of strings, numbers, booleans and lists of strings: JSON's escapes of
    a string are TOML's, and DEL, which JSON leaves as it is, is escaped; other non-ASCII
    text is kept as it is (TOML takes no surrogate pair)."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            text = json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
            try:
                text.encode()
            except UnicodeEncodeError:
                raise Failed(f"{name}.{key} {value!r} is not UTF-8 text") from None
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


# -- the key -------------------------------------------------------------------------------


def _key(
    where: topo.Topology, directory: str, environ: Mapping[str, str], warn: Callable[[str], None]
) -> tuple[str, str, bool]:
    """The job's key file for the daemon, the Slurm key file this task made ("": none), and
    whether the key is anyone's: the file the line names, the allocation's (inside Slurm),
    else a key derived from the run id, which anyone can derive (said).  A one-node job
    needs none: its daemon has no store port (it makes a key of its own)."""
    if where.one_node:
        return "", "", False
    if where.key_file:
        path = os.path.abspath(os.path.expanduser(where.key_file))
        _check_key(path, "--rdzv-conf key_file")
        return path, "", False
    if where.slurm_job:
        return (*slurm_key(where, environ), False)
    warn(
        f"no key for this job (--rdzv-conf key_file=FILE, a 0600 file that every node "
        f"reads): anyone who can reach {where.endpoint} can join it and disturb it, as with "
        "torchrun's store; they cannot read this node's command line or environment, nor "
        "make it run anything else"
    )
    path = os.path.join(directory, "cluster.key")
    _write(path, public_key(where.run_id).hex() + "\n")
    return path, "", True


def public_key(run_id: str) -> bytes:
    """The key of a job that was given none: the same on every node, and anyone's."""
    return hashlib.sha256(
        b"elasticrun public key\0" + run_id.encode("utf-8", "surrogateescape")
    ).digest()


def slurm_key(where: topo.Topology, environ: Mapping[str, str]) -> tuple[str, str]:
    """Inside a Slurm step: ``$HOME/.elasticrun/slurm-<job id>.key``, made (0600, in a 0700
    directory) by the step's task 0 and read by the others once it is there.  What it
    trusts: your home directory, shared by the allocation's nodes, where only you (and root)
    can read it; a task waits for it at most SLURM_KEY_WAIT seconds."""
    home = environ.get("HOME") or os.path.expanduser("~")
    directory = os.path.join(home, ".elasticrun")
    path = os.path.join(directory, f"slurm-{where.slurm_job}.key")
    if where.slurm_first:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not paths.is_own_dir(directory):
            raise Failed(f"refusing {directory}: it must be yours and writable by you only")
        if not os.path.exists(path):
            made = f"{path}.{os.getpid()}.tmp"
            _write(made, os.urandom(32).hex() + "\n")
            os.replace(made, path)  # whole or absent for the other nodes
        _check_key(path, "the Slurm job's key")
        return path, path
    deadline = time.monotonic() + SLURM_KEY_WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise Failed(
                f"no {path} after {SLURM_KEY_WAIT:g} s: task 0 of Slurm job {where.slurm_job} "
                "makes it in your home directory, which this node does not seem to share; "
                "give every node a key file with --rdzv-conf key_file=FILE"
            )
        time.sleep(0.2)  # another node writes it: nothing to wait on here but the file
    _check_key(path, "the Slurm job's key")
    return path, ""


def _check_key(path: str, what: str) -> None:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise Failed(f"{what} {path}: {exc.strerror}") from None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise Failed(
            f"{what} {path} must be yours and readable by you only "
            f"(it is uid {info.st_uid}, mode {info.st_mode & 0o777:o}): chmod 600 it"
        )


# -- what a daemon left ---------------------------------------------------------------------


def reap_leftovers(base: str) -> list[str]:
    """The directories of daemons whose elasticrun is gone and who did not remove them
    (both killed): their workers and cgroups are cleaned up, then the directories removed.
    Only this user's directories are believed, and only their regular files read (an owner
    file that is a FIFO would block the read).  Returns those removed."""
    removed = []
    for name in sorted(os.listdir(base)):
        directory = os.path.join(base, name)
        if not paths.is_own_dir(directory):
            continue  # not one of this user's daemons'
        try:
            owner = json.loads(_read_own_file(os.path.join(directory, "owner"), MAX_OWNER))
        except (OSError, ValueError):
            if _age(directory) < ORPHAN_AGE:
                continue  # being made right now
            owner = {}
        if not isinstance(owner, dict):
            owner = {}
        if _running(owner) or _answers(os.path.join(directory, RUN_DIR, paths.SOCKET_NAME)):
            continue
        if clean_up(directory):
            removed.append(directory)
    return removed


def clean_up(directory: str) -> bool:
    """``elasticd --clean-up`` with the daemon's config (its leftover workers and job
    cgroups), then the directory: only a directory and a config of this user's that nobody
    else can write, as this elasticrun wrote them (the config says what to remove).  A
    clean-up that does not end within CLEAN_UP_TIMEOUT (a process stuck in the kernel) is
    given up and the directory kept, for the next elasticrun to try again.  True: removed."""
    if not paths.is_own_dir(directory):
        return False
    config = os.path.join(directory, "daemon.toml")
    if _is_own_file(config):
        try:
            subprocess.run(
                [sys.executable, "-m", "elasticd", "--clean-up", "--config", config],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=CLEAN_UP_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            print(
                f"elasticrun: warning: the clean-up of {directory} did not end within "
                f"{CLEAN_UP_TIMEOUT:g} s: left for the next elasticrun",
                file=sys.stderr,
            )
            return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def _age(path: str) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _read_own_file(path: str, limit: int) -> bytes:
    """The first ``limit`` bytes of ``path``, a regular file of this user's: OSError if it
    is anything else (a link, a FIFO that would block the read, a device)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError(f"{path} is not a regular file of yours")
        return file.read(limit)


def _is_own_file(path: str) -> bool:
    """A regular file (not a link to one) of this user's that nobody else can write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "started": _start_time(os.getpid())}


def _running(owner: Mapping[str, Any]) -> bool:
    pid, started = owner.get("pid"), owner.get("started")
    return isinstance(pid, int) and started is not None and _start_time(pid) == started


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): a pid reused later differs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
            return True
        except OSError:
            return False


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _plain(text: str) -> bool:
    return bool(text) and all(c.isalnum() or c in "_.-" for c in text)


def daemon_reachable(socket_path: str) -> bool:
    """Whether a daemon answers at ``socket_path`` now."""
    return _answers(socket_path)
