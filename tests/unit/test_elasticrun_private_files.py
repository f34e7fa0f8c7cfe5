"""elasticrun's private daemon, the client's side (ctl/elasticctl/private.py): the config it
writes, the key it takes (a file of the user's alone; the Slurm allocation's, made by task 0
and waited for by the others; else a public one, said), where it keeps its directories (a
directory of the user's alone, in directories that only the user and root may change, with
room for the daemon's socket path), and what a killed one left, reaped (only the user's own
directories and files, and nothing followed out of them)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from types import SimpleNamespace

import pytest
from harness import needs_root

from elasticctl import private, topology
from elasticd.jobs import board
from elasticd.shell.checkpoints import TIER_SOCKET, remove_leftovers, tier_root
from elasticd.wire import paths

C10D = topology.Topology(nnodes="2:3", backend="c10d", host="h1", port=29400, run_id="r")
REQUEST = {"argv": ["x.py"], "nproc_per_node": 2, "join_timeout": 30}


@pytest.mark.parametrize(
    "value",
    ["plain", 'quote " and \\ backslash', "tab\tnew\nline", "ünïcødé ✓", "\x01\x7f", "😀"],
)
def test_toml_holds_any_string(value):
    assert tomllib.loads(private.toml({"t": {"k": value, "n": 3, "b": True}})) == {
        "t": {"k": value, "n": 3, "b": True}
    }


def config(where: topology.Topology, **env: str) -> dict:
    return tomllib.loads(private.daemon_config(REQUEST, where, "/d", "h1-7", "/k", env))


def test_the_daemons_config_for_c10d_etcd_and_one_node():
    found = config(C10D)
    assert found["store"]["endpoint"] == "h1:29400" and found["store"]["host"] == "auto"
    assert found["store"]["connect_timeout"] == 30.0 and found["store"]["firewall"] is False
    assert found["cluster"] == {"name": "elasticrun-r", "key_file": "/k"}
    assert found["paths"] == {"state_dir": "/d/state", "runtime_dir": "/d/run"}
    assert found["node"] == {"name": "h1-7", "peer_port": 0, "slots": max(2, os.cpu_count())}
    assert found["log"]["level"] == "warning" and found["metrics"]["port"] == 0
    assert config(C10D, LOGLEVEL="INFO")["log"]["level"] == "info"  # torchrun's variable
    hosted = topology.Topology(nnodes="2", backend="static", host="m", port=1, hosts_store=False)
    assert config(hosted)["store"]["host"] is False
    etcd = topology.Topology(
        nnodes="2", backend="etcd", host="e", port=2379, etcd_tls={"ca_file": "/ca"}
    )
    assert config(etcd)["store"] == {
        "backend": "etcd",
        "endpoints": ["e:2379"],
        "connect_timeout": 30.0,
        "ca_file": "/ca",
    }
    alone = config(topology.Topology(nnodes="1:1"))
    assert "store" not in alone and "cluster" not in alone  # --standalone's: no store port


def test_a_key_file_must_be_the_users_alone(tmp_path):
    key = tmp_path / "k"
    key.write_text("ab" * 32)
    key.chmod(0o640)
    with pytest.raises(private.Failed, match=r"readable by you only .* chmod 600"):
        private._check_key(str(key), "--rdzv-conf key_file")
    key.chmod(0o600)
    private._check_key(str(key), "--rdzv-conf key_file")
    with pytest.raises(private.Failed, match="No such file"):
        private._check_key(str(tmp_path / "none"), "--rdzv-conf key_file")


def test_without_a_key_the_job_says_anyone_can_join_and_its_key_is_anyones(tmp_path):
    warned = []
    path, made, keyless = private._key(C10D, str(tmp_path), {}, warned.append)
    assert keyless and made == ""
    assert bytes.fromhex(open(path).read().strip()) == private.public_key("r")
    assert "anyone who can reach h1:29400 can join it" in warned[0]
    assert private._key(topology.Topology(nnodes="1"), str(tmp_path), {}, warned.append) == (
        "",
        "",
        False,
    )


def slurm(first: bool) -> topology.Topology:
    return topology.Topology(
        nnodes="3", backend="c10d", host="n1", port=29400, slurm_job="99", slurm_first=first
    )


def test_the_slurm_allocations_key_is_made_by_task_0_and_waited_for_by_the_others(tmp_path):
    environ = {"HOME": str(tmp_path)}
    found = {}

    def other_task():
        found["other"] = private.slurm_key(slurm(False), environ)

    waiting = threading.Thread(target=other_task)
    waiting.start()  # before task 0 made it: it waits for it
    time.sleep(0.3)
    path, made = private.slurm_key(slurm(True), environ)
    waiting.join(10)
    assert found["other"] == (path, "") and made == path
    assert path == str(tmp_path / ".elasticrun" / "slurm-99.key")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / ".elasticrun").st_mode & 0o777 == 0o700
    assert private.slurm_key(slurm(True), environ) == (path, path)  # a requeued job: the same


def test_a_task_that_never_sees_the_key_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(private, "SLURM_KEY_WAIT", 0.3)
    with pytest.raises(private.Failed, match="does not seem to share; give every node a key"):
        private.slurm_key(slurm(False), {"HOME": str(tmp_path)})


def test_what_a_killed_elasticrun_left_is_reaped_and_nothing_else(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    for name, owner in (
        ("mine", {"pid": os.getpid(), "started": private._start_time(os.getpid())}),
        ("dead", {"pid": int(dead.stdout), "started": 1}),
        ("reused", {"pid": os.getpid(), "started": 1}),  # its pid now someone else's
    ):
        (base / name).mkdir()
        (base / name / "owner").write_text(json.dumps(owner))
    (base / "young").mkdir()  # being made: no owner yet
    (base / "old").mkdir()
    os.utime(base / "old", (time.time() - 3600, time.time() - 3600))
    removed = private.reap_leftovers(str(base))
    assert sorted(os.path.basename(path) for path in removed) == ["dead", "old", "reused"]
    assert sorted(os.listdir(base)) == ["mine", "young"]


def test_node_names_are_the_hosts_and_the_elasticruns():
    assert private.node_name(1234).endswith("-1234") and "." not in private.node_name(1)


def test_a_base_in_a_directory_others_may_change_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"  # TMPDIR's parent: anyone may rename what is in it
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    tmpdir = shared / "mine"
    tmpdir.mkdir(mode=0o700)
    monkeypatch.setattr(private.tempfile, "tempdir", str(tmpdir))
    base = tmpdir / "elasticrun-7"
    with pytest.raises(private.Failed) as refused:
        private.make_base(str(base))
    assert str(refused.value) == (
        f"refusing {base}: {shared} is mode 777: writable by others, without the sticky bit, "
        f"so another user could replace what lies in it; make {shared} sticky (chmod +t, as "
        "/tmp is; a Kubernetes emptyDir is not) or set TMPDIR to a directory of yours, on a "
        "path only you and root may change"
    )
    assert not base.exists()
    shared.chmod(0o1777)  # as /tmp is: only an entry's owner may rename it
    private.make_base(str(base))
    assert base.is_dir() and base.stat().st_mode & 0o777 == 0o700


@needs_root
def test_a_base_in_another_users_directory_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    monkeypatch.setattr(private.tempfile, "tempdir", str(theirs))
    with pytest.raises(private.Failed, match=rf"{theirs} is uid \d+'s, so another user could"):
        private.make_base(str(theirs / "elasticrun-0"))


@pytest.mark.parametrize("planted", ["dangling link", "link to a directory", "file"])
def test_a_link_or_a_file_planted_as_the_base_is_refused_saying_so(tmp_path, monkeypatch, planted):
    monkeypatch.setattr(private.tempfile, "tempdir", str(tmp_path))
    base = tmp_path / "elasticrun-7"
    if planted == "file":
        base.write_text("")
    else:
        target = tmp_path / "elsewhere"
        if planted == "link to a directory":
            target.mkdir(mode=0o700)
        base.symlink_to(target)
    kind = "a file" if planted == "file" else "a link"
    with pytest.raises(private.Failed) as refused:
        private.make_base(str(base))
    assert str(refused.value) == (
        f"refusing {base}: it must be a directory of yours that nobody else can write, and is "
        f"{kind} (someone else made it?); set TMPDIR to a directory of yours, on a path only "
        "you and root may change"
    )


def test_the_deepest_socket_is_a_checkpoint_tiers_with_the_longest_job_id():
    job = private.DEEPEST_SOCKET.split(os.sep)[1]
    assert board.JOB_ID.match(job) and not board.JOB_ID.match(job + "f")
    assert private.DEEPEST_SOCKET == os.path.join("checkpoints", job, TIER_SOCKET)
    config = SimpleNamespace(paths=SimpleNamespace(runtime_dir="/r"))
    assert tier_root(config) == os.path.join("/r", private.DEEPEST_SOCKET.split(os.sep)[0])


def test_the_longest_base_leaves_room_for_the_daemons_sockets(monkeypatch):
    short = tempfile.mkdtemp(dir="/tmp")
    try:
        name = f"elasticrun-{os.getuid()}"
        longest = os.path.join(short, "d" * (private.MAX_BASE - len(short) - len(name) - 2))
        os.mkdir(longest, 0o700)
        monkeypatch.setattr(private.tempfile, "tempdir", longest)
        base = private.base_dir()
        assert base == os.path.join(longest, name) and len(base) == private.MAX_BASE
        private.make_base(base)
        directory = private.make_job_dir(base, "r" * 40)  # the longest name: the id cut
        runtime = os.path.join(directory, private.RUN_DIR)
        for sock_name in (paths.SOCKET_NAME, private.DEEPEST_SOCKET):
            os.makedirs(os.path.dirname(os.path.join(runtime, sock_name)), exist_ok=True)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(os.path.join(runtime, sock_name))
        monkeypatch.setattr(private.tempfile, "tempdir", longest + "x")  # one byte too long
        fallen_back = private.base_dir()
        assert fallen_back == os.path.join(os.path.realpath("/tmp"), name)
        assert private._elsewhere(fallen_back) == (
            f"set TMPDIR to a directory of yours whose path has at most {len(longest)} bytes "
            f"(TMPDIR {longest}x is too long a path for the daemon's sockets, so /tmp is used)"
        )
    finally:
        shutil.rmtree(short)


def test_reaping_reads_no_fifo_and_cleans_up_with_its_own_config_only(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(private.subprocess, "run", lambda argv, **_: ran.append(argv[-1]))
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text("")
    for name in ("fifo", "linked", "plain"):
        (base / name).mkdir(mode=0o700)
    os.mkfifo(base / "fifo" / "owner")  # nobody ever writes it: reading it would wait forever
    (base / "linked" / "daemon.toml").symlink_to(elsewhere)
    (base / "plain" / "daemon.toml").write_text("")
    for name in ("fifo", "linked", "plain"):
        os.utime(base / name, (time.time() - 3600, time.time() - 3600))
    found: dict[str, list[str]] = {}
    reaping = threading.Thread(
        target=lambda: found.update(removed=private.reap_leftovers(str(base))), daemon=True
    )
    reaping.start()
    reaping.join(10)
    assert not reaping.is_alive(), "reaping waits on the owner file that is a FIFO"
    assert sorted(os.path.basename(path) for path in found["removed"]) == [
        "fifo",
        "linked",
        "plain",
    ]
    assert ran == [str(base / "plain" / "daemon.toml")]  # not the linked one's
    assert os.listdir(base) == [] and elsewhere.exists()


def test_a_clean_up_that_hangs_is_given_up_and_its_directory_kept_for_the_next(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(private, "CLEAN_UP_TIMEOUT", 0.5)
    monkeypatch.setattr(private.subprocess, "run", _a_clean_up_that_hangs)
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    stuck = base / "stuck"
    stuck.mkdir(mode=0o700)
    (stuck / "daemon.toml").write_text("")
    os.utime(stuck, (time.time() - 3600, time.time() - 3600))
    assert private.reap_leftovers(str(base)) == []
    assert stuck.is_dir()
    assert "did not end within 0.5 s: left for the next elasticrun" in capsys.readouterr().err


_real_run = subprocess.run


def _a_clean_up_that_hangs(argv, **kwargs):
    return _real_run(["sleep", "30"], **kwargs)


@needs_root
def test_another_users_directory_in_the_base_is_neither_cleaned_up_with_nor_removed(
    tmp_path, monkeypatch
):
    ran = []
    monkeypatch.setattr(private.subprocess, "run", lambda argv, **_: ran.append(argv[-1]))
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    (theirs / "daemon.toml").write_text("")
    (theirs / "owner").write_text("{}")
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    os.utime(theirs, (time.time() - 3600, time.time() - 3600))
    assert private.reap_leftovers(str(base)) == []
    private.clean_up(str(theirs))
    assert ran == [] and (theirs / "daemon.toml").exists()


def test_a_daemons_clean_up_follows_no_link_at_its_checkpoints_root(tmp_path):
    precious = tmp_path / "victim" / "precious"
    precious.mkdir(parents=True)
    (precious / "data").write_text("secret")
    runtime = tmp_path / "run"
    runtime.mkdir()
    (runtime / "checkpoints").symlink_to(tmp_path / "victim")
    assert remove_leftovers(str(runtime / "checkpoints")) == []
    assert (precious / "data").read_text() == "secret"
    (tmp_path / "real" / "checkpoints" / "j-1").mkdir(parents=True)
    assert remove_leftovers(str(tmp_path / "real" / "checkpoints")) == ["j-1"]
