"""elasticrun where no daemon takes the line (docs/elasticrun.md, "Where no elasticd runs"):
its private daemons, on this host's 127.0.0.x addresses (the multi-host tests are
tests/system/test_elasticrun_nodes.py, on network-namespace hosts, as a user who is not
root).  A one-node line runs on a daemon of its own; a daemon that answers takes the line
as before; two nodes whose endpoint is this host meet as torchrun's agents do (the second
joins when the port is taken); a node waiting at a full job takes a lost node's place; an
in-place job keeps its survivors' processes (PET_IN_PLACE=1); a node whose line differs is
refused saying how; Ctrl-C while waiting for the others ends it all; what a killed
elasticrun and its daemon left is reaped by the next."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FIXTURES, PY, free_port, wait_gone
from hostwide import remove_tree
from launched import Launched

from elasticd.wire import paths

pytestmark = pytest.mark.slow

ELASTICRUN = os.path.join(os.path.dirname(PY), "elasticrun")
TRAIN = str(FIXTURES / "launch_train.py")
INPLACE = str(FIXTURES / "launch_inplace.py")
WORLD = r"^start rank (\d+) world {world} "


@pytest.fixture
def tmpdir_env() -> Iterator[dict[str, str]]:
    """The environment of the launches: this test's own TMPDIR (its private daemons'
    directories go there: a short path, as a socket's must be) and no daemon to talk to;
    faulthandler on, so that a launch that hangs shows where (Launched.dump_stacks)."""
    tmp = tempfile.mkdtemp(prefix="erun-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("ELASTICD_SOCKET", "PET_PRIVATE")}
    yield {**env, "TMPDIR": tmp, "VIRTUAL_ENV": sys.prefix, "PYTHONFAULTHANDLER": "1"}
    remove_tree(tmp)


def base(env: dict[str, str]) -> Path:
    return Path(env["TMPDIR"]) / f"elasticrun-{os.getuid()}"


def launch(env: dict[str, str], *argv: str, name: str = "node", **extra: str) -> Launched:
    return Launched([ELASTICRUN, *argv], {**env, **extra}, env["TMPDIR"], name)


def line(port: int, run_id: str, nnodes: str, index: int, *rest: str) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--local-addr",
        f"127.0.0.{index}",
        *rest,
    ]


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def test_a_one_node_line_runs_on_a_daemon_of_its_own_and_leaves_nothing(tmpdir_env):
    if _answers(paths.default_socket_path()):
        pytest.skip("a daemon answers at the default socket here: it would take the line")
    node = launch(tmpdir_env, "--nproc-per-node", "2", TRAIN, "--steps", "3")
    assert node.wait(180) == 0, node.story("exit")
    for rank in (0, 1):
        node.wait_line(rf"^start rank {rank} world 2 ", timeout=1)
    node.wait_line(r"on a daemon of its own; this node is ", "err", timeout=1)
    assert "no key" not in node.text("err")  # a one-node job has no store port to guard
    assert list(base(tmpdir_env).iterdir()) == []


def test_a_daemon_that_answers_takes_the_line_and_refuses_its_topology(daemon, tmpdir_env):
    env = {**tmpdir_env, "ELASTICD_SOCKET": daemon.socket}
    one = launch(env, "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", TRAIN)
    assert one.wait(180) == 0, one.story("exit")
    one.wait_line(r"^elasticrun: job j-[0-9a-f]+ submitted", "err", timeout=1)
    several = launch(env, *line(free_port(), "x", "2", 1), TRAIN)
    assert several.wait(60) == 2, several.story("exit")
    several.wait_line(r"elasticrun --private`, on daemons of the job's own", "err", timeout=1)
    assert not base(env).exists()  # nothing private was started


def test_two_nodes_whose_endpoint_is_this_host_meet_as_torchruns_agents_do(tmpdir_env):
    """Both find the endpoint is theirs (no --local-addr): the one that cannot host joins
    the one that does."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    argv = [a for a in line(port, run_id, "2", 1) if a not in ("--local-addr", "127.0.0.1")]
    nodes = [launch(tmpdir_env, *argv, TRAIN, "--steps", "5", name=f"n{i}") for i in (1, 2)]
    for node in nodes:
        assert node.wait(240) == 0, node.story("exit")
        node.wait_line(WORLD.format(world=2), timeout=1)
    hosted = [("hosted here" in node.text("err")) for node in nodes]
    assert sorted(hosted) == [False, True]
    assert list(base(tmpdir_env).iterdir()) == []


def test_a_node_waiting_at_a_full_job_takes_a_lost_nodes_place(tmpdir_env):
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    script = (TRAIN, "--steps", "60", "--step-seconds", "0.25")
    first = [launch(tmpdir_env, *line(port, run_id, "2", i), *script, name=f"n{i}") for i in (1, 2)]
    for node in first:
        node.wait_line(WORLD.format(world=2), timeout=240)
    spare = launch(tmpdir_env, *line(port, run_id, "2", 3), *script, name="n3")
    spare.wait_line(r"this node is ", "err", timeout=120)  # it is in the job's cluster
    assert spare.mark() == 0  # ... and runs nothing: the job is full
    first[1].kill_tree()  # the node gone at once: its elasticrun, daemon and worker
    spare.wait_line(WORLD.format(world=2), timeout=120)  # in the lost node's place
    for node in (first[0], spare):
        assert node.wait(240) == 0, node.story("exit")
    (left,) = base(tmpdir_env).iterdir()  # the lost node's, for its next elasticrun to reap
    assert json.loads((left / "owner").read_text())["pid"] == first[1].proc.pid


def test_in_place_from_pet_keeps_the_survivors_process(tmpdir_env):
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    script = (INPLACE, "--batches", "300", "--step-seconds", "0.05")
    nodes = [
        launch(tmpdir_env, *line(port, run_id, "1:2", i), *script, name=f"n{i}", PET_IN_PLACE="1")
        for i in (1, 2)
    ]
    placed = [node.wait_line(r"^start rank \d+ world 2 pid (\d+)$", timeout=240) for node in nodes]
    mark = nodes[0].mark()
    nodes[1].kill_tree()  # the node gone: elasticrun, its daemon and its worker
    again = nodes[0].wait_line(r"^start rank 0 world 1 pid (\d+)$", timeout=120, after=mark)
    assert again.group(1) == placed[0].group(1)  # the survivor kept its process
    assert nodes[0].wait(300) == 0, nodes[0].story("exit")


def test_a_node_whose_line_differs_is_refused_saying_how(tmpdir_env):
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    conf = ("--rdzv-conf", "join_timeout=20")
    first = launch(tmpdir_env, *line(port, run_id, "2", 1), *conf, TRAIN, name="n1")
    first.wait_line(r"this node is ", "err", timeout=120)
    other = line(port, run_id, "2", 2)
    other[other.index("--nproc-per-node") + 1] = "2"
    second = launch(tmpdir_env, *other, *conf, TRAIN, name="n2")
    assert second.wait(120) == 1, second.story("exit")
    second.wait_line(r"nproc_per_node 2 here, 1 in the job", "err", timeout=1)
    assert first.wait(120) == 1, first.story("exit")  # nobody else came: its join timed out
    assert list(base(tmpdir_env).iterdir()) == []


def test_ctrl_c_while_waiting_for_the_others_ends_it_all(tmpdir_env):
    node = launch(tmpdir_env, *line(free_port(), uuid.uuid4().hex[:8], "2", 1), TRAIN)
    node.wait_line(r"this node is ", "err", timeout=120)
    daemons = [proc.pid for proc in node.descendants()]
    assert daemons
    node.signal(signal.SIGINT)
    assert node.wait(120) == 130, node.story("exit")
    assert wait_gone(daemons, 30) == []
    assert list(base(tmpdir_env).iterdir()) == []


def test_what_a_killed_elasticrun_and_its_daemon_left_is_reaped_by_the_next(tmpdir_env):
    node = launch(tmpdir_env, *line(free_port(), uuid.uuid4().hex[:8], "2", 1), TRAIN)
    node.wait_line(r"this node is ", "err", timeout=120)
    left = list(base(tmpdir_env).iterdir())
    assert len(left) == 1
    node.kill_tree()  # elasticrun and its daemon at once (a node's processes, all SIGKILLed)
    assert list(base(tmpdir_env).iterdir()) == left
    again = launch(tmpdir_env, "--private", TRAIN, "--steps", "1")
    assert again.wait(180) == 0, again.story("exit")
    assert list(base(tmpdir_env).iterdir()) == []
