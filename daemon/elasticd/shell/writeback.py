"""Copies checkpoint files between the checkpoint tier and a job's own directory, run as the
job's user (``python -I -m elasticd.shell.writeback JSON``), so that a path the user names
is written and read with exactly the user's rights, never the daemon's.  Standard library
only.

The JSON names ``before``: files to delete first; ``copy``: ``[[source, destination], ...]``
(each written to a temporary name beside its destination, then renamed: a reader never sees
half a file); then ``remove``: directories or files to delete.  Exit 0, or 1 with the reason on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys


def copy(source: str, destination: str) -> None:
    directory = os.path.dirname(destination)
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, f".{os.path.basename(destination)}.partial-{os.getpid()}")
    try:
        with open(source, "rb") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 * 1024 * 1024)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(partial, destination)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def main(argv: list[str]) -> int:
    try:
        plan = json.loads(argv[1])
        for path in plan.get("before", ()):
            remove(path)
        for source, destination in plan.get("copy", ()):
            copy(source, destination)
        for path in plan.get("remove", ()):
            remove(path)
    except (OSError, ValueError, IndexError, TypeError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
