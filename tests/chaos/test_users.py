"""Users against each other through the control socket (docs/security.md, "Who calls" and "What others see of a job"): a local
user (nobody) floods the daemon with huge submits and with as many allowed ones as it may
have, and another user's `elasticctl list` and `status` keep working, before and after a
restart; a job's arguments, error text and traceback are shown to its owner, root and the
admin group, not to other users.  Real daemons, real elasticctl, users made by the test."""

from __future__ import annotations

import json
import pwd
import subprocess
import uuid
from typing import Any

import psutil
from harness import CLIENT_ENV, FIXTURES, Control, needs_root, python_for_everyone
from local_users import local_users

from elasticd.wire import protocol

KiB, MiB = 1 << 10, 1 << 20
SUBMIT_MANY = FIXTURES / "submit_many.py"
SLEEPER = ["--no-python", "/bin/sh", "-c", "sleep 3600"]  # then the padding, as $0 $1 ...


def padding(total: int, piece: int = 30 * KiB) -> list[str]:
    """Arguments of ``total`` bytes or so, each small enough for execve (128 KiB at most)."""
    return [chr(ord("a") + i % 26) * piece for i in range(max(1, total // piece))]


def flood(daemon, user: str, count: int, pad: int, *submit: str) -> dict[str, Any]:
    """submit_many.py as ``user``: ``count`` submits of one job, with ``pad`` bytes of more
    arguments, over one connection."""
    account = pwd.getpwnam(user)
    done = subprocess.run(
        [
            f"{python_for_everyone()}/bin/python3",
            str(SUBMIT_MANY),
            daemon.socket,
            str(count),
            str(pad),
            *submit,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**CLIENT_ENV, "HOME": "/"},
        cwd=str(daemon.base),
        user=account.pw_uid,
        group=account.pw_gid,
        extra_groups=[],
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def unique(name: str) -> str:
    """A node name of this run alone: a daemon kills what it finds in its node's job cgroups
    at start, so daemons of tests that run at once on one host must not share names."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


def rss(daemon) -> int:
    return psutil.Process(daemon.proc.pid).memory_info().rss


def list_frames(daemon) -> list[int]:
    """The size of each reply of the `list --all` stream (read by hand, as bytes)."""
    with Control(daemon.socket) as control:
        return [len(json.dumps(result)) for result in control.stream("list", {"all": True}, 60)]


@needs_root
def test_a_flood_of_submits_is_refused_early_and_everyone_can_still_list(daemon_factory, figures):
    daemon = daemon_factory(unique("flood"), args=("--slots", "1")).start()
    with local_users("other") as users:
        other = users["other"]
        before = rss(daemon)

        # 0c as it was done: 80 submits of ~3.6 MiB of arguments each, refused one by one
        huge = flood(daemon, "nobody", 80, int(3.6 * MiB), *SLEEPER)
        assert huge["accepted"] == [] and sum(huge["refused"].values()) == 80, huge
        (refusal,) = huge["refused"]
        assert refusal.startswith("limit_exceeded: the job's command line is ")
        assert "(jobs.max_argv_bytes = 131072)" in refusal
        figures.add("0c: 80 submits of 3.6 MiB refused in (s)", str(huge["seconds"]))
        grown = rss(daemon) - before
        figures.add("0c: daemon memory after them (MiB more)", f"{grown / MiB:.0f}")
        assert grown < 200 * MiB  # was 1.4 GB

        # through elasticctl (whose own command line must fit execve): arguments and an
        # environment over their caps
        done = daemon.ctl_run("submit", *SLEEPER, *padding(200 * KiB), user="nobody")
        assert done.returncode == 1 and "jobs.max_argv_bytes" in done.stderr, done.stderr
        big = {f"BIG{i}": "x" * (60 * KiB) for i in range(3)}
        done = daemon.ctl_run("submit", *SLEEPER, user="nobody", env=big)
        assert done.returncode == 1, done.stderr
        assert (
            "environment (yours, with --env) is " in done.stderr
            and "jobs.max_env_bytes" in done.stderr
        )
        assert daemon.ctl("list", "--all") == []  # nothing of them was kept

        # as many allowed jobs as nobody may have (100, of ~120 KiB each), then one more;
        # root's job holds the one slot, so theirs wait (no process of theirs that anything
        # else on this host could end)
        blocker = daemon.submit(*SLEEPER)["id"]
        allowed = flood(daemon, "nobody", 101, 120 * KiB, *SLEEPER)
        assert len(allowed["accepted"]) == 100, allowed
        assert list(allowed["refused"]) == [
            "limit_exceeded: nobody has 100 jobs that have not ended, the most one user may have "
            "(jobs.max_per_user = 100): wait for some to end or cancel some"
        ]
        figures.add("0c: 101 allowed submits (s)", str(allowed["seconds"]))

        def everyone_can_list() -> list[dict[str, Any]]:
            rows = daemon.ctl("list", "--all", user=other)
            assert {r["id"] for r in rows if r["user"] == "nobody"} == set(allowed["accepted"])
            assert not any("argv" in row for row in rows)
            table = daemon.ctl_run("list", "--all", user=other)
            assert table.returncode == 0 and len(table.stdout.splitlines()) == len(rows) + 1, (
                table.stderr
            )
            status = daemon.ctl("status", allowed["accepted"][-1], user=other)
            assert (
                status["argv"] == ["/bin/sh"] and status["redacted"]
            )  # nobody's arguments stay theirs
            frames = list_frames(daemon)  # the jobs hold 12 MiB of arguments; the replies do not
            assert max(frames) <= protocol.LIST_BATCH and sum(frames) < 100 * KiB, frames
            return rows

        assert len(everyone_can_list()) == 101  # and root's
        assert daemon.ctl("submit", *SLEEPER, user=other)["id"]  # the cap is nobody's alone
        assert daemon.ctl("submit", *SLEEPER)["id"]  # root is exempt (so is the admin group)
        for job in daemon.ctl("list"):
            if job["user"] != "nobody" and job["id"] != blocker:
                daemon.ctl("cancel", job["id"])

        daemon.stop()  # the jobs are in the history: a restart reads them all back
        daemon.start()
        rows = everyone_can_list()
        assert {r["state"] for r in rows if r["user"] == "nobody"} <= {
            "CANCELLED",
            "FAILED",
        }  # all ended
        assert daemon.request("version").ok


SECRET_JOB = """\
import sys
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    raise RuntimeError(f"db password {sys.argv[1]} refused")


main()
"""
SECRET = "hunter2-s3cret"
HIDDEN = "(shown to the job's owner and admins only)"


@needs_root
def test_another_users_job_is_shown_without_its_arguments_or_error(daemon_factory, shared_tmp):
    script = shared_tmp / "secret_job.py"
    script.write_text(SECRET_JOB)
    with local_users("alice", "bob", "admin", admin_group=True) as users:
        config = shared_tmp / "admins.toml"
        config.write_text(f'[control]\nadmin_group = "{users["admins"]}"\n')
        daemon = daemon_factory(
            unique("views"), args=("--slots", "2", "--config", str(config))
        ).start()
        alice, bob, admin = users["alice"], users["bob"], users["admin"]
        docs = daemon.ctl("submit", "--wait", str(script), SECRET, user=alice, expect=1)
        job = docs[-1]["id"]
        assert docs[-1]["state"] == "FAILED" and SECRET in docs[-1]["error"]["message"]

        for viewer in (bob, "nobody"):
            shown = daemon.ctl("status", job, user=viewer)
            assert shown["argv"] == [str(script)] and shown["redacted"] is True
            assert (shown["error"]["message"], shown["error"]["traceback"]) == ("", "")
            assert (shown["error"]["rank"], shown["error"]["exit_code"], shown["state"]) == (
                0,
                1,
                "FAILED",
            )
            human = daemon.ctl_run("status", job, user=viewer)
            assert human.returncode == 0 and f"command:      {script} ... {HIDDEN}" in human.stdout
            assert f"error: {HIDDEN} (rank 0 on node" in human.stdout
            for out in (
                json.dumps(shown),
                human.stdout,
                daemon.ctl_run("list", user=viewer).stdout,
                json.dumps(daemon.ctl("list", user=viewer)),
                wait_as(daemon, viewer, job),
            ):
                assert SECRET not in out and "RuntimeError" not in out
            assert daemon.ctl_run("logs", job, user=viewer).returncode == 1  # as before

        for viewer in (alice, admin, None):  # the owner, the admin group, root
            shown = daemon.ctl("status", job, user=viewer)
            assert shown["argv"] == [str(script), SECRET] and shown["redacted"] is False
            assert f"RuntimeError: db password {SECRET} refused" in shown["error"]["message"]
            assert SECRET in shown["error"]["traceback"]
            human = daemon.ctl_run("status", job, user=viewer).stdout
            assert f"command:      {script} {SECRET}" in human and HIDDEN not in human


WAIT = """\
import json, sys
from elasticctl.client import Client
with Client(sys.argv[1]) as daemon:
    print(json.dumps(list(daemon.stream("wait", {"job": sys.argv[2]}))))
"""


def wait_as(daemon, user: str, job: str) -> str:
    """The `wait` stream of ``job`` as ``user`` sees it (elasticctl has no command for it)."""
    account = pwd.getpwnam(user)
    done = subprocess.run(
        [f"{python_for_everyone()}/bin/python3", "-c", WAIT, daemon.socket, job],
        capture_output=True,
        text=True,
        timeout=60,
        env={**CLIENT_ENV, "HOME": "/"},
        cwd="/",
        user=account.pw_uid,
        group=account.pw_gid,
        extra_groups=[],
    )
    assert done.returncode == 0 and json.loads(done.stdout)[-1]["redacted"], done.stderr
    return done.stdout
