"""What runs as root is root's: whether a program that the daemon runs (the discovery script,
nvidia-smi, nft) could have been changed by anyone but root.  A stdlib-only leaf.

A program is root's alone when the file, every directory above it, every symlink on the way
(each link followed, its target checked the same way) and, for a ``#!`` script, its
interpreter (and the program ``/usr/bin/env NAME`` would run) are owned by root (or by the
daemon's own user, when that is not root) and writable by nobody else: not by their group,
not by everyone.  One exception, as the kernel's sticky bit makes it safe: a directory of
root's that everyone may write but that is sticky (``/tmp``), since nobody but root may
then rename or remove the root-owned entries in it (the next step must still be root's).

Anything less would let that someone run their code as root: replace the file, rename a
directory above it, or re-point a link.  Checked at start-up and again before every run.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat

_MAX_LINKS = 40  # as the kernel's own limit on symlinks in one lookup
_MAX_NESTING = 4  # #! interpreters that are scripts themselves (the kernel allows 4)
_SHEBANG = 256  # bytes of a script's first line that the kernel reads (BINPRM_BUF_SIZE)


class Untrusted(Exception):
    """A program that someone other than root (or the daemon's user) could change."""


def owners(uid: int | None = None) -> frozenset[int]:
    """Who may own what the daemon runs: root, and the daemon's own user."""
    return frozenset({0, os.getuid() if uid is None else uid})


def check_program(path: str, allowed: frozenset[int] | None = None) -> None:
    """Untrusted, naming the path and why, unless ``path`` and what it runs are root's alone."""
    allowed = owners() if allowed is None else allowed
    _check(path, allowed, _MAX_NESTING)


def which(name: str, path: str | None = None) -> str | None:
    """``shutil.which`` on the absolute entries of PATH (a relative one, such as ``.``, would
    make the answer depend on the working directory)."""
    entries = (os.environ.get("PATH", os.defpath) if path is None else path).split(os.pathsep)
    absolute = os.pathsep.join(e for e in entries if os.path.isabs(e))
    return shutil.which(name, path=absolute) if absolute else None


def _check(path: str, allowed: frozenset[int], nesting: int) -> None:
    problem = loose_step(path, allowed)
    if problem:
        raise Untrusted(f"{path} is not root's alone: {problem}")
    interpreter = _interpreter(path)
    if interpreter is None:
        return
    if nesting <= 0:
        raise Untrusted(f"{path}: too many nested #! interpreters")
    for program in interpreter:
        _check(program, allowed, nesting - 1)


def loose_step(path: str, allowed: frozenset[int]) -> str | None:
    """The first step of ``path`` (from ``/``, symlinks followed) that someone else could
    change, and how; None when there is none."""
    if not os.path.isabs(path):
        return "not an absolute path"
    todo = [part for part in reversed(path.split("/")) if part]
    here, links = "/", 0
    problem = loose_entry("/", allowed)
    while problem is None and todo:
        name = todo.pop()
        if name in (".", ".."):
            here = here if name == "." else os.path.dirname(here)  # ``here`` has no links
            continue
        step = os.path.join(here, name)
        problem = loose_entry(step, allowed)
        if problem is None and os.path.islink(step):
            links += 1
            if links > _MAX_LINKS:
                return f"more than {_MAX_LINKS} symlinks"
            target = os.readlink(step)
            here = "/" if target.startswith("/") else here
            todo.extend(part for part in reversed(target.split("/")) if part)
        elif problem is None:
            here = step
    return problem


def loose_entry(path: str, allowed: frozenset[int]) -> str | None:
    """Why someone else could change this one file, directory or link; None if nobody."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if info.st_uid not in allowed:
        return f"{path} belongs to {_user(info.st_uid)}"
    if stat.S_ISLNK(info.st_mode):  # a link's own mode means nothing
        return None
    sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX and info.st_uid == 0
    if info.st_mode & 0o002 and not sticky:
        return f"{path} is writable by everyone"
    if info.st_mode & 0o020 and not sticky:
        return f"{path} is writable by its group"
    return None


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _interpreter(path: str) -> list[str] | None:
    """What a ``#!`` script's first line runs: the interpreter, and the program that
    ``env`` runs; None for a program that is not a script."""
    try:
        with open(path, "rb") as file:
            head = file.read(_SHEBANG)
    except OSError as exc:
        raise Untrusted(f"{path}: {exc.strerror}") from None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip()
    interpreter, _, argument = line.partition(" ")
    if not os.path.isabs(interpreter):
        raise Untrusted(f"{path}: its #! interpreter {interpreter!r} is not an absolute path")
    if os.path.basename(interpreter) != "env":
        return [interpreter]
    return [interpreter, _env_program(path, argument)]


def _env_program(path: str, argument: str) -> str:
    """The program ``#!/usr/bin/env [-S] [VAR=value ...] NAME`` runs, found as env finds it."""
    words = [w for w in argument.split() if w != "-S" and "=" not in w]
    if not words or words[0].startswith("-"):
        raise Untrusted(f"{path}: cannot tell which program its '#!{argument}' runs")
    name = words[0]
    found = name if "/" in name else which(name)
    if found is None:
        raise Untrusted(f"{path}: its #! program {name!r} is not on PATH")
    return found
