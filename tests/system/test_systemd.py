"""systemd/elasticd.service under a real systemd (PID 1 of a throwaway container, sdbox.py).

The unit file is the shipped one, with only ExecStart pointed at this checkout's venv. What
a systemd user relies on is checked through systemd itself: ``systemctl start`` returns
once READY=1 arrived (Type=notify), ``StatusText`` carries the daemon's STATUS= line,
``systemctl stop`` ends with exit status 0 and an empty cgroup, and the watchdog restarts a
wedged daemon.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sdbox
from harness import ROOT, WORKER, Control

pytestmark = [pytest.mark.root, pytest.mark.slow]

VENV = Path(sys.prefix)
CONFIG = """\
[node]
name = "box"
address = "127.0.0.1"
slots = 2

[store]
endpoint = "127.0.0.1:29400"
host = true

[jobs]
allow_root = true  # the test submits as root
"""


class Elasticd:
    """elasticd.service in a box, driven by systemctl and elasticctl run inside the box."""

    def __init__(self, box: sdbox.Box, units: Path) -> None:
        self.box = box
        self.units = units

    def systemctl(self, *args: str, check: bool = True) -> str:
        return self.box.run("systemctl", *args, check=check).stdout.strip()

    def show(self, *props: str) -> dict[str, str]:
        out = self.systemctl("show", "elasticd", *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines())

    def until(
        self, predicate: Callable[[dict[str, str]], bool], *props: str, timeout: float = 60.0
    ) -> dict[str, str]:
        """Re-read unit properties until they meet ``predicate``.  systemd emits no event a
        test can block on for these (a restart, a new StatusText), so this is a bounded
        poll, five times a second."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.show(*props)
            if predicate(found):
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"elasticd.service never matched: {found}\n{self.journal()}")
            time.sleep(0.2)

    def ctl(self, *args: str, expect: int = 0) -> Any:
        done = self.box.run(str(VENV / "bin" / "elasticctl"), "--json", *args, check=False)
        assert done.returncode == expect, (
            f"elasticctl {' '.join(args)} exited {done.returncode}\n"
            f"{done.stdout}\n{done.stderr}\n{self.journal()}"
        )
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        return lines[-1]

    def wait_job(
        self, job: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120.0
    ) -> dict[str, Any]:
        """Follow the job's ``wait`` stream over the daemon's control socket (reached from
        here through the box's root)."""
        with Control(self.box.path("/run/elasticd/control.sock")) as control:
            for doc in control.stream("wait", {"job": job}, timeout):
                if predicate(doc):
                    return doc
        raise AssertionError(f"job {job} ended without meeting the condition\n{self.journal()}")

    def wait_output(self, job: str, needles: list[str], timeout: float = 60.0) -> None:
        missing = set(needles)
        with Control(self.box.path("/run/elasticd/control.sock")) as control:
            for doc in control.stream("logs", {"job": job, "follow": True}, timeout):
                missing -= {
                    n for n in missing for line in doc.get("lines", []) if n in line["text"]
                }
                if not missing:
                    return
        raise AssertionError(f"job {job} never printed {missing}\n{self.journal()}")

    def journal(self) -> str:
        return self.box.run(
            "journalctl", "--no-pager", "-o", "cat", "-u", "elasticd", check=False
        ).stdout[-6000:]

    def set_watchdog(self, seconds: int) -> None:
        dropin = self.units / "elasticd.service.d"
        dropin.mkdir(exist_ok=True)
        (dropin / "watchdog.conf").write_text(f"[Service]\nWatchdogSec={seconds}\n")
        self.systemctl("daemon-reload")


@pytest.fixture
def elasticd() -> Iterator[Elasticd]:
    why = sdbox.usable()
    if why:
        pytest.skip(why)
    # outside /tmp: the box's systemd-tmpfiles must never see these files
    work = Path(tempfile.mkdtemp(prefix="elasticd-sdbox-", dir="/var/tmp"))
    units, etc = work / "units", work / "etc"
    units.mkdir()
    etc.mkdir()
    unit = (ROOT / "systemd" / "elasticd.service").read_text()
    unit, found = re.subn(
        r"^(ExecStart=|ExecStopPost=-)/usr/bin/elasticd",
        rf"\g<1>{VENV}/bin/elasticd",
        unit,
        flags=re.M,
    )
    assert found == 2, "the unit's ExecStart or ExecStopPost changed shape"
    (units / "elasticd.service").write_text(unit)
    (etc / "elasticd.toml").write_text(CONFIG)
    readonly = {str(ROOT), sys.base_prefix, str(VENV.resolve())}  # checkout, interpreter, venv
    box = sdbox.Box(
        f"edtest-{secrets.token_hex(3)}",
        work,
        binds_ro=[*sorted(readonly), f"{units}:/etc/systemd/system", f"{etc}:/etc/elasticd"],
    )
    try:
        box.up()
        yield Elasticd(box, units)
    finally:
        box.down()
        shutil.rmtree(work, ignore_errors=True)


def test_the_unit_starts_runs_a_job_and_stops_cleanly(elasticd):
    started = time.monotonic()
    elasticd.systemctl("start", "elasticd")  # a Type=notify start returns after READY=1
    print(f"active {time.monotonic() - started:.2f} s after systemctl start")
    unit = elasticd.show("Type", "ActiveState", "SubState", "StatusText", "MainPID")
    assert (unit["Type"], unit["ActiveState"], unit["SubState"]) == ("notify", "active", "running")
    assert unit["StatusText"] == "0 jobs running, 0 workers"  # the daemon's STATUS= line

    done = elasticd.ctl(
        "submit",
        "--wait",
        "--nproc-per-node",
        "2",
        "--python",
        f"{VENV}/bin/python",
        str(WORKER),
        "--print",
        "2",
    )
    assert done["state"] == "SUCCEEDED", done

    job = elasticd.ctl(
        "submit",
        "--nproc-per-node",
        "2",
        "--python",
        f"{VENV}/bin/python",
        str(WORKER),
        "--sleep",
        "0",
        "--child",
        "--escape",
        "--pid-dir",
        "/tmp",
    )["id"]
    running = elasticd.wait_job(
        job,
        lambda d: (
            d["state"] == "RUNNING"
            and sum(w["state"] == "HEALTHY" and bool(w["pid"]) for w in d["workers"]) == 2
        ),
    )
    main = elasticd.show("MainPID")["MainPID"]
    # Delegate=yes: the daemon moved into <unit>/daemon, each job has <unit>/job-<id>
    assert cgroup_of(elasticd, main).endswith("/elasticd.service/daemon")
    for worker in running["workers"]:
        assert cgroup_of(elasticd, worker["pid"]).endswith(f"/elasticd.service/job-{job}")
    base = re.search(r"job cgroups in (\S+)", elasticd.journal()).group(1)
    elasticd.until(lambda u: u["StatusText"] == "1 job running, 2 workers", "StatusText")
    elasticd.wait_output(job, ["ready 0", "ready 1"])  # each worker started both children
    in_job = elasticd.box.run("cat", f"{base}/job-{job}/cgroup.procs").stdout.split()
    assert len(in_job) >= 6  # two workers, each with a child and a setsid escapee

    elasticd.systemctl("stop", "elasticd")  # returns once the unit is down
    assert elasticd.systemctl("is-active", "elasticd", check=False) == "inactive"
    # (an inactive unit is unloaded, so its ExecMainStatus is gone: systemd's log tells)
    journal = elasticd.journal()
    assert "elasticd stopped" in journal and "Deactivated successfully" in journal, journal
    assert "Main process exited" not in journal, journal  # logged for a non-zero exit or a signal
    # the daemon stopped its workers (and their children) itself: systemd had nothing to kill
    assert "left-over process" not in journal and "Killing process" not in journal, journal
    for pid in in_job:  # the escapees too: the daemon killed the job's cgroup
        assert elasticd.box.run("kill", "-0", pid, check=False).returncode != 0

    # A clean stop is no crash: the next start does not record the job as failed ("daemon
    # died").  (This node is a cluster member, not --standalone: on shutdown it leaves the
    # job, which stays open for the cluster, so it may run again here.)
    elasticd.systemctl("start", "elasticd")
    doc = elasticd.ctl("status", job)
    assert doc["state"] != "FAILED", doc
    if doc["state"] not in ("CANCELLED", "SUCCEEDED"):
        elasticd.ctl("cancel", job)
    elasticd.systemctl("stop", "elasticd")


def test_what_a_sigkilled_daemon_left_goes_with_it(elasticd):
    """ExecStopPost runs `elasticd --clean-up` however the daemon
    ended; a SIGKILLed one's store firewall table (outside any cgroup) and job cgroups go."""
    dropin = elasticd.units / "elasticd.service.d"
    dropin.mkdir(exist_ok=True)
    (dropin / "norestart.conf").write_text(
        "[Service]\nRestart=no\n"
    )  # a node that never comes back
    elasticd.systemctl("daemon-reload")
    elasticd.systemctl("start", "elasticd")
    job = elasticd.ctl(
        "submit",
        "--nproc-per-node",
        "1",
        "--python",
        f"{VENV}/bin/python",
        str(WORKER),
        "--sleep",
        "0",
        "--escape",
        "--pid-dir",
        "/tmp",
    )["id"]
    elasticd.wait_output(job, ["ready 0"])
    journal = elasticd.journal()
    table = re.search(r"nftables table inet (\w+)\)", journal)
    assert table is not None, journal  # the store's firewall (root, nft): outside the unit's cgroup
    base = re.search(r"job cgroups in (\S+)", journal).group(1)
    assert (
        elasticd.box.run("nft", "list", "table", "inet", table.group(1), check=False).returncode
        == 0
    )

    elasticd.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", "elasticd")
    elasticd.until(lambda u: u["ActiveState"] in ("failed", "inactive"), "ActiveState")
    journal = elasticd.journal()
    assert f"removed nftables table inet {table.group(1)}" in journal, journal
    assert (
        elasticd.box.run("nft", "list", "table", "inet", table.group(1), check=False).returncode
        != 0
    )
    assert elasticd.box.run("test", "-e", f"{base}/job-{job}", check=False).returncode != 0


def cgroup_of(elasticd: Elasticd, pid: object) -> str:
    """A process's cgroup v2 path, as the box sees it."""
    lines = elasticd.box.run("cat", f"/proc/{pid}/cgroup").stdout.splitlines()
    return next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))


def test_a_config_the_daemon_refuses_fails_the_start_once_with_the_reason(elasticd):
    """A bad key: `systemctl start` fails, the journal names the key, and systemd does not
    restart it in a loop (RestartPreventExitStatus=2)."""
    (elasticd.units.parent / "etc" / "elasticd.toml").write_text(
        CONFIG + "\n[metrics]\nno_such_key = 1\n"
    )
    assert elasticd.box.run("systemctl", "start", "elasticd", check=False).returncode != 0
    found = elasticd.show("ActiveState", "Result", "ExecMainStatus", "NRestarts")
    assert found == {
        "ActiveState": "failed",
        "Result": "exit-code",
        "ExecMainStatus": "2",
        "NRestarts": "0",
    }, found
    journal = elasticd.journal()
    assert "no_such_key" in journal, journal


def test_the_watchdog_restarts_a_wedged_daemon(elasticd):
    elasticd.set_watchdog(2)
    elasticd.systemctl("start", "elasticd")
    before = elasticd.show("WatchdogUSec", "NRestarts", "MainPID")
    assert before["WatchdogUSec"] == "2s"
    elasticd.systemctl("kill", "--kill-whom=main", "--signal=SIGSTOP", "elasticd")  # wedge it
    stopped = time.monotonic()
    after = elasticd.until(
        lambda u: (
            int(u["NRestarts"]) > int(before["NRestarts"])
            and u["ActiveState"] == "active"
            and u["SubState"] == "running"
        ),
        "NRestarts",
        "ActiveState",
        "SubState",
        "MainPID",
        timeout=60,
    )
    print(f"restarted and active {time.monotonic() - stopped:.1f} s after SIGSTOP")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert after["MainPID"] != before["MainPID"]
    assert "Watchdog timeout" in elasticd.journal()
    assert elasticd.ctl("version")  # the new daemon answers
    elasticd.systemctl("stop", "elasticd")
