"""Job cgroups: one cgroup v2 per job on this node, as Slurm's proctrack/cgroup keeps them.

Every process a job starts stays in the job's cgroup whatever it does with sessions and
forks, so stopping a job is ``cgroup.kill`` and nothing escapes, and the cgroup's files give
the job's CPU time, memory peak and OOM kills.  A forked worker joins before exec by writing
``0`` to ``cgroup.procs`` fds that the daemon opened: the kernel checks the credentials of
the opener, not of the writer, so this still works after the worker switched to the job's user.

Where the job cgroups go (``JobCgroups.setup``, deciding by ``cgroup_placement``):
- under systemd, our own unit's cgroup, only if it is delegated (``Delegate=yes``); the
  daemon then moves itself into the leaf ``<unit>/daemon`` (cgroup v2 allows processes only
  in leaves of a subtree that has controllers enabled);
- otherwise ``<our cgroup>/elasticd-<instance>``, or the path that ``jobs.cgroup`` names
  (``cgroup_placement.instance_name``: the node's name and a digest of the daemon's state directory).
The daemon enables in its subtree (``cgroup.subtree_control``, from the top of what it owns
down to the base) the controllers it needs.  A hybrid host's v2 tree may lack the memory
and pids controllers (bound to cgroup v1); each is then used in a parallel cgroup v1 tree,
when there is one: a "twin" of the job's cgroup that its workers join too.  What each job
may use (``JobLimits``: its tasks, its memory) is written into its cgroup when it is made;
``controls`` says where each limit is enforced and ``lacking`` why one is not.  Without
usable cgroups ``available`` is False, ``reason`` says why, and the daemon falls back to
process groups.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import select
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from elasticd.core.containment import V1, V2, JobLimits
from elasticd.shell.cgroup_placement import (
    AUTO,
    DAEMON_LEAF,
    DISABLED,
    NAME,
    OFF,
    TWINS,
    Placement,
    choose_placement,
    find_hierarchy,
    home_cgroup,
)

log = logging.getLogger(__name__)

_CONTROLLERS = ("memory", "cpu", "pids", "io")
_JOB_PREFIX = "job-"
_REAP_TIMEOUT = 5.0
_SIGKILL_ROUNDS = 12  # back-off 1 ms .. 100 ms: about a second in all


@dataclass(frozen=True)
class Usage:
    """What a job used on this node, as far as the cgroup files tell (None: not known)."""

    cpu_seconds: float | None = None
    memory_peak: int | None = None
    oom_kills: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, doc: Any) -> Usage:
        if not isinstance(doc, Mapping):
            return cls()

        def number(name: str, kind: type) -> Any:
            value = doc.get(name)
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            return kind(value) if ok else None

        return cls(
            number("cpu_seconds", float), number("memory_peak", int), number("oom_kills", int)
        )


# --- The daemon's subtree ---


class JobCgroups:
    """The daemon's subtree: where job cgroups are made, and what they can bound."""

    def __init__(
        self,
        base: str | None = None,
        *,
        reason: str = "",
        description: str = "",
        v1_bases: Mapping[str, str] | None = None,
        owned: tuple[str, ...] = (),
        enabled: tuple[str, ...] = (),
        lacking: Mapping[str, str] | None = None,
    ) -> None:
        self.base = base
        self.v1_bases = dict(v1_bases or {})  # controller -> the base of its v1 twins
        self.available = base is not None
        self.reason = reason
        self.description = description
        self.enabled = enabled  # v2 controllers that job cgroups have
        self.lacking = dict(lacking or {})  # memory or pids -> why job cgroups cannot use it
        self._owned = owned  # what close() removes, innermost last

    @property
    def controls(self) -> dict[str, str]:
        """memory and pids -> where job cgroups have it (V2, or V1: a twin)."""
        return {
            name: V2 if name in self.enabled else V1
            for name in TWINS
            if name in self.enabled or name in self.v1_bases
        }

    @classmethod
    def setup(
        cls,
        node: str,
        setting: str = AUTO,
        *,
        environ: Mapping[str, str] = os.environ,
        proc: str = "/proc",
    ) -> JobCgroups:
        if setting == OFF:
            return cls(reason=DISABLED)
        try:
            hierarchy = find_hierarchy(
                _read(f"{proc}/self/mountinfo"), _read(f"{proc}/self/cgroup")
            )
        except OSError as exc:
            return cls(reason=f"cannot read {proc}/self: {exc.strerror}")
        cgroup, _ = home_cgroup(hierarchy, environ)
        home = hierarchy.v2_dir(cgroup) if cgroup is not None else None
        placement = choose_placement(
            hierarchy,
            setting,
            node,
            environ,
            delegated=home is not None and _is_delegated(home),
            writable=home is not None and os.access(home, os.W_OK),
        )
        if placement.base is None:
            return cls(reason=placement.reason)
        try:
            return cls._build(placement, setting)
        except OSError as exc:
            return cls(reason=f"cannot set up job cgroups in {placement.base}: {exc.strerror}")

    @classmethod
    def _build(cls, placement: Placement, setting: str) -> JobCgroups:
        base = placement.base
        assert base is not None
        if placement.systemd:
            _make_dirs(os.path.join(base, DAEMON_LEAF))
            _write(os.path.join(base, DAEMON_LEAF, "cgroup.procs"), str(os.getpid()))
            owned: list[str] = []
        else:
            made = _make_dirs(base)
            owned = [base] if setting == AUTO else made
        enabled, why = _enable_controllers(_chain(placement.top or base, base))
        v1_bases: dict[str, str] = {}
        for name in (name for name in TWINS if name not in enabled):
            twin_base, problem = _make_v1_base(placement.v1_bases.get(name))
            if twin_base:
                v1_bases[name] = twin_base
            else:
                why[name] = f"{why.get(name, 'not enabled')}; {problem}"
        owned += list(v1_bases.values())
        description = (
            f"job cgroups in {base} (controllers: {' '.join(enabled) or 'none'})"
            + (f"; elasticd moved to {base}/{DAEMON_LEAF}" if placement.systemd else "")
            + "".join(f"; {name} in {path} (cgroup v1)" for name, path in v1_bases.items())
        )
        lacking = {
            name: why[name] for name in TWINS if name not in enabled and name not in v1_bases
        }
        return cls(
            base,
            description=description,
            v1_bases=v1_bases,
            owned=tuple(owned),
            enabled=tuple(enabled),
            lacking=lacking,
        )

    def create(self, job_id: str, limits: JobLimits = JobLimits()) -> JobCgroup | None:
        """The job's cgroup (an existing empty one is reused), with ``limits`` written where
        the controllers are (no limit: "max").  Raises FileExistsError when one with
        processes exists, OSError when it cannot be made or limited."""
        if self.base is None:
            return None
        if not NAME.fullmatch(job_id):
            raise ValueError(f"job id {job_id!r} cannot name a cgroup")
        path = os.path.join(self.base, _JOB_PREFIX + job_id)
        _make_dirs(path)
        job = JobCgroup(path, self._twins(job_id, limits))
        if job.populated():
            raise FileExistsError(errno.EEXIST, "job cgroup still has processes", path)
        try:
            job.set_limits(limits, self.enabled)
        except OSError:
            job.remove()
            raise
        return job

    def _twins(self, job_id: str, limits: JobLimits) -> dict[str, str]:
        """The job's v1 twins.  One that cannot be made is left out with a warning, unless
        it has a limit to enforce (then OSError)."""
        twins = {}
        for name, base in self.v1_bases.items():
            path = os.path.join(base, _JOB_PREFIX + job_id)
            try:
                _make_dirs(path)
            except OSError as exc:
                if getattr(limits, name):
                    raise
                log.warning(
                    "no %s accounting for job %s: cannot make %s: %s",
                    name,
                    job_id,
                    path,
                    exc.strerror,
                )
                continue
            twins[name] = path
        return twins

    def leftovers(self) -> list[str]:
        """The job cgroups there are now (a previous run's, before ``reap_leftovers``)."""
        return _job_dirs(self.base)

    def reap_leftovers(self) -> int:
        """Kill and remove the job cgroups that a previous run of this daemon left behind;
        the number of processes killed."""
        killed = 0
        for path in _job_dirs(self.base):
            job = JobCgroup(path)
            killed += len(job.pids())
            job.kill()
            if not _wait_empty_blocking(path, _REAP_TIMEOUT):
                log.warning("processes in %s survived SIGKILL for %g s", path, _REAP_TIMEOUT)
            job.remove()
        for base in self.v1_bases.values():
            for path in _job_dirs(base):  # normally emptied above: the same processes
                killed += _kill_until_empty(path)
                _remove_tree(path)
        if killed:
            log.warning("killed %d processes left by a previous run in %s", killed, self.base)
        return killed

    def close(self) -> None:
        """Remove the directories we made, if empty (never a systemd-delegated unit)."""
        for path in reversed(self._owned):
            try:
                os.rmdir(path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.info("leaving %s: %s", path, exc.strerror)


def limit_writes(
    path: str, enabled: tuple[str, ...] | list[str], twins: Mapping[str, str], limits: JobLimits
) -> list[tuple[str, str, bool]]:
    """(file, value, required) to write, in this order, for a job cgroup at ``path`` whose
    v2 controllers are ``enabled`` and whose v1 twins are ``twins``.  Every value is written,
    "max" included, so that a reused cgroup keeps nothing of an earlier job.  An optional
    file may be missing: memory.oom.group (kernel 4.19), swap accounting (off or no swap)."""
    pids = str(limits.pids) if limits.pids else "max"
    writes: list[tuple[str, str, bool]] = []
    if "pids" in enabled:
        writes.append((os.path.join(path, "pids.max"), pids, True))
    elif "pids" in twins:
        writes.append((os.path.join(twins["pids"], "pids.max"), pids, True))
    if "memory" in enabled:
        memory = str(limits.memory) if limits.memory else "max"
        writes += [
            (os.path.join(path, "memory.oom.group"), "1", False),  # one OOM kill takes the job
            (os.path.join(path, "memory.max"), memory, True),
            (os.path.join(path, "memory.swap.max"), "0" if limits.memory else "max", False),
        ]
    elif "memory" in twins:
        memory = str(limits.memory) if limits.memory else "-1"
        memsw = os.path.join(twins["memory"], "memory.memsw.limit_in_bytes")
        writes += [
            (memsw, "-1", False),  # memsw may never be below the limit: lift it first
            (os.path.join(twins["memory"], "memory.limit_in_bytes"), memory, True),
            (memsw, memory, False),
        ]
    return writes


class JobCgroup:
    """One job's cgroup on this node (and its v1 twins, on a hybrid host)."""

    def __init__(self, path: str, v1: Mapping[str, str] | None = None) -> None:
        self.path = path
        self.v1 = dict(v1 or {})  # controller -> the job's v1 twin of it

    def set_limits(self, limits: JobLimits, enabled: tuple[str, ...] | list[str]) -> None:
        for path, value, required in limit_writes(self.path, enabled, self.v1, limits):
            if required or os.path.exists(path):
                _write(path, value)

    def __repr__(self) -> str:
        return f"JobCgroup({self.path!r})"

    def set_cpu_weight(self, weight: int) -> None:
        """The cgroup's share of the CPU against its siblings (cpu.weight, 1-10000; 100 is
        the default); nothing where the cpu controller is not enabled for it."""
        path = os.path.join(self.path, "cpu.weight")
        if os.path.exists(path):
            _write(path, str(weight))

    def join_fds(self) -> list[int]:
        """Fresh fds on ``cgroup.procs`` (the job's and its twins'): a forked child writes
        b"0" to each before exec to join.  The caller closes them once the child is spawned.
        A twin that cannot be opened raises: a worker outside its limits is not started."""
        fds = [_open_procs(self.path)]
        try:
            for path in self.v1.values():
                fds.append(_open_procs(path))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def adopt(self, pid: int) -> None:
        """Move the running process ``pid`` into the job (and its twins)."""
        fds = self.join_fds()
        try:
            for fd in fds:
                os.write(fd, str(pid).encode())
        finally:
            for fd in fds:
                os.close(fd)

    def pids(self) -> list[int]:
        return [pid for procs in _procs_files(self.path) for pid in _read_pids(procs)]

    def signal(self, sig: int) -> int:
        """Send ``sig`` to every process in the job; how many got it."""
        return sum(_signal_listed(procs, sig) for procs in _procs_files(self.path))

    def kill(self) -> None:
        """SIGKILL every process in the job, those forking right now included."""
        kill_file = os.path.join(self.path, "cgroup.kill")
        if os.path.exists(kill_file):
            try:
                _write(kill_file, "1")
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENODEV):  # not removed meanwhile
                    raise
        elif os.path.isdir(self.path):  # a kernel before 5.14
            _kill_until_empty(self.path)

    def populated(self) -> bool:
        try:
            return _keyed(_read(os.path.join(self.path, "cgroup.events"))).get("populated") == 1
        except OSError:
            return False

    async def wait_empty(self, timeout: float) -> bool:
        """True once no process is left in the job, False after ``timeout`` seconds."""
        try:
            watch = _EventsWatch(self.path)
        except FileNotFoundError:
            return True
        with watch:
            if not watch.populated():
                return True
            loop = asyncio.get_running_loop()
            emptied: asyncio.Future[bool] = loop.create_future()

            def on_change() -> None:
                if not watch.populated() and not emptied.done():
                    emptied.set_result(True)

            loop.add_reader(watch.fileno(), on_change)
            try:
                async with asyncio.timeout(timeout):
                    return await emptied
            except TimeoutError:
                return False
            finally:
                loop.remove_reader(watch.fileno())

    def usage(self) -> Usage:
        cpu = _keyed_file(os.path.join(self.path, "cpu.stat")).get("usage_usec")
        peak = _int_file(os.path.join(self.path, "memory.peak"))
        if peak is not None:
            oom = _keyed_file(os.path.join(self.path, "memory.events")).get("oom_kill")
        elif "memory" in self.v1:
            peak = _int_file(os.path.join(self.v1["memory"], "memory.max_usage_in_bytes"))
            oom = _keyed_file(os.path.join(self.v1["memory"], "memory.oom_control")).get("oom_kill")
        else:
            oom = None
        return Usage(
            cpu_seconds=None if cpu is None else cpu / 1e6, memory_peak=peak, oom_kills=oom
        )

    def remove(self) -> None:
        """Remove the job's directories (and any cgroups the job made inside)."""
        for path in (self.path, *self.v1.values()):
            _remove_tree(path)


class _EventsWatch:
    """``cgroup.events``, and an epoll fd that turns readable when the file changes.

    kernfs reports a change as POLLPRI; POLLIN is always set on its files, so an event loop
    cannot wait on the file itself.  It waits on the epoll fd instead, in which the file is
    registered for EPOLLPRI alone.  Reading the file re-arms the notification.
    """

    def __init__(self, cgroup_dir: str) -> None:
        self._fd = os.open(os.path.join(cgroup_dir, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._epoll = select.epoll()
            self._epoll.register(self._fd, select.EPOLLPRI)
        except BaseException:
            os.close(self._fd)
            raise

    def fileno(self) -> int:
        return self._epoll.fileno()

    def populated(self) -> bool:
        try:
            return _keyed(os.pread(self._fd, 4096, 0).decode()).get("populated") == 1
        except OSError:  # ENODEV: the cgroup was removed, so it is empty
            return False

    def wait(self, timeout: float) -> None:
        self._epoll.poll(max(timeout, 0))

    def __enter__(self) -> _EventsWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._epoll.close()
        os.close(self._fd)


def _wait_empty_blocking(cgroup_dir: str, timeout: float) -> bool:
    """``wait_empty`` for start-up, before the event loop runs."""
    deadline = time.monotonic() + timeout
    try:
        watch = _EventsWatch(cgroup_dir)
    except FileNotFoundError:
        return True
    with watch:
        while watch.populated():
            if time.monotonic() >= deadline:
                return False
            watch.wait(deadline - time.monotonic())
    return True


# --- Processes ---


def _procs_files(cgroup_dir: str) -> Iterator[str]:
    """``cgroup.procs`` of the cgroup and of every cgroup below it."""
    for parent, _, _ in os.walk(cgroup_dir):
        yield os.path.join(parent, "cgroup.procs")


def _read_pids(procs_file: str) -> list[int]:
    try:
        return [int(line) for line in _read(procs_file).split()]
    except OSError:
        return []


def _signal_listed(procs_file: str, sig: int) -> int:
    """Signal the processes listed in ``procs_file``; how many got it.

    Each pid is pinned with a pidfd and must still be listed afterwards, so that a pid
    reused by a process outside the cgroup in between never gets the signal.
    """
    pidfds: dict[int, int] = {}
    try:
        for pid in _read_pids(procs_file):
            try:
                pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                pass
        listed = set(_read_pids(procs_file))
        return sum(_send(fd, sig) for pid, fd in pidfds.items() if pid in listed)
    finally:
        for fd in pidfds.values():
            os.close(fd)


def _send(pidfd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False
    return True


def _kill_until_empty(cgroup_dir: str) -> int:
    """SIGKILL by pid until nothing is left, for cgroups without ``cgroup.kill`` (v1, or a
    kernel before 5.14).  A process forking meanwhile needs another round; the rounds back
    off and are bounded.  How many processes were there at first."""
    first = len([pid for procs in _procs_files(cgroup_dir) for pid in _read_pids(procs)])
    delay = 0.001
    for _ in range(_SIGKILL_ROUNDS):
        if not sum(_signal_listed(procs, signal.SIGKILL) for procs in _procs_files(cgroup_dir)):
            return first
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    log.warning("processes in %s survive SIGKILL", cgroup_dir)
    return first


# --- Files and directories ---


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    """One write(2), so that the kernel's answer to it is the error raised."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _open_procs(cgroup_dir: str) -> int:
    return os.open(os.path.join(cgroup_dir, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)


def _keyed(text: str) -> dict[str, int]:
    """``key value`` lines (cgroup.events, cpu.stat, memory.events, memory.oom_control)."""
    pairs = (line.split() for line in text.splitlines())
    return {
        fields[0]: int(fields[1]) for fields in pairs if len(fields) == 2 and fields[1].isdigit()
    }


def _keyed_file(path: str) -> dict[str, int]:
    try:
        return _keyed(_read(path))
    except OSError:
        return {}


def _int_file(path: str) -> int | None:
    try:
        return int(_read(path))
    except (OSError, ValueError):
        return None


def _is_delegated(cgroup_dir: str) -> bool:
    """systemd marks a delegated cgroup with an xattr; where cgroupfs has no xattrs, the
    best sign left is that we may enable controllers in it."""
    xattrs_work = False
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(cgroup_dir, name) == b"1":
                return True
            xattrs_work = True
        except OSError as exc:
            xattrs_work |= exc.errno == errno.ENODATA
    subtree_control = os.path.join(cgroup_dir, "cgroup.subtree_control")
    return not xattrs_work and os.access(subtree_control, os.W_OK)


def _make_dirs(path: str) -> list[str]:
    """mkdir -p; the directories it made, outermost first."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
    return missing[::-1]


def _chain(top: str, base: str) -> list[str]:
    """The cgroup directories from ``top`` down to ``base`` (which is in it), both included."""
    parts = [part for part in os.path.relpath(base, top).split("/") if part not in ("", ".")]
    return [top] + [os.path.join(top, *parts[: i + 1]) for i in range(len(parts))]


def _enable_controllers(chain: list[str]) -> tuple[list[str], dict[str, str]]:
    """Enable memory, cpu, pids and io for job cgroups: in each cgroup of ``chain``, from the
    outermost one we may write down to the base, as far as each is offered (each may fail
    alone: a non-root cgroup with processes of its own refuses).  The controllers enabled in
    the base, and why each of the others is not."""
    why: dict[str, str] = {}
    for directory in chain:
        offered = _read(os.path.join(directory, "cgroup.controllers")).split()
        subtree_control = os.path.join(directory, "cgroup.subtree_control")
        on = _read(subtree_control).split()
        for name in _CONTROLLERS:
            if name in why or name in on:
                continue
            if name not in offered:
                why[name] = (
                    f"{directory} does not offer it (cgroup.controllers: "
                    f"{' '.join(offered) or 'none'})"
                )
                continue
            try:
                _write(subtree_control, f"+{name}")
            except OSError as exc:
                why[name] = f"cannot enable it in {subtree_control}: {exc.strerror}"
                log.info("cannot enable the %s controller in %s: %s", name, directory, exc.strerror)
    enabled = _read(os.path.join(chain[-1], "cgroup.subtree_control")).split()
    return enabled, {name: text for name, text in why.items() if name not in enabled}


def _make_v1_base(v1_base: str | None) -> tuple[str | None, str]:
    """The base of a controller's v1 twins, made; or None and why not."""
    if v1_base is None:
        return None, "no cgroup v1 hierarchy has it either"
    try:
        _make_dirs(v1_base)
    except OSError as exc:
        return None, f"cannot make {v1_base} (cgroup v1): {exc.strerror}"
    return v1_base, ""


def _job_dirs(base: str | None) -> list[str]:
    if base is None:
        return []
    try:
        with os.scandir(base) as entries:
            return [
                entry.path
                for entry in entries
                if entry.name.startswith(_JOB_PREFIX) and entry.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []


def _remove_tree(cgroup_dir: str) -> None:
    """rmdir a cgroup and the cgroups below it, innermost first.  One that still has
    processes stays, with a warning."""
    for path, _, _ in os.walk(cgroup_dir, topdown=False):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", path, exc.strerror)
            return
