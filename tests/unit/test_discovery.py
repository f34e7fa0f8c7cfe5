"""Host discovery: the script's output, whether it lists this node (pure), and running the
script (a real process: no shell, a timeout, an output cap, the last good list kept)."""

from __future__ import annotations

import asyncio
import os
import pwd
from pathlib import Path

import psutil
import pytest
from harness import wait_gone

from elasticd.cluster.hosts import (
    DiscoveryFailed,
    HostDiscovery,
    UntrustedScript,
    run_discovery_script,
)
from elasticd.core.discovery import EVERYONE, Listing, listing, parse_hosts


@pytest.mark.parametrize(
    "output, hosts",
    [
        ("", {}),
        ("n1\nn2:4\n", {"n1": None, "n2": 4}),
        ("  n1:2  \r\n\n# a comment\n\t10.0.0.3\n", {"n1": 2, "10.0.0.3": None}),
        ("n1:2\nn1:8\n", {"n1": 2}),  # a host listed twice keeps its first line
        ("[::1]:3\n[fe80::2]\nfe80::7\n", {"::1": 3, "fe80::2": None, "fe80::7": None}),
        ("gpu-node-01.example.org:8", {"gpu-node-01.example.org": 8}),
    ],
)
def test_parse_hosts(output, hosts):
    assert parse_hosts(output) == hosts


@pytest.mark.parametrize(
    "output, words",
    [
        ("n1:0", "line 1"),
        ("n1\nn2:x", "line 2"),
        ("n1:-1", "slots must be"),
        ("n1:", "slots must be"),
        (":4", "not host[:slots]"),
        ("n1 4", "not host[:slots]"),
        ("[::1", "IPv6"),
        ("[::1]4", "IPv6"),
        ("n1:99999999", "slots must be"),
        ("n\x1b1:2", "not host[:slots]"),
    ],
)
def test_parse_hosts_names_the_bad_line(output, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        parse_hosts(output)


@pytest.mark.parametrize(
    "hosts, names, expected",
    [
        ({"n1": None, "n2": 4}, ("n2", "10.0.0.2"), Listing(True, 4)),
        ({"n1": None, "10.0.0.2": 3}, ("n2", "10.0.0.2"), Listing(True, 3)),  # by its address
        ({"n2": 5, "10.0.0.2": 3}, ("n2", "10.0.0.2"), Listing(True, 5)),  # the name first
        ({"n1": None}, ("n2", "10.0.0.2"), Listing(False)),
        ({}, ("n2", "10.0.0.2"), Listing(False)),
        ({"": 1}, ("", ""), Listing(False)),
        ({"n2": None}, ("n2",), Listing(True, None)),
    ],
)
def test_listing(hosts, names, expected):
    assert listing(hosts, names) == expected
    assert EVERYONE == Listing(True)


# -- running the script ---------------------------------------------------------------------


def script(tmp_path: Path, body: str, name: str = "discover") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def run(coro):
    return asyncio.run(coro)


def test_the_script_runs_without_a_shell_and_its_output_is_read(tmp_path):
    path = script(tmp_path, 'echo "n1:2"; echo "n2"; echo "$#" > "$0.args"\n')
    assert run(run_discovery_script(path, 10)) == "n1:2\nn2\n"
    assert (tmp_path / "discover.args").read_text() == "0\n"  # no arguments


@pytest.mark.parametrize(
    "body, words",
    [
        ("echo oops >&2; exit 3\n", "failed (exit status 3): 'oops'"),
        ("kill -9 $$\n", "killed by signal 9"),
        ("sleep 30\n", "did not finish within 0.5 s"),
        ("head -c 3000 /dev/zero\n", "printed more than 1000 bytes"),
        ("printf '\\377\\n'\n", "not UTF-8"),
    ],
)
def test_a_failed_run_says_why(tmp_path, body, words):
    path = script(tmp_path, body)
    with pytest.raises(DiscoveryFailed) as info:
        run(run_discovery_script(path, 0.5, limit=1000))
    assert path in str(info.value) and words in str(info.value)


def test_a_script_that_cannot_run(tmp_path):
    with pytest.raises(DiscoveryFailed, match=r"cannot run .*missing"):
        run(run_discovery_script(str(tmp_path / "missing"), 1))
    path = tmp_path / "not-executable"
    path.write_text("echo n1\n")
    with pytest.raises(DiscoveryFailed, match="Permission denied"):
        run(run_discovery_script(str(path), 1))


def test_a_timeout_kills_the_scripts_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    path = script(tmp_path, f"sleep 30 & echo $! > {pid_file}; wait\n")
    with pytest.raises(DiscoveryFailed, match="did not finish"):
        run(run_discovery_script(path, 0.5))
    assert wait_gone([int(pid_file.read_text())], timeout=5) == []


def test_children_left_in_the_background_die_with_the_run(tmp_path):
    """Row 0e: a script that exits 0 and leaves background children (their output elsewhere,
    so the pipes close) has its whole process group killed when it ends."""
    pid_file = tmp_path / "children.pid"
    path = script(
        tmp_path,
        f"for i in 1 2 3; do sleep 300 </dev/null >/dev/null 2>&1 & "
        f"echo $! >> {pid_file}; done\necho n1\n",
    )
    for _ in range(3):
        assert run(run_discovery_script(path, 10)) == "n1\n"
    children = [int(pid) for pid in pid_file.read_text().split()]
    assert len(children) == 9 and wait_gone(children, timeout=10) == []


def test_a_child_that_holds_the_output_pipe_is_killed_and_the_output_kept(tmp_path):
    path = script(tmp_path, "echo n1; sleep 300 &\necho n2\n")
    assert run(asyncio.wait_for(run_discovery_script(path, 30), 10)) == "n1\nn2\n"


def test_a_cancelled_run_leaves_no_process_and_no_zombie(tmp_path):
    """The daemon stops while a run is under way: the group is killed, the leader reaped."""
    pid_file = tmp_path / "pids"
    path = script(
        tmp_path, f"sleep 300 </dev/null >/dev/null 2>&1 & echo $$ $! > {pid_file}; sleep 300\n"
    )

    async def scenario() -> None:
        running = asyncio.create_task(run_discovery_script(path, 60))
        async with asyncio.timeout(10):
            while not pid_file.exists() or not pid_file.read_text().strip():
                await asyncio.sleep(0.01)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    run(scenario())
    leader, child = map(int, pid_file.read_text().split())
    assert wait_gone([leader, child], timeout=10) == []
    assert not [p for p in psutil.Process().children() if p.pid == leader]  # reaped: no zombie


def test_a_script_that_is_not_roots_alone_is_not_run(tmp_path):
    """Checked before every run: a script handed to nobody after start-up is refused, and
    the refusal is a failed run (the last good list stays in force)."""
    tmp_path.chmod(0o755)
    ran = tmp_path / "ran"
    path = script(tmp_path, f"echo n1; touch {ran}\n")
    discovery = HostDiscovery(path, interval=0.01, timeout=5, names=("n1",))
    assert run(discovery.first()) == Listing(True)
    ran.unlink()
    os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(
        UntrustedScript,
        match=f"refusing to run {path} is not root's alone: {path} belongs to nobody",
    ):
        run(discovery.discover())
    assert not ran.exists()


def test_unparsable_output_fails_the_run(tmp_path):
    path = script(tmp_path, "echo 'n1:many'\n")
    discovery = HostDiscovery(path, interval=0.01, timeout=5, names=("n1", "127.0.0.1"))
    with pytest.raises(DiscoveryFailed, match="printed line 1"):
        run(discovery.first())


def test_the_loop_reports_changes_and_keeps_the_last_good_list(tmp_path):
    """The list file changes: listed, then a failing run (counted, nothing changes), then
    not listed; each change reported once."""
    hosts = tmp_path / "hosts"
    hosts.write_text("n1:3\n")
    path = script(tmp_path, f"cat {hosts} || exit 1\n")
    failures: list[str] = []
    seen: list[Listing] = []
    discovery = HostDiscovery(
        path, interval=0.01, timeout=5, names=("n1", "10.0.0.1"), on_failure=failures.append
    )

    async def scenario() -> None:
        assert await discovery.first() == Listing(True, 3)
        stop = asyncio.Event()
        changed = asyncio.Event()

        def on_listing(new: Listing) -> None:
            seen.append(new)
            changed.set()

        running = asyncio.create_task(discovery.run(stop, on_listing))
        hosts.unlink()  # the script fails now
        async with asyncio.timeout(10):
            while len(failures) < 3:
                await asyncio.sleep(0.01)
        assert seen == []  # the last good list stays in force
        hosts.write_text("n2\n10.0.0.1:2\n")
        async with asyncio.timeout(10):
            await changed.wait()
        changed.clear()
        hosts.write_text("n2\n")
        async with asyncio.timeout(10):
            await changed.wait()
        stop.set()
        await running

    run(scenario())
    assert seen == [Listing(True, 2), Listing(False)]
    assert "failed (exit status 1)" in failures[0]
