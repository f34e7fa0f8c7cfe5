"""The CLI must start fast: importing it pulls in neither torch nor the daemon (docs/architecture.md, "The rules"):
of elasticd, only the stdlib-only modules in ``elasticd/wire/``."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import elasticctl.cli
daemon_modules = sorted(m for m in sys.modules
                        if m.startswith("elasticd.")
                        and m != "elasticd.wire" and not m.startswith("elasticd.wire."))
assert "elasticd.wire.protocol" in sys.modules, "elasticctl no longer imports the protocol from wire/"
assert "torch" not in sys.modules, "elasticctl imported torch"
assert not daemon_modules, f"elasticctl imported daemon modules: {daemon_modules}"
"""


def test_cli_imports_no_torch_and_only_the_wire():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "elasticctl.cli" in imported
    assert not [name for name in imported if name.split(".")[0] == "torch"]
