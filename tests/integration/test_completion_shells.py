"""elasticctl's completion scripts in real shells (docs/getting-started.md, "Shell completion"): the script that `elasticctl
completion bash|zsh` prints is loaded into bash (its completion function driven as readline
would: COMP_WORDS, COMP_CWORD, COMP_LINE, COMP_POINT) and into an interactive zsh on a pty
(zpty, compinit, a TAB typed), and completes commands, options, and the job ids and node
names of a real daemon (through `elasticctl completion --words`); without a daemon it completes
nothing and says nothing."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from harness import CLIENT_ENV, PY, Daemon, worker_args

NO_DAEMON = "/nonexistent/control.sock"

BASH_COMPLETE = r"""
COMP_LINE=$2
COMP_POINT=${#COMP_LINE}
read -ra COMP_WORDS <<< "$COMP_LINE"
[[ $COMP_LINE == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
_elasticctl
(( ${#COMPREPLY[@]} )) && printf '%s\n' "${COMPREPLY[@]}"
exit 0
"""
BASH_DRIVER = 'source "$1" || exit 3' + BASH_COMPLETE

# An interactive zsh on a pty, with compinit and elasticctl's function on $fpath: LINE and a
# TAB are typed; every match that completion adds is printed as <hit>match -- description</hit>,
# and <done> when completion has finished.
ZSH_INIT = r"""
PS1='' RPS1=''
autoload -U compinit && compinit -u -D
compadd() {
  if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; return; fi
  local -a __hits __dscr
  if (( $@[(I)-d] )); then
    local __d=${@[$[${@[(i)-d]}+1]]}
    if [[ $__d == \(* ]]; then eval "__dscr=$__d"; else __dscr=("${(@P)__d}"); fi
  fi
  builtin compadd -A __hits -D __dscr "$@"
  local i
  for i in {1..$#__hits}; do print -r -- "<hit>$__hits[$i]${__dscr[$i]:+ -- $__dscr[$i]}</hit>"; done
}
zstyle ':completion:*' list-grouped false
zstyle ':completion:*' insert-tab false
bindkey '^I' complete-word
_test_done() { print -r -- "<done>"; exit }
comppostfuncs=(_test_done)
"""

ZSH_DRIVER = r"""
zmodload zsh/zpty || exit 3
zpty z zsh -f -i
zpty -w z "fpath=(${(q)1} \$fpath); source ${(q)2}"
zpty -w -n z "$3"$'\t'
local out
zpty -r z out '*<done>*'
zpty -d z
print -r -- "$out"
"""


def script(shell: str, directory: Path) -> Path:
    """The file a package installs, as `elasticctl completion SHELL` prints it."""
    done = subprocess.run(
        [PY, "-m", "elasticctl", "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLIENT_ENV,
        check=True,
    )
    path = directory / ("_elasticctl" if shell == "zsh" else "elasticctl.bash")
    path.write_text(done.stdout)
    return path


def shell_env(socket: str) -> dict[str, str]:
    """elasticctl on PATH (the venv's), its socket in ELASTICD_SOCKET."""
    return {**CLIENT_ENV, "ELASTICD_SOCKET": socket}


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory) -> Path:
    return script("bash", tmp_path_factory.mktemp("bash"))


def complete_bash(bash_script: Path, line: str, socket: str = NO_DAEMON) -> list[str]:
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_DRIVER, "bash", str(bash_script), line],
        capture_output=True,
        text=True,
        timeout=30,
        env=shell_env(socket),
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return done.stdout.splitlines()


def test_bash_the_command_word(bash_script):
    assert complete_bash(bash_script, "elasticctl su") == ["submit"]
    assert complete_bash(bash_script, "elasticctl ")[:3] == ["submit", "run", "list"]
    assert complete_bash(bash_script, "elasticctl --socket /x --j") == ["--json"]
    assert complete_bash(bash_script, "elasticctl -- s") == ["submit", "status"]
    assert complete_bash(bash_script, "elasticctl bogus --x") == []


def test_bash_loads_it_from_inside_a_function_as_bash_completion_does(bash_script):
    # bash-completion's loader sources the file in a function: its tables must be global
    load_then_complete = '_load() { source "$1" || exit 3; }; _load "$1"' + BASH_COMPLETE
    done = subprocess.run(
        [
            "bash",
            "--norc",
            "--noprofile",
            "-c",
            load_then_complete,
            "bash",
            str(bash_script),
            "elasticctl submit --nproc",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=shell_env(NO_DAEMON),
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "--nproc-per-node\n", "")


def test_bash_options_and_their_values(bash_script):
    assert complete_bash(bash_script, "elasticctl submit --nproc") == ["--nproc-per-node"]
    assert complete_bash(bash_script, "elasticctl logs --fo") == ["--follow"]
    assert complete_bash(bash_script, "elasticctl run --start-method f") == ["fork", "forkserver"]
    assert complete_bash(bash_script, "elasticctl submit --nproc_per_node 2 --max") == [
        "--max-restarts"
    ]
    assert complete_bash(bash_script, "elasticctl completion ") == ["bash", "zsh"]
    assert complete_bash(bash_script, "elasticctl submit --env ") == []


def test_bash_files_for_the_script_and_its_arguments(bash_script, tmp_path):
    (tmp_path / "train.py").write_text("")
    where = str(tmp_path)
    assert complete_bash(bash_script, f"elasticctl submit --nnodes 2 {where}/tr") == [
        f"{where}/train.py"
    ]
    # torchrun's rule: after SCRIPT everything is the script's, options too
    assert complete_bash(bash_script, f"elasticctl submit {where}/train.py --nn") == []
    assert complete_bash(bash_script, f"elasticctl submit --workdir {where}/tr") == []  # a dir only


def test_bash_without_a_daemon_completes_nothing_and_says_nothing(bash_script):
    assert complete_bash(bash_script, "elasticctl cancel j-") == []
    assert complete_bash(bash_script, "elasticctl status ") == []
    assert complete_bash(bash_script, "elasticctl drain ") == []
    for words in ("jobs", "all-jobs", "nodes"):  # what the scripts call, stderr and all
        done = subprocess.run(
            [PY, "-m", "elasticctl", "--socket", NO_DAEMON, "completion", "--words", words],
            capture_output=True,
            text=True,
            timeout=30,
            env=CLIENT_ENV,
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_daemon_that_does_not_answer_costs_a_completion_two_seconds(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(str(tmp_path / "mute.sock"))
        mute.listen(8)  # connections are queued, never answered
        started = time.monotonic()
        done = subprocess.run(
            [
                PY,
                "-m",
                "elasticctl",
                "--socket",
                str(tmp_path / "mute.sock"),
                "completion",
                "--words",
                "jobs",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=CLIENT_ENV,
        )
        took = time.monotonic() - started
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert 2 <= took < 6, took


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    """A daemon with a node name of its own: daemons of one name on a host share a job cgroup
    (elasticd-<node>), and one that starts kills what another left in it."""
    return daemon_factory(f"cpl-{uuid.uuid4().hex[:6]}", args=("--slots", "4")).start()


def jobs_of_every_kind(daemon: Daemon) -> tuple[str, str]:
    """A finished job and a running one (its worker sleeps until cancelled)."""
    finished = daemon.submit_wait("--nproc-per-node", "1", *worker_args())["id"]
    running = daemon.submit("--nproc-per-node", "1", *worker_args("--sleep", "0"))["id"]
    daemon.wait_running(running, 1)
    return finished, running


def test_bash_job_ids_and_node_names_from_the_daemon(bash_script, daemon):
    finished, running = jobs_of_every_kind(daemon)
    assert complete_bash(bash_script, "elasticctl cancel j-", daemon.socket) == [running]
    assert sorted(complete_bash(bash_script, "elasticctl status ", daemon.socket)) == sorted(
        [finished, running]
    )
    assert complete_bash(bash_script, f"elasticctl logs {finished[:4]}", daemon.socket) == [
        job for job in (finished, running) if job.startswith(finished[:4])
    ]
    assert complete_bash(bash_script, "elasticctl drain ", daemon.socket) == [daemon.name]
    # --socket on the command line, before or after the command, is the one asked
    assert complete_bash(bash_script, f"elasticctl --socket {daemon.socket} cancel j") == [running]
    assert complete_bash(bash_script, f"elasticctl cancel --socket {daemon.socket} j") == [running]
    assert (
        complete_bash(bash_script, f"elasticctl status {running} ", daemon.socket) == []
    )  # one JOB


# -- zsh ------------------------------------------------------------------------------------


def require_zsh() -> None:
    if shutil.which("zsh"):
        return
    why = "zsh is not installed (apt-get install zsh, or bash .ci/setup-root.sh)"
    if os.environ.get("CI"):
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def zsh_dir(tmp_path_factory) -> Path:
    require_zsh()
    directory = tmp_path_factory.mktemp("zsh")
    script("zsh", directory)
    (directory / "init.zsh").write_text(ZSH_INIT)
    return directory


def complete_zsh(zsh_dir: Path, line: str, socket: str = NO_DAEMON) -> list[str]:
    """What zsh offers for LINE<TAB> (the matches, without descriptions)."""
    done = subprocess.run(
        ["zsh", "-f", "-c", ZSH_DRIVER, "zsh", str(zsh_dir), str(zsh_dir / "init.zsh"), line],
        capture_output=True,
        text=True,
        timeout=60,
        env=shell_env(socket),
    )
    out = done.stdout.replace("\r", "")
    assert done.returncode == 0 and "<done>" in out, out[-2000:] + done.stderr
    for trouble in (
        "Traceback",
        "invalid argument",
        "command not found",
        "elasticd is not running",
    ):
        assert trouble not in out, out[-2000:]
    return [hit.split(" -- ")[0] for hit in re.findall(r"<hit>(.*?)</hit>", out) if hit]


def test_zsh_the_script_parses(zsh_dir):
    done = subprocess.run(
        ["zsh", "-n", str(zsh_dir / "_elasticctl")], capture_output=True, text=True
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_zsh_commands_and_options(zsh_dir):
    assert complete_zsh(zsh_dir, "elasticctl su") == ["submit"]
    assert complete_zsh(zsh_dir, "elasticctl submit --nproc") == ["--nproc-per-node"]
    assert complete_zsh(zsh_dir, "elasticctl submit --start-method f") == ["fork", "forkserver"]
    assert complete_zsh(zsh_dir, "elasticctl completion ") == ["bash", "zsh"]
    # a torchrun spelling on the line is understood: its twin is not offered again
    assert "--nproc-per-node" not in complete_zsh(
        zsh_dir, "elasticctl submit --nproc_per_node 2 --npr"
    )


def test_zsh_job_ids_and_node_names_from_the_daemon(zsh_dir, daemon):
    finished, running = jobs_of_every_kind(daemon)
    assert complete_zsh(zsh_dir, "elasticctl cancel j-", daemon.socket) == [running]
    assert sorted(complete_zsh(zsh_dir, "elasticctl logs --follow j-", daemon.socket)) == sorted(
        [finished, running]
    )
    assert complete_zsh(zsh_dir, "elasticctl drain ", daemon.socket) == [daemon.name]
    assert complete_zsh(zsh_dir, f"elasticctl --socket {daemon.socket} status j-") == sorted(
        [finished, running], key=[finished, running].index
    )
    assert complete_zsh(zsh_dir, f"elasticctl cancel --socket {daemon.socket} j-") == [running]


def test_zsh_without_a_daemon_completes_nothing_and_says_nothing(zsh_dir):
    assert complete_zsh(zsh_dir, "elasticctl cancel j-") == []
