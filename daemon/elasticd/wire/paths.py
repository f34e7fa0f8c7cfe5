"""Where elasticd's files live, and which directories can be trusted with them.

A stdlib-only leaf, like :mod:`elasticd.wire.protocol`: elasticctl imports it to find the
daemon's socket.
"""

from __future__ import annotations

import os
import stat

SOCKET_NAME = "control.sock"
SYSTEM_RUNTIME_DIR = "/run/elasticd"
SYSTEM_STATE_DIR = "/var/lib/elasticd"


def default_runtime_dir(uid: int | None = None) -> str:
    """Where a daemon started by ``uid`` keeps its socket when not told otherwise."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "elasticd") if xdg else f"/tmp/elasticd-{uid}"


def default_state_dir(uid: int | None = None) -> str:
    """Where a daemon started by ``uid`` keeps its history, logs and keys when not told."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return SYSTEM_STATE_DIR
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(xdg, "elasticd")


def default_socket_path() -> str:
    """The socket elasticctl talks to: $ELASTICD_SOCKET, else the caller's own daemon's
    socket if it exists, else the system daemon's."""
    env = os.environ.get("ELASTICD_SOCKET")
    if env:
        return env
    own_dir = default_runtime_dir()
    own = os.path.join(own_dir, SOCKET_NAME)
    system = os.path.join(SYSTEM_RUNTIME_DIR, SOCKET_NAME)
    if os.path.exists(own) and is_own_dir(own_dir):
        return own
    if os.path.exists(system) or (os.path.lexists(own_dir) and not is_own_dir(own_dir)):
        return system
    return own


def how_to_reach(socket_path: str, uid: int | None = None) -> str:
    """How ``uid``'s elasticctl reaches a daemon listening at ``socket_path``: "" when it finds
    it by itself (the default socket), else the option and the variable that point it there."""
    if os.path.normpath(socket_path) == os.path.join(default_runtime_dir(uid), SOCKET_NAME):
        return ""
    return f"elasticctl --socket {socket_path} (or ELASTICD_SOCKET={socket_path})"


REACH_ELSEWHERE = (
    "point elasticctl at another daemon with --socket PATH or ELASTICD_SOCKET=PATH "
    f"(a daemon started with --runtime-dir DIR listens at DIR/{SOCKET_NAME})"
)


def is_own_dir(path: str) -> bool:
    """A directory (not a link to one) of this process's user that nobody else can write.
    Anything else could be swapped under us: /tmp/elasticd-UID made first by another user, a
    log directory where a job plants a link for a root daemon to follow."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
