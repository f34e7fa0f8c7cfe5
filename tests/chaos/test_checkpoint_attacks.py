"""The checkpoint tier against other users, strangers on the data plane, a job over its cap
and a daemon SIGKILLed while it holds checkpoints (docs/checkpoints.md, docs/security.md).

- another user cannot read or write a job's checkpoints: not in memory (the job's directory
  is its user's alone, as its socket), not on disk (written with the job's user's rights
  only, so a --checkpoint-dir the user cannot write gets nothing), not through status;
- a client without a node's CURVE key gets nothing from, and puts nothing into, a node's
  tier (its data plane): the handshake is refused and counted;
- a job whose save is over its cap fails its save (no space left on device) and another
  job's checkpoints on the same node are not disturbed;
- a daemon SIGKILLed while it holds checkpoints leaves nothing that its next start believes;
- a job whose directory's paths lead elsewhere (symlinks where the daemon writes a copy,
  fetches a range, or reads a file for another node) makes no daemon write or read
  anything its user could not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq
from harness import CLIENT_ENV, ROOT, needs_root, python_for_everyone
from local_users import local_users
from store_attack import wait_for

SCRIPT = str(ROOT / "examples" / "dcp_train.py")


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def train(report: Path, steps: int, *extra: str) -> tuple[str, ...]:
    return (
        "--env",
        "OMP_NUM_THREADS=1",
        SCRIPT,
        "--",
        "--model",
        "ddp",
        "--steps",
        str(steps),
        "--save-every",
        "5",
        "--step-time",
        "0.05",
        "--report",
        str(report),
        *extra,
    )


def saved(report: Path) -> int:
    path = report / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"save"' in line for line in lines)


def as_user(user: str, code: str) -> subprocess.CompletedProcess[str]:
    """Python ``code`` run as ``user``."""
    import pwd

    account = pwd.getpwnam(user)
    return subprocess.run(
        [f"{python_for_everyone()}/bin/python3", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**CLIENT_ENV, "HOME": "/"},
        cwd="/",
        user=account.pw_uid,
        group=account.pw_gid,
        extra_groups=[],
    )


@pytest.fixture
def report(shared_tmp: Path) -> Path:
    path = shared_tmp / "report"
    path.mkdir()
    path.chmod(0o777)  # the jobs' users write their events there (mkdir's mode is umasked)
    return path


@needs_root
def test_another_user_reads_and_writes_none_of_a_jobs_checkpoints(
    daemon_factory, shared_tmp, report
):
    daemon = daemon_factory(unique("ckptusers"), args=("--slots", "4")).start()
    with local_users("owner", "other") as users:
        owner, other = users["owner"], users["other"]
        private = shared_tmp / "others-private"
        private.mkdir(mode=0o700)
        os.chown(private, *_ids(other))
        # elasticctl refuses a --checkpoint-dir its user cannot write, nothing submitted
        refused = daemon.ctl_run(
            "submit", "--checkpoint-dir", str(private), *train(report, 10), user=owner
        )
        assert refused.returncode == 2 and "not a directory you can write" in refused.stderr
        # a directory the owner can write: the job's complete checkpoints land there
        disk = shared_tmp / "owners-disk"
        disk.mkdir(mode=0o700)
        os.chown(disk, *_ids(owner))
        job = daemon.ctl(
            "submit",
            "--nproc-per-node",
            "2",
            "--checkpoint-dir",
            str(disk),
            *train(report, 400),
            user=owner,
        )["id"]
        wait_for(lambda: saved(report) >= 4, 120, "checkpoints saved")
        wait_for(lambda: daemon.ctl("status", job).get("checkpoint"), 60, "one complete")
        tier = Path(daemon.runtime_dir) / "checkpoints" / job
        probe = f"""
import os, socket, sys
tier = {str(tier)!r}
for what in ("list", "read", "write", "socket"):
    try:
        if what == "list":
            os.listdir(tier)
        elif what == "read":
            open(os.path.join(tier, os.listdir(tier)[0]), "rb").read(1)
        elif what == "write":
            open(os.path.join(tier, "planted"), "wb").write(b"x")
        else:
            s = socket.socket(socket.AF_UNIX); s.connect(os.path.join(tier, ".tier.sock"))
            s.sendall(b'{{"op": "latest"}}\\n'); print("socket answered", s.recv(100))
        print(what, "ALLOWED")
    except PermissionError:
        print(what, "refused")
"""
        seen = as_user(other, probe)
        assert seen.stdout.split() == [
            "list",
            "refused",
            "read",
            "refused",
            "write",
            "refused",
            "socket",
            "refused",
        ], seen
        assert not os.path.exists(tier / "planted")
        # status: another user sees neither the directory on disk nor (being absent) anything in it
        shown = json.loads(daemon.ctl_run("--json", "status", job, user=other).stdout)
        assert shown.get("checkpoint_dir") is None and shown["redacted"] is True
        # what reached the disk is the owner's, written with the owner's rights
        wait_for(lambda: any(disk.iterdir()), 60, "a checkpoint on disk")
        for path in disk.rglob("*"):
            assert path.stat().st_uid == _ids(owner)[0], path
        daemon.ctl("cancel", job)


def _ids(user: str) -> tuple[int, int]:
    import pwd

    account = pwd.getpwnam(user)
    return account.pw_uid, account.pw_gid


def test_a_stranger_on_the_data_plane_gets_nothing_and_is_counted(daemon_factory, report):
    from store_attack import Cluster

    cluster = Cluster(daemon_factory, report.parent, prefix="tierport")
    a = cluster.add("a")
    cluster.start()
    endpoint = next(n["tier_endpoint"] for n in a.ctl("nodes") if n["name"] == a.name)
    assert endpoint and endpoint.startswith("tcp://")
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(endpoint)
        header = {"id": "x", "op": "put", "job": "j-000000", "ckpt": "s", "name": "f", "offset": 0}
        plain.send_multipart([json.dumps(header).encode(), b"x" * 1024])
        assert plain.poll(2000) == 0  # never answered
        public, secret = zmq.curve_keypair()
        stranger = ctx.socket(zmq.DEALER)  # CURVE, with a key no node record vouches for
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.curve_publickey, stranger.curve_secretkey = public, secret
        stranger.curve_serverkey = _server_key(a)
        stranger.connect(endpoint)
        get = {**header, "op": "get", "owner": a.name, "length": 10}
        stranger.send_multipart([json.dumps(get).encode()])
        assert stranger.poll(2000) == 0
    finally:
        ctx.destroy(linger=0)
    wait_for(lambda: _metric(a, "elasticd_peer_refused_total") >= 1, 30, "the refusal counted")
    cluster.stop()


def _server_key(daemon: Any) -> bytes:
    key = json.loads((Path(daemon.state_dir) / "peer.key").read_text())
    return key["public"].encode()


def _metric(daemon: Any, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read()
    for line in text.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@needs_root
def test_a_save_over_the_jobs_cap_fails_and_another_job_is_not_disturbed(
    daemon_factory, shared_tmp
):
    daemon = daemon_factory(unique("ckptcap"), args=("--slots", "4"), metrics_port=0).start()
    small, big = shared_tmp / "small", shared_tmp / "big"
    small.mkdir()
    big.mkdir()
    fine = daemon.submit("--nproc-per-node", "1", *train(small, 60))["id"]
    # a model whose checkpoint (about 12 MB) is over the job's 4 MiB of checkpoint memory
    over = daemon.submit(
        "--nproc-per-node",
        "1",
        "--checkpoint-memory",
        "4M",
        *train(big, 60, "--hidden", "1024"),
    )["id"]
    ended = daemon.wait_job(over, lambda j: j["state"] in ("FAILED", "SUCCEEDED"), 180)
    assert ended["state"] == "FAILED", ended  # its save failed in the script (torch's words)
    wait_for(
        lambda: "its checkpoint directory is full (4194304 bytes" in daemon.log_text(),
        30,
        "the daemon saying why the job's save failed",
    )
    done = daemon.wait_job(fine, lambda j: j["state"] in ("FAILED", "SUCCEEDED"), 180)
    assert done["state"] == "SUCCEEDED", done
    assert daemon.ctl("status", fine)["checkpoint"]["id"] == "step_60"
    assert daemon.ctl("version")  # the daemon answers


def tmpfs_options(path: Path) -> set[str]:
    """The options of the tmpfs mounted at ``path`` (/proc/self/mountinfo)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        if fields.split()[4] == str(path):
            fstype, _source, options = rest.split()
            assert fstype == "tmpfs", line
            return set(options.split(","))
    raise AssertionError(f"nothing is mounted at {path}")


@needs_root
def test_a_daemon_killed_while_it_holds_checkpoints_starts_without_them(daemon_factory, report):
    daemon = daemon_factory(unique("ckptkill"), args=("--slots", "2")).start()
    job = daemon.submit("--nproc-per-node", "1", *train(report, 4000))["id"]
    wait_for(lambda: saved(report) >= 2, 120, "checkpoints saved")
    tier = Path(daemon.runtime_dir) / "checkpoints" / job
    assert os.path.ismount(tier)
    options = tmpfs_options(tier)
    assert "mode=700" in options, options
    shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if shmem.exists() and "[deny]" not in shmem.read_text():  # tmpfs may have huge pages
        assert "huge=within_size" in options, options  # its shards in them
    daemon.signal(signal.SIGKILL)
    daemon.wait_exit()
    assert os.path.ismount(tier)  # the kernel keeps it: the next start must deal with it
    daemon.start()
    assert not os.path.exists(tier)
    assert "removed the checkpoints a previous run left here" in daemon.log_text()
    ended = daemon.wait_job(job, lambda j: j["state"] in ("FAILED", "CANCELLED", "SUCCEEDED"), 60)
    assert ended["state"] == "FAILED" and "daemon died" in ended["error"]["message"], ended


@needs_root
def test_symlinks_in_a_jobs_directory_make_no_daemon_write_or_read_as_root(
    daemon_factory, shared_tmp, report
):
    """tests/fixtures/tier_path_attack.py, as a user who is not root, on two nodes: links
    to a directory only root may write where the daemons write copies and ranges, and one
    to a file only root may read in place of a file another node fetches."""
    from store_attack import Cluster

    root_only = shared_tmp / "root-only"
    root_only.mkdir(mode=0o755)
    secret = shared_tmp / "secret"
    secret.write_text("ROOT-SECRET-" + uuid.uuid4().hex + "x" * 64)
    secret.chmod(0o600)
    shared_tmp.chmod(0o755)  # the job's user reaches the links' targets (and is refused)
    cluster = Cluster(daemon_factory, shared_tmp, prefix="tierpath")
    a, b = cluster.add("a"), cluster.add("b")
    cluster.start()
    script = str(ROOT / "tests" / "fixtures" / "tier_path_attack.py")
    with local_users("attacker") as users:
        job = a.ctl(
            "submit",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            script,
            "--",
            str(root_only),
            str(secret),
            str(report),
            user=users["attacker"],
        )["id"]
        ended = a.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 180)
        assert ended["state"] == "SUCCEEDED", (ended, a.log_text(), b.log_text())
        seen = {r: json.loads((report / f"attack-{r}.json").read_text()) for r in (0, 1)}
        # nothing written where only root may write, by either daemon
        assert list(root_only.rglob("*")) == [], list(root_only.rglob("*"))
        # the checkpoint was complete (the attack was made), and the fetch got no secret
        assert seen[1]["complete"] == {"ok": True, "complete": True}, seen
        assert "ROOT-SECRET" not in json.dumps(seen), seen
        assert seen[1]["fetch"]["ok"] is False, seen  # rank 0's daemon could not read it
        # a FIFO where fetched bytes go is refused at once, and the daemon answers on
        fifo = seen[1]["fetch_into_fifo"]
        assert fifo["ok"] is False and "not a regular file" in fifo["error"], seen
        for daemon in (a, b):
            assert daemon.ctl("version")  # both answer on
    cluster.stop()
