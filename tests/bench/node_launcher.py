"""Run a node's program (elasticd or torchrun) once Python and torch are loaded, writing
when that was to ``<dir>/up-<pid>``.

    python node_launcher.py DIR MODULE [ARGS...]   # as ``python -m MODULE ARGS...``

bench_recovery.py's scale-up figure starts there as well as at the process start, so that
the control plane is not charged for the ~1.3 s import of torch that both programs begin
with on this machine.
"""

import os
import runpy
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: F401  (both programs import it first thing)


def main() -> None:
    directory, module, *argv = sys.argv[1:]
    with open(os.path.join(directory, f"up-{os.getpid()}"), "w") as f:
        f.write(repr(time.time()))
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
