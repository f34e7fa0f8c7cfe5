"""`elasticd --check-config FILE` (docs/configuration.md, "Checking a file"): the real program checks a file as start-up
would, prints every error in start-up's words, exits 0 or 2, and starts nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import CLIENT_ENV, PY


def elasticd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLIENT_ENV,
        cwd=str(cwd),
    )


@pytest.fixture
def places(tmp_path: Path) -> list[str]:
    """Dirs a started daemon would make: a check must make none of them."""
    return ["--state-dir", str(tmp_path / "state"), "--runtime-dir", str(tmp_path / "run")]


def test_a_good_file_is_ok_and_nothing_is_made(tmp_path, places):
    path = tmp_path / "elasticd.toml"
    path.write_text(
        '[node]\nname = "n1"\nslots = 4\n[cluster]\nname = "prod"\n'
        '[store]\nendpoint = "node1:29400"\n'
    )
    done = elasticd("--check-config", str(path), *places, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{path}: OK\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elasticd.toml"]


def test_the_shipped_default_config_is_ok(tmp_path):
    shipped = Path(__file__).resolve().parents[2] / "packaging" / "elasticd.toml"
    done = elasticd("--check-config", str(shipped), cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


def test_every_error_in_start_ups_words_and_exit_2(tmp_path, places):
    path = tmp_path / "elasticd.toml"
    path.write_text("[node]\nslots = -1\nbogus = 2\n[metrics]\nport = 70000\n")
    done = elasticd("--check-config", str(path), *places, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == "elasticd: config key 'node.slots': must be 0 or more, got -1"
    assert lines[1].startswith("elasticd: config key 'node.bogus': unknown key (known: name, ")
    assert (
        lines[2]
        == "elasticd: config key 'metrics.port': must be a port number (0..65535), got 70000"
    )
    assert lines[3:] == [f"{path}: 3 errors"]
    started = elasticd("--config", str(path), *places, cwd=tmp_path)  # what start-up says
    assert (started.returncode, started.stderr) == (2, lines[0] + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elasticd.toml"]


def test_an_unknown_key_alone(tmp_path):
    path = tmp_path / "elasticd.toml"
    path.write_text("[jobs]\nstop_grace = 5\nmax_restart = 3\n")
    done = elasticd("--check-config", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith(
        "elasticd: config key 'jobs.max_restart': unknown key (known: allow_root, stop_grace, max_restarts"
    )
    assert done.stderr.splitlines()[1:] == [f"{path}: 1 error"]


def test_options_given_with_it_are_checked_as_start_up_would(tmp_path):
    path = tmp_path / "elasticd.toml"
    path.write_text("[node]\nslots = 2\n")
    done = elasticd("--check-config", str(path), "--slots", "-2", cwd=tmp_path)
    assert done.returncode == 2
    assert (
        done.stderr.splitlines()[0]
        == "elasticd: config key 'node.slots': must be 0 or more, got -2"
    )
    both = elasticd("--check-config", str(path), "--config", str(path), cwd=tmp_path)
    assert both.returncode == 2 and "leave out --config" in both.stderr


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("missing.toml", None, "cannot read {path}: No such file or directory"),
        ("broken.toml", "[node\nslots = 1\n", "{path} is not valid TOML: "),
        ("binary.toml", b"\xff\xfe\x00", "{path} is not valid TOML: "),
        ("a-directory", "dir", "cannot read {path}: Is a directory"),
    ],
)
def test_a_file_that_cannot_be_read(tmp_path, name, content, words):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    done = elasticd("--check-config", str(path), cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    first, last = done.stderr.splitlines()
    assert first.startswith("elasticd: config key '--config': " + words.format(path=path)), first
    assert last == f"{path}: 1 error"


def test_it_is_in_the_help(tmp_path):
    done = elasticd("--help", cwd=tmp_path)
    assert (
        "elasticd --check-config FILE [options]" in done.stdout
        and "--check-config FILE" in done.stdout
    )


def test_bad_scheduler_keys_are_named_down_to_the_nested_key(tmp_path, places):
    path = tmp_path / "elasticd.toml"
    path.write_text(
        '[scheduler]\nmax_priority = "high"\nshares = {ml = 0}\n'
        "[scheduler.users.alice]\nnodes = -1\ncpus = 4\n"
    )
    done = elasticd("--check-config", str(path), *places, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "elasticd: config key 'scheduler.max_priority': must be an integer, got 'high'",
        "elasticd: config key 'scheduler.users.alice.nodes': must be 0 or more, got -1",
        "elasticd: config key 'scheduler.users.alice.cpus': unknown key (known: nodes, gpus, slots)",
        "elasticd: config key 'scheduler.shares.ml': must be greater than 0, got 0.0",
        f"{path}: 4 errors",
    ]
    started = elasticd("--config", str(path), *places, cwd=tmp_path)
    assert (started.returncode, started.stderr) == (2, done.stderr.splitlines()[0] + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elasticd.toml"]
    path.write_text(
        "[scheduler]\nmax_priority = 10\nuser_quota = {nodes = 2}\n"
        "[scheduler.accounts.ml]\ngpus = 8\n"
    )
    good = elasticd("--check-config", str(path), *places, cwd=tmp_path)
    assert (good.returncode, good.stdout, good.stderr) == (0, f"{path}: OK\n", "")
