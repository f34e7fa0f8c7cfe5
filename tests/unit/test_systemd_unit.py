"""The shipped unit passes `systemd-analyze verify` and fits the daemon's shutdown."""

import configparser
import os
import shutil
import subprocess
import sys

import pytest

from elasticd.config import JobsConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
UNIT = os.path.join(ROOT, "systemd", "elasticd.service")


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNIT)
    return parser


def test_unit_settings():
    service = _unit()["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["Restart"] == "on-failure" and service["KillMode"] == "mixed"
    assert service["RuntimeDirectory"] == "elasticd" and service["StateDirectory"] == "elasticd"
    assert int(service["WatchdogSec"]) > 0
    assert (
        service["Delegate"] == "yes"
    )  # job cgroups under the unit (daemon/elasticd/shell/cgroups.py)
    # the daemon must be able to stop workers that ignore SIGTERM before systemd gives up
    assert int(service["TimeoutStopSec"]) > JobsConfig().stop_grace + 10


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path):
    """Verify a copy whose ExecStart points at this checkout's real daemon."""
    daemon = os.path.join(os.path.dirname(sys.executable), "elasticd")
    text = open(UNIT).read().replace("/usr/bin/elasticd", daemon)
    unit = tmp_path / "elasticd.service"
    unit.write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [line for line in done.stderr.splitlines() if "elasticd.service" in line]
    assert done.returncode == 0 and not problems, done.stderr
