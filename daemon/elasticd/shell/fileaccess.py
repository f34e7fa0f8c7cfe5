"""Who may read a job's files on disk: what ``elasticctl logs`` allows, no more.

A job's directories and files under ``<state dir>/logs/<job>/`` are root's (a job that owned
its output could write past ``output.max_bytes``), readable by the job's user and by the
admin group (``control.admin_group``) through a POSIX access ACL, and by nobody else: not the
user's primary group, which other users may share, and not other users.  The ACL is written
as the kernel's ``system.posix_acl_access`` value (``include/uapi/linux/posix_acl_xattr.h``:
a version word, then ``(tag, perm, id)`` entries sorted by tag and id), so no library is
needed.  Where the file system takes no ACL, files stay ``0600`` and directories ``0711``
(the worker still reaches its error file by name): the user then reads through ``elasticctl
logs``, and the daemon says so once.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF  # ACL_UNDEFINED_ID: the entries that name no user or group
_R, _W, _X = 4, 2, 1

FILE_MODE = 0o600  # what a file is created with, and stays without an ACL
DIR_MODE = 0o700  # what a directory is created with
DIR_FALLBACK = 0o711  # a directory without an ACL: the worker passes, nobody lists it
_ATTEMPT = re.compile(r"^attempt_\d+$")


@dataclass(frozen=True)
class Readers:
    """Who may read a job's files besides root: its user and the admin group (None: there
    is none on this host)."""

    uid: int
    admin_gid: int | None = None


def acl_value(readers: Readers, *, directory: bool) -> bytes:
    """The ``system.posix_acl_access`` value that gives ``readers`` read access (and search,
    for a directory), root read and write, and nobody else anything."""
    read = _R | _X if directory else _R
    entries = [(_USER_OBJ, _R | _W | (_X if directory else 0), _NO_ID)]
    if readers.uid != 0:
        entries.append((_USER, read, readers.uid))
    entries.append((_GROUP_OBJ, 0, _NO_ID))
    if readers.admin_gid is not None:
        entries.append((_GROUP, read, readers.admin_gid))
    entries += [(_MASK, read, _NO_ID), (_OTHER, 0, _NO_ID)]
    return struct.pack("<I", _VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)


class FileAccess:
    """Gives a job's files and directories to their readers (see the module's docstring).
    One per daemon: it says once that the file system refuses ACLs (once per other reason)."""

    def __init__(self, admin_group: str = "") -> None:
        self._admin_group = admin_group
        self._said: set[int | None] = set()  # errnos of the refusals logged

    def readers(self, uid: int) -> Readers | None:
        """The job's readers now (the admin group may have been made since); None when the
        daemon is not root (it and its one user own everything)."""
        if os.getuid() != 0:
            return None
        try:
            admin_gid = grp.getgrnam(self._admin_group).gr_gid if self._admin_group else None
        except KeyError:
            admin_gid = None
        return Readers(uid, admin_gid)

    def grant_file(self, fd: int, readers: Readers | None) -> None:
        """A file created ``FILE_MODE`` becomes readable by ``readers`` (or stays root's)."""
        if readers is not None:
            self._set_acl(fd, acl_value(readers, directory=False))

    def grant_dir(self, path: str, readers: Readers | None) -> None:
        """A directory of ours becomes searchable by ``readers`` (without an ACL: by anyone
        who knows a name in it, listable by nobody)."""
        if readers is not None and not self._set_acl(path, acl_value(readers, directory=True)):
            os.chmod(path, DIR_FALLBACK, follow_symlinks=False)

    def _set_acl(self, target: int | str, value: bytes) -> bool:
        try:
            if isinstance(target, str):
                os.setxattr(target, XATTR, value, follow_symlinks=False)
            else:
                os.setxattr(target, XATTR, value)
            return True
        except OSError as exc:
            self._refused(exc)
            return False

    def _refused(self, exc: OSError) -> None:
        """Said once for each reason: a file system without ACLs refuses every one."""
        if exc.errno in self._said:
            return
        self._said.add(exc.errno)
        if exc.errno == errno.EOPNOTSUPP:
            log.warning(
                "the log directory's file system takes no POSIX ACL: jobs' output and "
                "error files are root's alone (0600, directories 0711); their users read "
                "them with elasticctl logs and status"
            )
        else:
            log.warning(
                "a job's file could not be given its ACL (%s): it stays root's alone "
                "(0600, a directory 0711); its user reads it with elasticctl logs",
                exc.strerror or exc,
            )


def restrict_earlier(root: str) -> int:
    """Files in ``<root>/<job>/attempt_<n>/`` that an earlier elasticd left readable by the
    job's group (``0640``, no ACL) become their owner's alone (``0600``); how many.  Run at
    start: what it finds is what was there before this version, until retention deletes it."""
    changed = 0
    for job in _entries(root):
        if not job.is_dir(follow_symlinks=False):
            continue
        for attempt in _entries(job.path):
            if _ATTEMPT.match(attempt.name) and attempt.is_dir(follow_symlinks=False):
                changed += sum(_restrict(entry) for entry in _entries(attempt.path))
    return changed


def _restrict(entry: os.DirEntry[str]) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or not info.st_mode & 0o077 or _has_acl(entry.path):
            return False
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.fchmod(fd, FILE_MODE)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _has_acl(path: str) -> bool:
    try:
        os.getxattr(path, XATTR, follow_symlinks=False)
        return True
    except OSError as exc:
        return exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP)


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []
