"""``submit --warm-restart``: a restart's workers are made of standbys, interpreters the
daemon started beside the round before, torch already imported (elastic/standby.py), and
they run the script as a fresh worker would: the same environment, argv, ``__main__``,
``sys.path[0]``, cgroup, CPU priority and stdin.  A standby that is gone by then (killed by
its user) is replaced by a worker started anew; none outlives the job."""

from __future__ import annotations

import json
import os
import pwd
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import FIXTURES
from store_attack import wait_for

SCRIPT = str(FIXTURES / "standby_worker.py")
PLACE = {
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
}


def standbys(job: str) -> dict[int, psutil.Process]:
    """The standbys of ``job`` now, by pid."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        line = proc.info["cmdline"] or []
        if not (any(a.endswith("standby.py") for a in line) and SCRIPT in line):
            continue
        try:
            if proc.environ().get("TORCHELASTIC_RUN_ID") == job:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return found


def said_standbys(daemon: Any, job: str) -> int | None:
    """The standbys ``elasticctl status`` counts on the daemon's node."""
    (node,) = daemon.ctl("status", job)["nodes"]
    return (node["usage"] or {}).get("standbys")


def autogroup_nice(pid: int) -> int | None:
    """The nice value of ``pid``'s autogroup (None: the kernel has no autogroups)."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except OSError:
        return None


def record(out: Path, rank: int, attempt: int) -> dict[str, Any] | None:
    path = out / f"rank_{rank}_{attempt}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_a_restart_runs_the_script_in_its_standbys_as_in_fresh_workers(
    daemon: Any, shared_tmp: Path, user: str
) -> None:
    out, gate = shared_tmp / "out", shared_tmp / "gate"
    out.mkdir()
    out.chmod(0o777)
    as_user = {"user": user, "cwd": str(shared_tmp)} if user != "root" else {}
    job = daemon.submit(
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "1",
        "--warm-restart",
        SCRIPT,
        "--",
        str(out),
        str(gate),
        **as_user,
    )
    first = {r: wait_for(lambda r=r: record(out, r, 0), 120, f"rank {r} started") for r in range(3)}
    waiting = wait_for(
        lambda: len(standbys(job["id"])) == 3 and standbys(job["id"]), 120, "three standbys"
    )
    uid = pwd.getpwnam(user).pw_uid
    for proc in waiting.values():  # nice 19 first, then the daemon's (Standbys.hurry_later)
        assert proc.uids().real == uid and proc.nice() in (19, 0)
        assert proc.pid not in {first[r]["pid"] for r in range(3)}
        # each standby leads a session: where the kernel shares the CPU between sessions
        # first, its session's autogroup is lowered too, or its nice value would weigh nothing.
        # The hurry raises the threads first, then the autogroup: read in the other order, a
        # thread still at 19 means an autogroup still at 19
        group = autogroup_nice(proc.pid)
        assert group is None or proc.nice() != 19 or group == 19, (group, proc.nice())
    wait_for(lambda: all(p.nice() == 0 for p in waiting.values()), 60, "standbys hurried")
    assert {autogroup_nice(p.pid) for p in waiting.values()} <= {0, None}
    assert said_standbys(daemon, job["id"]) == 3  # status reads this node's now
    killed = min(waiting)  # its user may kill a standby: that slot starts anew
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: said_standbys(daemon, job["id"]) == 2, 30, "status counting 2 standbys")
    shown = daemon.ctl_run("status", job["id"]).stdout
    assert "warm restart: 2 standbys waiting (on 1 of 1 nodes)" in shown, shown
    gate.touch()
    done = daemon.wait_job(job["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED"), 180)
    assert done["state"] == "SUCCEEDED" and done["restarts"] == 1, done
    second = {r: record(out, r, 1) for r in range(3)}
    made = {r for r in range(3) if second[r]["pid"] in waiting}
    assert len(made) == 2 and killed not in {second[r]["pid"] for r in range(3)}, second
    for rank in range(3):
        was, now = first[rank], second[rank]
        assert now["name"] == "__main__" and now["argv"] == was["argv"] == [
            SCRIPT,
            str(out),
            str(gate),
        ]
        assert now["path0"] == was["path0"] == str(FIXTURES)
        assert now["cgroup"] == was["cgroup"] and now["nice"] == was["nice"] == 0
        assert now["autogroup_nice"] == was["autogroup_nice"] and was["autogroup_nice"] in (0, None)
        assert now["stdin_empty"] and was["stdin_empty"]
        assert {k: v for k, v in now["env"].items() if k not in PLACE} == {
            k: v for k, v in was["env"].items() if k not in PLACE
        }
        assert now["env"]["RANK"] == str(rank) and now["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    # the round after the last one keeps no standbys: none is left once the job ended
    wait_for(lambda: not standbys(job["id"]), 30, "no standby left after the job")


def test_warm_restart_is_refused_where_it_cannot_help(daemon: Any) -> None:
    for flags, words in (
        (("--in-place",), "keeps its survivors' processes"),
        (("--no-python",), "needs a script or a module"),
    ):
        done = daemon.ctl_run("submit", "--warm-restart", *flags, "/bin/true")
        assert done.returncode != 0 and words in done.stderr, done
