"""What runs as root is root's (docs/security.md, "Between daemons, and what runs as root"), with real daemons run by root.

A discovery script that `nobody` could change is refused at start-up (a config error naming
the key, and the script never runs), and refused before every later run once it becomes
so (a failed run: counted, logged, the last list stays in force); a script's background
children die with each run; an ``nvidia-smi`` on PATH that `nobody` could change is not run.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest
from harness import fake_nvidia_smi, free_port, wait_gone
from store_attack import metric, wait_for

NOBODY = pwd.getpwnam("nobody").pw_uid

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="the daemon must run as root")


def executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def discovery_config(directory: Path, script: str, interval: float = 0.2) -> str:
    config = directory / "discovery.toml"
    config.write_text(f'[discovery]\nscript = "{script}"\ninterval = {interval}\n')
    return str(config)


def test_a_script_in_a_directory_nobody_owns_stops_start_up_unrun(daemon_factory, shared_tmp):
    """Row 0e as filed: nobody's script in nobody's directory was run as root every second."""
    home = shared_tmp / "nobodys"
    home.mkdir()
    ran = shared_tmp / "ran"
    script = executable(home / "discover", f"#!/bin/sh\nid -u > {ran}\necho n1\n")
    os.chown(home, NOBODY, -1)
    os.chown(script, NOBODY, -1)
    daemon = daemon_factory(
        f"rs1-{os.getpid()}", args=("--config", discovery_config(shared_tmp, script))
    )
    daemon.start(wait=False)
    assert daemon.wait_exit(30) == 1
    errors = [line for line in daemon.log_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1, errors
    assert (
        f"config key 'discovery.script': refusing to run {script} is not root's alone: "
        f"{home} belongs to nobody (uid {NOBODY})"
    ) in errors[0]
    assert not ran.exists() and not os.path.exists(daemon.socket)


def test_each_run_is_reaped_and_a_script_handed_to_nobody_is_refused(daemon_factory, shared_tmp):
    runs = shared_tmp / "runs"
    children = shared_tmp / "children"
    name = f"rs2-{os.getpid()}"
    script = executable(
        shared_tmp / "discover",
        (
            f"#!/bin/sh\necho $$ >> {runs}\n"
            f"sleep 300 </dev/null >/dev/null 2>&1 &\necho $! >> {children}\necho {name}\n"
        ),
    )
    daemon = daemon_factory(
        name, metrics_port=free_port(), args=("--config", discovery_config(shared_tmp, script))
    ).start()

    def lines(path: Path) -> list[str]:
        return path.read_text().split() if path.exists() else []

    wait_for(lambda: len(lines(runs)) >= 6, 60, "six runs of the script")
    left = [int(pid) for pid in lines(children)]
    assert wait_gone(left, timeout=15) == [], "a background child outlived its run"

    os.chown(script, NOBODY, -1)  # nobody could change it from now on
    before = metric(daemon, "elasticd_discovery_failures_total")
    wait_for(
        lambda: metric(daemon, "elasticd_discovery_failures_total") >= before + 3,
        60,
        "three refused runs",
    )
    count = len(lines(runs))
    wait_for(
        lambda: metric(daemon, "elasticd_discovery_failures_total") >= before + 6,
        60,
        "three more refused runs",
    )
    assert len(lines(runs)) <= count + 1  # at most the run that was under way at the chown
    warnings = [line for line in daemon.log_text().splitlines() if "refusing to run" in line]
    assert len(warnings) == 1 and " WARNING " in warnings[0]  # once, while it stays so
    assert f"{script} belongs to nobody" in warnings[0]
    assert daemon.ctl("nodes")[0]["state"] == "up"  # the last good list stays in force
    assert daemon.stop() == 0


def test_an_nvidia_smi_that_nobody_could_change_is_not_run(daemon_factory, shared_tmp):
    env = fake_nvidia_smi(shared_tmp / "bin", 4)
    trusted = daemon_factory(f"rs3a-{os.getpid()}", env=env).start()
    assert trusted.ctl("nodes")[0]["gpus_total"] == 4  # root's alone: it runs
    trusted.stop()
    os.chown(shared_tmp / "bin", NOBODY, -1)
    daemon = daemon_factory(f"rs3-{os.getpid()}", env=env).start()
    assert daemon.ctl("nodes")[0]["gpus_total"] == 0
    assert (
        f"not running {shared_tmp / 'bin' / 'nvidia-smi'} is not root's alone: "
        f"{shared_tmp / 'bin'} belongs to nobody"
    ) in daemon.log_text()
