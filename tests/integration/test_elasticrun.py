"""elasticrun and `elasticctl run` against a real daemon: what a torchrun user relies on
beyond the worker's environment (tests/integration/test_torchrun_equivalence.py compares
that with torchrun): Ctrl-C and SIGTERM cancel the job and leave no worker, a silent job is
followed for as long as it runs, the failing rank's stderr (an ImportError) is shown, the
interpreter is the one the user means without an activated venv, and --log-dir keeps a copy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import PY, Daemon, wait_gone, with_sigint

pytestmark = pytest.mark.slow

VENV_BIN = os.path.dirname(PY)
NOT_ACTIVATED = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
NOT_ACTIVATED["PATH"] = "/usr/local/bin:/usr/bin:/bin"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("elasticrun"), name="er1", args=("--slots", "8")).start()
    yield d
    d.stop()


def elasticrun(
    daemon: Daemon,
    *argv: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    program: str = "elasticrun",
    sigint: object = signal.SIG_DFL,
) -> subprocess.Popen[str]:
    """Start .venv/bin/elasticrun (or elasticctl) as a user would: by its path, the venv
    not activated, SIGINT as a terminal leaves it (``sigint``: SIG_IGN as a script's
    background job inherits it; whatever ran this test does not decide)."""
    environ = {**NOT_ACTIVATED, "ELASTICD_SOCKET": daemon.socket, **(env or {})}
    return subprocess.Popen(
        with_sigint(sigint, [os.path.join(VENV_BIN, program), *argv]),
        cwd=cwd,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def job_id_of(line: str) -> str:
    """The id in 'elasticrun: job j-… submitted (…)'."""
    return line.split("job ", 1)[1].split()[0]


def script(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "sig, how, inherited",
    [
        (signal.SIGINT, "Ctrl-C", signal.SIG_DFL),
        (signal.SIGTERM, "SIGTERM", signal.SIG_DFL),
        # started by a script in the background (bash ignores SIGINT for it): torchrun still
        # handles SIGINT, and so does elasticrun (CI ran the suite so, and Ctrl-C was lost)
        (signal.SIGINT, "kill -INT", signal.SIG_IGN),
    ],
    ids=["Ctrl-C", "SIGTERM", "SIGINT-ignored-before"],
)
def test_a_signal_cancels_the_job_and_exits_130(daemon, tmp_path, sig, how, inherited):
    script(
        tmp_path,
        "sleeper.py",
        "import os, time\n"
        "open(f'pid_{os.environ[\"RANK\"]}', 'w').write(str(os.getpid()))\n"
        "print('ready', os.environ['RANK'], flush=True)\ntime.sleep(600)\n",
    )
    proc = elasticrun(daemon, "--nproc-per-node", "2", "sleeper.py", cwd=tmp_path, sigint=inherited)
    seen = [proc.stdout.readline(), proc.stdout.readline()]  # both workers run
    assert sorted(seen) == ["ready 0\n", "ready 1\n"], (seen, daemon.log_text())
    pids = [int((tmp_path / f"pid_{r}").read_text()) for r in range(2)]
    proc.send_signal(sig)
    code, _, err = finish(proc)
    assert code == 130, err
    job_id = job_id_of(err.splitlines()[0])
    assert f"elasticrun: job {job_id} cancelled" in err
    assert daemon.ctl("status", job_id)["state"] == "CANCELLED"
    assert wait_gone(pids) == []


def test_a_silent_job_is_followed_past_the_reply_timeout(daemon, tmp_path):
    """The first reply of a followed output stream is bounded (ELASTICCTL_TIMEOUT): a job that
    prints nothing for longer must not end the following with a timeout."""
    script(tmp_path, "quiet.py", "import time\ntime.sleep(4)\nprint('done', flush=True)\n")
    code, out, err = finish(
        elasticrun(daemon, "quiet.py", cwd=tmp_path, env={"ELASTICCTL_TIMEOUT": "1"})
    )
    assert (code, out) == (0, "done\n"), err


def test_an_import_error_is_shown_when_the_job_fails(daemon, tmp_path):
    """A worker that cannot import torch (here: a python without it) fails at import: the
    failure summary shows the ImportError from its stderr, in run and in submit --wait."""
    script(tmp_path, "needs_torch.py", "import torch\n")
    python = "/usr/bin/python3"
    done = subprocess.run([python, "-c", "import torch"], capture_output=True)
    if done.returncode == 0:
        pytest.skip("the system python3 has torch")
    for argv, program in (
        (["--python", python, "needs_torch.py"], "elasticrun"),
        (["submit", "--wait", "--python", python, "needs_torch.py"], "elasticctl"),
    ):
        code, out, err = finish(elasticrun(daemon, *argv, cwd=tmp_path, program=program))
        assert code == 1, (out, err)
        assert "needs_torch.py FAILED" in err
        assert "rank      : 0 (local_rank: 0)" in err
        assert "ModuleNotFoundError: No module named 'torch'" in err
    # no error file: the root cause is the exception line its stderr ended with
    assert out.splitlines()[-1].startswith(
        "error: ModuleNotFoundError: No module named 'torch' (rank 0"
    ), out
    assert "  error     : ModuleNotFoundError: No module named 'torch'" in err


def test_the_venv_elasticctl_runs_from_is_the_interpreter(daemon, tmp_path):
    """Not activated, python3 on PATH without torch: elasticctl's own venv (it has torch)
    runs the job, and status says so."""
    script(tmp_path, "uses_torch.py", "import sys, torch\nprint(sys.executable, flush=True)\n")
    code, out, err = finish(
        elasticrun(daemon, "run", "uses_torch.py", cwd=tmp_path, program="elasticctl")
    )
    assert code == 0, err
    python = os.path.join(VENV_BIN, "python3")
    job = daemon.ctl("status", job_id_of(err.splitlines()[0]))
    assert job["python"] == python
    assert out.strip() == python
    shown = subprocess.run(
        [os.path.join(VENV_BIN, "elasticctl"), "--socket", daemon.socket, "status", job["id"]],
        capture_output=True,
        text=True,
        env=NOT_ACTIVATED,
    )
    assert f"python:       {python}" in shown.stdout.splitlines()


def test_log_dir_keeps_a_copy_of_every_rank(daemon, tmp_path):
    script(
        tmp_path,
        "talk.py",
        "import os, sys\nr = os.environ['RANK']\n"
        "print('out', r)\nprint('err', r, file=sys.stderr)\n",
    )
    code, out, err = finish(
        elasticrun(
            daemon,
            "--nproc-per-node",
            "2",
            "--redirects",
            "3",
            "--log-dir",
            str(tmp_path / "logs"),
            "talk.py",
            cwd=tmp_path,
        )
    )
    assert (code, out) == (0, ""), err
    assert "err 0" not in err and "err 1" not in err  # redirected: only in the files
    run = tmp_path / "logs" / job_id_of(err.splitlines()[0]) / "attempt_0"
    for rank in (0, 1):
        assert (run / str(rank) / "stdout.log").read_text() == f"out {rank}\n"
        assert (run / str(rank) / "stderr.log").read_text() == f"err {rank}\n"


def test_elasticrun_help_lists_every_torchrun_option():
    from elasticctl import torchrun

    done = subprocess.run(
        [os.path.join(VENV_BIN, "elasticrun"), "--help"],
        capture_output=True,
        text=True,
        env=NOT_ACTIVATED,
    )
    assert done.returncode == 0
    for dest in torchrun.TREATMENT:
        assert "--" + dest.replace("_", "-") in done.stdout or dest in (
            "module",
            "redirects",
            "tee",
        )
    assert sys.executable  # the installed entry point ran without an activated venv
