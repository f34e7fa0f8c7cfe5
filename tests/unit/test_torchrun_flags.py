"""torchrun's command line under elasticd (ctl/elasticctl/torchrun.py): every flag of the
installed torch's own parser is accepted in every spelling, PET_* variables are read as
torchrun reads them, and each flag is honoured or refused with a reason."""

from __future__ import annotations

import argparse

import pytest

from elasticctl import cli, submission, torchrun

torch_run = pytest.importorskip("torch.distributed.run")


def torch_parser() -> argparse.ArgumentParser:
    return torch_run.get_args_parser()


def torch_options() -> list[argparse.Action]:
    return [a for a in torch_parser()._actions if a.option_strings and a.dest != "help"]


def ours(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    return cli.parse_args(["run", *argv], environ or {})


@pytest.fixture(autouse=True)
def no_own_venv(monkeypatch):
    monkeypatch.setattr(submission, "own_venv_python", lambda: "")


def test_every_torchrun_option_has_a_treatment():
    assert {a.dest for a in torch_options()} == set(torchrun.TREATMENT)


@pytest.mark.parametrize("action", torch_options(), ids=lambda a: a.option_strings[-1])
def test_every_spelling_is_accepted(action):
    """Each option string of torchrun's parser parses here (a sample value for options that
    take one), to the same destination."""
    sample = {
        "nnodes": "2",
        "nproc_per_node": "2",
        "max_restarts": "1",
        "monitor_interval": "1",
        "start_method": "fork",
        "node_rank": "0",
        "master_port": "29500",
        "numa_binding": "node",
        "shutdown_timeout": "5",
        "redirects": "3",
        "tee": "1",
        "local_ranks_filter": "0",
        "rdzv_conf": "join_timeout=5",
    }.get(action.dest, "x")
    for spelling in action.option_strings:
        argv = [spelling] if action.nargs == 0 else [spelling, sample]
        args = ours([*argv, "train.py"])
        assert args.script == "train.py", spelling
        assert getattr(args, action.dest) not in (None, False, "", []) or action.dest in (
            "node_rank",
        ), spelling


PET_CASES = [
    ({"PET_NPROC_PER_NODE": "4"}, "nproc_per_node", 4, "4"),
    ({"PET_NNODES": "1:3"}, "nnodes", "1:3", "1:3"),
    ({"PET_NO_PYTHON": "1"}, "no_python", True, True),
    ({"PET_NO_PYTHON": "0"}, "no_python", False, False),
    ({"PET_MODULE": "1"}, "module", True, True),
    ({"PET_STANDALONE": "1"}, "standalone", True, True),
    ({"PET_MAX_RESTARTS": "2"}, "max_restarts", 2, 2),
    ({"PET_ROLE": "trainer"}, "role", "trainer", "trainer"),
    ({"PET_TEE": "3"}, "tee", "3", "3"),
    ({"PET_REDIRECTS": "0:1"}, "redirects", "0:1", "0:1"),
    ({"PET_LOG_DIR": "/tmp/l"}, "log_dir", "/tmp/l", "/tmp/l"),
    ({"PET_MASTER_PORT": "29511"}, "master_port", 29511, 29511),
    ({"PET_RDZV_CONF": "join_timeout=9"}, "rdzv_conf", "join_timeout=9", "join_timeout=9"),
]


@pytest.mark.parametrize("environ, dest, expected, torchs", PET_CASES)
def test_pet_variables_are_read_as_torchrun_reads_them(
    environ, dest, expected, torchs, monkeypatch
):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert getattr(torch_parser().parse_args(["train.py"]), dest) == torchs  # torchrun's reading
    assert getattr(ours(["train.py"], environ), dest) == expected


def test_the_command_line_wins_over_pet():
    assert ours(["--nproc-per-node", "2", "x.py"], {"PET_NPROC_PER_NODE": "4"}).nproc_per_node == 2


def test_a_pet_switch_torchrun_cannot_read_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("PET_NO_PYTHON", "yes")
    assert cli.main(["submit", "x.py"]) == 2
    assert cli.elasticrun(["x.py"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "elasticctl: PET_NO_PYTHON='yes': expected 0 or 1 (as torchrun reads it)",
        "elasticrun: PET_NO_PYTHON='yes': expected 0 or 1 (as torchrun reads it)",
    ]


def test_the_issue_example_pet_nproc_and_no_python(tmp_path):
    """`PET_NPROC_PER_NODE=4 PET_NO_PYTHON=1 elasticctl submit run.sh` ran one worker and fed
    the shell script to python."""
    environ = {"PET_NPROC_PER_NODE": "4", "PET_NO_PYTHON": "1", "PATH": "/usr/bin:/bin"}
    args = cli.parse_args(["submit", "run.sh"], environ)
    request = submission.submit_request(args, environ, str(tmp_path))
    assert (request["nproc_per_node"], request["kind"], request["argv"]) == (4, "exec", ["run.sh"])


# -- honoured -------------------------------------------------------------------------------


def request_of(line: str, environ: dict[str, str] | None = None) -> dict:
    environ = {"PATH": "/usr/bin:/bin", **(environ or {})}
    return submission.submit_request(cli.parse_args(line.split(), environ), environ, "/work")


def test_role_master_port_and_rdzv_conf_reach_the_request():
    request = request_of(
        "submit --role trainer --master-port 29511 "
        "--rdzv-conf join_timeout=90,last_call_timeout=2.5,is_host=1 x.py"
    )
    assert (request["role"], request["master_port"]) == ("trainer", 29511)
    assert (request["join_timeout"], request["last_call_timeout"]) == (90, 2.5)


def test_defaults_add_nothing():
    request = request_of("submit x.py")
    assert not {"role", "master_port", "join_timeout", "last_call_timeout"} & set(request)


def test_elasticctl_own_timeouts_win_over_rdzv_conf():
    request = request_of("submit --join-timeout 5 --rdzv-conf join_timeout=90 x.py")
    assert request["join_timeout"] == 5


@pytest.mark.parametrize(
    "line, kind",
    [
        ("submit x.py", "script"),
        ("submit -m pkg.mod", "module"),
        ("submit --no-python x.sh", "exec"),
        ("submit --run-path x.py", "script"),
        ("submit --run-path --no-python x.py", "script"),
    ],
)
def test_kind_follows_torchrun_precedence(line, kind):
    assert request_of(line)["kind"] == kind


@pytest.mark.parametrize(
    "line",
    [
        "submit --rdzv-backend c10d --rdzv-endpoint localhost:29400 --rdzv-id a x.py",
        "submit --standalone --master-addr 127.0.0.1 --master-port 29500 --node-rank 0 x.py",
        "submit --monitor-interval 5 --start-method fork --event-log-handler null x.py",
        "submit --local-addr 127.0.0.1 --signals-to-handle SIGTERM,SIGINT x.py",
    ],
)
def test_one_node_job_accepts_the_launcher_topology(line):
    assert request_of(line)["argv"] == ["x.py"]


@pytest.mark.parametrize(
    "line, words",
    [
        (
            "submit --nnodes 2 --rdzv-endpoint h:29400 x.py",
            "--rdzv-endpoint: elasticd's daemons are the rendezvous",
        ),
        ("submit --nnodes 1:3 --standalone x.py", "--standalone: elasticd's daemons"),
        ("submit --nnodes 2 --master-addr h --node-rank 1 x.py", "--master-addr, --node-rank"),
        ("submit --node-rank 1 x.py", "--node-rank 1: a one-node job has node rank 0"),
        ("submit --event-log-handler console x.py", "torchrun's event handlers do not run here"),
        ("submit --numa-binding node x.py", "numactl"),
        ("submit --shutdown-timeout 5 x.py", "jobs.stop_grace"),
        ("submit --virtual-local-rank x.py", "LOCAL_RANK is the worker's slot"),
        ("submit --logs-specs mine x.py", "--log-dir copies it"),
        ("submit --duplicate-stdout-filters a,b x.py", "filter `elasticctl logs JOB`"),
        ("submit --signals-to-handle SIGTERM,SIGUSR1 x.py", "--signals-to-handle SIGUSR1"),
        ("submit --rdzv-conf frob=1 x.py", "--rdzv-conf key 'frob' means nothing under elasticd"),
        ("submit --rdzv-conf join_timeout x.py", "expected KEY=VALUE"),
    ],
)
def test_refusals_say_why(line, words):
    with pytest.raises(cli.UsageError, match=None) as info:
        request_of(line)
    assert words in str(info.value)


def test_every_refusal_is_reported_at_once(capsys):
    assert cli.main("run --nnodes 2 --rdzv-id a --numa-binding node x.py".split()) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("elasticctl: --") for line in err)


@pytest.mark.parametrize(
    "line",
    [
        "submit --tee 3 x.py",
        "submit --log-dir /tmp x.py",
        "submit -r 1 x.py",
        "submit --local-ranks-filter 0 x.py",
    ],
)
def test_output_options_need_a_follower(line):
    args = cli.parse_args(line.split(), {})
    with pytest.raises(cli.UsageError, match="add --wait"):
        submission.output_plan(args, {})
    submission.output_plan(cli.parse_args(line.replace("submit", "submit --wait").split(), {}), {})
    submission.output_plan(cli.parse_args(line.replace("submit", "run").split(), {}), {})


# -- the output plan --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, stream, local_rank, shown",
    [
        ({}, "out", 0, "plain"),
        ({}, "err", 1, "plain"),
        ({"redirects": torchrun.ALL}, "out", 0, None),
        ({"redirects": torchrun.OUT}, "err", 0, "plain"),
        ({"redirects": {1: torchrun.ERR}}, "err", 1, None),
        ({"redirects": {1: torchrun.ERR}}, "err", 0, "plain"),
        ({"tee": torchrun.ALL}, "err", 3, "prefixed"),
        ({"tee": torchrun.OUT, "redirects": torchrun.ALL}, "out", 0, "prefixed"),
        ({"tee": torchrun.OUT, "redirects": torchrun.ALL}, "err", 0, None),
        ({"ranks_shown": frozenset({1})}, "out", 0, None),
        ({"ranks_shown": frozenset({1}), "tee": torchrun.ALL}, "out", 1, "prefixed"),
    ],
)
def test_where_a_line_goes(options, stream, local_rank, shown):
    assert torchrun.Output(**options).shown(stream, local_rank) == shown


def test_prefixes_as_torchrun_makes_them():
    assert torchrun.Output(role="trainer").prefix(rank=5, local_rank=1) == "[trainer1]:"
    template = torchrun.Output(
        role="r", prefix_template="[${role_name}|${rank}|${local_rank}|${x}]:"
    )
    assert template.prefix(rank=5, local_rank=1) == "[r|5|1|${x}]:"


@pytest.mark.parametrize("text, parsed", [("0", 0), ("3", 3), ("0:1,1:2", {0: 1, 1: 2})])
def test_std_settings(text, parsed):
    assert torchrun.parse_std(text, "--tee") == parsed


@pytest.mark.parametrize("text", ["4", "a", "0:4", "0:1,", "1:"])
def test_bad_std_settings(text):
    with pytest.raises(torchrun.TorchrunError, match="--tee"):
        torchrun.parse_std(text, "--tee")


def test_bad_ranks_filter():
    with pytest.raises(torchrun.TorchrunError, match="--local-ranks-filter"):
        torchrun.ranks_filter("0,x")
    assert torchrun.ranks_filter("") is None


def test_elasticrun_defaults_to_torchruns_no_restarts(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "dispatch", lambda args: seen.setdefault("args", args) and 0)
    cli.elasticrun(["x.py", "--max-restarts", "3"])
    assert seen["args"].max_restarts == 0 and seen["args"].script_args == ["--max-restarts", "3"]
    seen.clear()
    cli.elasticrun(["--max_restarts", "3", "x.py"])
    assert seen["args"].max_restarts == 3


def test_the_docs_list_every_option_as_treated():
    """docs/elasticrun.md's table of torchrun's options says what TREATMENT says."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "elasticrun.md").read_text()
    rows = {}
    for line in page.splitlines():
        if line.startswith("| `-"):
            flag, treatment = (cell.strip() for cell in line.strip("|").split("|", 1))
            rows[flag.strip("`").split(", ")[-1].lstrip("-").replace("-", "_")] = treatment
    assert rows == {dest: text.replace("|", "/") for dest, text in torchrun.TREATMENT.items()}
