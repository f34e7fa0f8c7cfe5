"""A job that forks, escapes with setsid, or loses its main process to the OOM killer while
its children live on: the daemon sees the death from the process and nothing outlives the
job (docs/concepts.md, "Nothing a job starts outlives it")."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest
from harness import alive, needs_root, sleeping_job, wait_gone, worker_args
from store_attack import Cluster

from elasticd.store.firewall import table_name


def _job_cgroups(daemon) -> list[str]:
    """The job cgroups the daemon has now (skips the test if it runs without cgroups)."""
    found = re.search(r"job cgroups in (\S+)", daemon.log_text())
    if found is None:
        pytest.skip("the daemon runs without cgroups here")
    base = found.group(1)
    return (
        sorted(d for d in os.listdir(base) if d.startswith("job-")) if os.path.isdir(base) else []
    )


@needs_root
def test_a_worker_killed_while_its_children_hold_its_pipes_is_noticed_at_once(
    daemon, shared_tmp, figures
):
    """The OOM killer's everyday case: the training process dies, its DataLoader children
    (same process group, same stdout) live on.  The job must not stay RUNNING."""
    job_id, pids = sleeping_job(daemon, shared_tmp, 2, "--child")
    worker, child = pids[0], pids[1]
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    failed = daemon.wait_job(job_id, lambda d: d["state"] == "FAILED", timeout=30)
    noticed = time.monotonic() - killed
    figures.add("item 4: dead worker (children hold its pipes) noticed after", f"{noticed:.3f} s")
    assert "killed by SIGKILL" in failed["error"]["message"] and failed["error"]["rank"] == 0
    assert wait_gone(pids, timeout=15) == []  # its children died with the job
    assert not alive(child)


@needs_root
def test_a_child_that_escapes_with_setsid_dies_with_the_job(daemon, shared_tmp, figures):
    job_id, pids = sleeping_job(daemon, shared_tmp, 2, "--escape")
    escapees = pids[1::2]  # each worker wrote its own pid, then its escapee's
    assert all(os.getsid(p) == p for p in escapees)  # each left its worker's session
    assert _job_cgroups(daemon) == [f"job-{job_id}"]
    started = time.monotonic()
    assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"
    figures.add(
        "item 5: cancel of a job with setsid escapees took", f"{time.monotonic() - started:.2f} s"
    )
    left = wait_gone(pids, timeout=5)
    figures.add("item 5: processes left after cancel (cgroup)", str(len(left)))
    assert left == []
    assert _job_cgroups(daemon) == []  # and its cgroup is gone
    usage = daemon.ctl("status", job_id)["usage"]
    assert usage["cpu_seconds"] > 0 and usage["memory_peak"] > 0


def test_without_cgroups_cancel_still_ends_and_frees_the_slots(daemon_factory, shared_tmp, figures):
    """jobs.cgroup = off (a container without delegation): a setsid escapee survives, as the
    daemon says at start, but it holds nothing of the daemon's: cancel returns, the slots
    are free for the next job."""
    config = shared_tmp / "nocgroup.toml"
    config.write_text('[jobs]\ncgroup = "off"\nstop_grace = 1\n')
    daemon = daemon_factory(args=("--slots", "2", "--config", str(config))).start()
    assert "no cgroups for jobs (disabled by jobs.cgroup = off)" in daemon.log_text()
    job_id, pids = sleeping_job(daemon, shared_tmp, 2, "--escape")
    try:
        started = time.monotonic()
        assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"
        figures.add("item 5: cancel without cgroups took", f"{time.monotonic() - started:.2f} s")
        assert wait_gone(pids[0::2], timeout=5) == []  # the workers
        assert all(alive(p) for p in pids[1::2])  # the escapees: no cgroup, no way to find them
        second = daemon.submit("--nproc-per-node", "2", *worker_args())  # both slots are free
        assert daemon.wait_job(second["id"], lambda d: d["state"] == "SUCCEEDED")
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@needs_root
def test_what_a_killed_daemon_left_is_killed_at_its_next_start(daemon, shared_tmp, figures):
    _job_id, pids = sleeping_job(daemon, shared_tmp, 1, "--escape")
    daemon.signal(signal.SIGKILL)
    daemon.wait_exit()
    escapee = pids[1]
    assert alive(escapee)  # PDEATHSIG took the worker; the escapee is in no process group of ours
    daemon.start()
    assert wait_gone([escapee], timeout=10) == []
    assert _job_cgroups(daemon) == []
    figures.add("item 5: processes left after a SIGKILLed daemon restarted", "0")


def _table(name: str) -> bool:
    """Whether nftables has ``inet name`` now."""
    return (
        subprocess.run(["nft", "list", "table", "inet", name], capture_output=True).returncode == 0
    )


@needs_root
def test_what_a_killed_daemon_that_never_comes_back_left_goes_with_elasticd_clean_up(
    daemon_factory, shared_tmp
):
    """A SIGKILLed node that never came back kept its nftables table
    and its job cgroups (systemd's unit now runs --clean-up after every stop)."""
    if shutil.which("nft") is None:
        pytest.skip("needs nft (.ci/setup-root.sh installs nftables)")
    cluster = Cluster(daemon_factory, shared_tmp, prefix="cleanup", firewall=True)
    node = cluster.add("a")
    cluster.start()
    table = table_name(cluster.name, node.name)
    job_id, pids = sleeping_job(node, shared_tmp, 1, "--escape")
    cgroups = _job_cgroups(node)
    clean_up = [*node.argv(), "--clean-up"]

    refused = subprocess.run(clean_up, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "a daemon answers on" in refused.stderr, refused
    assert _table(table) and all(alive(p) for p in pids)  # a running daemon's: untouched

    node.signal(signal.SIGKILL)
    node.wait_exit()
    escapee = pids[1]
    assert alive(escapee) and _table(table) and _job_cgroups(node) == cgroups == [f"job-{job_id}"]
    done = subprocess.run(clean_up, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert (
        f"removed nftables table inet {table}" in done.stdout and "killed 1 leftover" in done.stdout
    ), done
    assert f"/job-{job_id}" in done.stdout, done
    assert wait_gone([escapee], timeout=10) == []
    assert not _table(table) and _job_cgroups(node) == []
    again = subprocess.run(clean_up, capture_output=True, text=True, timeout=60)
    assert (
        again.returncode == 0
        and "killed 0 leftover" in again.stdout
        and "job cgroups" not in again.stdout
        and "no firewall table left" in again.stdout
    ), again
