"""A worker started before it is needed (``submit --warm-restart``): run by path, never
imported, as ``python standby.py script PATH`` or ``python standby.py module NAME``.

It imports torch, the torch modules the script imports, and TorchDynamo (which torch imports
at the first call of a function it keeps out of compilation: FSDP2's first ``fully_shard``,
DCP, the optimizers; 0.5-0.8 s) unless the script sets a ``TORCH*`` variable itself (Dynamo
and Inductor read theirs when imported: a fresh worker would read what the script set), then
waits on
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

DYNAMO = "torch._dynamo"
TORCH_VARIABLES = ("TORCH", "PYTORCH")  # the prefixes of what torch's modules read


def torch_imports(path: str) -> list[str]:
    """The ``torch`` modules ``path`` imports, at its top level or in a function, then
    TorchDynamo unless the script sets torch's variables (none if unreadable): importing
    torch's own modules early changes nothing the script sees."""
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
    return wanted if sets_torch_variables(tree) else [*wanted, DYNAMO]


def sets_torch_variables(tree: ast.AST) -> bool:
    """Whether the script may set one of torch's environment variables: a ``TORCH*`` key,
    or one it computes, given to ``os.environ[...] =``, ``.setdefault``, ``.update``,
    ``|=`` or ``os.putenv``."""

    def environ(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    def torch_key(key: ast.expr | None) -> bool:
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return True  # computed: it may be
        return key.value.startswith(TORCH_VARIABLES)

    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign) and environ(node.target):  # os.environ |= {...}
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if environ(node.value) and torch_key(node.slice):
                return True
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id
            if name == "putenv" or (
                isinstance(func, ast.Attribute)
                and environ(func.value)
                and name in ("setdefault", "__setitem__")
            ):
                if torch_key(node.args[0] if node.args else None):
                    return True
            elif isinstance(func, ast.Attribute) and environ(func.value) and name == "update":
                keys: list[ast.expr | None] = [  # None: a ** of keys it does not show
                    ast.Constant(k.arg) if k.arg else None for k in node.keywords
                ]
                for arg in node.args:
                    keys += list(arg.keys) if isinstance(arg, ast.Dict) else [None]
                if any(torch_key(k) for k in keys):
                    return True
    return False


def main() -> None:
    kind, target = sys.argv[1], sys.argv[2]
    del sys.path[0]  # this file's directory: the script's own goes there below
    for name in torch_imports(target) if kind == "script" else ["torch", DYNAMO]:
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
    # what the imports set themselves goes too (TorchDynamo's import sets Inductor's cache
    # directory, which a fresh worker would not have yet; its children find the same one)
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
