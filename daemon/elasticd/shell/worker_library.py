"""The library that training scripts import (``elasticd.elastic``), laid out for workers.

A worker's Python may lack every daemon dependency (zmq, cryptography ...), so workers do not
get the daemon's own site-packages: the daemon copies just ``elasticd/elastic`` (torch and the
standard library only) under ``<runtime dir>/python`` at start and puts that directory first
on each worker's PYTHONPATH.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

_INIT = '"""elasticd, as a worker sees it: only the elastic package."""\n'


def install(runtime_dir: str) -> str:
    """Copy the package under ``runtime_dir``; the directory to put on PYTHONPATH."""
    root = os.path.join(runtime_dir, "python")
    package = os.path.join(root, "elasticd")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(package, mode=0o755)
    os.chmod(root, 0o755)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(_INIT)
    daemon = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # elasticd/, above shell/
    source = os.path.join(daemon, "elastic")  # not imported: torch
    target = os.path.join(package, "elastic")
    os.makedirs(target, mode=0o755)
    for name in sorted(os.listdir(source)):
        if name.endswith(".py"):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
            os.chmod(os.path.join(target, name), 0o644)
    return root


def python_path(library: str, env: Mapping[str, str]) -> str:
    """PYTHONPATH for a worker: the library first, then what the submitter had."""
    return os.pathsep.join(p for p in (library, env.get("PYTHONPATH", "")) if p)
