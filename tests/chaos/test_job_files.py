"""What a job leaves on disk, against other users and against the job itself (docs/security.md,
"The files of a job on disk"), with real users, a real daemon and real workers.

Users A and B share a primary group; C is in the admin group.  On disk a job's files are what
``elasticctl logs`` allows: A's job is readable by A and C, never by B (row 1), with POSIX ACLs
and, where the file system takes none, root's alone.  The error file is read within bounds
and kept by the daemon at the worker's exit: a nested one cannot turn a failure into success
(row 0b), a 40 MiB world-writable one is kept capped and cannot be rewritten (row 3)."""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Daemon, needs_root
from local_users import account

from elasticd.shell.errorfile import MAX_BYTES, MAX_MESSAGE
from elasticd.shell.fileaccess import XATTR, Readers, acl_value

pytestmark = needs_root
MiB = 1 << 20


@dataclass(frozen=True)
class People:
    group: str  # A's and B's primary group
    admins: str  # the daemon's control.admin_group; C is in it
    a: str
    b: str
    c: str

    def uid(self, name: str) -> int:
        return pwd.getpwnam(name).pw_uid

    def gid(self, group: str) -> int:
        return grp.getgrnam(group).gr_gid


@pytest.fixture
def people() -> Iterator[People]:
    """Made for the test and removed after it (listed first by the tests, so that their
    daemons, and any worker still running as A, stop before)."""
    tag = uuid.uuid4().hex[:6]
    who = People(f"e24g{tag}", f"e24adm{tag}", f"e24a{tag}", f"e24b{tag}", f"e24c{tag}")
    made_users: list[str] = []
    made_groups: list[str] = []
    try:
        for group in (who.group, who.admins):
            account("groupadd", group)
            made_groups.append(group)
        for user, groups in (
            (who.a, ["-g", who.group]),
            (who.b, ["-g", who.group]),
            (who.c, ["-N", "-G", who.admins]),
        ):
            account("useradd", "-M", "-s", "/usr/sbin/nologin", *groups, user)
            made_users.append(user)
        yield who
    finally:
        for user in made_users:
            account("userdel", "-f", user, check=False)
        for group in made_groups:
            account("groupdel", group, check=False)


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, timeout=60)


def reads(user: str, path: Path) -> bool:
    """Whether ``user`` can open ``path`` (a file to read it, a directory to list it)."""
    return as_user(user, "ls" if path.is_dir() else "cat", str(path)).returncode == 0


def writes(user: str, path: Path) -> bool:
    return as_user(user, "sh", "-c", f"echo forged >> '{path}'").returncode == 0


def configured(
    daemon_factory: Callable[..., Daemon],
    shared_tmp: Path,
    people: People,
    *,
    acl: bool,
    unmount: list[Daemon],
) -> Daemon:
    """A daemon (not started) whose admin group is C's and whose output rotates at 64 KiB;
    without ``acl`` its log directory is a ramfs, a file system that takes no ACL (unmounted
    after the test)."""
    name = f"files-{uuid.uuid4().hex[:6]}"
    config = shared_tmp / f"{name}.toml"
    config.write_text(
        f'[control]\nadmin_group = "{people.admins}"\n[output]\nmax_bytes = 65536\nbackups = 3\n'
    )
    daemon = daemon_factory(name, args=("--slots", "2", "--config", str(config)))
    if not acl:
        logs = daemon.state_dir / "logs"
        logs.mkdir(parents=True)
        daemon.state_dir.chmod(0o755)
        subprocess.run(["mount", "-t", "ramfs", "-o", "mode=755", "ramfs", str(logs)], check=True)
        unmount.append(daemon)
    return daemon


def start(*args, **kw) -> Daemon:
    return configured(*args, **kw).start()


@pytest.fixture
def unmount() -> Iterator[list[Daemon]]:
    """Daemons whose ramfs log directory goes once they stopped."""
    daemons: list[Daemon] = []
    yield daemons
    for daemon in daemons:
        daemon.stop()
        subprocess.run(["umount", str(daemon.state_dir / "logs")], check=False)


def script(shared_tmp: Path, name: str, text: str) -> str:
    path = shared_tmp / name
    path.write_text(text)
    path.chmod(0o644)
    return str(path)


_LOUD = """
import json, os, sys
print("A's secret on stdout", flush=True)
sys.stdout.write(("x" * 1023 + "\\n") * 200)  # 200 KiB: rotated at 64 KiB
sys.stderr.write("A's secret on stderr\\n")
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump({"message": {"message": "RuntimeError: A's secret", "extraInfo": {
        "py_callstack": "Traceback: A's secret", "timestamp": "1700000000"}}}, f)
sys.exit(3)
"""


def loud_job(daemon: Daemon, shared_tmp: Path, people: People) -> tuple[dict, Path]:
    job = daemon.ctl(
        "submit",
        "--wait",
        script(shared_tmp, "loud.py", _LOUD),
        user=people.a,
        cwd=str(shared_tmp),
        expect=1,
    )[-1]
    assert job["state"] == "FAILED" and job["exit_code"] == 3, job
    assert job["error"]["message"] == "RuntimeError: A's secret", job
    return job, daemon.state_dir / "logs" / job["id"]


def test_a_group_mate_reads_nothing_of_a_job_on_disk_or_through_elasticctl(
    people, daemon_factory, shared_tmp
):
    """Row 1: B shares A's primary group and reads nothing of A's job; A and the admin C read
    all of it, on disk as through elasticctl logs, rotated files included.  A file that an
    earlier version left 0640 root:<A's group> is A's group's no more once the daemon started."""
    daemon = configured(daemon_factory, shared_tmp, people, acl=True, unmount=[])
    earlier = daemon.state_dir / "logs" / "j-e24old" / "attempt_0" / "rank_0.out"
    earlier.parent.mkdir(parents=True)
    daemon.state_dir.chmod(0o755)
    earlier.write_text("A's secret of an earlier version\n")
    os.chown(earlier, 0, people.gid(people.group))
    earlier.chmod(0o640)
    assert reads(people.b, earlier)
    daemon.start()
    assert not reads(people.b, earlier) and stat.S_IMODE(earlier.stat().st_mode) == 0o600
    job, job_dir = loud_job(daemon, shared_tmp, people)
    attempt = job_dir / "attempt_0"
    files = sorted(p for p in attempt.iterdir() if not p.name.endswith(".rotated"))
    names = {p.name for p in files}
    assert {
        "rank_0.out",
        "rank_0.out.1",
        "rank_0.out.3",
        "rank_0.err",
        "rank_0.error.json",
    } <= names
    readers = Readers(people.uid(people.a), people.gid(people.admins))
    for path in [job_dir, attempt, *files]:
        info = path.stat()
        assert (info.st_uid, info.st_gid) == (0, 0), path  # root's: the job cannot append
        assert os.getxattr(path, XATTR) == acl_value(readers, directory=path.is_dir()), path
        assert reads(people.a, path) and reads(people.c, path), path
        assert not reads(people.b, path), path
    assert not writes(people.a, attempt / "rank_0.out")
    assert "A's secret" in (attempt / "rank_0.error.json").read_text()

    for user in (people.a, people.c):
        shown = daemon.ctl_run("logs", job["id"], user=user)
        assert shown.returncode == 0 and "A's secret on stdout" in shown.stdout, shown.stderr
    refused = daemon.ctl_run("logs", job["id"], user=people.b)
    assert refused.returncode == 1 and "A's secret" not in refused.stdout + refused.stderr


def test_without_acls_only_root_reads_job_files_and_elasticctl_serves_them(
    people, daemon_factory, shared_tmp, unmount
):
    """Row 1 where the file system refuses ACLs: files 0600 root, directories 0711 (the worker
    still writes its error file), said once in the daemon's log; users read through
    elasticctl."""
    daemon = start(daemon_factory, shared_tmp, people, acl=False, unmount=unmount)
    job, job_dir = loud_job(daemon, shared_tmp, people)
    loud_job(daemon, shared_tmp, people)
    attempt = job_dir / "attempt_0"
    for path in [job_dir, attempt, *attempt.iterdir()]:
        info = path.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (
            0,
            0o711 if path.is_dir() else 0o600,
        ), path
        for user in (people.a, people.b, people.c):
            assert not reads(user, path), (user, path)
    for user in (people.a, people.c):
        shown = daemon.ctl_run("logs", job["id"], user=user)
        assert shown.returncode == 0 and "A's secret on stderr" in shown.stdout, shown.stderr
    assert daemon.ctl_run("logs", job["id"], user=people.b).returncode == 1
    assert daemon.log_text().count("takes no POSIX ACL") == 1


_NESTED = """
import os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    f.write('{"message": ' + "[" * 100000 + "]" * 100000 + "}")
sys.stderr.write("the last words on stderr\\n")
sys.exit(3)
"""


def test_a_deeply_nested_error_file_fails_the_job_with_its_exit_code(daemon, shared_tmp):
    """Row 0b: it was recorded SUCCEEDED, exit 0 (a RecursionError in the exit callback)."""
    done = daemon.ctl_run("submit", "--wait", script(shared_tmp, "nested.py", _NESTED))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "its error file was unreadable (nested more than 64 deep)" in done.stdout
    assert "the last words on stderr" in done.stderr  # the summary's stderr tail
    job = daemon.ctl("status", daemon.ctl("list", "--all")[0]["id"])
    assert (job["state"], job["exit_code"]) == ("FAILED", 3)
    assert (
        job["error"]["message"] == "exited with code 3; its error file was unreadable "
        "(nested more than 64 deep)"
    )
    assert (
        daemon.submit_wait(script(shared_tmp, "fine.py", "print('fine')\n"))["state"] == "SUCCEEDED"
    )


_HUGE = """
import os, sys
path = os.environ["TORCHELASTIC_ERROR_FILE"]
with open(path, "w") as f:
    f.write('{"message": {"message": "RuntimeError: ')
    for _ in range(40):
        f.write("y" * (1 << 20))
    f.write('", "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000"}}}')
os.chmod(path, 0o666)
print("written", flush=True)
with open(sys.argv[1], "rb") as go:
    go.read()
sys.exit(3)
"""

_HOLDER = """
import sys
held = open(sys.argv[1], "r+b")
print("open", flush=True)
sys.stdin.read()
held.write(b'{"message": "forged root cause"}' + b" " * 100)
held.close()
"""


@pytest.mark.parametrize("acl", [True, False], ids=["acl", "no-acl"])
def test_a_world_writable_40_mib_error_file_is_kept_capped_and_cannot_be_rewritten(
    people, daemon_factory, shared_tmp, unmount, acl
):
    """Row 3: the job chmods its error file 0666 and writes 40 MiB into it.  The daemon keeps
    at most 1 MiB of it, in a file of its own, at the worker's exit; status shows the message
    cut; a process that opened the worker's file before (A's own where B cannot reach it,
    B where the directories are 0711 for lack of ACLs) writes into it after, and nothing
    changes."""
    daemon = start(daemon_factory, shared_tmp, people, acl=acl, unmount=unmount)
    go = shared_tmp / "go"
    os.mkfifo(go)
    go.chmod(0o666)
    job = daemon.ctl(
        "submit", script(shared_tmp, "huge.py", _HUGE), str(go), user=people.a, cwd=str(shared_tmp)
    )["id"]
    daemon.wait_output(job, ["written"])
    path = daemon.state_dir / "logs" / job / "attempt_0" / "rank_0.error.json"
    assert path.stat().st_size == 40 * MiB + 106
    assert writes(people.b, path) is (not acl)  # 0666, behind a directory B cannot enter
    size = path.stat().st_size
    holder = subprocess.Popen(
        [
            "runuser",
            "-u",
            people.a if acl else people.b,
            "--",
            "/usr/bin/python3",
            "-c",
            _HOLDER,
            str(path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"open\n"
        with open(go, "wb"):
            pass  # the worker exits 3
        ended = daemon.wait_job(job, lambda d: d["state"] in ("FAILED", "SUCCEEDED"))
    finally:
        holder.communicate(timeout=60)  # it writes into the file it holds
    assert holder.returncode == 0

    message = ended["error"]["message"]
    assert (ended["state"], ended["exit_code"]) == ("FAILED", 3)
    assert message.startswith("RuntimeError: yyy") and len(message) < MAX_MESSAGE + 200
    assert message.endswith(
        f"[elasticd: cut here: the error file holds {size} bytes; elasticd reads {MAX_BYTES}]"
    )
    kept = path.stat()
    assert (kept.st_uid, kept.st_size) == (0, MAX_BYTES)
    assert stat.S_IMODE(kept.st_mode) == (0o640 if acl else 0o600)  # mode 0640: the ACL's mask
    assert path.read_bytes().startswith(b'{"message": {"message": "RuntimeError: yyy')
    assert not writes(people.b, path) and not writes(people.a, path)
    assert daemon.ctl("status", job)["error"] == ended["error"]
    shown = daemon.ctl_run("status", job, user=people.a)
    assert (
        shown.returncode == 0
        and "RuntimeError: yyy" in shown.stdout
        and "forged" not in shown.stdout
    )
