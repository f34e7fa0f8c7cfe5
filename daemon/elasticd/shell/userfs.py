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
for _call in (_libc.setfsuid, _libc.setfsgid):
    _call.argtypes, _call.restype = [ctypes.c_uint32], ctypes.c_uint32
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int
# setgroups(2)'s number, for the 64-bit processes of the architectures this daemon is built for
_SETGROUPS = (
    {"x86_64": 116, "aarch64": 159}.get(platform.machine())
    if ctypes.sizeof(ctypes.c_void_p) == 8
    else None
)
_QUERY = 0xFFFFFFFF  # an id no call accepts: the calls answer the current one
_PR_GET_SECUREBITS = 27
_SECBIT_NO_SETUID_FIXUP = 1 << 2  # set: changing the fsuid keeps root's file capabilities

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
    if _libc.prctl(_PR_GET_SECUREBITS, 0, 0, 0, 0) & _SECBIT_NO_SETUID_FIXUP:
        raise PermissionError("SECBIT_NO_SETUID_FIXUP is set: a user's fsuid keeps root's rights")
    groups = os.getgroups()
    before_uid, before_gid = _libc.setfsuid(_QUERY), _libc.setfsgid(_QUERY)
    try:
        _set_groups([])
        _libc.setfsgid(gid)
        _libc.setfsuid(uid)
        if _libc.setfsuid(_QUERY) != uid or _libc.setfsgid(_QUERY) != gid:
            raise PermissionError(f"could not take the file system rights of uid {uid}")
        yield
    finally:
        _libc.setfsuid(before_uid)
        _libc.setfsgid(before_gid)
        _set_groups(groups)
        if _libc.setfsuid(_QUERY) != before_uid or os.getgroups() != groups:
            os.abort()  # a thread left with a user's rights would make root's files theirs


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
