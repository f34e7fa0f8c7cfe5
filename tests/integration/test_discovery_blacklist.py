"""Host discovery and the blacklist, with real daemons of one cluster and real workers.

Discovery: a script that prints a file the test rewrites; a node it adds takes a share of a
running job (which grows), a node it removes leaves it (which shrinks).  Blacklist: the jobs
of a user whose workers keep failing on a node are kept off it, the other users' stay; a
node where several users' jobs keep failing is kept out of new work, shown as blacklisted
with the time left on every node, and readmitted when its cooldown ends, or at once by
`elasticctl undrain`.

Waits are on the daemons' own job streams, or polls of `elasticctl nodes` with a deadline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness import Daemon, needs_root, worker_args
from local_users import local_users
from store_attack import Cluster, metric, node_states, wait_for

# A worker that fails at once on the node whose state dir is given, while the marker file
# exists, and sleeps otherwise.  The error file torchrun's contract gives every worker lies
# in its node's state dir: that is how the worker knows where it runs.
FAILING_WORKER = """\
import os, sys, time
marker, state_dir = sys.argv[1], sys.argv[2]
if os.path.exists(marker) and os.environ["TORCHELASTIC_ERROR_FILE"].startswith(state_dir + "/"):
    sys.exit("failing on purpose")
time.sleep(3600)
"""


def executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def node(daemon: Daemon, name: str) -> dict[str, Any]:
    return next(n for n in daemon.ctl("nodes") if n["name"] == name)


def running_on(doc: dict[str, Any], names: list[str]) -> bool:
    """The job runs, on exactly these nodes, every worker up."""
    return (
        doc["state"] == "RUNNING"
        and sorted(n["node"] for n in doc["nodes"]) == sorted(names)
        and len(doc["workers"]) == doc["world_size"]
        and all(w["state"] == "HEALTHY" and w["pid"] for w in doc["workers"])
    )


def test_discovery_grows_and_shrinks_a_job_and_a_failing_script_changes_nothing(
    daemon_factory, shared_tmp
):
    cluster = Cluster(daemon_factory, shared_tmp, prefix="dsc", firewall=False)
    hosts = shared_tmp / "hosts"
    script = executable(shared_tmp / "discover", f"#!/bin/sh\nexec cat {hosts}\n")
    config = f'[discovery]\nscript = "{script}"\ninterval = 0.2\n'
    a, b = cluster.add("a", config=config), cluster.add("b", config=config)
    hosts.write_text(f"# only a\n{a.name}\n")
    a.start()
    b.start()
    wait_for(lambda: node_states(a) == {a.name: "up", b.name: "drained"}, 20, "b is not listed")
    assert "drained (not listed)" in a.ctl_run("nodes").stdout
    assert metric(b, "elasticd_node_listed") == 0 and metric(a, "elasticd_node_listed") == 1

    job = a.submit("--nnodes", "1:2", *worker_args("--sleep", "0"))["id"]
    a.wait_job(job, lambda d: running_on(d, [a.name]))

    hosts.write_text(f"{a.name}\n{b.name}:3\n")  # b may take work, with 3 slots
    grown = a.wait_job(job, lambda d: running_on(d, [a.name, b.name]) and d["world_size"] == 2)
    assert grown["restarts"] == 0  # a membership change spends no restart
    wait_for(
        lambda: (lambda n: (n["state"], n["slots_total"]))(node(a, b.name)) == ("up", 3),
        20,
        "b up with the slots the script gave it",
    )

    hosts.write_text(f"{a.name}\n")  # b leaves the job through a new round
    shrunk = a.wait_job(job, lambda d: running_on(d, [a.name]) and d["world_size"] == 1)
    assert shrunk["restarts"] == 0
    assert b.ctl("status", job)["nodes"] == shrunk["nodes"]
    wait_for(
        lambda: node_states(a)[b.name] == "drained" and node(a, b.name)["slots_total"] == 2,
        20,
        "b drained again, with its own slots",
    )

    hosts.unlink()  # the script fails from now on: counted, and the last list stays in force
    wait_for(lambda: metric(a, "elasticd_discovery_failures_total") >= 3, 20, "failures counted")
    assert node_states(b) == {a.name: "up", b.name: "drained"}
    assert a.ctl("status", job)["state"] == "RUNNING"
    assert "host discovery failed" in a.log_text()
    a.ctl("cancel", job)


def test_a_discovery_script_that_fails_at_start_stops_the_daemon(daemon_factory, shared_tmp):
    script = executable(shared_tmp / "discover", "#!/bin/sh\necho 'no inventory' >&2\nexit 3\n")
    config = shared_tmp / "discovery.toml"
    config.write_text(f'[discovery]\nscript = "{script}"\n')
    daemon = daemon_factory(args=("--config", str(config))).start(wait=False)
    assert daemon.wait_exit(30) == 1
    errors = [line for line in daemon.log_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "config key 'discovery.script'" in errors[0]
    assert f"{script} failed (exit status 3): 'no inventory'" in errors[0]
    assert not os.path.exists(daemon.socket)


def blacklisting_cluster(daemon_factory, shared_tmp, prefix: str, blacklist: str) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix=prefix, firewall=False)
    config = f"[blacklist]\n{blacklist}"
    cluster.add("a", config=config)
    cluster.add("b", config=config)
    return cluster.start()


def pid_of(doc: dict[str, Any]) -> int:
    (worker,) = doc["workers"]
    return worker["pid"]


def kept_off(daemon: Daemon, user: str) -> int:
    """How many times ``daemon`` kept ``user``'s jobs off its node (its log says so)."""
    return daemon.log_path.read_text(errors="replace").count(f"jobs of {user} kept off it")


@needs_root
def test_one_users_failing_job_does_not_drain_anothers_but_two_users_failing_blacklist_the_node(
    daemon_factory, shared_tmp
):
    """Issue 24, 0d: a job of X that keeps failing on b is kept off b (again at the end of each
    cooldown), while Y's job on b runs on untouched; when Y's jobs fail on b too, b is
    blacklisted: everyone leaves it, it takes no job, and it is readmitted when its cooldown
    ends."""
    a, b = blacklisting_cluster(
        daemon_factory, shared_tmp, "blk", "failures = 2\nwindow = 60\ncooldown_range = [6, 12]\n"
    )
    marker = shared_tmp / "fail-on-b"
    marker.touch()
    worker = executable(shared_tmp / "worker.py", FAILING_WORKER)
    with local_users("x", "y") as users:
        x, y = users["x"], users["y"]
        quiet = a.submit("--nodes", b.name, *worker_args("--sleep", "0"), user=y)["id"]
        before = a.wait_job(quiet, lambda d: running_on(d, [b.name]))
        failing = a.submit(
            "--nnodes", "1:2", "--max-restarts", "20", worker, marker, str(b.state_dir), user=x
        )["id"]

        # x's workers fail on b twice: x's job is kept off b and goes on on a; y's stays
        wait_for(lambda: kept_off(b, x) >= 1, 60, "x's jobs kept off b")
        a.wait_job(failing, lambda d: running_on(d, [a.name]))
        # and again when the cooldown ends: x's job rejoins b, fails there, is kept off again
        wait_for(lambda: kept_off(b, x) >= 2, 90, "x's jobs kept off b a second time")
        after = a.ctl("status", quiet)
        assert running_on(after, [b.name]) and pid_of(after) == pid_of(before), after
        assert (after["round"], after["restarts"]) == (before["round"], 0)  # never drained
        assert (
            node_states(a)[b.name] == "up" and metric(b, "elasticd_node_blacklistings_total") == 0
        )

        # now y's jobs fail on b as well: two users' jobs failing there blacklist the node
        also = a.submit(
            "--nodes", b.name, "--max-restarts", "20", worker, marker, str(b.state_dir), user=y
        )["id"]
        seen = wait_for(
            lambda: (lambda n: n if n["state"] == "blacklisted" else None)(node(b, b.name)),
            60,
            "b blacklisted",
        )
        assert 0 < seen["blacklisted_until"] - seen["last_seen"] <= 12.5
        assert kept_off(b, y) == 1
        marker.unlink()  # from now on b's workers would run
        for job_id in (failing, also):  # (and take b's slots)
            a.ctl("cancel", job_id)
        wait_for(
            lambda: (
                "blacklisted ("
                in next(
                    line
                    for line in a.ctl_run("nodes").stdout.splitlines()
                    if line.startswith(b.name)
                )
            ),
            10,
            "a shows b blacklisted with the time left",
        )
        assert metric(b, "elasticd_node_blacklisted") == 1
        assert metric(b, "elasticd_node_blacklistings_total") == 1
        a.wait_job(
            quiet,
            lambda d: (
                d["state"] != "RUNNING"
                or b.name not in [n["node"] for n in d["nodes"] if n["state"] == "RUNNING"]
            ),
        )  # y's job left b

        # a job only b may run (root's) is not taken while b is blacklisted
        pinned = a.submit("--nodes", b.name, *worker_args("--sleep", "0"))["id"]
        assert node_states(b)[b.name] == "blacklisted"  # still, after the submit

        def readmitted() -> bool:  # the job's state first: b may be readmitted between the two
            state = a.ctl("status", pinned)["state"]
            up = node_states(b)[b.name] == "up"
            if not up:
                assert state == "PENDING", "a blacklisted node took work"
            return up

        wait_for(readmitted, 30, "b readmitted when its cooldown ended")

        a.wait_job(pinned, lambda d: running_on(d, [b.name]))  # b takes work again
        a.wait_job(quiet, lambda d: running_on(d, [b.name]))  # y's job too, once y's cooldown ended
        assert metric(b, "elasticd_node_blacklisted") == 0
        wait_for(lambda: node_states(a)[b.name] == "up", 10, "a sees b up")
        for job_id in (quiet, pinned):
            a.ctl("cancel", job_id)


def test_undrain_lifts_a_blacklisting_at_once(daemon_factory, shared_tmp):
    a, b = blacklisting_cluster(
        daemon_factory,
        shared_tmp,
        "bku",
        "failures = 1\nwindow = 60\ncooldown_range = [300, 300]\n",
    )
    for user in ("root", "nobody"):  # two users' jobs fail on b: it is blacklisted
        # (a worker that exits 1 at once: worker.py's --fail-rank would start torch for @record)
        failed = a.ctl(
            "submit",
            "--wait",
            "--nodes",
            b.name,
            "--no-python",
            "/bin/false",
            expect=1,
            user=None if user == "root" else user,
        )[-1]
        assert failed["state"] == "FAILED"
    wait_for(lambda: node_states(a)[b.name] == "blacklisted", 20, "a sees b blacklisted")
    assert "blacklisted (4m" in a.ctl_run("nodes").stdout  # some 300 s left

    assert a.ctl("undrain", b.name) == {"name": b.name, "drain": False}
    wait_for(lambda: node_states(a)[b.name] == "up", 20, "b readmitted by undrain")
    assert metric(b, "elasticd_node_blacklisted") == 0
    job = a.submit("--nodes", b.name, *worker_args("--sleep", "0"))[
        "id"
    ]  # root's, kept off no more
    a.wait_job(job, lambda d: running_on(d, [b.name]))
    a.ctl("cancel", job)
