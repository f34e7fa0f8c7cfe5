"""elasticctl's command line -> namespace -> request args (no daemon involved)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest

from elasticctl import cli, submission

SUBMIT_CASES = [
    # (command line, expected script, expected script args, expected options)
    (
        "submit train.py --nnodes 2:4 --nproc-per-node gpu --max-restarts 3 -- --epochs 10",
        "train.py",
        ["--epochs", "10"],
        {"nnodes": "2:4", "nproc_per_node": "gpu", "max_restarts": 3},
    ),
    (
        "submit --nnodes 2 train.py --epochs 10 --nnodes-max 5 --nproc 3",
        "train.py",
        ["--epochs", "10", "--nnodes-max", "5", "--nproc", "3"],
        {"nnodes": "2"},
    ),
    (
        "submit --nnodes 2 train.py -h --help",
        "train.py",
        ["-h", "--help"],
        {"nnodes": "2", "module": False, "wait": False},
    ),
    (
        "submit train.py -- --wait --nnodes 5 -m",
        "train.py",
        ["--wait", "--nnodes", "5", "-m"],
        {"wait": False, "nnodes": "1:1", "module": False},
    ),
    ("run train.py -- --json", "train.py", ["--json"], {"json": None}),
    (
        "submit train.py",
        "train.py",
        [],
        {"nnodes": "1:1", "nproc_per_node": 1, "max_restarts": None},
    ),
    ("submit --nnodes=3 -- train.py --lr 1", "train.py", ["--lr", "1"], {"nnodes": "3"}),
    ("submit --wait train.py -- -- x", "train.py", ["--", "x"], {"wait": True}),
    ("submit train.py --json -- a", "train.py", ["a"], {"json": True}),
    (
        "submit --nproc_per_node 4 --max_restarts 2 --no_python ./run.sh -x",
        "./run.sh",
        ["-x"],
        {"nproc_per_node": 4, "max_restarts": 2, "no_python": True},
    ),
    ("submit -m pkg.train --lr 1", "pkg.train", ["--lr", "1"], {"module": True}),
    ("submit --module pkg.train", "pkg.train", [], {"module": True}),
    (
        "submit --env A=1 --env B=x=y --env C= train.py",
        "train.py",
        [],
        {"env": [("A", "1"), ("B", "x=y"), ("C", "")]},
    ),
    (
        "submit --nodes a,b --nodes c --exclude d train.py",
        "train.py",
        [],
        {"nodes": ["a", "b", "c"], "exclude": ["d"]},
    ),
    (
        "submit --join-timeout 60 --exit_barrier_timeout 2.5 --last-call-timeout 0 train.py",
        "train.py",
        [],
        {"join_timeout": 60, "exit_barrier_timeout": 2.5, "last_call_timeout": 0},
    ),
    (
        "submit --name demo --workdir /w --python /p/python3 --wait x.py",
        "x.py",
        [],
        {"name": "demo", "workdir": "/w", "python": "/p/python3", "wait": True},
    ),
    ("--socket /s submit x.py", "x.py", [], {"socket": "/s"}),
    ("submit --socket /s x.py", "x.py", [], {"socket": "/s"}),
]


@pytest.mark.parametrize("line,script,script_args,options", SUBMIT_CASES)
def test_submit_parsing(line, script, script_args, options):
    args = cli.parse_args(line.split())
    assert args.command in cli.JOB_COMMANDS
    assert (args.script, args.script_args) == (script, script_args)
    assert {name: getattr(args, name) for name in options} == options


@pytest.mark.parametrize(
    "line",
    [
        "submit --nnodes 0 x.py",
        "submit --nnodes 3:2 x.py",
        "submit --nnodes two x.py",
        "submit --nnodes 1:2:3 x.py",
        "submit --nproc-per-node 0 x.py",
        "submit --nproc-per-node xpu x.py",
        "submit --max-restarts -1 x.py",
        "submit --env NOEQUALS x.py",
        "submit --env =v x.py",
        "submit --join-timeout soon x.py",
        "submit --exit-barrier-timeout -3 x.py",
        "submit --nodes , x.py",
        "submit --bogus x.py",
        "submit --join-timeout 0 x.py",
        "submit --exit-barrier-timeout 0 x.py",
        "submit --nproc x.py",  # no abbreviations: a script argument must never be eaten
        "frobnicate",
        "",
        "status",
    ],
)
def test_usage_errors_exit_2(line, capsys):
    assert cli.main(line.split()) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line,moved,passed",
    [
        (
            "submit train.py --nproc-per-node 2 --wait",
            "elasticctl submit --nproc-per-node 2 --wait train.py",
            "elasticctl submit train.py -- --nproc-per-node 2 --wait",
        ),
        (
            "--socket /s submit --nnodes 2 train.py --epochs 3 --nproc_per_node=4 --env A=1 x -r 3",
            "elasticctl --socket /s submit --nnodes 2 --nproc_per_node=4 --env A=1 -r 3 train.py --epochs 3 x",
            "elasticctl --socket /s submit --nnodes 2 train.py -- --epochs 3 --nproc_per_node=4 --env A=1 x -r 3",
        ),
        (
            "run -m pkg.mod --json --lr 1",
            "elasticctl run -m --json pkg.mod --lr 1",
            "elasticctl run -m pkg.mod -- --json --lr 1",
        ),
        (
            "submit --no-python ./a.sh 'two words' --name n",
            "elasticctl submit --no-python --name n ./a.sh 'two words'",
            "elasticctl submit --no-python ./a.sh -- 'two words' --name n",
        ),
        (
            "submit x.py --socket",
            "elasticctl submit --socket PATH x.py",
            "elasticctl submit x.py -- --socket",
        ),
    ],
)
def test_own_options_after_the_script_are_refused_with_both_corrections(
    line, moved, passed, capsys
):
    """`submit train.py --nproc-per-node 2 --wait` ran one worker and
    did not wait.  Now it is refused, showing the line with the options moved and the '--'
    form; both corrections parse to what each means."""
    import shlex

    assert cli.main(shlex.split(line)) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "elasticctl's options" in err
    assert f"\n  {moved}\n" in err and err.rstrip().endswith(f"\n  {passed}")
    fixed, escaped = (cli.parse_args(shlex.split(text)[1:]) for text in (moved, passed))
    original = shlex.split(line)
    assert escaped.script_args == original[len(original) - len(escaped.script_args) :]
    assert fixed.script == escaped.script and "--" not in escaped.script_args


def test_own_options_split_with_their_values():
    parser = cli.parse_args(["submit", "x.py"]).command_parser
    assert submission.own_options_after_script(
        parser,
        [
            "--nnodes",
            "2",
            "--lr",
            "1",
            "--wait",
            "--max_restarts=3",
            "-t",
            "3",
            "--tag",
            "--nproc",
            "-h",
            "--help",
            "--nproc-per-node",
        ],
    ) == (
        [
            "--nnodes",
            "2",
            "--wait",
            "--max_restarts=3",
            "-t",
            "3",
            "--nproc-per-node",
            "N|gpu|cpu|auto",
        ],
        ["--lr", "1", "--tag", "--nproc", "-h", "--help"],
    )


def test_elasticrun_keeps_torchruns_rule(monkeypatch):
    """elasticrun is torchrun verbatim: options after the script are the script's, silently."""
    seen = {}
    monkeypatch.setattr(cli, "dispatch", lambda args: seen.setdefault("args", args) and 0)
    assert cli.elasticrun(["train.py", "--nproc-per-node", "2", "--max-restarts", "3"]) == 0
    args = seen["args"]
    assert (args.script, args.script_args, args.nproc_per_node) == (
        "train.py",
        ["--nproc-per-node", "2", "--max-restarts", "3"],
        1,
    )


@pytest.mark.parametrize(
    "line,expected",
    [
        ("status j-1", {"command": "status", "job": "j-1"}),
        ("status -- j-1", {"command": "status", "job": "j-1"}),
        ("ps --json", {"command": "ps", "json": True, "all": False}),
        ("list --all", {"command": "list", "all": True}),
        ("list -a", {"command": "list", "all": True}),
        (
            "logs j-1 -f --rank 2 --socket /x",
            {
                "command": "logs",
                "job": "j-1",
                "follow": True,
                "rank": 2,
                "attempt": None,
                "socket": "/x",
            },
        ),
        ("logs j-1 --attempt 1", {"follow": False, "rank": None, "attempt": 1}),
        ("cancel j-1", {"command": "cancel", "job": "j-1"}),
        ("drain n1", {"command": "drain", "node": "n1"}),
        ("undrain n1", {"command": "undrain", "node": "n1"}),
        ("nodes", {"command": "nodes", "json": None, "socket": None}),
        ("--json version", {"command": "version", "json": True}),
    ],
)
def test_other_commands(line, expected):
    args = cli.parse_args(line.split())
    assert {name: getattr(args, name) for name in expected} == expected


# -- the submit request -------------------------------------------------------------------


@pytest.fixture
def python_on_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


def request(line, environ, cwd="/work"):
    return submission.submit_request(cli.parse_args(line.split(), environ), environ, cwd)


@pytest.fixture(autouse=True)
def no_own_venv(monkeypatch):
    """These tests run in the repo's venv, which has torch: elasticctl would choose it."""
    monkeypatch.setattr(submission, "own_venv_python", lambda: "")


def test_submit_request_has_everything_the_daemon_needs(python_on_path):
    environ = {"PATH": str(python_on_path.parent), "HOME": "/home/a"}
    req = request(
        "submit --nnodes 2:4 --nproc-per-node gpu --env HOME=/tmp --env X=1 "
        "train.py -- --epochs 10",
        environ,
    )
    assert req == {
        "argv": ["train.py", "--epochs", "10"],
        "kind": "script",
        "workdir": "/work",
        "env": {"PATH": str(python_on_path.parent), "HOME": "/tmp", "X": "1"},
        "nnodes": "2:4",
        "nproc_per_node": "gpu",
        "python": str(python_on_path),
    }


@pytest.mark.parametrize(
    "line,expected",
    [
        ("submit x.py", {}),
        ("submit --max-restarts 0 --name n x.py", {"max_restarts": 0, "name": "n"}),
        ("submit --nodes a,b --exclude c x.py", {"nodes": ["a", "b"], "exclude": ["c"]}),
        (
            "submit --join-timeout 60 --last-call-timeout 0.5 --exit-barrier-timeout 300 x.py",
            {"join_timeout": 60, "last_call_timeout": 0.5, "exit_barrier_timeout": 300},
        ),
        ("submit --wait x.py", {"wait": True}),
        (
            "submit --priority 5 --account ml --preemptible --nnodes 2:8 --nnodes-step 2 x.py",
            {
                "priority": 5,
                "account": "ml",
                "preemptible": True,
                "nnodes": "2:8",
                "nnodes_step": 2,
            },
        ),
        ("submit --priority -3 x.py", {"priority": -3}),
        ("run --nnodes_step 4 --priority=0 x.py", {"nnodes_step": 4, "priority": 0}),
    ],
)
def test_optional_submit_args_only_when_given(line, expected, python_on_path):
    req = request(line, {"PATH": str(python_on_path.parent)})
    base = {"argv", "kind", "workdir", "env", "nnodes", "nproc_per_node", "python"}
    assert set(req) == base | set(expected)
    assert {name: req[name] for name in expected} == expected


@pytest.mark.parametrize(
    "line, words",
    [
        (
            "submit --priority high x.py",
            "argument --priority: expected a whole number (digits 0-9), got 'high'",
        ),
        ("submit --priority 1.5 x.py", "argument --priority: expected a whole number"),
        (
            "submit --nnodes-step 0 x.py",
            "argument --nnodes-step: expected a number of at least 1, got 0",
        ),
        ("submit --account '' x.py", "argument --account: expected a group name"),
        ("run --account 'a b' x.py", "argument --account: expected a group name"),
        ("submit x.py --preemptible", "--preemptible after the script would be the script's own"),
    ],
)
def test_bad_sharing_options_are_usage_errors(line, words, capsys):
    import shlex

    with pytest.raises(SystemExit) as exited:
        cli.parse_args(shlex.split(line), {})
    assert exited.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize(
    "line,kind,argv",
    [
        ("submit train.py a", "script", ["train.py", "a"]),
        ("submit -m pkg.mod a", "module", ["pkg.mod", "a"]),
        ("submit --no-python ./run.sh a", "exec", ["./run.sh", "a"]),
    ],
)
def test_kind_and_argv(line, kind, argv, python_on_path):
    req = request(line, {"PATH": str(python_on_path.parent)})
    assert (req["kind"], req["argv"]) == (kind, argv)


@pytest.mark.parametrize(
    "workdir,expected",
    [
        (None, "/work"),
        ("/data/run", "/data/run"),
        ("sub/dir", "/work/sub/dir"),
        ("..", "/"),
    ],
)
def test_workdir_is_absolute(workdir, expected, python_on_path):
    option = f"--workdir {workdir} " if workdir else ""
    assert (
        request(f"submit {option}x.py", {"PATH": str(python_on_path.parent)})["workdir"] == expected
    )


@pytest.mark.parametrize(
    "line,message",
    [
        ("submit", "SCRIPT is required"),
        ("submit --nnodes 2 --", "SCRIPT is required"),
        ("submit -m --no-python x", "exclude each other"),
    ],
)
def test_submit_usage_errors(line, message, python_on_path):
    with pytest.raises(cli.UsageError, match=message):
        request(line, {"PATH": str(python_on_path.parent)})


# -- which python -------------------------------------------------------------------------


def make_venv(root):
    (root / "bin").mkdir(parents=True)
    link = root / "bin" / "python3"
    link.symlink_to(os.path.realpath("/bin/sh"))
    return link


def test_active_venv_wins_and_its_symlink_is_kept(tmp_path, python_on_path):
    venv_python = make_venv(tmp_path / "venv")
    environ = {"VIRTUAL_ENV": str(tmp_path / "venv"), "PATH": str(python_on_path.parent)}
    assert submission.submitter_python(None, environ, "/work") == str(venv_python)


def test_venv_without_python3_falls_back_to_path(tmp_path, python_on_path):
    (tmp_path / "empty-venv").mkdir()
    environ = {"VIRTUAL_ENV": str(tmp_path / "empty-venv"), "PATH": str(python_on_path.parent)}
    assert submission.submitter_python(None, environ, "/work") == str(python_on_path)


def test_python3_on_path_without_venv(python_on_path):
    environ = {"PATH": f"/nonexistent:{python_on_path.parent}"}
    assert submission.submitter_python(None, environ, "/work") == str(python_on_path)


def test_relative_path_entry_gives_an_absolute_python(python_on_path, monkeypatch):
    cwd = python_on_path.parent.parent
    monkeypatch.chdir(cwd)
    assert submission.submitter_python(None, {"PATH": "bin"}, str(cwd)) == str(python_on_path)


def test_no_python_anywhere(tmp_path):
    environ = {"PATH": str(tmp_path)}
    assert submission.submitter_python(None, environ, "/work") is None
    with pytest.raises(cli.UsageError, match="no python3 found"):
        request("submit x.py", environ)
    assert "python" not in request("submit --no-python ./run.sh", environ)


@pytest.mark.parametrize(
    "chosen,expected",
    [
        ("/opt/py/bin/python3", "/opt/py/bin/python3"),
        ("venv/bin/python3", "/work/venv/bin/python3"),
    ],
)
def test_explicit_python_path(chosen, expected):
    assert submission.submitter_python(chosen, {"PATH": ""}, "/work") == expected


def test_explicit_python_name_is_looked_up_on_path(python_on_path):
    environ = {"PATH": str(python_on_path.parent)}
    assert submission.submitter_python("python3", environ, "/work") == str(python_on_path)
    with pytest.raises(cli.UsageError, match="not found on PATH"):
        submission.submitter_python("python9", environ, "/work")


# -- the reply timeout --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, 15.0),
        ("", 15.0),
        ("0.5", 0.5),
        ("30", 30.0),
    ],
)
def test_reply_timeout(value, expected):
    environ = {} if value is None else {"ELASTICCTL_TIMEOUT": value}
    assert cli.reply_timeout(environ) == expected


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_bad_reply_timeout(value):
    with pytest.raises(cli.UsageError, match="ELASTICCTL_TIMEOUT"):
        cli.reply_timeout({"ELASTICCTL_TIMEOUT": value})


# -- the submitter's own checks (the daemon never stats a user's files) -----------------------


def _request(tmp_path, **kw):
    base = {
        "workdir": str(tmp_path),
        "argv": ["train.py"],
        "kind": "script",
        "python": cli.sys.executable,
        "env": {"PATH": os.defpath},
    }
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "change, words",
    [
        ({"workdir": "/no/such/dir"}, "workdir /no/such/dir not found"),
        ({"argv": ["missing.py"]}, "script missing.py not found in "),
        ({"argv": ["/no/such.py"]}, "script /no/such.py not found"),
        ({"argv": ["sub"]}, "script sub in .* is a directory without a __main__.py"),
        ({"python": "/no/python3"}, "python /no/python3 not found"),
        (
            {"kind": "exec", "argv": ["no-such-program-xyz"]},
            "executable no-such-program-xyz not found on PATH",
        ),
        ({"kind": "exec", "argv": ["./train.py"]}, "Permission denied"),  # not executable
    ],
)
def test_check_runnable_refuses_what_could_only_fail(tmp_path, change, words):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "sub").mkdir()
    with pytest.raises(cli.ClientError, match=words) as info:
        submission.check_runnable(_request(tmp_path, **change))
    assert info.value.code == "invalid_spec"


def test_check_runnable_takes_a_runnable_job(tmp_path):
    (tmp_path / "train.py").write_text("")
    submission.check_runnable(_request(tmp_path))
    submission.check_runnable(_request(tmp_path, kind="module", argv=["pkg.mod"]))
    submission.check_runnable(_request(tmp_path, kind="exec", argv=["true"], python=""))


class _CancelInterrupted:
    """A daemon whose cancel takes a second Ctrl-C on the way (SIGINT to this process, as
    the terminal sends it)."""

    def __enter__(self) -> _CancelInterrupted:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def call(self, op: str, args: dict) -> dict:
        assert op == "cancel"
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a handler that raises runs here, at the next bytecode
        return {"id": args["job"], "state": "CANCELLED"}


def test_a_second_ctrl_c_does_not_cut_the_cancel_short(monkeypatch, capsys):
    """Ctrl-C cancels the followed job; a second one while the cancel was on its way raised
    out of it: the job's line went unsaid (elasticrun) or the job was left running (a
    daemon).  The cancel is bounded by the reply timeout; signals are handled as before
    after it."""
    monkeypatch.setattr(cli, "connect", lambda args: _CancelInterrupted())
    args = argparse.Namespace(signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT", prog="elasticrun")
    before = signal.getsignal(signal.SIGINT)
    assert cli.cancel_followed(args, "j-1f2e3d") == cli.INTERRUPTED
    assert "elasticrun: job j-1f2e3d cancelled" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before
