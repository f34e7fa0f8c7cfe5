"""elasticd.elastic.runtime's group forming, on torch's real TCPStore and gloo."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import ROOT

AFTER_A_FAILED_INIT = textwrap.dedent("""
    import datetime, os, socket
    import torch.distributed as dist
    from elasticd.elastic.runtime import init_default_group
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]  # nobody listens there
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2",
                      TORCH_DIST_INIT_BARRIER="0")
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=0.2))
    except Exception:
        pass
    assert not dist.is_initialized()
    os.environ.update(RANK="0", WORLD_SIZE="1")
    init_default_group("gloo")
    print(dist.distributed_c10d._get_default_group().group_name)
""")


def test_a_group_formed_after_a_failed_init_has_the_name_its_peers_have():
    """A failed init left torch's counter at 1: the next default group was "1", and its peers'
    "0" (a 3-node in-place job hung in gloo's rendezvous after a forming was given up)."""
    run = subprocess.run([sys.executable, "-c", AFTER_A_FAILED_INIT], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0"
