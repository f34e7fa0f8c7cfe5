"""An --in-place job whose script never calls elasticd.elastic.run.
Its replacement workers, started without a rank, die while warming up; that loop left and
rejoined the node 360 times in 3.7 minutes, spending no restart, with the job shown RUNNING.
Now each warm-up failure spends a restart and the job fails saying what the script lacks."""

from __future__ import annotations

import os
import signal

_PLAIN = """
import os, sys, time
print("rank", os.environ["RANK"], flush=True)  # env:// as torch.distributed reads it
time.sleep(600)
"""


def test_a_plain_script_submitted_in_place_fails_once_its_restarts_are_spent_naming_elastic_run(
    daemon, shared_tmp
):
    path = shared_tmp / "plain.py"
    path.write_text(_PLAIN)
    job = daemon.submit("--in-place", "--nproc-per-node", "2", "--max-restarts", "1", str(path))
    running = daemon.wait_job(
        job["id"], lambda j: sum(w["state"] == "HEALTHY" for w in j["workers"]) == 2
    )
    victim = next(w["pid"] for w in running["workers"] if w["local_rank"] == 1)
    os.kill(victim, signal.SIGKILL)
    ended = daemon.wait_job(job["id"], lambda j: j["state"] in ("FAILED", "SUCCEEDED", "CANCELLED"))
    assert ended["state"] == "FAILED", ended
    assert "must call elasticd.elastic.run" in ended["error"]["message"], ended["error"]
    assert ended["exit_code"] == 1
