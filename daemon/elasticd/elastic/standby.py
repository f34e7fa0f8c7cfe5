"""A worker started before it is needed (``submit --warm-restart``): run by path, never
imported, as ``python standby.py script PATH`` or ``python standby.py module NAME``.

It imports torch, the torch modules the script imports, and TorchDynamo (which torch imports
at the first call of a function it keeps out of compilation: FSDP2's first ``fully_shard``,
DCP, the optimizers; 0.5-0.8 s), then waits on
stdin for the daemon's one line: ``{"env": {...}, "argv": [...]}``, the environment and the
``sys.argv`` a worker of the restarted group gets.  It then becomes that worker: stdin
reads /dev/null, the environment is replaced, and the script runs as ``__main__`` (what
``python PATH`` or ``python -m NAME`` would run).  End of file on stdin (the daemon let it
go) ends it.

The daemon starts it with the environment of the job's workers less the variables that
name a worker's place (RANK, WORLD_SIZE, MASTER_PORT ...), and uses it only when the
restarted worker's environment differs from that in those variables alone: what the
interpreter and torch read at start (PYTHONPATH, OMP_NUM_THREADS, LD_PRELOAD ...) is what
a worker started then would have read.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import runpy
import sys


def torch_imports(path: str) -> list[str]:
    """The ``torch`` modules ``path`` imports, at its top level or in a function (none if
    unreadable): importing torch's own modules early changes nothing the script sees."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    names = ["torch"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    wanted = [n for n in dict.fromkeys(names) if n == "torch" or n.startswith("torch.")]
    return [*wanted, "torch._dynamo"]


def main() -> None:
    kind, target = sys.argv[1], sys.argv[2]
    del sys.path[0]  # this file's directory: the script's own goes there below
    for name in torch_imports(target) if kind == "script" else ["torch", "torch._dynamo"]:
        try:
            importlib.import_module(name)
        except Exception:  # the script will say so itself, as a fresh worker would
            pass
    line = sys.stdin.buffer.readline()
    if not line:
        return
    order = json.loads(line)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = list(order["argv"])
    if kind == "module":
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
