"""The worker library (elasticd.elastic, as laid out for workers) imports with torch and the
standard library alone: its framework integrations (lightning.py, accelerate.py) are
imported only by the scripts that use them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elasticd.shell import worker_library

HIDE = (
    "import sys\nfor name in ('lightning', 'lightning_fabric', 'pytorch_lightning', 'accelerate'):\n"
    "    sys.modules[name] = None  # an import of it raises ImportError\n"
)


def run(library: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", HIDE + code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": library},
    )


def test_the_worker_library_imports_without_the_frameworks(tmp_path: Path) -> None:
    library = worker_library.install(str(tmp_path))
    shipped = sorted(os.listdir(os.path.join(library, "elasticd", "elastic")))
    assert "lightning.py" in shipped and "accelerate.py" in shipped, shipped
    done = run(library, "import elasticd.elastic as e\nprint(e.__file__, e.run.__name__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(library), done.stdout
    for module, needs in (("lightning", "needs Lightning"), ("accelerate", "needs accelerate")):
        done = run(library, f"import elasticd.elastic.{module}")
        assert (
            done.returncode == 1
            and f"ImportError: elasticd.elastic.{module} {needs}" in done.stderr
        ), done.stderr
