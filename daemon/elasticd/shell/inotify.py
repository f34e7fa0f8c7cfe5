"""Linux inotify on the event loop (ctypes; the standard library has none): what appears
in a directory is awaited, never polled."""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_DONT_FOLLOW = 0x02000000  # a watched path that is a symlink is not followed
IN_ONLYDIR = 0x01000000  # a watched path must be a directory
IN_ISDIR = 0x40000000
IN_IGNORED = 0x00008000
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len

_libc = ctypes.CDLL(None, use_errno=True)  # the libc this process runs with
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


@dataclass(frozen=True)
class Change:
    directory: str  # the watched directory
    name: str  # the entry in it ("" for the directory itself)
    mask: int

    @property
    def is_dir(self) -> bool:
        return bool(self.mask & IN_ISDIR)


class Watcher:
    """Watches directories; calls ``on_change`` on the event loop for each change (an
    overflow of the kernel's queue is one Change with ``mask`` IN_Q_OVERFLOW: rescan)."""

    def __init__(self, on_change: Callable[[Change], None]) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._fd = fd
        self._on_change = on_change
        self._dirs: dict[int, str] = {}
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._read)

    def watch(self, directory: str, mask: int) -> None:
        wd = _libc.inotify_add_watch(self._fd, os.fsencode(directory), mask)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        self._dirs[wd] = directory

    def watching(self, under: str) -> int:
        """How many directories under ``under`` (itself included) are watched now."""
        prefix = under.rstrip("/") + "/"
        return sum(1 for path in self._dirs.values() if path == under or path.startswith(prefix))

    def unwatch(self, directory: str) -> None:
        for wd, path in list(self._dirs.items()):
            if path == directory:
                del self._dirs[wd]
                _libc.inotify_rm_watch(self._fd, wd)

    def _read(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size : offset + _HEADER.size + length]
            offset += _HEADER.size + length
            name = os.fsdecode(raw.split(b"\0", 1)[0])
            if mask & IN_Q_OVERFLOW:
                self._on_change(Change("", "", mask))
                continue
            directory = self._dirs.get(wd)
            if mask & IN_IGNORED:
                self._dirs.pop(wd, None)
                continue
            if directory is not None:
                self._on_change(Change(directory, name, mask))

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._dirs.clear()
