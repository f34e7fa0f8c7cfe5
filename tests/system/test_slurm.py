"""elasticrun under Slurm, for real (docs/slurm.md): a 3-node ``sbatch`` whose ``srun
elasticrun --nnodes 2:3 ...`` trains with nothing of elasticd installed but the package,
as a user who is not root; one node's task is SIGKILLed mid-training and the job goes on at 2
and ends 0 there.  The line leaves the endpoint, the rendezvous id and the key to Slurm
(the step's first node, the job id, a key that the step's task 0 makes in the user's home).

The cluster is Debian's slurm-wlm on three network-namespace test hosts (slurm.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import netns
import psutil
import pytest
import slurm
from harness import python_for_everyone
from launched import Lines
from user_nodes import TRAIN, Account, host_names, left_behind, on_host, user_made

pytestmark = [pytest.mark.root, pytest.mark.slow]

REPORT: list[str] = []
BATCH = """\
#!/bin/bash
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
# examples/slurm/elasticrun.sbatch's line, each task's status said after it
srun --label --kill-on-bad-exit=0 bash -c \\
  'elasticrun --nnodes 2:3 --nproc-per-node 1 {train} --steps 40 --step-seconds 0.25;
   echo "task $SLURM_PROCID exit $?"' > {fifo} 2>&1
echo "srun exit $?" > {fifo}
"""


@pytest.fixture(scope="module")
def subnet() -> Iterator[netns.Subnet]:
    why = netns.usable() or slurm.usable()
    if why:
        if os.environ.get("CI") and slurm.usable():
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    claimed = netns.Subnet.claim()
    yield claimed
    claimed.release()


@pytest.fixture
def cluster(
    subnet: netns.Subnet, shared_tmp: Path, request: pytest.FixtureRequest
) -> slurm.SlurmCluster:
    hosts = subnet.hosts(3)
    request.addfinalizer(hosts.down)
    hosts.up()
    request.addfinalizer(host_names(hosts))
    made = slurm.SlurmCluster(hosts, shared_tmp, f"erun{uuid.uuid4().hex[:6]}")
    request.addfinalizer(made.stop)
    return made.start()


@pytest.fixture
def user(shared_tmp: Path) -> Iterator[Account]:
    with user_made(shared_tmp) as account:
        yield account


def elasticrun_command(user: Account) -> Path:
    """``elasticrun`` on the user's PATH, as the package installs it."""
    bin_dir = user.home / "bin"
    bin_dir.mkdir()
    script = bin_dir / "elasticrun"
    script.write_text(
        f"#!{python_for_everyone()}/bin/python3\nimport sys\n"
        "from elasticctl.cli import elasticrun\nsys.exit(elasticrun())\n"
    )
    script.chmod(0o755)
    return bin_dir


def task_of(user: Account, netns_name: str) -> psutil.Process:
    """The user's elasticrun on one test host."""
    inode = os.stat(f"/run/netns/{netns_name}").st_ino
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if (
                proc.info["uids"].real == user.uid
                and any(arg.endswith("bin/elasticrun") for arg in proc.info["cmdline"] or ())
                and os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inode
            ):
                return proc
        except (psutil.NoSuchProcess, OSError):
            continue
    raise AssertionError(f"no elasticrun of {user.name} on {netns_name}")


def test_a_node_of_an_sbatch_job_killed_the_job_goes_on_and_ends_0(cluster, user):
    bin_dir = elasticrun_command(user)
    fifo = user.home / "output"
    os.mkfifo(fifo, 0o600)
    os.chown(fifo, user.uid, user.gid)
    reading = os.open(fifo, os.O_RDWR)  # never an end of file: the lines are waited for
    output = Lines(os.fdopen(reading, "rb"))
    script = user.home / "job.sbatch"
    script.write_text(BATCH.format(train=TRAIN, fifo=fifo))
    for path in (bin_dir, bin_dir / "elasticrun", script):
        os.chown(path, user.uid, user.gid)
    env = user.env(**cluster.env, GLOO_SOCKET_IFNAME="eth0")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    argv = ["sbatch", "--wait", f"--output={user.home / 'batch.out'}", str(script)]
    batch = subprocess.Popen(
        on_host(cluster.hosts, 1, user.as_user(argv)),
        env=env,
        cwd=str(user.home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        for task in range(3):
            output.wait_line(rf"^{task}: start rank \d+ world 3 ", timeout=300)
        job = re.search(r"Submitted batch job (\d+)", batch.stdout.readline().decode()).group(1)  # type: ignore[union-attr]
        key = user.home / ".elasticrun" / f"slurm-{job}.key"
        assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_uid == user.uid
        told = output.text()
        assert "elasticrun: --rdzv-id " + job + " (from Slurm)" in told, told
        assert "--rdzv-endpoint h1:29400 (from Slurm)" in told, told

        mark = output.mark()
        victim = task_of(user, cluster.hosts.ns(3))  # type: ignore[attr-defined]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for task in range(2):
            output.wait_line(rf"^{task}: start rank \d+ world 2 ", timeout=120, after=mark)
        reformed = time.monotonic() - killed
        for task, status in ((0, 0), (1, 0), (2, 137)):
            output.wait_line(rf"^{task}: task {task} exit {status}$", timeout=300)
        assert batch.wait(120) == 0, cluster.logs()
        output.wait_line(r"^srun exit ", timeout=30)
    except AssertionError as exc:
        batch.kill()
        raise AssertionError(f"{exc}\n--- output ---\n{output.text()}\n{cluster.logs()}") from None
    assert not key.exists(), "task 0 removes the allocation's key at its end"
    assert left_behind(user, ["h1", "h2", "h3"], cluster.hosts) == []
    REPORT.append(
        f"sbatch -N3, srun elasticrun --nnodes 2:3: node h3's task SIGKILLed, the other two "
        f"re-formed at 2 in {reformed:.1f} s and ended 0; srun said: "
        + output.wait_line(r"^srun exit \d+", timeout=1).group(0)
    )
