"""A local user probing what a root daemon can see (docs/security.md, "Jobs run as their user"): whether a file exists
in a directory the user cannot read must not show in any answer, and no worker may start in
a directory the user could not enter."""

from __future__ import annotations

import json
import pwd
import subprocess

from harness import FIXTURES, needs_root, python_for_everyone


def as_nobody(socket_path: str, op: str, args: dict) -> dict:
    """One raw request as nobody, without elasticctl's own checks."""
    nobody = pwd.getpwnam("nobody")
    done = subprocess.run(
        ["/usr/bin/python3", str(FIXTURES / "flood.py"), socket_path, "once", op, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=60,
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
        cwd="/",
    )
    return json.loads(done.stdout)


@needs_root
def test_submit_tells_nobody_whether_a_file_exists_where_it_cannot_look(daemon, shared_tmp):
    secret = shared_tmp / "secret"
    secret.mkdir(mode=0o700)
    (secret / "there.py").write_text("print('hi')\n")
    answers = [
        daemon.ctl_run("submit", "--workdir", str(secret), name, user="nobody")
        for name in ("there.py", "missing.py")
    ]
    assert [a.returncode for a in answers] == [1, 1]
    assert (
        answers[0].stderr
        == answers[1].stderr
        == f"elasticctl: submit: workdir {secret}: Permission denied\n"
    )


@needs_root
def test_the_daemon_itself_looks_at_nothing_and_workers_enter_the_workdir_as_the_user(
    daemon, shared_tmp
):
    """Straight to the socket (no elasticctl): both jobs are taken and both fail the same
    way, as nobody; a readable directory under an unreadable one is not entered either
    (Popen's cwd= used to chdir as root before dropping to the user)."""
    python = f"{python_for_everyone()}/bin/python3"
    secret = shared_tmp / "secret"
    secret.mkdir(mode=0o700)
    inside = secret / "open"
    inside.mkdir(mode=0o755)
    (inside / "there.py").write_text("print(open('data.txt').read())\n")
    (inside / "data.txt").write_text("the secret\n")
    errors = []
    for name in ("there.py", "missing.py"):
        reply = as_nobody(
            daemon.socket,
            "submit",
            {"argv": [name], "python": python, "workdir": str(inside), "env": {}},
        )
        assert reply["ok"], reply
        job = reply["result"]["id"]
        done = daemon.wait_job(job, lambda d: d["state"] == "FAILED", timeout=60)
        errors.append((done["error"]["exit_code"], done["error"]["message"]))
        assert "the secret" not in daemon.ctl_run("logs", job).stdout
    assert (
        errors[0]
        == errors[1]
        == (126, "exited with code 126 (the working directory could not be entered)")
    )
