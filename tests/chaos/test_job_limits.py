"""A job that forks far past its limit, or allocates past its memory limit, hurts only itself
(docs/concepts.md, "What a job may use"): the fork fails in the job (EAGAIN), the node and the daemon stay healthy,
other jobs run, and cancel leaves nothing.  With cgroups (the pids controller, in cgroup v2
or in a hybrid host's v1 tree) and without them (RLIMIT_NPROC for the job's user); the node
says which in `elasticctl nodes`.

Every fork bomb here runs under a limit the test has checked first, and stops by itself after
a few hundred forks whatever happens: small limits, so the tests are quick and safe.
"""

from __future__ import annotations

import os
import pwd
import re
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest
from harness import needs_root, wait_gone, worker_args
from local_users import account

LIMIT = 32  # jobs.max_pids_per_worker in these tests: one worker, so the job's limit
ATTEMPTS = 400  # the fork bomb gives up after this many forks (12 x the limit)

FORK_BOMB = f"""
import errno, os, signal, sys
pid_dir = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_DFL)
children, failed = [], "none"
for _ in range({ATTEMPTS}):
    try:
        pid = os.fork()
    except OSError as exc:
        failed = errno.errorcode.get(exc.errno, str(exc.errno))
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    children.append(pid)
with open(os.path.join(pid_dir, "pids.tmp"), "w") as f:
    f.write(" ".join(map(str, [os.getpid(), *children])))
os.replace(os.path.join(pid_dir, "pids.tmp"), os.path.join(pid_dir, "pids"))
print("forked", len(children), "failed", failed, flush=True)
signal.pause()
"""

HOG = "memory = b'x' * (400 << 20)\nprint('allocated', len(memory), flush=True)\n"


def _start(daemon_factory, directory: Path, *lines: str):
    """A daemon with these [jobs] lines, under a node name of its own (job cgroups are named
    after the node: other tests' daemons must not share them)."""
    path = directory / "containment.toml"
    path.write_text("[jobs]\nstop_grace = 1\n" + "".join(f"{line}\n" for line in lines))
    name = f"ct{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return daemon_factory(name, args=("--slots", "4", "--config", str(path))).start()


def _script(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.write_text(text)
    path.chmod(0o644)
    return str(path)


def _pid_dir(directory: Path) -> Path:
    pid_dir = directory / "pids"
    pid_dir.mkdir()
    pid_dir.chmod(0o777)
    return pid_dir


def _node(daemon) -> dict:
    [node] = daemon.ctl("nodes")
    return node


def _cgroup_dirs(daemon) -> list[str]:
    """Every directory the daemon makes job cgroups in (v2, and a hybrid host's v1 twins)."""
    line = re.search(r"job cgroups in .*", daemon.log_text())
    assert line is not None, daemon.log_text()
    return re.findall(r"in (/\S+)", line.group(0))


def _job_dirs(daemon, timeout: float = 30.0) -> list[str]:
    """The job cgroups (and twins) still there after ``timeout``.  An agent removes its job's
    cgroup just after the job's end is recorded, and the daemon tells no client when: this
    looks again until they are gone, within a bound."""
    deadline = time.monotonic() + timeout
    while True:
        left = [
            entry
            for base in _cgroup_dirs(daemon)
            if os.path.isdir(base)
            for entry in os.listdir(base)
            if entry.startswith("job-")
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _bomb(daemon, shared_tmp: Path, **kw) -> tuple[str, list[int], str]:
    """Submit the fork bomb; wait until it gave up; its job id, pids and what it printed."""
    pid_dir = _pid_dir(shared_tmp)
    script = _script(shared_tmp, "bomb.py", FORK_BOMB)
    job = daemon.ctl("submit", "--python", "/usr/bin/python3", script, str(pid_dir), **kw)
    daemon.wait_output(job["id"], ["forked "], timeout=60)
    said = re.search(r"forked \d+ failed \w+", daemon.ctl_run("logs", job["id"]).stdout)
    assert said is not None
    return job["id"], [int(p) for p in (pid_dir / "pids").read_text().split()], said.group(0)


def _still_healthy(daemon) -> None:
    """The daemon answers, its node is up, and another job runs to its end meanwhile."""
    assert daemon.proc.poll() is None
    assert _node(daemon)["state"] == "up"
    other = daemon.submit(*worker_args())
    assert (
        daemon.wait_job(other["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED"), timeout=120)[
            "state"
        ]
        == "SUCCEEDED"
    )


@needs_root
def test_a_fork_bomb_stops_at_the_jobs_pids_limit(daemon_factory, shared_tmp, figures):
    daemon = _start(daemon_factory, shared_tmp, f"max_pids_per_worker = {LIMIT}")
    containment = _node(daemon)["containment"]
    if containment["pids_by"] not in ("cgroup v2", "cgroup v1"):
        pytest.skip(f"no pids controller for job cgroups here: {containment['missing']}")
    assert containment == {
        "cgroup": True,
        "pids_per_worker": LIMIT,
        "pids_by": containment["pids_by"],
        "memory": 0,
        "memory_by": containment["memory_by"],
        "missing": [],
    }
    # root's own job: RLIMIT_NPROC would not bind it, the cgroup does
    job_id, pids, said = _bomb(daemon, shared_tmp)
    figures.add("row 5: a fork bomb under pids.max = 32 (cgroup)", said)
    forked = int(said.split()[1])
    assert said.endswith("failed EAGAIN") and 0 < forked < LIMIT, said  # the worker is one too
    assert len(pids) == forked + 1
    _still_healthy(daemon)
    assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"
    assert wait_gone(pids, timeout=15) == []
    assert _job_dirs(daemon) == []  # its cgroup and twins went with it
    assert "Traceback" not in daemon.log_text()


@pytest.fixture
def job_user():
    """A user of this test's own (RLIMIT_NPROC counts every process of a uid: `nobody` may
    be busy in other tests), removed with whatever it still runs."""
    name = f"ect{uuid.uuid4().hex[:8]}"
    account("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name)
    uid = pwd.getpwnam(name).pw_uid
    try:
        yield name
    finally:
        for proc in psutil.process_iter(["uids"]):
            if proc.info["uids"] and proc.info["uids"].real == uid:
                proc.kill()
        wait_gone(
            [
                p.pid
                for p in psutil.process_iter(["uids"])
                if p.info["uids"] and p.info["uids"].real == uid
            ],
            timeout=10,
        )
        account("userdel", name)


def _processes_of(user: str) -> list[int]:
    uid = pwd.getpwnam(user).pw_uid
    return [
        p.pid
        for p in psutil.process_iter(["uids", "status"])
        if p.info["uids"]
        and p.info["uids"].real == uid
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


@needs_root
def test_without_cgroups_rlimit_nproc_stops_a_fork_bomb_and_the_node_says_so(
    daemon_factory, shared_tmp, job_user, figures
):
    daemon = _start(daemon_factory, shared_tmp, 'cgroup = "off"', f"max_pids_per_worker = {LIMIT}")
    log = daemon.log_text()
    assert log.count("no cgroups for jobs (disabled by jobs.cgroup = off)") == 1  # said once
    assert (
        log.count(
            "no pids controller (no job cgroups): a job's processes and threads are "
            f"bounded by RLIMIT_NPROC instead ({LIMIT} per worker)"
        )
        == 1
    )
    table = daemon.ctl_run("nodes")
    assert table.returncode == 0, table.stderr
    _header, row, blank, *notes = table.stdout.splitlines()
    assert re.split(r"\s{2,}", row)[-3:] == ["no", f"{LIMIT}/worker (RLIMIT_NPROC)", "no limit"]
    assert blank == "" and [note.split(":")[0] for note in notes] == [daemon.name] * 2
    assert notes[0].startswith(
        f"{daemon.name}: no cgroups for jobs (disabled by jobs.cgroup = off)"
    )
    assert "does not bind jobs that run as root" in notes[1]

    job_id, pids, said = _bomb(daemon, shared_tmp, user=job_user, cwd=str(shared_tmp))
    figures.add("row 5: a fork bomb under RLIMIT_NPROC = 32 (no cgroup)", said)
    forked = int(said.split()[1])
    assert said.endswith("failed EAGAIN") and 0 < forked < LIMIT, said  # the worker is one too
    assert sorted(_processes_of(job_user)) == sorted(pids)  # all of them the job's, none escaped
    _still_healthy(daemon)
    assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"
    assert wait_gone(pids, timeout=15) == []  # the children stayed in the worker's process group
    assert _processes_of(job_user) == []


@needs_root
def test_a_worker_past_max_memory_is_oom_killed_and_the_job_fails_saying_so(
    daemon_factory, shared_tmp, figures
):
    daemon = _start(daemon_factory, shared_tmp, 'max_memory = "64M"')
    containment = _node(daemon)["containment"]
    if not containment["memory_by"]:
        pytest.skip(f"no memory controller for job cgroups here: {containment['missing']}")
    assert containment["memory"] == 64 << 20 and containment["missing"] == []
    script = _script(shared_tmp, "hog.py", HOG)
    failed = daemon.ctl("submit", "--wait", "--python", "/usr/bin/python3", script, expect=1)[-1]
    figures.add(
        "row 5: a worker allocating 400 MiB under max_memory = 64M",
        f"{failed['state']}: {failed['error']['message']}",
    )
    assert failed["state"] == "FAILED", failed
    assert (
        "out of memory" in failed["error"]["message"]
        and failed["error"]["exit_code"] == -signal.SIGKILL
    )
    assert daemon.ctl("status", failed["id"])["usage"]["oom_kills"] >= 1
    _still_healthy(daemon)
    assert _job_dirs(daemon) == []
