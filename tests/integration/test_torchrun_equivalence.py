"""torch's launcher scenarios run through torchrun and through elasticrun (docs/elasticrun.md).

Each scenario runs the same command line twice, in the same working directory, with the same
environment and the same output directory: once as ``python -m torch.distributed.run ARGS``
and once as ``elasticrun ARGS`` against a standalone elasticd (node "tr1", 8 slots) started
by this module.  One helper (``observe``) turns each run into a result: the launcher's exit
code, the files the workers wrote (names and contents), what every worker saw (its
environment, sys.argv, ``__name__``, its interpreter's prefix, its working directory,
``torch.distributed.is_torchelastic_launched()``, a gloo all_reduce over env://), the worker
lines on the launcher's stdout and stderr, the copies under ``--log-dir``, and for a failed
run the facts of the failure summary.  The test asserts that both results are equal.

The scenario scripts (tests/fixtures/launcher/probe.py and probe.sh) were written for this
project after the cases of torch's test/distributed/launcher (rank files in an output
directory, a bash script with --no-python, -m, --run-path, nproc cpu/auto, a raising worker,
is_torchelastic_launched, env:// with gloo, local ranks).

Normalized (values that legitimately differ between two launchers, or two runs):
- ``MASTER_ADDR``, ``MASTER_PORT``: only their presence.  Each launcher picks the rendezvous
  address and port (torchrun's --standalone takes the host name and a port of its c10d
  store, elasticd takes group rank 0's node address);
- ``TORCHELASTIC_RUN_ID``: presence.  torchrun's is ``none`` (static) or a uuid
  (--standalone); elasticd's is the job id;
- ``TORCHELASTIC_ERROR_FILE``: presence.  Each launcher owns the path (a torchelastic temp
  dir, the daemon's state dir);
- the environment beyond the compared variables: only the *names* a launcher adds to the
  worker's environment, and the names of inherited variables whose value it changed;
- the failure summary: its layout differs (torchrun prints a ChildFailedError block,
  elasticrun its own), so each is read into facts: the root-cause rank, its exit code or
  signal, and whether the summary carries the error text;
- ``--log-dir``: the first directory level (torchrun: ``<run id>_<random>``, elasticrun: the
  job id); the paths below it and the files' contents are compared;
- console output: only the probe's own lines, as a sorted list per stream (ranks print
  concurrently, so their order between ranks is not defined under either launcher), on
  stderr up to the failure summary (whose stderr tail repeats them).

Every launch gets PET_MASTER_PORT (a free port, the same for both launchers): torchrun's
default 29500 would collide with other torchruns on the host.  PYTHONPATH is the scripts'
directory (for -m probe) and ELASTICD_SOCKET the daemon's socket, for both.

Known differences, pinned per launcher in ``KNOWN`` (each side must show exactly its value,
so a change on either side fails the test) and listed here:
- CUDA_VISIBLE_DEVICES: empty for ``--nproc-per-node cpu`` workers under elasticd, unset
  under torchrun;
- the failure summary of a worker without an error file (a shell script): torchrun's has
  the exit code only, elasticrun's also the tail of the rank's stderr;
- PYTHONPATH: elasticd puts its worker library (``elasticd.elastic``, for in-place jobs)
  first; the submitter's PYTHONPATH follows unchanged;
- ELASTICD_CHECKPOINT_DIR: elasticd gives every worker the job's checkpoint directory in
  the node's memory (docs/checkpoints.md); torchrun has none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import CLIENT_ENV, FIXTURES, PY, Daemon, free_port

pytestmark = pytest.mark.slow

LAUNCHERS_DIR = FIXTURES / "launcher"
PROBE = str(LAUNCHERS_DIR / "probe.py")
SHELL = str(LAUNCHERS_DIR / "probe.sh")
ELASTICRUN = os.path.join(os.path.dirname(PY), "elasticrun")
LAUNCHERS = {"torchrun": (PY, "-m", "torch.distributed.run"), "elasticrun": (ELASTICRUN,)}
TIMEOUT = 180.0

# compared by value
VALUES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
)
# compared by presence (see the module's docstring)
PRESENT = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
# what the launchers' own environment must not bring in
SCRUBBED = re.compile(
    r"^(PET_|TORCHELASTIC_|ELASTICD_|PYTEST_)|^(OMP_NUM_THREADS|LOGLEVEL|"
    r"PYTHONPATH|MASTER_ADDR|MASTER_PORT|RANK|LOCAL_RANK|WORLD_SIZE)$"
)
# compared by presence and pinned in KNOWN: the job's checkpoint directory (elasticd only)
CHECKPOINTS = "ELASTICD_CHECKPOINT_DIR"
JOB_MARK = "ELASTICD_JOB"
# what bash sets itself in probe.sh (whether "_" is new depends on who started the test)
SHELL_OWN = {"_", "PWD", "OLDPWD", "SHLVL", "PS1"}
WORKER_LINE = re.compile(r"probe (out|err) \d+$")


@dataclass(frozen=True)
class Scenario:
    id: str
    args: tuple[str, ...]  # "{out}" and "{logs}" are filled in
    env: dict[str, str] = field(default_factory=dict)
    failure_text: str | None = None  # what the failure summary must tell
    expect_exit: int = 0
    expect_files: tuple[str, ...] = ()  # among what the workers wrote
    expect_stdout: tuple[str, ...] | None = None  # the worker lines on stdout, sorted


SCENARIOS = [
    # torch's test_script.py + env:// init: the environment, is_torchelastic_launched,
    # gloo all_reduce, and script arguments that look like launcher flags passed through
    Scenario(
        "script-env-allreduce-argv",
        (
            "--nproc-per-node",
            "2",
            PROBE,
            "{out}",
            "--all-reduce",
            "--lr",
            "0.1",
            "--nproc-per-node",
            "9",
            "--max-restarts=3",
            "-m",
        ),
    ),
    # a worker raising an exception (through @record): exit 1, rank 1 and its error named
    Scenario(
        "worker-raises",
        ("--nproc-per-node", "2", PROBE, "{out}", "--all-reduce", "--fail-rank", "1"),
        failure_text="RuntimeError: probe failure from rank 1 attempt 0",
        expect_exit=1,
    ),
    # --max-restarts 1: the first attempt fails, the second succeeds (no all_reduce: see
    # probe.py on torchrun's own restarts)
    Scenario(
        "restart-once",
        (
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            PROBE,
            "{out}",
            "--fail-rank",
            "1",
            "--fail-attempts",
            "1",
        ),
        expect_files=(
            "rank_0.attempt_0.json",
            "rank_1.attempt_0.json",
            "rank_0.attempt_1.json",
            "rank_1.attempt_1.json",
        ),
    ),
    # torch's test_script.sh: --no-python, and arguments after the script untouched
    Scenario(
        "no-python-shell",
        ("--nproc_per_node", "2", "--no-python", SHELL, "{out}", "--flag", "a b", "--no-python"),
    ),
    # a shell worker exiting 3 (no error file: the summary has only the exit code)
    Scenario(
        "no-python-shell-fails",
        ("--nproc_per_node", "2", "--no_python", SHELL, "{out}", "--fail-rank", "1"),
        failure_text="probe shell failure from rank 1",
        expect_exit=1,
    ),
    # every option from PET_* variables (docs/elasticrun.md, "Defaults")
    Scenario(
        "pet-env-shell",
        (SHELL, "{out}"),
        env={"PET_NPROC_PER_NODE": "2", "PET_NO_PYTHON": "1"},
        expect_files=("rank_0.attempt_0.env", "rank_1.attempt_0.env"),
    ),
    # one worker (the default): no OMP_NUM_THREADS
    Scenario("default-nproc-shell", ("--no-python", SHELL, "{out}")),
    Scenario("module", ("--nproc-per-node", "2", "-m", "probe", "{out}", "--x", "1")),
    Scenario("run-path", ("--nproc-per-node", "2", "--run-path", PROBE, "{out}", "--x", "1")),
    Scenario("nproc-cpu", ("--nproc-per-node", "cpu", "--no-python", SHELL, "{out}")),
    Scenario("nproc-auto", ("--nproc_per_node", "auto", "--no-python", SHELL, "{out}")),
    Scenario(
        "role-and-tee",
        ("--nproc-per-node", "2", "--role", "trainer", "--tee", "3", "--no-python", SHELL, "{out}"),
    ),
    Scenario(
        "tee-prefix-template",
        ("--nproc-per-node", "2", "-t", "3", "--no-python", SHELL, "{out}"),
        env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "},
    ),
    Scenario(
        "tee-stdout-only", ("--nproc-per-node", "2", "--tee", "1", "--no-python", SHELL, "{out}")
    ),
    Scenario(
        "redirects",
        ("--nproc-per-node", "2", "--redirects", "3", "--no-python", SHELL, "{out}"),
        expect_stdout=(),
    ),
    Scenario(
        "local-ranks-filter",
        ("--nproc-per-node", "2", "--local-ranks-filter", "1", "--no-python", SHELL, "{out}"),
        expect_stdout=("probe out 1",),
    ),
    Scenario(
        "log-dir-redirects",
        ("--nproc-per-node", "2", "--log-dir", "{logs}", "-r", "3", "--no-python", SHELL, "{out}"),
    ),
    # multi-node launch flags on a one-node job, and env:// through them
    Scenario(
        "standalone",
        ("--standalone", "--nnodes", "1", "--nproc-per-node", "2", PROBE, "{out}", "--all-reduce"),
    ),
]

# (scenario id or "*", a regular expression over the normalized result's flat keys) -> the
# value each launcher must show
WORKER_ENV = r"files/rank_\d+\.attempt_\d+\.(json/env|env)"
KNOWN: dict[tuple[str, str], dict[str, Any]] = {
    # elasticd puts its worker library (elasticd.elastic) first on PYTHONPATH
    ("*", WORKER_ENV + "/PYTHONPATH"): {
        "torchrun": [str(LAUNCHERS_DIR)],
        "elasticrun": ["<added>", str(LAUNCHERS_DIR)],
    },
    # elasticd gives every worker the job's checkpoint directory in memory
    ("*", WORKER_ENV + "/" + CHECKPOINTS): {"torchrun": False, "elasticrun": True},
    # and its job's id, by which a killed daemon's leftover processes are found
    ("*", WORKER_ENV + "/" + JOB_MARK): {"torchrun": False, "elasticrun": True},
    # elasticd hides the node's GPUs from CPU workers (they belong to other jobs)
    ("nproc-cpu", WORKER_ENV + "/added"): {
        "torchrun": ["TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"],
        "elasticrun": [
            "CUDA_VISIBLE_DEVICES",
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        ],
    },
    # without an error file torchrun's summary has only the exit code; elasticrun's carries
    # the tail of the failing rank's stderr
    ("no-python-shell-fails", "failure/text_in_summary"): {"torchrun": False, "elasticrun": True},
}


# -- running and observing ------------------------------------------------------------------


@dataclass
class Run:
    launcher: str
    argv: list[str]
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if not os.path.exists(ELASTICRUN):
        pytest.fail(f"{ELASTICRUN} is not installed (pip install -e . in the venv)")
    daemon = Daemon(tmp_path_factory.mktemp("equivalence"), name="tr1", args=("--slots", "8"))
    daemon.start()
    yield daemon
    daemon.stop()


def launcher_env(daemon: Daemon, scenario: Scenario, port: int) -> dict[str, str]:
    env = {k: v for k, v in CLIENT_ENV.items() if not SCRUBBED.search(k)}
    env.update(
        PYTHONPATH=str(LAUNCHERS_DIR),
        PYTHONDONTWRITEBYTECODE="1",
        ELASTICD_SOCKET=daemon.socket,
        PET_MASTER_PORT=str(port),
    )
    env.update(scenario.env)
    return env


def launch(launcher: str, scenario: Scenario, cwd: Path, env: dict[str, str]) -> Run:
    out, logs = cwd / "out", cwd / "logs"
    for directory in (out, logs):
        shutil.rmtree(directory, ignore_errors=True)
    out.mkdir()
    args = [a.format(out=out, logs=logs) for a in scenario.args]
    argv = [*LAUNCHERS[launcher], *args]
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            # every process it started first: torchrun's workers have sessions of their own
            # and outlive a killed torchrun
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(
                f"{launcher} did not end in {TIMEOUT} s: {' '.join(argv)}\n"
                f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
            )
    return Run(launcher, argv, proc.returncode, stdout, stderr)


def observe(run: Run, scenario: Scenario, cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """One launcher's result, normalized (see the module's docstring)."""
    out = cwd / "out"
    files: dict[str, Any] = {}
    for path in sorted(out.iterdir()):
        files[path.name] = read_output_file(path, env)
    result: dict[str, Any] = {
        "exit_code": run.exit_code,
        "files": files,
        "stdout": sorted(console_lines(run.stdout)),
        "stderr": sorted(console_lines(run.stderr.partition("Root Cause")[0])),
        "log_dir": log_dir_copies(cwd / "logs"),
    }
    if scenario.failure_text is not None:
        result["failure"] = failure_facts(run, scenario.failure_text)
    return result


def read_output_file(path: Path, given: dict[str, str]) -> Any:
    if not path.is_file():
        return "<not a regular file>"  # probe.sh's FIFO
    if path.suffix == ".json":  # probe.py's report
        report = json.loads(path.read_text())
        report["env"] = worker_env(report["env"], given)
        return report
    if path.suffix == ".env":  # probe.sh's `env -0`
        pairs = (item.partition("=") for item in path.read_text().split("\0") if item)
        return worker_env({k: v for k, _, v in pairs}, given)
    if path.suffix == ".args":
        return path.read_text().split("\0")[:-1]
    return path.read_text()  # a rank file (empty) or an all_reduce sum


def worker_env(env: dict[str, str], given: dict[str, str]) -> dict[str, Any]:
    seen: dict[str, Any] = {k: env.get(k) for k in VALUES}
    seen.update({k: bool(env.get(k)) for k in PRESENT})
    given_path = given.get("PYTHONPATH", "").split(os.pathsep)
    seen["PYTHONPATH"] = [
        p if p in given_path else "<added>" for p in env.get("PYTHONPATH", "").split(os.pathsep)
    ]
    seen[CHECKPOINTS] = bool(env.get(CHECKPOINTS))
    seen[JOB_MARK] = bool(env.get(JOB_MARK))
    compared = set(VALUES) | set(PRESENT) | {"PYTHONPATH", CHECKPOINTS, JOB_MARK} | SHELL_OWN
    seen["added"] = sorted(set(env) - set(given) - compared)
    seen["changed"] = sorted(k for k in set(given) - compared if k in env and env[k] != given[k])
    seen["removed"] = sorted(set(given) - set(env) - SHELL_OWN)
    return seen


def console_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if WORKER_LINE.search(line)]


def log_dir_copies(logs: Path) -> dict[str, str] | None:
    if not logs.exists():
        return None
    copies = {}
    for path in sorted(p for p in logs.rglob("*") if p.is_file()):
        relative = path.relative_to(logs).parts
        copies["/".join(("<run>", *relative[1:]))] = path.read_text()
    return copies


def failure_facts(run: Run, text: str) -> dict[str, Any]:
    """The failure summary as facts: the root cause's rank and exit code, whether the
    summary carries ``text``, and whether ``text`` reached the launcher's stderr at all."""
    summary = failure_summary(run)
    facts: dict[str, Any] = {
        "summary_found": summary is not None,
        "text_on_stderr": text in run.stderr,
    }
    if summary is not None:
        facts.update(
            rank=summary_field(summary, "rank"),
            exitcode=summary_field(summary, "exitcode"),
            text_in_summary=text in summary,
        )
    return facts


def failure_summary(run: Run) -> str | None:
    if run.launcher == "torchrun":  # ChildFailedError's block, from its root cause on
        start = run.stderr.find("Root Cause (first observed failure):")
        return None if start < 0 else run.stderr[start:]
    start = run.stderr.find("Root Cause")
    return None if start < 0 else run.stderr[start:]


def summary_field(summary: str, name: str) -> str | None:
    found = re.search(rf"^\s*{name}\s*:\s*(\S+)", summary, re.MULTILINE)
    return found.group(1) if found else None


def flat(result: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The result as {"files/rank_0.attempt_0.json/env/RANK": value, ...} for the diff."""
    if not isinstance(result, dict) or not result:
        return {prefix.rstrip("/"): result}
    items: dict[str, Any] = {}
    for key, value in result.items():
        items.update(flat(value, f"{prefix}{key}/"))
    return items


def known_for(scenario: Scenario, key: str) -> dict[str, Any] | None:
    for (where, pattern), values in KNOWN.items():
        if where in ("*", scenario.id) and re.fullmatch(pattern, key):
            return values
    return None


def describe(runs: dict[str, Run], results: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, run in runs.items():
        parts.append(
            f"--- {name}: {' '.join(run.argv)} -> exit {run.exit_code}\n"
            f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-4000:]}\n"
            f"result:\n{json.dumps(results[name], indent=1, sort_keys=True)[:6000]}"
        )
    return "\n".join(parts)


# -- the test -------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
def test_same_result_under_torchrun_and_elasticrun(
    scenario: Scenario, daemon: Daemon, tmp_path: Path
) -> None:
    env = launcher_env(daemon, scenario, free_port())
    runs, results = {}, {}
    for launcher in LAUNCHERS:
        runs[launcher] = launch(launcher, scenario, tmp_path, env)
        results[launcher] = observe(runs[launcher], scenario, tmp_path, env)
    context = describe(runs, results)
    torchrun, elasticrun = flat(results["torchrun"]), flat(results["elasticrun"])
    for key in sorted(set(torchrun) | set(elasticrun)):
        pinned = known_for(scenario, key)
        if pinned is not None:  # a known difference: each side shows exactly its value
            assert (torchrun.get(key), elasticrun.get(key)) == (
                pinned["torchrun"],
                pinned["elasticrun"],
            ), f"{key}: the known difference changed\n{context}"
            torchrun.pop(key, None)
            elasticrun.pop(key, None)
    differing = {
        k: (torchrun.get(k, "<absent>"), elasticrun.get(k, "<absent>"))
        for k in sorted(set(torchrun) | set(elasticrun))
        if torchrun.get(k, "<absent>") != elasticrun.get(k, "<absent>")
    }
    if differing:
        pytest.fail(
            f"{scenario.id}: torchrun and elasticrun differ (torchrun's, elasticrun's):\n"
            + "".join(f"  {k}: {v[0]!r} != {v[1]!r}\n" for k, v in differing.items())
            + context,
            pytrace=False,
        )
    check_scenario_facts(scenario, results["torchrun"], runs["torchrun"])


def check_scenario_facts(scenario: Scenario, result: dict[str, Any], run: Run) -> None:
    """What each scenario is about, checked on the (now equal) result, so that two launchers
    that agree on something wrong still fail."""
    assert result["exit_code"] == scenario.expect_exit
    assert set(scenario.expect_files) <= set(result["files"]), result["files"]
    if scenario.expect_stdout is not None:
        assert tuple(result["stdout"]) == scenario.expect_stdout, result["stdout"]
    files = result["files"]
    reports = {name: report for name, report in files.items() if name.endswith((".json", ".env"))}
    assert reports, files
    for report in reports.values():
        env = report["env"] if "env" in report else report
        assert all(env[k] for k in PRESENT), env
    if scenario.failure_text is not None:
        failure = result["failure"]
        assert failure["summary_found"] and failure["rank"] == "1", failure
        assert failure["text_on_stderr"], failure
