"""`elasticctl usage` (sreport's job; docs/scheduler.md) against a real daemon: two users' jobs run
on a node with GPUs, and the node-, slot- and GPU-seconds per user and per account match
their run times; the filters by user, account and time work, for anyone who asks, and show
nothing of what a job runs; bad times are refused and the daemon goes on; the numbers come
back from the history after a restart."""

from __future__ import annotations

import datetime
import grp
import json
import pwd
import time
import uuid
from typing import Any

import pytest
from harness import fake_nvidia_smi, needs_root, worker_args
from store_attack import Cluster, wait_for

SECRET = "s3cr3t-usage"
SLEEP = 2.0
BOUND = 1.0  # seconds a node's span may differ from the job's start-to-end (its reports' times)


def final(daemon, job_id: str, state: str = "SUCCEEDED") -> dict:
    """The job's status once its nodes' parts reported their own end too (it follows the
    job's outcome by a moment)."""

    def ended() -> dict | None:
        doc = daemon.ctl("status", job_id)
        return (
            doc if doc["nodes"] and all(node["state"] == state for node in doc["nodes"]) else None
        )

    return wait_for(ended, 60, f"job {job_id}'s parts {state}")


def rows(doc: dict, by: str) -> dict[str, dict]:
    return {row[by]: row for row in doc[f"{by}s"]}


def numbers(row: dict) -> tuple:
    return row["node_seconds"], row["slot_seconds"], row["gpu_seconds"], row["jobs"]


def check(row: dict, job: dict, slots: int, gpus: int) -> None:
    ran = job["ended"] - job["started"]
    assert SLEEP <= row["node_seconds"] and abs(row["node_seconds"] - ran) <= BOUND, (row, ran)
    assert abs(row["slot_seconds"] - slots * row["node_seconds"]) < 1e-6
    assert abs(row["gpu_seconds"] - gpus * row["node_seconds"]) < 1e-6
    assert row["jobs"] == 1


@needs_root
def test_usage_per_user_and_account_matches_the_jobs_run_times(daemon_factory, shared_tmp):
    daemon = daemon_factory(
        f"usage-{uuid.uuid4().hex[:6]}",
        args=("--slots", "4"),
        env=fake_nvidia_smi(shared_tmp / "bin", 2),
    ).start()
    nobody = pwd.getpwnam("nobody")
    nogroup = grp.getgrgid(nobody.pw_gid).gr_name
    secret_dir = shared_tmp / SECRET
    secret_dir.mkdir()

    # root's job: 2 workers (2 slots, 2 of the node's GPUs); then nobody's: 1 worker, 1 GPU
    root_job = daemon.submit_wait(
        "--nproc-per-node",
        "2",
        "--env",
        f"TOKEN={SECRET}",
        *worker_args("--sleep", str(SLEEP), "--pid-dir", str(secret_dir)),
    )
    root_job = final(daemon, root_job["id"])
    between = time.time()
    their_job = daemon.submit_wait(
        "--nproc-per-node",
        "1",
        *worker_args("--sleep", str(SLEEP)),
        user="nobody",
        cwd=str(shared_tmp),
    )
    their_job = final(daemon, their_job["id"])
    assert root_job["state"] == their_job["state"] == "SUCCEEDED"

    everything = daemon.ctl("usage")
    users, accounts = rows(everything, "user"), rows(everything, "account")
    assert set(users) == {"root", "nobody"} and set(accounts) == {"root", nogroup}
    check(users["root"], root_job, slots=2, gpus=2)
    check(users["nobody"], their_job, slots=1, gpus=1)
    assert numbers(accounts["root"]) == numbers(users["root"])
    assert numbers(accounts[nogroup]) == numbers(users["nobody"])
    assert everything["since"] is None and everything["until"] <= everything["now"]

    # anyone may ask, for anyone; the filters
    theirs = daemon.ctl("usage", "--user", "nobody", user="nobody")
    assert list(rows(theirs, "user")) == ["nobody"] and list(rows(theirs, "account")) == [nogroup]
    assert rows(theirs, "user")["nobody"] == users["nobody"]
    assert list(rows(daemon.ctl("usage", "--account", "root"), "user")) == ["root"]
    nobodys = daemon.ctl("usage", "--user", "no-such-user")
    assert nobodys["users"] == nobodys["accounts"] == []
    iso = datetime.datetime.fromtimestamp(between).isoformat()
    later = daemon.ctl("usage", "--since", iso)
    assert list(rows(later, "user")) == ["nobody"] and abs(later["since"] - between) < 1e-3
    assert rows(later, "user")["nobody"] == users["nobody"]  # it ran wholly after `between`
    earlier = daemon.ctl("usage", "--until", iso)
    assert (
        list(rows(earlier, "user")) == ["root"] and rows(earlier, "user")["root"] == users["root"]
    )
    assert set(rows(daemon.ctl("usage", "--since", "1h"), "user")) == {"root", "nobody"}

    # the table, as another user sees it: names and numbers, nothing of what the jobs ran
    table = daemon.ctl_run("usage", user="nobody")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("usage from the oldest job known (ended jobs are kept 30d) to ")
    assert lines[2].split() == ["USER", "NODE-HOURS", "SLOT-HOURS", "GPU-HOURS", "JOBS"]
    assert {line.split()[0] for line in lines[3:5]} == {"root", "nobody"}
    assert all(line.split()[1:] == ["<0.01", "<0.01", "<0.01", "1"] for line in lines[3:5])
    shown = table.stdout + json.dumps(everything) + json.dumps(theirs)
    assert SECRET not in shown and root_job["id"] not in shown and "worker.py" not in shown

    # bad input: refused, clearly, and the daemon goes on
    bad = daemon.ctl_run("usage", "--since", "yesterday-ish")
    assert bad.returncode == 2 and "argument --since: expected an ISO date or time" in bad.stderr
    assert "got 'yesterday-ish'" in bad.stderr
    backwards = daemon.ctl_run("usage", "--since", "1h", "--until", "2h")
    assert (
        backwards.returncode == 2 and "--since must be before --until and now" in backwards.stderr
    )
    for args, code in (
        ({"since": "yesterday"}, "bad_request"),
        ({"since": 10.0, "until": 5.0}, "invalid_spec"),
        ({"since": 1e300}, "bad_request"),  # past 9999-12-31
        ({"user": 3}, "bad_request"),
    ):
        reply = daemon.request("usage", **args)
        assert not reply.ok and reply.code == code, (args, reply)
    assert daemon.proc.poll() is None and rows(daemon.ctl("usage"), "user") == users

    # ended jobs come back from the history: the same numbers after a restart
    daemon.stop()
    daemon.start()
    assert (
        rows(daemon.ctl("usage"), "user") == users
        and rows(daemon.ctl("usage"), "account") == accounts
    )


def world(daemon, job_id: str, size: int) -> dict:
    """The job's document once it runs with ``size`` workers, all up."""
    return daemon.wait_job(
        job_id,
        lambda d: (
            d["state"] == "RUNNING"
            and d["world_size"] == size
            and sum(w["state"] == "HEALTHY" for w in d["workers"]) == size
        ),
        timeout=120,
    )


@pytest.mark.slow
def test_a_node_that_leaves_a_job_and_takes_it_again_is_charged_both_spans_not_the_gap(
    daemon_factory: Any, shared_tmp
) -> None:
    """The shrink-then-grow of a shared cluster (a drain here): the node's part of the job
    is a new part when it comes back, and its first span is still charged; the time between
    is not."""
    cluster = Cluster(daemon_factory, shared_tmp, prefix="usage")
    a, b = cluster.add("a"), cluster.add("b")
    cluster.start()
    job = a.submit("--nnodes", "1:2", "--last-call-timeout", "1", *worker_args("--sleep", "0"))[
        "id"
    ]
    started = world(a, job, 2)["started"]  # a's first run; b's is between it and now
    both = time.time()
    time.sleep(2)  # b's first span
    drained = time.time()
    a.ctl("drain", b.name)
    world(a, job, 1)
    left = time.time()  # b's part LEFT between `drained` and now
    time.sleep(6)  # the gap: b holds nothing of the job (more than the 5 s of margins below)
    undrained = time.time()
    a.ctl("undrain", b.name)
    world(a, job, 2)
    back = time.time()  # b runs the job again, since `undrained` at the earliest
    time.sleep(2)
    a.ctl("cancel", job)
    ended = final(a, job, "STOPPED")["ended"]
    wait_for(lambda: final(b, job, "STOPPED"), 60, "b saw the end too")

    # each span between what the test saw from outside, with a second for the parts' own
    # reports (a node's part ends a moment after the job's outcome)
    low = (ended - started) + (drained - both) + (ended - back)
    high = (ended - started + 1) + (left - started) + (ended + 1 - undrained)
    for daemon in (a, b):  # every node's view: b's earlier span came with its new part
        used = daemon.ctl("usage")["users"][0]["node_seconds"]
        assert low <= used <= high, (low, used, high)
    assert high < 2 * (ended - started) - 3  # had the gap been charged, it would show
