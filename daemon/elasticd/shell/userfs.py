"""File system calls with a user's rights, on the calling thread alone.

A job's checkpoint directory is its user's: they may rename anything in it, and put a
symlink where the daemon expects a directory or a file.  A root daemon that followed such
a path would write a root-owned file of the job's bytes anywhere (a copy landing in
``/etc/cron.d``), delete anything, or hand the job any file on the host.  So the daemon
makes every call on paths inside a job's directory with the job's user's file system
identity: ``setfsuid(2)`` and ``setfsgid(2)`` to theirs and no supplementary groups, for
the calling thread only (the kernel keeps these per thread; glibc's ``setgroups`` would
change every thread's, so the system call is made directly).  The kernel then lets the
daemon do there what the user could, wherever a path leads, and no more.

``rights_of`` wraps synchronous code only: an ``await`` inside it would lend the thread's
identity to whatever task runs next on the loop.  Work in another thread (``to_thread``)
takes the rights inside that thread (``with_rights_of``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

_libc = ctypes.CDLL(None, use_errno=True)  # the libc this process runs with
_libc.setfsuid.restype = ctypes.c_int
_libc.setfsgid.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long
# setgroups(2)'s number, for the architectures this daemon is built for
_SETGROUPS = {"x86_64": 116, "aarch64": 159}.get(platform.machine())
_QUERY = ctypes.c_uint(0xFFFFFFFF).value  # an id no call accepts: answers the current one

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def rights_of(uid: int, gid: int) -> Iterator[None]:
    """This thread's file system calls have the rights of ``uid``/``gid`` (and no
    supplementary group) inside; root's again after.  Nothing changes where the daemon is
    not root (it is the job's user then) or the job is root's."""
    if os.geteuid() != 0 or uid == 0:
        yield
        return
    groups = os.getgroups()
    _set_groups([])
    try:
        before_gid = _libc.setfsgid(gid)
        before_uid = _libc.setfsuid(uid)
        try:
            if _libc.setfsuid(_QUERY) != uid or _libc.setfsgid(_QUERY) != gid:
                raise PermissionError(f"could not take the file system rights of uid {uid}")
            yield
        finally:
            _libc.setfsuid(before_uid)
            _libc.setfsgid(before_gid)
    finally:
        _set_groups(groups)


def with_rights_of(uid: int, gid: int, call: Callable[P, R]) -> Callable[P, R]:
    """``call`` made with ``rights_of(uid, gid)`` in whatever thread runs it."""

    @functools.wraps(call)
    def made(*args: P.args, **kwargs: P.kwargs) -> R:
        with rights_of(uid, gid):
            return call(*args, **kwargs)

    return made


def _set_groups(groups: list[int]) -> None:
    """This thread's supplementary groups (setgroups(2) itself: only this thread's)."""
    if not groups and not os.getgroups():
        return
    if _SETGROUPS is None:
        raise PermissionError(
            f"cannot change one thread's groups on {platform.machine()}: the daemon runs "
            "without supplementary groups there (systemd's SupplementaryGroups= unset)"
        )
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _libc.syscall(_SETGROUPS, len(groups), array) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setgroups: {os.strerror(errno)}")
