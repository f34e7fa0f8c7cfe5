"""What a new user met first (docs/getting-started.md), against a real daemon with a real
elasticctl: options written after the script, and a daemon whose socket is not the default."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from harness import CLIENT_ENV, PY

from elasticd.wire import paths

ARGV_SCRIPT = "import json, sys\nprint('argv ' + json.dumps(sys.argv[1:]))\n"


def test_own_options_after_the_script_are_refused_and_nothing_is_submitted(daemon, shared_tmp):
    script = shared_tmp / "train.py"
    script.write_text(ARGV_SCRIPT)
    done = daemon.ctl_run(
        "submit", str(script), "--nproc-per-node", "2", "--wait", cwd=str(shared_tmp)
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    prefix = f"elasticctl --socket {daemon.socket} submit"
    assert f"  {prefix} --nproc-per-node 2 --wait {shlex.quote(str(script))}\n" in done.stderr
    assert f"  {prefix} {shlex.quote(str(script))} -- --nproc-per-node 2 --wait\n" in done.stderr
    assert daemon.ctl("list", "--all") == []


def test_double_dash_gives_the_script_elasticctls_option_names(daemon, shared_tmp):
    script = shared_tmp / "train.py"
    script.write_text(ARGV_SCRIPT)
    job = daemon.submit_wait(str(script), "--", "--wait", "--nproc-per-node", "2", "--", "x")
    assert job["state"] == "SUCCEEDED", job
    assert len(job["workers"]) == 1  # --nproc-per-node 2 was the script's, not the job's
    logs = daemon.ctl_run("logs", job["id"]).stdout
    assert 'argv ["--wait", "--nproc-per-node", "2", "--", "x"]' in logs, logs


def test_a_daemon_off_the_default_socket_says_how_to_reach_it(daemon):
    """A daemon started with --runtime-dir (as every harness daemon is) logs how
    elasticctl reaches it; elasticctl, not told, names the socket it tried and how to point it
    elsewhere; with ELASTICD_SOCKET it works."""
    assert (
        f"reach this daemon with elasticctl --socket {daemon.socket} "
        f"(or ELASTICD_SOCKET={daemon.socket})"
    ) in daemon.log_text()
    default = os.path.join(paths.SYSTEM_RUNTIME_DIR, paths.SOCKET_NAME)
    if os.path.lexists(default):
        pytest.skip(f"a daemon of this host listens at {default}")
    env = {k: v for k, v in CLIENT_ENV.items() if k != "ELASTICD_SOCKET"}
    lost = subprocess.run(
        [PY, "-m", "elasticctl", "list"], capture_output=True, text=True, timeout=60, env=env
    )
    assert lost.returncode == 2
    assert f"no control socket at {default}" in lost.stderr
    assert (
        "--socket PATH or ELASTICD_SOCKET=PATH" in lost.stderr
        and "--runtime-dir DIR" in lost.stderr
    )
    found = subprocess.run(
        [PY, "-m", "elasticctl", "--json", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "ELASTICD_SOCKET": daemon.socket},
    )
    assert found.returncode == 0, found.stderr
