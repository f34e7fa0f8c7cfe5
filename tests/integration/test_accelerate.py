"""Hugging Face accelerate, the real framework (accelerate 1.15.0, pinned by
packaging/venv.sh), under elasticd: examples/accelerate_train.py, written as accelerate's
docs write a script (``Accelerator(cpu=True)``, ``prepare``, ``save_state``/``load_state``).

- under elasticrun it ends as under torchrun, the same command line word for word, with the
  same parameters (the script prints a checksum of them);
- in an ``--in-place`` job, through ``elasticd.elastic.accelerate.elastic_accelerator``,
  every round's ``Accelerator`` sees that round's world: a worker SIGKILLed leaves its
  survivor training alone (world 1), and the replacement brings it back to 2;
- on three daemons, ``--nnodes 2:3``, a node SIGKILLed mid-training: the job re-forms on two,
  resumes from the newest ``save_state`` and succeeds.

Skipped, with the reason, where accelerate is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import CLIENT_ENV, ROOT, beside_torchrun
from store_attack import Cluster, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None,
        reason="accelerate is not installed (packaging/venv.sh installs accelerate==1.15.0)",
    ),
]

SCRIPT = str(ROOT / "examples" / "accelerate_train.py")
TIMEOUT = 600.0  # a loaded 2-core machine: each worker imports torch and accelerate
FINAL = re.compile(r"final step (\d+) checksum ([0-9a-f]+)")
START = re.compile(r"start step (\d+) world (\d+) accelerate (\d+)")


def final(text: str) -> tuple[int, str]:
    found = FINAL.findall(text)
    assert len(found) == 1, text[-3000:]
    return int(found[0][0]), found[0][1]


def starts(text: str) -> list[tuple[int, int, int]]:
    """(step, world, accelerate's num_processes) of every round's start, in order."""
    return [(int(s), int(w), int(n)) for s, w, n in START.findall(text)]


def test_a_script_runs_unchanged_and_ends_as_under_torchrun(daemon: Any, shared_tmp: Path) -> None:
    """The same command line, word for word, to torch's torchrun and to elasticrun (which
    submits it to the daemon and prints the workers' output as torchrun does)."""
    argv = ["--standalone", "--nproc-per-node", "2", SCRIPT, "--max-steps", "12", "--every", "4"]
    ours, theirs = beside_torchrun(daemon, shared_tmp, argv, CLIENT_ENV, TIMEOUT)
    assert final(ours) == final(theirs) and final(ours)[0] == 12, (ours, theirs)
    for launcher in (
        "ckpt-elasticd",
        "ckpt-torchrun",
    ):  # not "elasticd": python -m elasticctl, run there, would import it
        assert (shared_tmp / launcher / "latest").read_text().endswith("step_12")


def test_in_place_every_round_has_an_accelerator_of_its_world(daemon: Any) -> None:
    """A worker SIGKILLed: its survivor re-forms alone (world 1) while the replacement warms
    up, then the two re-form (world 2); each round's Accelerator must say the round's size.
    The job trains until cancelled: a warm-up on a loaded machine has no bound to outlast."""
    job = daemon.submit(
        "--in-place",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        SCRIPT,
        "--",
        "--in-place",
        "--max-steps",
        "1000000",
        "--every",
        "5",
        "--step-seconds",
        "0.05",
    )["id"]
    doc = daemon.wait_running(job, 2, TIMEOUT)
    daemon.wait_output(job, ["start step 0 world 2 accelerate 2"], TIMEOUT)
    pid = next(w["pid"] for w in doc["workers"] if w["rank"] == 1)
    subprocess.run(["kill", "-KILL", str(pid)], check=True)

    def back_to_two() -> list[tuple[int, int, int]] | None:
        rounds = starts(daemon.ctl_run("logs", job).stdout)
        worlds = [world for _, world, _ in rounds]
        return rounds if 1 in worlds and 2 in worlds[worlds.index(1) :] else None

    rounds = wait_for(back_to_two, TIMEOUT, "a round of 1, then of 2 again", interval=2.0)
    assert rounds[0][1] == 2 and all(world == seen for _, world, seen in rounds), rounds
    assert daemon.ctl("status", job)["restarts"] == 1
    assert daemon.ctl("cancel", job)["state"] == "CANCELLED"


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="accelerate")
    for role in ("a", "b", "c"):
        cluster.add(role)
    return cluster.start()


def test_a_node_loss_resumes_from_the_newest_state_and_succeeds(
    cluster: Cluster, shared_tmp: Path
) -> None:
    a = cluster[0]
    ckpt = shared_tmp / "ckpt"
    job = a.submit(
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--last-call-timeout",
        "1",
        SCRIPT,
        "--",
        "--ckpt-dir",
        str(ckpt),
        "--max-steps",
        "25",
        "--every",
        "5",
        "--step-seconds",
        "0.25",
    )["id"]
    doc = a.wait_running(job, 3, TIMEOUT)
    a.wait_output(job, ["start step 0 world 3 accelerate 3"], TIMEOUT)
    wait_for(lambda: (ckpt / "latest").is_file(), TIMEOUT, "a saved state")
    rank_of = {w["node"]: w["rank"] for w in doc["workers"]}
    victim = max(
        (d for d in cluster.daemons[1:] if rank_of[d.name] != 0), key=lambda d: rank_of[d.name]
    )
    victim.signal(signal.SIGKILL)
    victim.wait_exit(30)
    end = a.wait_job(job, lambda d: d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), TIMEOUT)
    assert end["state"] == "SUCCEEDED", end
    logs = a.ctl_run("logs", job).stdout
    resumed = [step for step, world, seen in starts(logs) if world == 2 and seen == 2]
    assert resumed and resumed[0] > 0 and resumed[0] % 5 == 0, logs[-4000:]
    assert final(logs)[0] == 25 and end["restarts"] == 0, end
