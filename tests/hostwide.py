"""What the tests take from the host as a whole, handed out so that tests running at once
never share it: those of one run (pytest-xdist runs several at once) and those of another
run on this host (another checkout's suite).  Uses no elasticd code (tests/fixtures/etcd.py
takes its ports here too).

- ``free_port()``: a TCP port that no other test was handed out lately.  Ports are handed
  out in turn from a range below the kernel's ephemeral ports (so that no connection is
  given one as its local port), by a cursor that every test process of this user shares: a
  file under /tmp, advanced under an exclusive lock.  A port comes back only after all the
  others of the range (about 12,000) were handed out, long after the test that had it
  ended; and it must bind when it is handed out (something else may listen there).
- ``host_lock(name)``: an exclusive lock shared by every test process on the host, for
  what must not be done twice at once (``useradd``, a cache made once and kept).
- ``made_once(path, make)``: a directory kept between runs, made by one process only.
- ``run_tag()``: a short random tag of this test process, for names.
- ``remove_tree(path)``: a test's directory removed, with what is mounted below it (a
  SIGKILLed daemon leaves its jobs' checkpoint tmpfs mounted: only its next start on the
  same directory unmounts them, and a test never starts it again).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

# What elasticd and torch listen on by default (store, peer, torchrun, etcd): a daemon that
# runs on this host outside the tests, or a test that wants the default, may hold them.
DEFAULTS = frozenset({2379, 2380, 9464, 29400, 29401, 29500})
_SPAN = 12000  # how many ports below the ephemeral range take turns
_TAG = uuid.uuid4().hex[:6]


def run_tag() -> str:
    return _TAG


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(port: int) -> bool:
    """Whether ``port`` is free on every address (a wildcard bind conflicts with any)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked_file(path: str) -> Iterator[int]:
    """``path`` (made 0600 if missing, never through a link) open and exclusively locked."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # and with it the lock


def free_port(count: int = 1) -> int:
    """A TCP port, free now, that no other test on this host was handed out lately; with
    ``count``, the first of that many consecutive ones (``--master-port P`` in place uses P
    and P + 1)."""
    top = _ephemeral_start()
    low = max(1024, top - _SPAN)
    span = top - low - count + 1
    with _locked_file(f"/tmp/elasticd-test-ports-{os.getuid()}") as fd:
        cursor = 0
        with contextlib.suppress(ValueError):
            cursor = int(os.pread(fd, 32, 0) or b"0")
        for step in range(1, span + 1):
            port = low + (cursor + step) % span
            run = range(port, port + count)
            if not set(run) & DEFAULTS and all(_binds(each) for each in run):
                break
        else:
            raise RuntimeError(f"no {count} free ports in {low}..{top - 1}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(port + count - 1 - low).encode(), 0)
        return port


@contextlib.contextmanager
def host_lock(name: str) -> Iterator[None]:
    """Hold the host-wide lock ``name`` (of this user's test processes) for the block."""
    with _locked_file(f"/tmp/elasticd-test-{name}-{os.getuid()}.lock"):
        yield


def made_once(path: Path, make: Callable[[Path], None]) -> Path:
    """``path``, made by ``make(path)`` unless a complete one is there: one process makes
    it while any other that wants it waits; one that failed half-way is made anew."""
    done = path / ".complete"
    if done.exists():
        return path
    with host_lock(path.name):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path


_MNT_DETACH = 2


def remove_tree(path: str | os.PathLike[str]) -> None:
    """``path`` and everything below it gone: the mounts below it detached first (deepest
    first), then the files removed.  Errors are ignored, as ``shutil.rmtree``'s are."""
    top = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4].replace("\\040", " ") for line in f]
    except OSError:
        points = []
    below = sorted((p for p in points if p.startswith(top + "/")), key=len, reverse=True)
    if below:
        libc = ctypes.CDLL(None, use_errno=True)
        for point in below:
            libc.umount2(os.fsencode(point), _MNT_DETACH)
    shutil.rmtree(top, ignore_errors=True)
