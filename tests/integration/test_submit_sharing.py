"""What users give the scheduler at submit (docs/scheduler.md), through the real elasticctl and a real
daemon: --priority, --account, --preemptible and --nnodes-step land in the job's spec and
`elasticctl status` shows them; the account defaults to the submitter's primary group; a
user who is not root or an admin may charge only a group they are in and ask a priority up
to their bound, refused with what to do and nothing made; the config's [scheduler] section
raises the bound."""

from __future__ import annotations

import grp
import pwd
import uuid
from pathlib import Path

from harness import Daemon, free_port, needs_root, worker_args
from local_users import local_users


def primary_group(user: str) -> str:
    return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name


def job_ids(daemon: Daemon) -> set[str]:
    rows = daemon.ctl("list", "--all")
    return {row["id"] for row in rows}


def refused(daemon: Daemon, *args: str, user: str, cwd: Path) -> str:
    """A submit that the daemon refuses: exit 1, its message, and no job made."""
    before = job_ids(daemon)
    done = daemon.ctl_run("submit", *args, *worker_args(), user=user, cwd=str(cwd))
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert job_ids(daemon) == before
    return done.stderr


def one_node_cluster(daemon_factory, shared_tmp: Path, config: str = "") -> Daemon:
    """A daemon that hosts its cluster's store (not standalone: a job may ask for more nodes
    than it has, and waits for them)."""
    path = shared_tmp / "cluster.toml"
    path.write_text("[node]\npeer_port = 0\n" + config)
    return daemon_factory(
        "sh1",
        standalone=False,
        args=(
            "--config",
            str(path),
            "--cluster",
            f"sh-{uuid.uuid4().hex[:8]}",
            "--store",
            f"127.0.0.1:{free_port()}",
            "--store-host",
            "--node-address",
            "127.0.0.1",
            "--slots",
            "2",
            "--allow-root",
        ),
    ).start()


def test_the_options_land_in_the_spec_and_status_shows_them(daemon_factory, shared_tmp):
    daemon = one_node_cluster(daemon_factory, shared_tmp)
    job = daemon.submit(
        "--priority",
        "7",
        "--account",
        "ml",
        "--preemptible",
        "--nnodes",
        "2:4",
        "--nnodes-step",
        "2",
        *worker_args("--sleep", "0"),
    )
    assert (job["priority"], job["account"], job["preemptible"], job["nnodes_step"]) == (
        7,
        "ml",
        True,
        2,
    )
    shown = daemon.ctl_run("status", job["id"])
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = lines.index("account:      ml")
    assert lines[at : at + 4] == [
        "account:      ml",
        "priority:     7",
        "nnodes step:  2",
        "preemptible:  yes",
    ]
    plain = daemon.submit("--priority", "-2", *worker_args("--sleep", "0"))
    assert (plain["priority"], plain["account"], plain["preemptible"], plain["nnodes_step"]) == (
        -2,
        "root",
        False,
        1,
    )
    text = daemon.ctl_run("status", plain["id"]).stdout
    assert "account:      root" in text and "priority:     -2" in text
    assert "nnodes step" not in text and "preemptible" not in text
    for ended in (job, plain):
        assert daemon.ctl("cancel", ended["id"])["state"] == "CANCELLED"


def test_a_step_that_no_count_fits_is_refused(daemon):
    done = daemon.ctl_run("submit", "--nnodes", "3:3", "--nnodes-step", "2", *worker_args())
    assert done.returncode == 1
    assert "no node count from 3 to 3 is a multiple of --nnodes-step 2" in done.stderr
    standalone = daemon.ctl_run("submit", "--nnodes", "1:4", "--nnodes-step", "2", *worker_args())
    assert standalone.returncode == 1
    assert "a job needing 2 nodes (--nnodes-step 2) can never start" in standalone.stderr
    assert job_ids(daemon) == set()


@needs_root
def test_a_user_charges_their_primary_group_and_no_group_of_others(daemon, shared_tmp):
    group = primary_group("nobody")
    job = daemon.ctl("submit", *worker_args(), user="nobody", cwd=str(shared_tmp))
    assert (job["user"], job["account"]) == ("nobody", group)
    assert daemon.ctl("status", job["id"])["account"] == group
    named = daemon.ctl(
        "submit", "--account", group, *worker_args(), user="nobody", cwd=str(shared_tmp)
    )
    assert named["account"] == group
    said = refused(daemon, "--account", "root", user="nobody", cwd=shared_tmp)
    assert said == (
        f"elasticctl: --account root: nobody may charge jobs only to a group they are "
        f"in ({group}); root and the admin group may name any account\n"
    )
    anyone = daemon.submit("--account", "physics", *worker_args())  # root may name any
    assert anyone["account"] == "physics"


@needs_root
def test_a_priority_over_the_bound_is_refused_until_the_config_raises_it(
    daemon_factory, shared_tmp
):
    config = shared_tmp / "sched.toml"
    config.write_text("[scheduler]\nmax_priority = 2\n")
    daemon = daemon_factory(args=("--config", str(config), "--slots", "2")).start()
    assert (
        daemon.ctl("submit", "--priority", "2", *worker_args(), user="nobody", cwd=str(shared_tmp))[
            "priority"
        ]
        == 2
    )
    assert (
        daemon.ctl(
            "submit", "--priority", "-1000", *worker_args(), user="nobody", cwd=str(shared_tmp)
        )["priority"]
        == -1000
    )
    said = refused(daemon, "--priority", "5", user="nobody", cwd=shared_tmp)
    assert said == (
        "elasticctl: --priority 5 is over 2, the highest nobody may ask "
        "(scheduler.max_priority = 2): an operator raises it with "
        "scheduler.priority_users.nobody or scheduler.priority_groups.<group>\n"
    )
    assert daemon.submit("--priority", "1000", *worker_args())["priority"] == 1000  # root: any

    daemon.stop()
    config.write_text("[scheduler]\nmax_priority = 2\npriority_users = {nobody = 5}\n")
    daemon.start()
    job = daemon.ctl(
        "submit", "--priority", "5", *worker_args(), user="nobody", cwd=str(shared_tmp)
    )
    assert daemon.ctl("status", job["id"])["priority"] == 5
    said = refused(daemon, "--priority", "6", user="nobody", cwd=shared_tmp)
    assert (
        "--priority 6 is over 5, the highest nobody may ask (scheduler.priority_users.nobody = 5)"
        in said
    )


@needs_root
def test_a_group_raises_its_members_bound_and_may_be_charged_by_them(daemon_factory, shared_tmp):
    """A secondary group counts for both: its members may charge it and ask its bound; a
    user outside it may do neither."""
    with local_users("admin_member", "outsider", admin_group=True) as users:
        # users["admins"] is a plain group here: the daemon's admin group is another
        group, member = users["admins"], users["admin_member"]
        config = shared_tmp / "groups.toml"
        config.write_text(
            f'[control]\nadmin_group = "no-such-group-{group}"\n'
            f"[scheduler]\npriority_groups = {{{group} = 50}}\n"
        )
        daemon = daemon_factory(args=("--config", str(config), "--slots", "2")).start()
        job = daemon.ctl(
            "submit",
            "--account",
            group,
            "--priority",
            "50",
            *worker_args(),
            user=member,
            cwd=str(shared_tmp),
        )
        assert (job["account"], job["priority"]) == (group, 50)
        assert (
            daemon.ctl("submit", *worker_args(), user=member, cwd=str(shared_tmp))["account"]
            == member
        )  # useradd -U: own group
        outsider = users["outsider"]
        said = refused(daemon, "--account", group, user=outsider, cwd=shared_tmp)
        assert (
            f"--account {group}: {outsider} may charge jobs only to a group they are in ({outsider})"
            in said
        )
        said = refused(daemon, "--priority", "50", user=outsider, cwd=shared_tmp)
        assert (
            f"--priority 50 is over 0, the highest {outsider} may ask (scheduler.max_priority = 0)"
            in said
        )
        for row in daemon.ctl("list"):
            if row["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                daemon.ctl("cancel", row["id"])
        daemon.stop()  # before its users go
